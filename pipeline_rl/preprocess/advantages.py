"""Group-relative advantages, computed per completion token.

For a group of n rollouts with rewards R_1..R_n, rollout i gets the sequence advantage

    A_i = (R_i - b_i) / s

- b_i, the baseline: the group mean (1/n) sum_j R_j, or with `leave_one_out` the mean of
  the *other* rollouts (1/(n-1)) sum_{j != i} R_j. A group of one rollout has nothing to
  compare with: b_1 = R_1, so A_1 = 0.
- s: 1, or with `divide_by_std` the population standard deviation of the group's rewards
  plus STD_EPS (a group of equal rewards then keeps advantage 0 instead of dividing by 0).

Per-token rewards (`Rollout.token_rewards`, e.g. a process reward model's score of a step
placed on the step's last token, or a turn's reward) enter as an undiscounted reward-to-go:
completion token t of rollout i gets

    A_{i,t} = A_i + sum_{u >= t} r_{i,u}

so a token is credited with the rewards of its own step and of every later step, never with
earlier ones. Reward-to-go is not baselined (token positions do not line up across a
group's rollouts): a scorer that wants a centred signal gives centred rewards (e.g. +1 for
a good step, -1 for a bad one). Tokens with mask 0 (inserted by the environment) still
carry their rewards into the reward-to-go of earlier tokens, but get advantage 0: they are
not trained on.
"""

from __future__ import annotations

import math

from pipeline_rl.config import AdvantageConfig
from pipeline_rl.streams.records import Rollout, RolloutGroup

STD_EPS = 1e-6
ZERO_TOL = 1e-9
"""Advantages of magnitude below this count as zero for `filter_zero` (float round-off of R - mean)."""


def sequence_advantages(rewards: list[float], divide_by_std: bool = False, leave_one_out: bool = False) -> list[float]:
    """A_i = (R_i - b_i) / s for one group's rewards (see the module docstring)."""
    n = len(rewards)
    if n == 0:
        return []
    if n == 1:
        return [0.0]
    total = sum(rewards)
    mean = total / n
    if leave_one_out:
        baselines = [(total - r) / (n - 1) for r in rewards]
    else:
        baselines = [mean] * n
    scale = 1.0
    if divide_by_std:
        scale = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n) + STD_EPS
    return [(r - b) / scale for r, b in zip(rewards, baselines)]


def reward_to_go(token_rewards: list[float]) -> list[float]:
    """out[t] = sum of token_rewards[t:]."""
    out = [0.0] * len(token_rewards)
    running = 0.0
    for t in range(len(token_rewards) - 1, -1, -1):
        running += token_rewards[t]
        out[t] = running
    return out


def token_advantages(rollout: Rollout, sequence_advantage: float) -> list[float]:
    """Advantage of each completion token: A_i plus the reward-to-go, 0 where mask is 0."""
    n = len(rollout.completion_ids)
    to_go = reward_to_go(rollout.token_rewards) if rollout.token_rewards is not None else [0.0] * n
    mask = rollout.mask if rollout.mask is not None else [1] * n
    return [(sequence_advantage + g) if m else 0.0 for g, m in zip(to_go, mask)]


def group_advantages(group: RolloutGroup, cfg: AdvantageConfig) -> list[list[float]]:
    """Per-token advantages of every rollout of `group`, aligned with its completion_ids."""
    seq = sequence_advantages([r.reward for r in group.rollouts], cfg.divide_by_std, cfg.leave_one_out)
    return [token_advantages(r, a) for r, a in zip(group.rollouts, seq)]


def all_zero(advantages: list[list[float]]) -> bool:
    """True when no token of the group has a non-zero advantage (the group carries no gradient)."""
    return all(abs(a) < ZERO_TOL for row in advantages for a in row)
