import math

import pytest

from pipeline_rl.actor.problems import UniformSkip
from pipeline_rl.streams.records import Rollout, RolloutGroup


def group(rewards: list[float], token_rewards: list[float] | None = None) -> RolloutGroup:
    rollouts = [
        Rollout(
            prompt_ids=[1],
            completion_ids=[2],
            logprobs=[-0.5],
            versions=[0],
            reward=r,
            finish_reason="stop",
            token_rewards=token_rewards,
        )
        for r in rewards
    ]
    return RolloutGroup(problem_id="p", group_id="g", rollouts=rollouts)


@pytest.mark.parametrize("p", [0.5, 0.8])
def test_a_problem_whose_last_group_was_uniform_is_skipped_at_rate_p(p):
    skip = UniformSkip(p, "seed")
    skip.record("solved", group([1.0] * 8))
    skip.record("failed", group([0.0] * 8))
    skip.record("mixed", group([1.0, 0.0, 1.0, 1.0]))
    n = 4000
    total = 0
    for name in ("solved", "failed"):
        skipped = sum(skip.skip(name) for _ in range(n))
        # Binomial(n, p): 5 standard deviations either side.
        assert abs(skipped - n * p) <= 5 * math.sqrt(n * p * (1 - p))
        total += skipped
    assert not any(skip.skip("mixed") for _ in range(n))
    assert not any(skip.skip("never seen") for _ in range(n))
    assert skip.skipped == total


def test_a_group_with_any_spread_clears_the_problem():
    skip = UniformSkip(0.9, "seed")
    skip.record("q", group([1.0] * 8))
    assert any(skip.skip("q") for _ in range(50))
    skip.record("q", group([1.0] * 7 + [0.5]))
    assert not any(skip.skip("q") for _ in range(1000))


def test_groups_that_may_still_carry_a_gradient_are_never_skipped():
    skip = UniformSkip(0.9, "seed")
    skip.record("one attempt", group([1.0]))  # no group baseline to compare with
    skip.record("token rewards", group([1.0] * 4, token_rewards=[0.5]))  # per-token advantages
    for name in ("one attempt", "token rewards"):
        assert not any(skip.skip(name) for _ in range(1000))


def test_off_skips_nothing():
    skip = UniformSkip(0.0, "seed")
    skip.record("solved", group([1.0] * 8))
    assert not any(skip.skip("solved") for _ in range(1000))
    assert skip.skipped == 0


def test_the_skips_are_the_same_for_the_same_seed():
    def draws(seed: str) -> list[bool]:
        skip = UniformSkip(0.5, seed)
        skip.record("solved", group([1.0] * 8))
        return [skip.skip("solved") for _ in range(200)]

    assert draws("a") == draws("a")
    assert draws("a") != draws("b")
