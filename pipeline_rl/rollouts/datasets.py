"""Problem sets: JSONL, Parquet, or a user function, checked row by row.

A problem is a dict with at least "id" (str or int, unique), "prompt" (str) and "answer"
(str, or a number, which is turned into its str); other keys are kept and reach the domain's
rollout unchanged. A bad row raises DatasetError naming the file (or loader) and the line
(or row), so nothing is skipped silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from pipeline_rl.core.plugins import load_plugin

REQUIRED = ("id", "prompt", "answer")


class DatasetError(ValueError):
    """A data set that cannot be used; the message names the file and line or row."""


def _check(row: Any, where: str) -> dict:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected an object, got {type(row).__name__}")
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        raise DatasetError(f"{where}: missing key(s) {missing} (a problem needs {list(REQUIRED)})")
    problem = dict(row)
    pid, prompt, answer = row["id"], row["prompt"], row["answer"]
    if isinstance(pid, bool) or not isinstance(pid, (str, int)) or pid == "":
        raise DatasetError(f"{where}: 'id' must be a non-empty string or an integer, got {pid!r}")
    if not isinstance(prompt, str) or not prompt:
        raise DatasetError(f"{where}: 'prompt' must be a non-empty string, got {type(prompt).__name__}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DatasetError(f"{where}: 'answer' must be a string or a number, got {type(answer).__name__}")
    problem["id"] = str(pid)
    problem["answer"] = str(answer)
    return problem


def _read_jsonl(path: Path) -> list[tuple[str, Any]]:
    rows = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append((f"{path}:{number}", orjson.loads(line)))
            except orjson.JSONDecodeError as e:
                raise DatasetError(f"{path}:{number}: not valid JSON: {e}") from None
    return rows


def _read_parquet(path: Path) -> list[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:
        raise DatasetError(f"{path}: cannot read as Parquet: {e}") from None
    return [(f"{path}: row {i}", row) for i, row in enumerate(table.to_pylist())]


def load_problems(loader: str, path: str) -> list[dict]:
    """Read and check every problem. `loader`: "jsonl", "parquet", or "module:function", which
    is called with `path` and must return a list of problem dicts."""
    if loader in ("jsonl", "parquet"):
        file = Path(path)
        if not file.is_file():
            raise DatasetError(f"data set file not found: {file}")
        rows = _read_jsonl(file) if loader == "jsonl" else _read_parquet(file)
    elif ":" in loader:
        result = load_plugin(loader, "actor.dataset.loader", "callable", check=callable)(path)
        if not isinstance(result, list):
            raise DatasetError(f"dataset loader '{loader}' returned {type(result).__name__}, expected a list")
        rows = [(f"{loader}({path!r}): row {i}", row) for i, row in enumerate(result)]
    else:
        raise DatasetError(f"unknown dataset loader {loader!r}: expected jsonl, parquet or module:function")
    problems, seen = [], {}
    for where, row in rows:
        problem = _check(row, where)
        if problem["id"] in seen:
            raise DatasetError(f"{where}: duplicate id {problem['id']!r} (first at {seen[problem['id']]})")
        seen[problem["id"]] = where
        problems.append(problem)
    if not problems:
        raise DatasetError(f"data set {path!r} ({loader}) has no problems")
    return problems
