"""The trainer step's metrics over ranks (trainer/step_metrics.py): two real gloo ranks with
different counts give the hand-summed totals, the lag histogram over the union of their lag
ranges, and the same values on both ranks; step_values' arithmetic on hand-made totals."""

from __future__ import annotations

import multiprocessing
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from fixtures.helpers import free_port

from pipeline_rl.config.choices import LrBySignal
from pipeline_rl.trainer.inputs import CONSISTENCY_KEYS
from pipeline_rl.trainer.lag_gate import GateResult
from pipeline_rl.trainer.loss import STAT_KEYS
from pipeline_rl.trainer.step_metrics import GateTotals, RankReduction, StepCounts, StepTotals, step_values

# Per rank: its gates (two micro-batches, one update each) and its sample lags.
GATES = {
    0: [
        GateResult([1, 1, 0], Counter({0: 2}), dropped_samples=0, dropped_tokens=0, masked_tokens=1),
        GateResult([1, 0, 0], Counter({1: 1}), dropped_samples=0, dropped_tokens=0),
    ],
    1: [
        GateResult([0, 0, 0], Counter({4: 1}), dropped_samples=1, dropped_tokens=3),
        GateResult([1, 1, 1], Counter({0: 1}), dropped_samples=0, dropped_tokens=0, masked_tokens=2),
    ],
}
STATS = {0: 1.0, 1: 10.0}
"""Each rank's value of every loss stat."""
ROUTES = {0: (5, 1), 1: (3, 2)}
FILTERED = (10.0, 4.0)
"""The step's filtered groups' (tokens, samples): step-level, the same on every rank."""


def _rank(rank: int, port: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ranks = RankReduction(torch.device("cpu"))
    gates = GATES[rank]
    gated = GateTotals.reduce(gates, [slice(0, 1), slice(1, 2)], ranks, FILTERED)
    counts = StepCounts.zeros(torch.device("cpu"))
    for gate in gates:
        counts.lags.update(gate.lags)
    counts.rewards, counts.samples, counts.tokens = 0.5 + rank, 3, 6
    counts.add_loss_stats({k: torch.tensor(STATS[rank]) for k in STAT_KEYS})
    counts.consistency += torch.arange(len(CONSISTENCY_KEYS), dtype=torch.float64)
    totals = StepTotals.reduce(counts, ROUTES[rank], ranks)
    ((going, _),) = ranks.ranges([(float(rank), float(rank))])
    out.put((rank, gated, totals, going))
    dist.destroy_process_group()


def test_two_ranks_sum_their_counts_and_join_their_lag_ranges():
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = sorted((out.get(timeout=120) for _ in procs), key=lambda x: x[0])
    for p in procs:
        p.join(30)
    (_, gated0, totals0, low0), (_, gated1, totals1, low1) = got
    assert gated0 == gated1 and totals0 == totals1 and low0 == low1 == 0.0
    # Update 0 is each rank's first micro-batch: [1, 1, 0] and the dropped [0, 0, 0].
    assert gated0.update_tokens == [2.0, 4.0] and gated0.update_samples == [2.0, 2.0]
    # The filtered groups are not summed over ranks: each update's denominators take half of them.
    assert gated0.denominators(0) == (2.0 + 5.0, 2.0 + 2.0) and gated0.denominators(1) == (4.0 + 5.0, 2.0 + 2.0)
    assert (gated0.dropped_samples, gated0.dropped_tokens, gated0.masked_tokens) == (1.0, 3.0, 3.0)
    assert totals0.stats == {k: 11.0 for k in STAT_KEYS}
    assert totals0.consistency == {k: 2.0 * i for i, k in enumerate(CONSISTENCY_KEYS)}
    # Rank 0 saw lags 0..1, rank 1 lags 0 and 4: the histogram spans 0..4, lags 2 and 3 empty.
    assert totals0.lags == {0: 3, 1: 1, 2: 0, 3: 0, 4: 1}
    assert (totals0.rewards, totals0.samples, totals0.tokens) == (2.0, 6.0, 12.0)
    assert (totals0.routes_replayed, totals0.routes_moved) == (8.0, 3.0)


def test_step_values_from_hand_made_totals():
    stats = {k: 0.0 for k in STAT_KEYS} | {"tokens": 8.0, "loss": 3.0, "pg_loss": 2.0, "w": 8.0, "w_sq": 8.0}
    consistency = {k: 0.0 for k in CONSISTENCY_KEYS} | {
        "lag0_tokens": 4.0,
        "lag0_abs_diff": 0.2,
        "lag0_kl": 0.04,
        "behaviour_tokens": 8.0,
        "behaviour_kl": 0.8,
    }
    totals = StepTotals(stats, consistency, {0: 3, 1: 0, 2: 1}, 3.0, 4.0, 20.0, 10.0, 4.0)
    gated = GateTotals(
        dropped_tokens=5.0, dropped_samples=1.0, masked_tokens=2.0, update_tokens=[4.0, 4.0], update_samples=[2.0, 2.0]
    )
    values = step_values(totals, gated, epochs=2, updates_done=2)
    assert values["trained_tokens"] == 4.0  # two passes over the same tokens
    assert values["loss"] == 1.5 and values["pg_loss"] == 1.0  # means over the two updates
    assert values["mismatch/lag0_abs_logprob_diff"] == pytest.approx(0.05)
    assert values["mismatch/lag0_kl"] == pytest.approx(0.01)
    assert "mismatch/unswapped_tokens" not in values  # none of them
    assert values["behaviour_kl"] == pytest.approx(0.1)
    assert values["routing/moved_share"] == pytest.approx(0.4)
    assert values["reward_mean"] == 0.75 and values["samples"] == 4.0 and values["tokens"] == 20.0
    assert values["lag_hist"] == {"0": 3, "2": 1}
    assert values["updated"] and values["optimizer_updates"] == 2
    assert (values["dropped_samples"], values["dropped_tokens"], values["masked_tokens"]) == (1.0, 5.0, 2.0)
    assert step_values(totals, gated, epochs=1, updates_done=0)["updated"] is False


def test_the_signal_share_of_an_update_against_the_filtered_samples_lr_by_signal_names():
    """Updates of 3, 1 and 0 trained samples, 12 filtered samples of which 3 unsolved: each
    update is set against its equal third of them (4, or 1 unsolved); an update that trains
    nothing keeps its lr."""
    gated = GateTotals(
        dropped_tokens=0.0,
        dropped_samples=0.0,
        masked_tokens=0.0,
        update_tokens=[6.0, 2.0, 0.0],
        update_samples=[3.0, 1.0, 0.0],
        filtered_samples=12.0,
        unsolved_samples=3.0,
    )
    assert [gated.signal_share(u, LrBySignal.scheduled) for u in range(3)] == [1.0, 1.0, 1.0]
    assert [gated.signal_share(u, LrBySignal.all) for u in range(3)] == [3 / 7, 1 / 5, 1.0]
    assert [gated.signal_share(u, LrBySignal.unsolved) for u in range(3)] == [3 / 4, 1 / 2, 1.0]
