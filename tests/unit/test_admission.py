"""Admission control (pure logic): the staleness bound holds, a stalled trainer stalls the
actors, sync mode is generate -> train -> update, and nothing deadlocks."""

from __future__ import annotations

import itertools
import math
import random
from collections import deque
from fractions import Fraction

import pytest

from pipeline_rl.actor.admission import Admission, admission_lag, effective_max_lag
from pipeline_rl.config import load_config


def admit_all(adm: Admission, version: int) -> list[int]:
    started = []
    while adm.may_start(version):
        started.append(adm.start())
    return started


@pytest.mark.parametrize("groups_per_step, actors, max_lag", [(16, 1, 4), (16, 2, 0), (6, 4, 1), (5, 3, 2), (1, 1, 0)])
def test_stalled_trainer_bounds_what_an_actor_starts(groups_per_step, actors, max_lag):
    adm = Admission(groups_per_step, actors, max_lag)
    started = admit_all(adm, version=0)
    share = groups_per_step / actors
    assert len(started) == adm.ahead_limit(0) <= (max_lag + 1) * share + 1
    assert len(started) >= (max_lag + 1) * share
    assert all(adm.step_of(g) <= max_lag for g in started)
    assert not adm.may_start(0)
    # One new version admits about one more share, never more than the bound allows.
    more = admit_all(adm, version=1)
    assert len(started) + len(more) == adm.ahead_limit(1)
    assert abs(len(more) - share) < 1 + 1e-9


def test_step_of_matches_floor_of_share():
    adm = Admission(groups_per_step=10, actors=3, max_lag=0)
    for g in range(200):
        assert adm.step_of(g) == math.floor(Fraction(g) / Fraction(10, 3))
        assert adm.step_of(adm.first_group_of(adm.step_of(g))) == adm.step_of(g)
        assert adm.first_group_of(adm.step_of(g)) <= g


def simulate(groups_per_step, actors, max_lag, interval, steps, seed=0, sync=False):
    """Actors admit and (instantly) generate at their current version; the trainer takes each
    step's groups from the actors' partitions in the order actors of equal speed produce them
    (lowest group number first, ties broken at random), trains, and publishes every `interval`
    steps. Returns the lag (trained step - generating version) of every group."""
    bound = effective_max_lag(max_lag, interval, sync)
    rng = random.Random(seed)
    adms = [Admission(groups_per_step, actors, bound) for _ in range(actors)]
    queues = [deque() for _ in range(actors)]  # (group number, version) per actor
    published = trained = 0
    lags = []
    for _ in range(steps * 10):
        for adm, q in zip(adms, queues):
            for g in admit_all(adm, published):
                q.append((g, published))
        if sum(map(len, queues)) < groups_per_step:
            break  # deadlock: the trainer needs groups no actor may start
        taken = 0
        while taken < groups_per_step:
            q = min((q for q in queues if q), key=lambda q: (q[0][0], rng.random()))
            lags.append(trained - q.popleft()[1])
            taken += 1
        trained += 1
        if trained % interval == 0:
            published = trained
        if trained == steps:
            break
    assert trained == steps, f"stalled at step {trained}"
    return lags


@pytest.mark.parametrize(
    "groups_per_step, actors, max_lag, interval",
    [
        (16, 1, 4, 1),
        (16, 2, 2, 1),
        (16, 4, 0, 1),
        (12, 3, 1, 2),
        (16, 2, 4, 3),
    ],
)
def test_lag_of_trained_groups_stays_within_bound(groups_per_step, actors, max_lag, interval):
    for seed in range(3):
        lags = simulate(groups_per_step, actors, max_lag, interval, steps=40, seed=seed)
        bound = effective_max_lag(max_lag, interval, sync=False)
        assert max(lags) <= bound
        assert min(lags) >= 0


def test_uneven_share_lag_within_one_extra_step():
    # 10 groups over 3 actors: a share of 3.33 groups, so landing steps are approximate: max_lag + 1.
    for seed in range(5):
        assert max(simulate(10, 3, 1, 1, steps=40, seed=seed)) <= 2


def test_sync_mode_is_generate_train_update():
    assert effective_max_lag(4, 1, sync=True) == 0
    adm = Admission(groups_per_step=8, actors=2, max_lag=effective_max_lag(4, 1, sync=True))
    for version in range(5):
        # Exactly one step's share at the current policy, then wait for the update.
        assert admit_all(adm, version) == list(range(4 * version, 4 * version + 4))
    assert simulate(8, 2, 4, 1, steps=20, sync=True) == [0] * 8 * 20


def test_sync_mode_with_update_interval_does_not_deadlock():
    assert effective_max_lag(0, 3, sync=True) == 2
    lags = simulate(8, 1, 0, 3, steps=12, sync=True)
    assert max(lags) == 2


def test_resume_starts_at_the_checkpoint_step():
    adm = Admission(16, 2, max_lag=1, started=Admission(16, 2, 1).first_group_of(10))
    assert adm.started == 80 and adm.step_of(adm.started) == 10
    assert len(admit_all(adm, version=10)) == 16  # steps 10 and 11: two shares of 8
    assert not adm.may_start(10)


def test_abandoned_group_frees_its_place():
    adm = Admission(4, 1, max_lag=0)
    assert admit_all(adm, 0) == [0, 1, 2, 3]
    adm.abandon()
    assert adm.may_start(0) and adm.start() == 3 and not adm.may_start(0)


def test_bad_settings_are_rejected():
    for args in itertools.product((0, 16), (0, 1), (-1, 2)):
        if args != (16, 1, 2):
            with pytest.raises(ValueError):
                Admission(*args)


def test_admission_lag_defaults_to_max_lag_and_can_exceed_it():
    assert admission_lag(load_config("tiny", ["shared.max_lag=2"])) == 2
    cfg = load_config("tiny", ["shared.max_lag=1", "actor.admission_lag=3"])
    assert admission_lag(cfg) == 3
    # Admitting 3 versions ahead while the gate allows 1: groups land up to 3 steps late, so the
    # trainer's gate, not the actor, is what keeps stale tokens out of training.
    lags = simulate(8, 1, admission_lag(cfg), 1, steps=20)
    assert max(lags) == 3
    cfg.actor.mode = "sync"
    assert admission_lag(cfg) == 0


@pytest.mark.parametrize(
    "groups_per_step, before, after, max_lag", [(12, 2, 3, 1), (12, 3, 2, 0), (16, 1, 4, 2), (6, 4, 1, 1)]
)
def test_a_rescaled_job_keeps_the_next_groups_step_and_takes_the_new_share(groups_per_step, before, after, max_lag):
    adm = Admission(groups_per_step, before, max_lag)
    admit_all(adm, version=0)
    admit_all(adm, version=3)
    step = adm.step_of(adm.started)  # where the next group was predicted to land
    started = adm.started
    adm.rebase(after, version=4)  # the next group's step is within version 4's bound
    assert adm.actors == after and adm.step_of(adm.started) == step
    assert adm.started == adm.first_group_of(step) and adm.offset == adm.started - started
    # From there, one new version admits one share of the new count (within rounding).
    first = admit_all(adm, version=3)
    more = admit_all(adm, version=4)
    assert all(adm.step_of(g) <= 4 + max_lag for g in first + more)
    assert abs(len(more) - groups_per_step / after) < 1 + 1e-9
    # Scaled back: again the next group's step is kept.
    step = adm.step_of(adm.started)
    adm.rebase(before, version=5)
    assert adm.actors == before and adm.step_of(adm.started) == step
    with pytest.raises(ValueError):
        adm.rebase(0, version=4)


def test_a_rescaled_actor_predicting_past_its_version_starts_at_its_version():
    """Actor 0 of 2 made every group of steps 0..4 alone (actor 1 started late, then drained):
    it predicts its next group in step 10, while the trainer waits for step 5. Scaled to 1
    actor at version 5, it starts a share at once (step 7, the bound of version 5), and every
    version after that opens one more share: no wait for a version that waits for it."""
    adm = Admission(groups_per_step=4, actors=2, max_lag=2, started=20)
    assert adm.step_of(adm.started) == 10 and not adm.may_start(5)
    adm.rebase(1, version=5)
    assert adm.step_of(adm.started) == 7
    for version in range(5, 10):
        assert len(admit_all(adm, version)) == 4


@pytest.mark.parametrize("trainer_version_known", [True, False])
def test_an_actor_left_alone_after_making_less_than_its_share_lands_no_group_late(trainer_version_known):
    """Actor 1 of 2 started 8 groups (it predicts its next in step 4), but actor 0 made more:
    steps 0..4 are full, 6 of actor 1's groups are still to land, the trainer is at version 5.
    Actor 0 goes (absent, or scaled away). Rebased on the trainer's version, actor 1 alone lands
    every group within max_lag of the version it started at, and never waits for a step that
    waits for it; rebased on its own prediction, its groups land steps late (the trainer's gate
    would drop them)."""
    gps, max_lag = 4, 2
    adm = Admission(gps, actors=2, max_lag=max_lag, started=8)
    assert adm.step_of(adm.started) == 4
    queue = 5 * gps + 6  # groups ahead of the next one in the order the preprocessor takes them
    version = queue // gps  # the trainer trains every full step
    adm.rebase(1, version=version, trainer_version=version if trainer_version_known else None)
    lags = []
    for _ in range(10):
        admitted = admit_all(adm, version)
        for _ in admitted:
            lags.append(queue // gps - version)  # the step it lands in, less the version it started at
            queue += 1
        assert admitted or queue // gps > version, "the actor waits for a version that waits for it"
        version = queue // gps
    assert (max(lags) <= max_lag) == trainer_version_known, lags
