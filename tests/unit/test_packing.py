"""Packing: whole sequences, restarting positions, balanced ranks, equal counts, padding."""

import random

import pytest

from pipeline_rl.preprocess.packing import (
    PAD_TOKEN_ID,
    deal,
    first_fit_decreasing,
    is_padding,
    pack_step,
    rollout_sequence,
    share_prompt,
)
from pipeline_rl.streams.records import MicroBatch, Rollout, decode, encode


def make_rollout(prompt_len, completion_len, version=3, mask=None, ref=False, start=100):
    prompt = list(range(start, start + prompt_len))
    completion = list(range(start + prompt_len, start + prompt_len + completion_len))
    return Rollout(
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=[-0.1 * (i + 1) for i in range(completion_len)],
        versions=[version + (i % 2) for i in range(completion_len)],
        reward=1.0,
        finish_reason="stop",
        mask=mask,
        ref_logprobs=[-0.2] * completion_len if ref else None,
    )


def make_sequences(lengths, seed=0):
    rng = random.Random(seed)
    seqs = []
    for i, n in enumerate(lengths):
        p = rng.randint(1, n - 1)
        r = make_rollout(p, n - p, start=1000 * i)
        seqs.append(rollout_sequence(r, [0.5] * (n - p), f"g{i}", seq_length=10_000))
    return seqs


def unpack(mb: MicroBatch):
    """The sequences of a micro-batch as (input_ids, position_ids) slices."""
    out, start = [], 0
    for n in mb.seq_lengths:
        out.append((mb.input_ids[start : start + n], mb.position_ids[start : start + n]))
        start += n
    return out


def test_rollout_sequence_layout():
    r = make_rollout(3, 4, version=5, mask=[1, 0, 1, 1])
    s = rollout_sequence(r, [1.0, 0.0, 2.0, 3.0], "g", seq_length=64)
    assert s.input_ids == r.prompt_ids + r.completion_ids
    assert s.loss_mask == [0, 0, 0, 1, 0, 1, 1]
    assert s.advantages == [0.0, 0.0, 0.0, 1.0, 0.0, 2.0, 3.0]
    assert s.old_logprobs == pytest.approx([0, 0, 0, -0.1, 0, -0.3, -0.4])
    assert s.versions == [-1, -1, -1, 5, -1, 5, 6]
    assert s.sample_version == 5
    assert s.loss_tokens == 3 and not s.truncated


def test_long_sequence_is_truncated_and_flagged():
    r = make_rollout(5, 10, version=2, ref=True)
    s = rollout_sequence(r, [1.0] * 10, "g", seq_length=8)
    assert s.truncated and len(s) == 8
    assert s.loss_mask == [0] * 5 + [1] * 3
    assert len(s.ref_logprobs) == 8 and len(s.versions) == 8
    # Prompt alone longer than seq_length: no trained token left.
    s = rollout_sequence(make_rollout(9, 3), [1.0] * 3, "g", seq_length=8)
    assert s.truncated and s.loss_tokens == 0 and s.sample_version == -1


def test_first_fit_decreasing_by_hand():
    # Sorted: 6, 5, 4, 3, 2 -> [6, 4], [5, 3, 2].
    assert first_fit_decreasing([2, 6, 4, 5, 3], 10) == [[1, 2], [3, 4, 0]]
    with pytest.raises(ValueError, match="exceeds capacity"):
        first_fit_decreasing([11], 10)


def test_deal_balances_with_equal_counts():
    dealt = deal([9, 8, 7, 2, 1], 2)
    assert sorted(len(d) for d in dealt) == [2, 3]
    loads = [sum([9, 8, 7, 2, 1][i] for i in d) for d in dealt]
    assert abs(loads[0] - loads[1]) <= 3


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_pack_step_invariants(ranks):
    rng = random.Random(ranks)
    lengths = [rng.randint(3, 60) for _ in range(40)]
    seqs = make_sequences(lengths)
    seq_length = 64
    per_rank = pack_step(seqs, step=7, ranks=ranks, seq_length=seq_length)
    assert len(per_rank) == ranks
    count = len(per_rank[0])
    assert all(len(b) == count for b in per_rank)
    seen = []
    for batches in per_rank:
        for index, mb in enumerate(batches):
            decode(encode(mb), MicroBatch)  # lengths agree
            assert (mb.step, mb.index, mb.count) == (7, index, count)
            assert len(mb.input_ids) <= seq_length
            for ids, pos in unpack(mb):
                assert pos == list(range(len(ids)))
                if not is_padding(mb):
                    seen.append(ids)
    # Every sequence appears exactly once and whole.
    assert sorted(seen) == sorted(s.input_ids for s in seqs)
    assert per_rank[0][0].step_tokens == sum(s.loss_tokens for s in seqs)
    assert per_rank[0][0].step_samples == len(seqs)
    # Balance: rank loads differ by at most one micro-batch's worth of tokens.
    loads = [sum(len(mb.input_ids) for mb in b if not is_padding(mb)) for b in per_rank]
    assert max(loads) - min(loads) <= seq_length


def test_padding_micro_batches_fill_short_ranks():
    seqs = make_sequences([30, 30, 30])
    per_rank = pack_step(seqs, step=0, ranks=2, seq_length=32)  # 3 micro-batches for 2 ranks
    assert [len(b) for b in per_rank] == [2, 2]
    pads = [mb for b in per_rank for mb in b if is_padding(mb)]
    assert len(pads) == 1
    pad = pads[0]
    assert pad.input_ids == [PAD_TOKEN_ID] and pad.loss_mask == [0] and pad.seq_lengths == [1]
    assert pad.step_tokens == sum(s.loss_tokens for s in seqs) and pad.step_samples == 3
    # One sequence for four ranks: three ranks get only padding.
    per_rank = pack_step(make_sequences([10]), step=1, ranks=4, seq_length=32)
    assert [len(b) for b in per_rank] == [1, 1, 1, 1]
    assert sum(is_padding(b[0]) for b in per_rank) == 3


def test_denominators_make_ranks_sum_to_one_rank_update():
    """A token-normalised sum over all ranks' micro-batches equals the one-rank value."""
    seqs = make_sequences([12, 40, 7, 33, 25, 18, 60, 5])
    for s in seqs:
        s.advantages = [a * (i % 3 - 1) for i, a in enumerate(s.advantages)]

    def objective(per_rank):
        return sum(
            sum(a * m for a, m in zip(mb.advantages, mb.loss_mask)) / mb.step_tokens for b in per_rank for mb in b
        )

    one = objective(pack_step(seqs, 0, 1, 64))
    assert objective(pack_step(seqs, 0, 2, 64)) == pytest.approx(one)
    assert objective(pack_step(seqs, 0, 3, 64)) == pytest.approx(one)


def test_ref_logprobs_carried_and_required_everywhere():
    with_ref = [rollout_sequence(make_rollout(2, 3, ref=True), [1.0] * 3, f"g{i}", 64) for i in range(3)]
    per_rank = pack_step(with_ref, 0, 2, 10)
    for b in per_rank:
        for mb in b:
            assert mb.ref_logprobs is not None and len(mb.ref_logprobs) == len(mb.input_ids)
    real = [mb for b in per_rank for mb in b if not is_padding(mb)]
    assert sum(mb.ref_logprobs.count(-0.2) for mb in real) == 9
    mixed = with_ref + [rollout_sequence(make_rollout(2, 3), [1.0] * 3, "bare", 64)]
    with pytest.raises(ValueError, match="bare"):
        pack_step(mixed, 0, 2, 10)


def test_share_prompt_blocks_and_positions():
    """A group of four rollouts with a 5-token prompt: blocks of at most 12 tokens, each head
    keeps the prompt, followers keep their completion and continue the positions from 5."""
    group = [rollout_sequence(make_rollout(5, c, start=10), [1.0] * c, "g", 64) for c in (3, 2, 4, 1)]
    shared = share_prompt(group, 5, seq_length=12)
    assert [s.prefix for s in shared] == [0, 5, 0, 5]  # 8+2 fit in 12; 4 does not, so a new head
    assert [len(s) for s in shared] == [8, 2, 9, 1]
    assert shared[1].input_ids == group[1].input_ids[5:] and shared[1].loss_mask == [1, 1]
    (mb,) = pack_step(shared, step=0, ranks=1, seq_length=32)[0]
    assert mb.prefix_lengths == [0, 5, 0, 5]
    assert mb.position_ids == list(range(8)) + [5, 6] + list(range(9)) + [5]
    assert mb.step_samples == 4 and mb.step_tokens == 10
    assert decode(encode(mb), MicroBatch) == mb


def test_pack_step_keeps_a_block_together():
    """First-fit packs a head and its followers as one unit: they land in the same micro-batch."""
    blocks = [
        share_prompt(
            [rollout_sequence(make_rollout(4, 2, start=100 * g), [1.0] * 2, f"g{g}", 64) for _ in range(3)], 4, 64
        )
        for g in range(5)
    ]
    per_rank = pack_step([s for b in blocks for s in b], step=0, ranks=2, seq_length=20)
    for batches in per_rank:
        for mb in batches:
            if is_padding(mb):
                continue
            assert mb.prefix_lengths[0] == 0
            heads = [i for i, p in enumerate(mb.prefix_lengths) if p == 0]
            assert all(len(set(mb.group_ids[h : h + 3])) == 1 for h in heads)
            assert len(mb.input_ids) == 10 * len(heads)


def test_followers_without_a_head_are_rejected():
    group = share_prompt([rollout_sequence(make_rollout(4, 2), [1.0] * 2, "g", 64) for _ in range(2)], 4, 64)
    with pytest.raises(ValueError, match="no head"):
        pack_step(group[1:], step=0, ranks=1, seq_length=64)


def with_routes(rollout: Rollout, width: int = 4, first: int = 0) -> Rollout:
    """The rollout with routes: token i of the completion sent to experts first + i (mod 200)."""
    import numpy as np

    from pipeline_rl.core.routes import encode_routes

    n = len(rollout.completion_ids)
    rows = (np.arange(n)[:, None] + first + np.zeros((1, width), dtype=np.int64)) % 200
    rollout.routes = encode_routes(rows.astype(np.uint8))
    return rollout


def test_routes_travel_with_their_tokens_through_truncation_sharing_and_padding():
    import numpy as np

    from pipeline_rl.core.routes import NO_ROUTE, decode_routes

    seqs = [
        rollout_sequence(with_routes(make_rollout(3, 5), first=10 * i), [1.0] * 5, f"g{i}", seq_length=7)
        for i in range(3)
    ]
    # truncated to 7 tokens: the prompt's 3 rows of no routes, then the completion's first 4
    assert seqs[0].truncated and seqs[0].routes is not None and seqs[0].routes.shape == (7, 4)
    assert (seqs[0].routes[:3] == NO_ROUTE).all() and (seqs[0].routes[3:, 0] == [0, 1, 2, 3]).all()
    shared = share_prompt(seqs, prompt_length=3, seq_length=20)
    assert shared[1].routes is not None and (shared[1].routes[:, 0] == [10, 11, 12, 13]).all()
    ranks = pack_step(shared, step=0, ranks=2, seq_length=20)
    for mbs in ranks:
        for packed in mbs:
            mb = decode(encode(packed), MicroBatch)  # through the wire
            assert mb.routes is not None
            rows = decode_routes(mb.routes, len(mb.input_ids), "mb")
            # a row of routes per token: no routes wherever nothing is trained
            assert ((rows == NO_ROUTE).all(-1) | np.array(mb.loss_mask, dtype=bool)).all()
    total = [decode_routes(mb.routes or "", len(mb.input_ids), "mb") for mbs in ranks for mb in mbs]
    assert sum(len(t) for t in total) == sum(len(mb.input_ids) for mbs in ranks for mb in mbs)


def test_a_step_with_routes_on_some_rollouts_only_is_refused_naming_the_groups():
    seqs = [
        rollout_sequence(with_routes(make_rollout(3, 5)), [1.0] * 5, "g0", seq_length=50),
        rollout_sequence(make_rollout(3, 5), [1.0] * 5, "g1", seq_length=50),
    ]
    with pytest.raises(
        ValueError, match=r"step 4: routes of \[4\] bytes per token, and groups \['g1'\] without routes"
    ):
        pack_step(seqs, step=4, ranks=1, seq_length=50)
    bad = make_rollout(3, 5)
    bad.routes = "AAAA"  # 3 bytes for 5 tokens
    with pytest.raises(ValueError, match="group g2: routes of 3 bytes do not split into 5 tokens"):
        rollout_sequence(bad, [1.0] * 5, "g2", seq_length=50)
