"""A trainer step's metrics, apart from the step itself: what one rank counts while it trains
(`StepCounts`), the ranks' sums and ranges in one collective each (`RankReduction`), and the
step's metric values made from the totals (`step_values`).

Every rank must make the same collectives with vectors of the same length: the lag histogram's
range is agreed first (one MIN collective, a maximum taken as the minimum of its negative), then
every count goes in one SUM collective laid out by `StepTotals.layout`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipeline_rl.config.choices import LrBySignal
from pipeline_rl.streams.records import PAD_GROUP_ID, MicroBatch
from pipeline_rl.trainer.inputs import CONSISTENCY_KEYS
from pipeline_rl.trainer.lag_gate import GateResult
from pipeline_rl.trainer.loss import STAT_KEYS, summarize


class RankReduction:
    """Reductions over the trainer ranks on `device` (float64: counts stay exact far past any
    step's size)."""

    def __init__(self, device: torch.device):
        self.device = device

    def sums(self, values: Sequence[float]) -> list[float]:
        """Each value summed over the ranks."""
        return self._reduce(values, dist.ReduceOp.SUM)

    def ranges(self, pairs: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
        """Per (low, high) pair, the lowest low and the highest high over the ranks."""
        lows = self._reduce([*(lo for lo, _ in pairs), *(-hi for _, hi in pairs)], dist.ReduceOp.MIN)
        n = len(pairs)
        return [(lows[i], -lows[n + i]) for i in range(n)]

    def _reduce(self, values: Sequence[float], op: Any) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()


@dataclass
class GateTotals:
    """What the max_lag gate left and took over all ranks: the denominators of each update."""

    dropped_tokens: float
    dropped_samples: float
    masked_tokens: float
    update_tokens: list[float]
    """Per optimizer update of the step, the tokens it trains."""
    update_samples: list[float]
    filtered_tokens: float = 0.0
    """Tokens of the step's filtered groups counted in its denominators (MicroBatch.filtered_tokens)."""
    filtered_samples: float = 0.0
    unsolved_samples: float = 0.0
    """Of the filtered samples, those of groups below the step's mean reward (MicroBatch.unsolved_samples)."""

    def denominators(self, update: int) -> tuple[float, float]:
        """The token and sequence denominators of `update`'s loss: what it trains, and its equal
        share of the step's filtered groups."""
        n = len(self.update_tokens)
        return (
            self.update_tokens[update] + self.filtered_tokens / n,
            self.update_samples[update] + self.filtered_samples / n,
        )

    def signal_share(self, update: int, against: LrBySignal) -> float:
        """The share of `update`'s samples that carry a signal, against its equal share of the
        step's filtered samples that `against` names (trainer.optimizer.lr_by_signal)."""
        n = len(self.update_samples)
        trained = self.update_samples[update]
        other = {
            LrBySignal.scheduled: 0.0,
            LrBySignal.all: self.filtered_samples,
            LrBySignal.unsolved: self.unsolved_samples,
        }
        return trained / (trained + other[against] / n) if trained else 1.0

    @classmethod
    def reduce(
        cls, gates: list[GateResult], updates: list[slice], ranks: RankReduction, filtered: tuple[float, float, float]
    ) -> GateTotals:
        """Sums over the ranks; `filtered` is the step's (tokens, samples, unsolved samples), the
        same on every rank."""
        local = [
            sum(g.dropped_tokens for g in gates),
            sum(g.dropped_samples for g in gates),
            sum(g.masked_tokens for g in gates),
            *(sum(sum(g.loss_mask) for g in gates[u]) for u in updates),
            *(sum(g.samples for g in gates[u]) for u in updates),
        ]
        total = ranks.sums(local)
        n = len(updates)
        return cls(total[0], total[1], total[2], total[3 : 3 + n], total[3 + n : 3 + 2 * n], *filtered)


@dataclass
class StepCounts:
    """One rank's counts over a step: the loss plug-in's stats (every pass), the consistency sums
    and what its samples were (the first pass only: later passes see weights no version had)."""

    stats: torch.Tensor
    consistency: torch.Tensor
    lags: Counter = field(default_factory=Counter)
    rewards: float = 0.0
    samples: int = 0
    tokens: int = 0

    @classmethod
    def zeros(cls, device: torch.device) -> StepCounts:
        return cls(
            torch.zeros(len(STAT_KEYS), dtype=torch.float64, device=device),
            torch.zeros(len(CONSISTENCY_KEYS), dtype=torch.float64, device=device),
        )

    def count_samples(self, mb: MicroBatch, gate: GateResult) -> None:
        self.lags.update(gate.lags)
        real = [j for j, g in enumerate(mb.group_ids) if g != PAD_GROUP_ID]
        self.rewards += sum(mb.rewards[j] for j in real)
        self.samples += len(real)
        self.tokens += len(mb.input_ids)

    def add_loss_stats(self, stats: dict[str, torch.Tensor]) -> None:
        self.stats += torch.stack([stats[k] for k in STAT_KEYS]).to(self.stats)


@dataclass
class StepTotals:
    """StepCounts summed over the ranks, with the MoE routes the step replayed."""

    stats: dict[str, float]
    consistency: dict[str, float]
    lags: dict[int, int]
    rewards: float
    samples: float
    tokens: float
    routes_replayed: float
    routes_moved: float

    @classmethod
    def reduce(cls, counts: StepCounts, routes: tuple[int, int], ranks: RankReduction) -> StepTotals:
        """Every rank's `counts` and `routes` (replayed, moved) summed: two collectives."""
        lo, hi = (int(x) for x in ranks.ranges([(min(counts.lags, default=0), max(counts.lags, default=0))])[0])
        span = range(lo, hi + 1)
        local = [
            *counts.stats.tolist(),
            *counts.consistency.tolist(),
            counts.rewards,
            counts.samples,
            counts.tokens,
            *routes,
            *(counts.lags.get(lag, 0) for lag in span),
        ]
        total = iter(ranks.sums(local))
        stats = {k: next(total) for k in STAT_KEYS}
        consistency = {k: next(total) for k in CONSISTENCY_KEYS}
        rewards, samples, tokens, replayed, moved = (next(total) for _ in range(5))
        lags = {lag: int(next(total)) for lag in span}
        return cls(stats, consistency, lags, rewards, samples, tokens, replayed, moved)


def step_values(totals: StepTotals, gated: GateTotals, epochs: int, updates_done: int) -> dict[str, Any]:
    """The step's metrics from the ranks' totals."""
    values: dict[str, Any] = dict(summarize(totals.stats))
    # The ratio metrics average over the passes; every pass trains the same tokens.
    values["trained_tokens"] /= epochs
    # Inference/training consistency on tokens sampled by the weights being trained (lag 0),
    # and on those whose rollout no swap touched (a swap mid-rollout leaves a KV cache of
    # older weights): there logprobs differ only by numerics and an MoE router's choices.
    c = totals.consistency
    for name in ("lag0", "unswapped"):
        if c[f"{name}_tokens"]:
            values[f"mismatch/{name}_tokens"] = c[f"{name}_tokens"]
            values[f"mismatch/{name}_abs_logprob_diff"] = c[f"{name}_abs_diff"] / c[f"{name}_tokens"]
            values[f"mismatch/{name}_kl"] = c[f"{name}_kl"] / c[f"{name}_tokens"]
    if totals.routes_replayed:
        # How often the engine's experts were not the ones the trainer's router would pick:
        # what routing replay corrects (token-layer pairs of the step's forward passes).
        values["routing/replayed"] = totals.routes_replayed
        values["routing/moved_share"] = totals.routes_moved / totals.routes_replayed
    if c["behaviour_tokens"]:
        # How far the trained policy has moved from the one that sampled: per-version step
        # size times the lag, the quantity the ratio clip and the lag gate control.
        values["behaviour_kl"] = c["behaviour_kl"] / c["behaviour_tokens"]
    # The per-update losses are means of their mini-batch: report the mean over updates.
    values["loss"] /= max(updates_done, 1)
    values["pg_loss"] /= max(updates_done, 1)
    values.update(
        reward_mean=totals.rewards / max(totals.samples, 1),
        samples=totals.samples,
        tokens=totals.tokens,
        dropped_samples=gated.dropped_samples,
        dropped_tokens=gated.dropped_tokens,
        masked_tokens=gated.masked_tokens,
        updated=updates_done > 0,
        optimizer_updates=updates_done,
        lag_hist={str(lag): n for lag, n in totals.lags.items() if n},
    )
    return values
