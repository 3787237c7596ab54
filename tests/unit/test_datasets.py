"""Problem loading: JSONL, Parquet and module:function loaders, with errors that name the
file and line of a bad row."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline_rl.config import ConfigError
from pipeline_rl.rollouts.datasets import DatasetError, load_problems

ROWS = [{"id": "a", "prompt": "Q: 1+2=", "answer": "3"}, {"id": 7, "prompt": "Q: 2+2=", "answer": 4, "level": 1}]


def problems_from_function(path):
    return [{"id": f"{path}-{i}", "prompt": "Q: 1+1=", "answer": "2"} for i in range(3)]


def not_a_list(path):
    return {"id": "x"}


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_and_parquet_agree(tmp_path):
    jsonl = write_jsonl(tmp_path / "p.jsonl", ROWS + [""])  # a blank line is no row
    parquet = tmp_path / "p.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [{**r, "id": str(r["id"]), "answer": str(r["answer"]), "level": r.get("level")} for r in ROWS]
        ),
        parquet,
    )
    from_jsonl = load_problems("jsonl", str(jsonl))
    assert from_jsonl == [
        {"id": "a", "prompt": "Q: 1+2=", "answer": "3"},
        {"id": "7", "prompt": "Q: 2+2=", "answer": "4", "level": 1},
    ]
    from_parquet = load_problems("parquet", str(parquet))
    assert [{k: v for k, v in p.items() if k != "level"} for p in from_parquet] == [
        {k: v for k, v in p.items() if k != "level"} for p in from_jsonl
    ]


def test_function_loader():
    problems = load_problems("test_datasets:problems_from_function", "set")
    assert [p["id"] for p in problems] == ["set-0", "set-1", "set-2"]
    with pytest.raises(DatasetError, match="returned dict, expected a list"):
        load_problems("test_datasets:not_a_list", "x")
    with pytest.raises(
        ConfigError, match=r"bad value for 'actor\.dataset\.loader': cannot import 'test_datasets:missing_function'"
    ):
        load_problems("test_datasets:missing_function", "x")


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"id": "b", "prompt": "Q"', r"p.jsonl:2: not valid JSON"),
        ({"id": "b", "prompt": "Q"}, r"p.jsonl:2: missing key\(s\) \['answer'\]"),
        ({"id": "b", "prompt": 3, "answer": "1"}, r"p.jsonl:2: 'prompt' must be a non-empty string"),
        ({"id": None, "prompt": "Q", "answer": "1"}, r"p.jsonl:2: 'id' must be"),
        ({"id": "b", "prompt": "Q", "answer": [1]}, r"p.jsonl:2: 'answer' must be a string or a number"),
        ({"id": "a", "prompt": "Q", "answer": "1"}, r"p.jsonl:2: duplicate id 'a' \(first at .*p.jsonl:1\)"),
        ("[1, 2]", r"p.jsonl:2: expected an object, got list"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "p.jsonl", [ROWS[0], bad])
    with pytest.raises(DatasetError, match=message):
        load_problems("jsonl", str(path))


def test_missing_empty_and_unknown(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        load_problems("jsonl", str(tmp_path / "none.jsonl"))
    with pytest.raises(DatasetError, match="has no problems"):
        load_problems("jsonl", str(write_jsonl(tmp_path / "e.jsonl", [])))
    with pytest.raises(DatasetError, match="unknown dataset loader 'csv'"):
        load_problems("csv", "x.csv")
    bad_parquet = tmp_path / "bad.parquet"
    bad_parquet.write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="cannot read as Parquet"):
        load_problems("parquet", str(bad_parquet))
