"""Group-relative advantages and per-token rewards, against hand-computed values."""

import pytest

from pipeline_rl.config import AdvantageConfig
from pipeline_rl.preprocess.advantages import all_zero, group_advantages, reward_to_go, sequence_advantages
from pipeline_rl.streams.records import Rollout, RolloutGroup


def rollout(reward, n_tokens=3, token_rewards=None, mask=None):
    return Rollout(
        prompt_ids=[1, 2],
        completion_ids=list(range(n_tokens)),
        logprobs=[-0.5] * n_tokens,
        versions=[0] * n_tokens,
        reward=reward,
        finish_reason="stop",
        mask=mask,
        token_rewards=token_rewards,
    )


def test_mean_baseline():
    assert sequence_advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    assert sequence_advantages([3.0, 1.0, 2.0]) == [1.0, -1.0, 0.0]


def test_divide_by_std():
    # Population std of [1, 0, 0, 1] is 0.5.
    got = sequence_advantages([1.0, 0.0, 0.0, 1.0], divide_by_std=True)
    assert got == pytest.approx([1.0, -1.0, -1.0, 1.0], rel=1e-5)
    # [3, 1, 2]: mean 2, std sqrt(2/3).
    got = sequence_advantages([3.0, 1.0, 2.0], divide_by_std=True)
    assert got == pytest.approx([1.2247449, -1.2247449, 0.0], rel=1e-5)


def test_leave_one_out():
    # Rollout 0 is compared with the mean of [0, 0, 0]; the others with mean of [1, 0, 0] = 1/3.
    got = sequence_advantages([1.0, 0.0, 0.0, 0.0], leave_one_out=True)
    assert got == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    got = sequence_advantages([4.0, 2.0, 0.0], leave_one_out=True, divide_by_std=True)
    # Baselines 1, 2, 3; population std of [4, 2, 0] is sqrt(8/3).
    assert got == pytest.approx([3 / 1.6329932, 0.0, -3 / 1.6329932], rel=1e-5)


def test_degenerate_groups_have_zero_advantage():
    assert sequence_advantages([0.7]) == [0.0]
    assert sequence_advantages([0.7], leave_one_out=True) == [0.0]
    assert sequence_advantages([]) == []
    equal = sequence_advantages([0.1, 0.1, 0.1], divide_by_std=True)
    assert all(abs(a) < 1e-9 for a in equal)


def test_reward_to_go():
    assert reward_to_go([0.0, 0.5, 0.0, -1.0]) == [-0.5, -0.5, -1.0, -1.0]
    assert reward_to_go([]) == []


def test_token_advantages_add_reward_to_go_and_mask():
    group = RolloutGroup(
        problem_id="p",
        group_id="g",
        rollouts=[
            # Sequence advantage 0.75 - 0.5 = 0.25; reward-to-go [-0.5, -0.5, -1, -1]; token 2 is masked.
            rollout(0.75, 4, token_rewards=[0.0, 0.5, 0.0, -1.0], mask=[1, 1, 0, 1]),
            rollout(0.25, 2),
        ],
    )
    adv = group_advantages(group, AdvantageConfig())
    assert adv[0] == pytest.approx([-0.25, -0.25, 0.0, -0.75])
    assert adv[1] == pytest.approx([-0.25, -0.25])


def test_token_rewards_give_signal_to_equal_outcomes():
    group = RolloutGroup(
        problem_id="p",
        group_id="g",
        rollouts=[
            rollout(1.0, 3, token_rewards=[1.0, 0.0, 0.0]),
            rollout(1.0, 3, token_rewards=[0.0, 0.0, 0.0]),
        ],
    )
    adv = group_advantages(group, AdvantageConfig(divide_by_std=True))
    assert adv[0] == pytest.approx([1.0, 0.0, 0.0])
    assert adv[1] == [0.0, 0.0, 0.0]
    assert not all_zero(adv)


def test_all_zero_ignores_round_off():
    group = RolloutGroup(problem_id="p", group_id="g", rollouts=[rollout(0.1), rollout(0.1), rollout(0.1)])
    assert all_zero(group_advantages(group, AdvantageConfig()))
    group.rollouts[0].reward = 0.2
    assert not all_zero(group_advantages(group, AdvantageConfig()))
