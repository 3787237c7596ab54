"""The trainer's consistency sums (pipeline_rl/trainer/inputs.py) on a hand-made micro-batch:
which tokens count as lag 0, which of those as unswapped, and the sums over each."""

from __future__ import annotations

import math

import torch

from pipeline_rl.trainer.inputs import CONSISTENCY_KEYS, consistency_sums


def test_unswapped_tokens_are_the_lag0_tokens_of_rollouts_no_swap_touched():
    # Three packed sequences, each a prompt token (version -1, not trained) then generated tokens:
    # A entirely by version 3; B by 2 then 3 (a swap mid-rollout); C entirely by 2 (lag 1).
    versions = torch.tensor([-1, 3, 3, 3, -1, 2, 3, 3, -1, 2, 2])
    seq_index = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2])
    mask = (versions >= 0).long()
    mask[3] = 0  # a generated token left out of the loss (e.g. gated): counted nowhere
    old = torch.zeros(11)
    d = torch.tensor([0.0, 0.1, -0.2, 9.0, 0.0, 0.3, 0.4, -0.5, 0.0, 0.6, 0.7])
    sums = dict(zip(CONSISTENCY_KEYS, consistency_sums(old + d, old, mask, versions, seq_index, 3, 3).tolist()))

    def k3(x: float) -> float:
        return math.exp(x) - 1 - x

    lag0 = [0.1, -0.2, 0.4, -0.5]  # A's trained tokens and B's version-3 tokens
    unswapped = [0.1, -0.2]  # A's only
    trained = [0.1, -0.2, 0.3, 0.4, -0.5, 0.6, 0.7]
    assert sums["lag0_tokens"] == 4 and sums["unswapped_tokens"] == 2 and sums["behaviour_tokens"] == 7
    assert math.isclose(sums["lag0_abs_diff"], sum(abs(x) for x in lag0), rel_tol=1e-6)
    assert math.isclose(sums["lag0_kl"], sum(k3(x) for x in lag0), rel_tol=1e-6)
    assert math.isclose(sums["unswapped_abs_diff"], sum(abs(x) for x in unswapped), rel_tol=1e-6)
    assert math.isclose(sums["unswapped_kl"], sum(k3(x) for x in unswapped), rel_tol=1e-6)
    assert math.isclose(sums["behaviour_kl"], sum(k3(x) for x in trained), rel_tol=1e-6)
