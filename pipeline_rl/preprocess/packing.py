"""Packing one optimizer step's sequences into micro-batches, balanced over trainer ranks.

Each rollout becomes one sequence, prompt + completion. Sequences are packed whole into
micro-batches of at most `seq_length` tokens (first-fit decreasing), with position ids that
restart at 0 for each sequence, so attention never crosses sequences. Micro-batches are then
dealt to ranks, largest first, each to the rank with the fewest tokens so far among those
that have fewer than ceil(micro-batches / ranks); ranks left short get padding micro-batches
so that every rank runs the same number of forward/backward passes per step.

With shared prompts (`share_prompt`, pipeline_rl/core/logprobs.py), a group's rollouts form
blocks of one prompt followed by completions; a block is packed whole, like one sequence.

A sequence longer than `seq_length` is truncated to its first `seq_length` tokens (the
completion's tail loses its loss tokens) and flagged `truncated`, for the caller to count
and report: one over-long rollout should not stop a run.

A padding micro-batch holds one sequence of one token (PAD_TOKEN_ID, position 0), loss mask
0, group id PAD_GROUP_ID and sample version -1: it contributes zero loss and is left out of
the step's denominators.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np

from pipeline_rl.core.routes import decode_routes, encode_routes, no_routes
from pipeline_rl.streams.records import PAD_GROUP_ID, MicroBatch, Rollout

PAD_TOKEN_ID = 0
"""Any id the vocabulary has will do: the token is masked out and attends only to itself."""
TOKEN_FIELDS = ("input_ids", "loss_mask", "advantages", "old_logprobs", "versions", "ref_logprobs", "routes")
"""Sequence fields with one value per token."""


@dataclass
class Sequence:
    """One rollout laid out token by token for training; all lists have the same length."""

    input_ids: list[int]
    loss_mask: list[int]
    advantages: list[float]
    old_logprobs: list[float]
    versions: list[int]
    ref_logprobs: list[float] | None
    group_id: str
    reward: float
    sample_version: int
    """Oldest policy version among the trained tokens (-1 if it has none)."""
    truncated: bool = False
    prefix: int = 0
    """> 0: this sequence holds only its completion and attends to the first `prefix` tokens
    (the prompt) of its block's head, the nearest earlier sequence with prefix 0."""
    routes: np.ndarray | None = None
    """With routing replay: a row of routes per token (pipeline_rl/core/routes.py)."""

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def loss_tokens(self) -> int:
        return sum(self.loss_mask)


def rollout_sequence(rollout: Rollout, advantages: list[float], group_id: str, seq_length: int) -> Sequence:
    """Lay out prompt + completion; prompt tokens get mask 0, advantage 0, logprob 0, version -1
    and no routes. Raises ValueError naming the group when the routes do not fit the completion."""
    p = len(rollout.prompt_ids)
    c = len(rollout.completion_ids)
    mask = rollout.mask if rollout.mask is not None else [1] * c
    ref = None if rollout.ref_logprobs is None else [0.0] * p + rollout.ref_logprobs
    routes = None
    if rollout.routes is not None:
        completion = decode_routes(rollout.routes, c, f"group {group_id}")
        routes = np.concatenate([no_routes(p, completion.shape[1]), completion])
    seq = Sequence(
        input_ids=rollout.prompt_ids + rollout.completion_ids,
        loss_mask=[0] * p + list(mask),
        advantages=[0.0] * p + list(advantages),
        old_logprobs=[0.0] * p + [lp if m else 0.0 for lp, m in zip(rollout.logprobs, mask)],
        versions=[-1] * p + [v if m else -1 for v, m in zip(rollout.versions, mask)],
        ref_logprobs=ref,
        group_id=group_id,
        reward=rollout.reward,
        sample_version=-1,
        routes=routes,
    )
    if len(seq) > seq_length:
        seq.truncated = True
        for name in TOKEN_FIELDS:
            value = getattr(seq, name)
            if value is not None:
                setattr(seq, name, value[:seq_length])
    trained = [v for v, m in zip(seq.versions, seq.loss_mask) if m]
    seq.sample_version = min(trained) if trained else -1
    return seq


def share_prompt(group: list[Sequence], prompt_length: int, seq_length: int) -> list[Sequence]:
    """One group's sequences (all with the same `prompt_length`-token prompt, laid out by
    rollout_sequence) as blocks of at most `seq_length` tokens: each block's first sequence
    keeps the prompt, the next ones keep only their completion (prefix = prompt_length)."""
    out: list[Sequence] = []
    used = 0
    for s in group:
        rest = len(s) - prompt_length
        if out and rest > 0 and used + rest <= seq_length:
            follower = copy.copy(s)
            for name in TOKEN_FIELDS:
                value = getattr(s, name)
                if value is not None:
                    setattr(follower, name, value[prompt_length:])
            follower.prefix = prompt_length
            out.append(follower)
            used += rest
        else:
            out.append(s)
            used = len(s)
    return out


def blocks(sequences: list[Sequence]) -> list[list[Sequence]]:
    """Sequences grouped into the units packing keeps together: a head and its followers."""
    out: list[list[Sequence]] = []
    for i, s in enumerate(sequences):
        if s.prefix == 0:
            out.append([s])
        elif out:
            out[-1].append(s)
        else:
            raise ValueError(f"sequence {i} (group {s.group_id}) shares a prompt but no head sequence precedes it")
    return out


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of total <= capacity, longest items first.
    Every length must be <= capacity."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > capacity:
            raise ValueError(f"item {i} of length {lengths[i]} exceeds capacity {capacity}")
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def deal(sizes: list[int], ranks: int) -> list[list[int]]:
    """Indices of `sizes` dealt to `ranks` ranks: largest first, each to the lightest rank
    that still has fewer than ceil(len / ranks) items. Counts differ by at most one."""
    per_rank = math.ceil(len(sizes) / ranks)
    dealt: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = min((r for r in range(ranks) if len(dealt[r]) < per_rank), key=lambda r: load[r])
        dealt[r].append(i)
        load[r] += sizes[i]
    return dealt


def _micro_batch(
    seqs: list[Sequence], step: int, index: int, count: int, step_tokens: int, step_samples: int, with_ref: bool
) -> MicroBatch:
    """One micro-batch of `seqs`; their routes, when they have them, in one block."""
    shared = any(s.prefix for s in seqs)
    mb = MicroBatch(
        step=step,
        index=index,
        count=count,
        input_ids=[],
        position_ids=[],
        loss_mask=[],
        advantages=[],
        old_logprobs=[],
        versions=[],
        seq_lengths=[],
        sample_versions=[],
        group_ids=[],
        rewards=[],
        step_tokens=step_tokens,
        step_samples=step_samples,
    )
    ref_logprobs: list[float] = []
    for s in seqs:
        mb.input_ids += s.input_ids
        mb.position_ids += range(s.prefix, s.prefix + len(s))
        mb.loss_mask += s.loss_mask
        mb.advantages += s.advantages
        mb.old_logprobs += s.old_logprobs
        mb.versions += s.versions
        if with_ref:
            assert s.ref_logprobs is not None, "with_ref: every sequence has reference logprobs"
            ref_logprobs += s.ref_logprobs
        mb.seq_lengths.append(len(s))
        mb.sample_versions.append(s.sample_version)
        mb.group_ids.append(s.group_id)
        mb.rewards.append(s.reward)
    mb.ref_logprobs = ref_logprobs if with_ref else None
    mb.prefix_lengths = [s.prefix for s in seqs] if shared else None
    routes = [s.routes for s in seqs if s.routes is not None]
    if routes:
        assert len(routes) == len(seqs), "every sequence of a step has routes, or none does"
        mb.routes = encode_routes(np.concatenate(routes))
    return mb


def padding_sequence(with_ref: bool, route_width: int | None = None) -> Sequence:
    """A one-token sequence that trains nothing; with `route_width`, one row of no routes."""
    return Sequence(
        input_ids=[PAD_TOKEN_ID],
        loss_mask=[0],
        advantages=[0.0],
        old_logprobs=[0.0],
        versions=[-1],
        ref_logprobs=[0.0] if with_ref else None,
        group_id=PAD_GROUP_ID,
        reward=0.0,
        sample_version=-1,
        routes=None if route_width is None else no_routes(1, route_width),
    )


def pack_step(
    sequences: list[Sequence],
    step: int,
    ranks: int,
    seq_length: int,
    filtered: tuple[int, int] = (0, 0),
    unsolved_samples: int = 0,
) -> list[list[MicroBatch]]:
    """The step's micro-batches for each rank: equally many per rank, padded where needed.

    Denominators over the whole step (all ranks): step_tokens = loss tokens, step_samples =
    sequences with at least one loss token; `filtered` (tokens, sequences) of the groups
    filtered out that still count in them, carried beside (the trainer adds them after its lag
    gate, which judges the trained sequences only), with `unsolved_samples`, those of the
    filtered sequences whose group's reward is below the step's mean. With reference logprobs on
    any sequence, every sequence must have them (a KL term over part of a step would be wrong)."""
    with_ref = any(s.ref_logprobs is not None for s in sequences)
    if with_ref:
        missing = [s.group_id for s in sequences if s.ref_logprobs is None]
        if missing:
            raise ValueError(f"step {step}: groups {sorted(set(missing))} lack ref_logprobs while others have them")
    widths = {s.routes.shape[1] for s in sequences if s.routes is not None}
    if widths:
        missing = sorted({s.group_id for s in sequences if s.routes is None})
        if missing or len(widths) > 1:
            raise ValueError(
                f"step {step}: routes of {sorted(widths)} bytes per token"
                + (f", and groups {missing} without routes" if missing else "")
                + ": every rollout of a routing-replay run carries one MoE model's routes"
            )
    route_width = next(iter(widths), None)
    step_tokens = sum(s.loss_tokens for s in sequences)
    step_samples = sum(1 for s in sequences if s.loss_tokens > 0)
    units = blocks(sequences)
    bins = [
        [s for i in b for s in units[i]]
        for b in first_fit_decreasing([sum(len(s) for s in u) for u in units], seq_length)
    ]
    dealt = deal([sum(len(s) for s in b) for b in bins], ranks)
    count = max(1, max(len(d) for d in dealt))
    out = []
    for rank_bins in dealt:
        chosen = [bins[i] for i in rank_bins]
        chosen += [[padding_sequence(with_ref, route_width)]] * (count - len(chosen))
        out.append(
            [_micro_batch(seqs, step, i, count, step_tokens, step_samples, with_ref) for i, seqs in enumerate(chosen)]
        )
    for mb in (mb for batches in out for mb in batches):
        mb.filtered_tokens, mb.filtered_samples = filtered
        mb.unsolved_samples = unsolved_samples
    return out


def is_padding(mb: MicroBatch) -> bool:
    return mb.group_ids == [PAD_GROUP_ID]
