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


def step(version: int, kl: float | None) -> dict:
    values = {"version": version, "compute_s": 0.1}
    if kl is not None:
        values["behaviour_kl"] = kl
    return {"process": "trainer0", "time": float(version), "values": values}


def test_the_first_updates_are_weighed_against_the_later_ones():
    # Version 1 is the start; 2-5 are the first updates, 6-10 the later ones (one without a KL).
    kls = {1: 9.0, 2: 0.01, 3: 0.07, 4: 0.02, 5: 0.03, 6: 0.002, 7: 0.004, 8: None, 9: 0.003, 10: 0.012}
    sizes = bench_learning.update_sizes([step(v, k) for v, k in kls.items()])
    assert sizes == {"first_kl_max": 0.07, "later_kl_median": 0.004, "later_kl_max": 0.012}
    # A run too short to have later updates, or without the KL (TRL's steps), has no figures.
    assert bench_learning.update_sizes([step(v, 0.01) for v in range(1, 6)]) == {}
    assert bench_learning.update_sizes([step(v, None) for v in range(1, 20)]) == {}


def test_the_update_sizes_are_kept_in_the_row():
    results = [{**summary("warm", 0.9, None), "update_sizes": {"first_kl_max": 0.07, "later_kl_median": 0.004}}]
    (row,) = bench_learning.result_rows([("m", results)], 120.0)
    assert row["first_kl_max"] == 0.07 and row["later_kl_median"] == 0.004


def test_a_row_names_the_step_its_run_trained_with():
    # conf=tiny's own step, and a variant's overrides of it.
    shipped = bench_learning.step_of("tiny", [])
    assert shipped == {"groups_per_step": 64, "attempts": 4, "entropy_coef": 0.01}
    other = ["shared.groups_per_step=32", "actor.attempts=8", "trainer.loss.entropy_coef=0"]
    assert bench_learning.step_of("tiny", other) == {"groups_per_step": 32, "attempts": 8, "entropy_coef": 0.0}
    results = [{**summary("async", 0.9, None), "step": bench_learning.step_of("tiny", other)}]
    (row,) = bench_learning.result_rows([("m", results)], 600.0)
    assert (row["groups_per_step"], row["attempts"], row["entropy_coef"]) == (32, 8, 0.0)
