"""scripts/group_spread.py: groups by right attempts against a binomial, from hand-made actor
streams (the records the actor writes, in the run directory's layout)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.helpers import ROOT

from pipeline_rl.streams.records import Rollout, RolloutGroup, encode

sys.path.insert(0, str(ROOT / "scripts"))
import group_spread


def group(rewards: list[float], n: int) -> RolloutGroup:
    rollouts = [Rollout([1], [2, 0], [-1.0, -1.0], [0, 0], reward, "stop") for reward in rewards]
    return RolloutGroup(problem_id=f"p{n}", group_id=f"g{n}", rollouts=rollouts)


def run_dir(tmp_path: Path, groups: list[list[float]]) -> Path:
    actor = tmp_path / "streams" / "actor"
    actor.mkdir(parents=True)
    (actor / "0.jsonl").write_bytes(b"".join(encode(group(g, n)) + b"\n" for n, g in enumerate(groups)))
    return tmp_path


def test_problems_of_two_kinds_are_wider_spread_than_the_binomial():
    # Right attempts 0, 0, 4, 4 of 4: p = 0.5, every group agrees (the binomial: 2 x 0.5^4 = 1/8),
    # variance 4 against the binomial's 4 x 0.5 x 0.5 = 1.
    row = group_spread.window_report([0, 0, 4, 4], 4)
    assert row == {
        "groups": 4,
        "attempts": 4,
        "mean_reward": 0.5,
        "no_spread": 1.0,
        "no_spread_binomial": 0.125,
        "all_right": 0.5,
        "all_right_binomial": 0.0625,
        "dispersion": 4.0,
    }


def test_problems_alike_are_as_narrow_as_the_binomial_or_narrower():
    # 1, 2, 2, 3 right of 4: p = 0.5, variance 0.5 against 1; no group agrees.
    row = group_spread.window_report([1, 2, 2, 3], 4)
    assert (row["no_spread"], row["dispersion"]) == (0.0, 0.5)
    # At p = 0.25 in groups of 2: agreement 0.75^2 + 0.25^2 = 0.625 under the binomial.
    assert group_spread.window_report([1, 0, 1, 0], 2)["no_spread_binomial"] == pytest.approx(0.625)


def test_a_policy_always_right_has_no_dispersion_to_report():
    assert group_spread.window_report([3, 3], 3)["dispersion"] is None


def test_windows_cover_every_group_in_order(tmp_path):
    counts, attempts = group_spread.right_counts(run_dir(tmp_path, [[0, 0], [1, 0], [1, 1], [0, 1], [1, 1]]))
    assert (counts, attempts) == ([0, 1, 2, 1, 2], 2)
    rows = group_spread.report(counts, attempts, window=2)
    assert [(r["first_group"], r["groups"], r["mean_reward"]) for r in rows] == [
        (0, 2, 0.25),
        (2, 2, 0.75),
        (4, 1, 1.0),
    ]


def test_a_reward_that_is_not_0_or_1_is_refused_naming_the_line(tmp_path):
    path = run_dir(tmp_path, [[0, 1], [0.5, 1]])
    with pytest.raises(ValueError, match=r"actor/0\.jsonl:2: rewards \[0\.5, 1\.0\] are not all 0 or 1"):
        group_spread.right_counts(path)


def test_groups_of_another_size_are_refused_naming_the_line(tmp_path):
    path = run_dir(tmp_path, [[0, 1], [0, 1, 1]])
    with pytest.raises(ValueError, match=r"0\.jsonl:2: a group of 3 attempts after groups of 2"):
        group_spread.right_counts(path)


def test_a_line_that_is_not_a_group_is_refused_naming_it(tmp_path):
    path = run_dir(tmp_path, [[0, 1]])
    with (path / "streams" / "actor" / "0.jsonl").open("ab") as f:
        f.write(b'{"kind": "rollout_group", "problem_id": "p"}\n')
    with pytest.raises(ValueError, match=r"actor/0\.jsonl:2: "):
        group_spread.right_counts(path)


def test_the_command_keeps_its_rows(tmp_path):
    path = run_dir(tmp_path / "run", [[0, 0], [1, 0], [1, 1], [0, 1]])
    kept = tmp_path / "spread.json"
    cmd = [sys.executable, "scripts/group_spread.py", str(path), "--labels", "r", "--window", "2", "--json", str(kept)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "| r | 0-2 | 2 | 0.250 | 0.500 (0.625) | 0.000 (0.062) | 0.67 |" in out
    assert [r["name"] for r in json.loads(kept.read_text())] == ["r 0-2", "r 2-4"]
