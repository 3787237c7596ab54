"""scripts/bench_tables.py: the generated tables in docs/ agree with the kept JSON, a table is
made from hand-made rows, and the comparison flags the figures that moved, not those that held."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fixtures.helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import bench_tables

ROW = {
    "setup": "1 rank(s), ZeRO-2",
    "lr": 5e-07,
    "updates": 100,
    "full_updates": 10,
    "changed_fraction_median": 0.003,
    "changed_fraction_max": 0.005,
    "delta_bytes_ratio_median": 0.008,
    "delta_bytes_ratio_max": 0.0125,
    "publish_s_delta": 0.25,
    "publish_s_full": 1.0,
    "lock_hold_s_delta": 0.0075,
    "lock_hold_s_full": 0.03,
    "staging_bytes_delta_max": 2 * 2**20,
    "staging_bytes_full": 190 * 2**20,
    "swaps_failed": 0,
    "checksum_mismatches": 0,
    "engine_differs_from_checkpoint": [],
}


def test_the_pages_agree_with_the_kept_json():
    proc = subprocess.run(
        [sys.executable, "scripts/bench_tables.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    for name, (_, _, page) in bench_tables.TABLES.items():
        assert f"<!-- table: {name} -->" in (ROOT / page).read_text(), (name, page)


def test_a_table_is_made_from_its_rows():
    table = bench_tables.delta_table([ROW, ROW | {"checksum_mismatches": 1}])
    lines = table.splitlines()
    assert lines[2] == (
        "| 1 rank(s), ZeRO-2 | 5e-07 | 0.30% (0.50%) | 0.80% (1.25%) = 1/125 | 250 / 1000 ms | 7.5 / 30.0 ms "
        "| 2.0 / 190.0 MiB | yes |"
    )
    assert lines[3].endswith("| NO |")


def test_a_stale_page_is_rewritten_from_the_json(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "bench_delta.json").write_text(json.dumps([ROW]))
    page = "text\n<!-- table: bench_delta -->\n| old |\n<!-- end table -->\nmore\n"
    made = bench_tables.render(page, tmp_path)
    assert made.startswith("text\n<!-- table: bench_delta -->\n| setup |") and made.endswith(
        "<!-- end table -->\nmore\n"
    )
    assert "| old |" not in made and bench_tables.render(made, tmp_path) == made
    with pytest.raises(KeyError, match="'nowhere'"):
        bench_tables.render("<!-- table: nowhere -->\nx\n<!-- end table -->", tmp_path)


def test_the_comparison_names_what_moved_beyond_the_kept_band():
    kept = [ROW]
    assert bench_tables.moved([dict(ROW)], kept, 0.25) == []
    # Within the kept run's own spread (its max) though beyond the tolerance: not moved.
    assert bench_tables.moved([ROW | {"delta_bytes_ratio_median": 0.012}], kept, 0.25) == []
    found = bench_tables.moved([ROW | {"publish_s_delta": 0.5, "lock_hold_s_full": 0.031}], kept, 0.25)
    assert len(found) == 1 and "publish_s_delta: 0.5, kept 0.25" in found[0]
    assert bench_tables.moved([ROW | {"lr": 1e-6}], kept, 0.25) == [
        "('1 rank(s), ZeRO-2', 1e-06, None, None, None): no such row in the kept run",
        "('1 rank(s), ZeRO-2', 5e-07, None, None, None): in the kept run only",
    ]


LEARNING_ROW = {
    "model": "family_char_brief",
    "mode": "async",
    "budget_s": 600.0,
    "start": 0.3,
    "final": 0.9,
    "worst_drop": 0.01,
    "early_fall": 0.0,
    "versions_per_s": 2.5,
    "completions_per_s": 640.0,
    "trl_final": 0.8,
    "trl_span_s": 590.0,
    "trl_completions_per_s": 400.0,
    "time_to_trl_s": 236.0,
    "gain": 0.1,
}


def test_a_learning_table_is_made_from_its_rows():
    never = LEARNING_ROW | {"model": "m2", "time_to_trl_s": None, "final": 0.7, "gain": -0.1}
    lines = bench_tables.learning_table([LEARNING_ROW, never]).splitlines()
    # 590 s of TRL's evaluations / 236 s = 2.5x sooner.
    assert lines[2] == "| `family_char_brief` | 0.300 | 0.800 | 236 s | 2.5x | 0.900 (+0.100) | 0.010 | 0.000 | 2.50 |"
    assert lines[3] == "| `m2` | 0.300 | 0.800 | never | never | 0.700 (-0.100) | 0.010 | 0.000 | 2.50 |"
