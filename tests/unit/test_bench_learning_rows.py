"""scripts/bench_learning.py's kept rows: each names the machine and commit its own pipeline_rl run
ran on, so a run reused by a later invocation keeps the provenance of the code that made it."""

from __future__ import annotations

import sys

import pytest
from fixtures.helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import bench_learning


def summary(mode: str, final: float, provenance: dict | None) -> dict:
    # Evaluations at 0, 10, 20 and 30 s: the moving average of 3 reaches 0.5 at 20 s.
    curve = [(0.0, 0.3), (10.0, 0.4), (20.0, 0.8), (30.0, final)]
    return {
        "mode": mode,
        "curve": curve,
        "reach": {t: bench_learning.learning_curve.time_to(curve, t) for t in bench_learning.THRESHOLDS},
        "start_eval": 0.3,
        "final_eval": final,
        "worst_drop": 0.0,
        "early_fall": 0.0,
        "versions_per_s": 2.0,
        "completions_per_s": 500.0,
        "eval_span_s": 30.0,
        "provenance": provenance,
    }


def test_each_row_names_the_machine_and_commit_of_its_own_run():
    earlier = {"machine": "2-core A", "commit": "aaaaaaa"}
    now = {"machine": "2-core A", "commit": "bbbbbbb"}
    results = [summary("async", 0.9, earlier), summary("sig", 0.7, now), summary("old", 0.6, None)]
    results.append(summary("trl", 0.5, now))
    rows = {r["mode"]: r for r in bench_learning.result_rows([("m", results)], 600.0)}
    assert set(rows) == {"async", "sig", "old"}
    assert rows["async"]["commit"] == "aaaaaaa" and rows["sig"]["commit"] == "bbbbbbb"
    assert "commit" not in rows["old"] and "machine" not in rows["old"]
    # Against TRL's final 0.5: the average of (0.3, 0.4, 0.8) = 0.5 at 20 s; async ends 0.4 above.
    assert rows["async"]["time_to_trl_s"] == 20.0
    assert rows["async"]["gain"] == pytest.approx(0.4)
    # The average of (0.4, 0.8, 0.9) = 0.7 at 30 s; 0.9 is never reached.
    assert rows["async"]["time_to_0.7_s"] == 30.0 and rows["async"]["time_to_0.9_s"] is None
