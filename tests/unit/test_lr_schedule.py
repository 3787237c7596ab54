"""The learning-rate multiplier: linear warm-up, then constant or a half cosine to a floor at
the end of the run, by steps or by wall time, whichever ends the run first."""

from __future__ import annotations

import itertools
import math

import pytest

from pipeline_rl.config import load_config
from pipeline_rl.trainer.model import lr_factor

NO_WARMUP = "trainer.optimizer.warmup_steps=0"
"""For the tests of the decay alone (the default warms up)."""


def factor(*overrides: str, clock=lambda: 0.0):
    return lr_factor(load_config("tiny", ["max_time_s=0", *overrides]), clock)


def cosine(floor: float, done: float) -> float:
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done))


def test_constant_after_warmup():
    f = factor("trainer.optimizer.warmup_steps=4", "trainer.optimizer.decay=constant", "shared.max_steps=10")
    assert [f(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert f(10**6) == 1.0


def test_cosine_by_steps_reaches_the_floor_at_max_steps():
    f = factor(
        "trainer.optimizer.warmup_steps=2",
        "trainer.optimizer.decay=cosine",
        "trainer.optimizer.min_lr_ratio=0.2",
        "shared.max_steps=6",
    )
    assert f(0) == 0.5 and f(1) == 1.0
    # The 4 updates after warm-up walk the half cosine in quarters.
    for k in range(1, 5):
        assert f(1 + k) == pytest.approx(cosine(0.2, k / 4), rel=1e-12)
    assert f(100) == pytest.approx(0.2, rel=1e-12)
    after = [f(s) for s in range(1, 8)]
    assert all(a >= b for a, b in itertools.pairwise(after))  # never rises after warm-up


def test_updates_per_step_count_in_the_run_length():
    f = factor(
        NO_WARMUP,
        "trainer.optimizer.decay=cosine",
        "shared.max_steps=2",
        "trainer.updates_per_step=2",
    )
    assert f(1) == pytest.approx(cosine(0.1, 0.5), rel=1e-12)  # update 2 of 4
    assert f(3) == pytest.approx(0.1, rel=1e-12)


def test_cosine_by_time_when_time_ends_the_run_first():
    now = [100.0]
    f = lr_factor(
        load_config("tiny", [NO_WARMUP, "max_time_s=60", "shared.max_steps=1000000", "trainer.optimizer.decay=cosine"]),
        lambda: now[0],
    )
    assert f(0) == pytest.approx(cosine(0.1, 1e-6), rel=1e-9)  # by steps: barely started
    now[0] = 115.0
    assert f(1) == pytest.approx(cosine(0.1, 0.25), rel=1e-12)
    now[0] = 190.0
    assert f(2) == pytest.approx(0.1, rel=1e-12)  # past max_time_s: the floor, not beyond it


def test_steps_win_when_they_end_the_run_first():
    f = lr_factor(
        load_config("tiny", [NO_WARMUP, "max_time_s=3600", "shared.max_steps=4", "trainer.optimizer.decay=cosine"]),
        lambda: 0.0,
    )
    assert f(1) == pytest.approx(cosine(0.1, 0.5), rel=1e-12)


def test_a_trainer_started_mid_run_goes_on_with_the_schedule_by_time():
    """A trainer pool restarted 30 s into a 60 s run (the launch time comes from the launcher)
    takes the decay from half-way, not from its own start."""
    cfg = load_config(
        "tiny", [NO_WARMUP, "max_time_s=60", "shared.max_steps=1000000", "trainer.optimizer.decay=cosine"]
    )
    f = lr_factor(cfg, lambda: 130.0, started=100.0)
    assert f(0) == pytest.approx(cosine(0.1, 0.5), rel=1e-12)


def test_the_default_warms_up_over_ten_updates():
    f = factor("trainer.optimizer.decay=constant")
    assert [f(s) for s in (0, 4, 9, 10)] == pytest.approx([0.1, 0.5, 1.0, 1.0], rel=1e-12)
