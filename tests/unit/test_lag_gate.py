"""apply_lag_gate: samples (or, in token mode, tokens) older than max_lag are excluded and counted."""

from pipeline_rl.config import LagGateMode
from pipeline_rl.streams.records import MicroBatch
from pipeline_rl.trainer.lag_gate import apply_lag_gate


def micro_batch(seqs):
    """seqs: list of (loss_mask, sample_version)."""
    mask = [m for s, _ in seqs for m in s]
    return MicroBatch(
        step=0,
        index=0,
        count=1,
        input_ids=[1] * len(mask),
        position_ids=[i for s, _ in seqs for i in range(len(s))],
        loss_mask=mask,
        advantages=[0.0] * len(mask),
        old_logprobs=[0.0] * len(mask),
        versions=[0] * len(mask),
        seq_lengths=[len(s) for s, _ in seqs],
        sample_versions=[v for _, v in seqs],
        group_ids=["g"] * len(seqs),
        rewards=[0.0] * len(seqs),
        step_tokens=sum(mask),
        step_samples=len(seqs),
    )


def test_stale_samples_are_masked_and_counted_and_lag_equal_to_max_is_kept():
    mb = micro_batch(
        [
            ([0, 1, 1], 10),  # lag 0
            ([0, 0, 1, 1], 6),  # lag 4 == max_lag: kept
            ([0, 1, 1, 1], 5),  # lag 5: dropped
            ([0], -1),  # padding: no trained tokens, not gated
            ([1, 1], 2),  # lag 8: dropped
        ]
    )
    result = apply_lag_gate(mb, version=10, max_lag=4)
    assert result.loss_mask == [0, 1, 1] + [0, 0, 1, 1] + [0, 0, 0, 0] + [0] + [0, 0]
    assert result.dropped_samples == 2
    assert result.dropped_tokens == 5
    assert result.dropped_lags == [5, 8]
    assert result.lags == {0: 1, 4: 1, 5: 1, 8: 1}
    assert mb.loss_mask == [0, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1, 0, 1, 1]  # the record itself is untouched


def test_nothing_dropped_within_the_lag_budget():
    mb = micro_batch([([1, 1], 3), ([1], 1)])
    result = apply_lag_gate(mb, version=3, max_lag=2)
    assert result.loss_mask == mb.loss_mask
    assert result.dropped_samples == 0 and result.dropped_tokens == 0
    assert result.lags == {0: 1, 2: 1}


def test_max_lag_zero_keeps_only_current_policy_samples():
    mb = micro_batch([([1], 7), ([1], 6)])
    result = apply_lag_gate(mb, version=7, max_lag=0)
    assert result.loss_mask == [1, 0]
    assert result.dropped_lags == [1]


def token_micro_batch(seqs):
    """seqs: list of (loss_mask, per-token versions); versions -1 where the mask is 0."""
    mb = micro_batch([(mask, min((v for v, m in zip(vs, mask) if m), default=-1)) for mask, vs in seqs])
    mb.versions = [v for _, vs in seqs for v in vs]
    return mb


def test_token_mode_masks_only_stale_tokens_and_keeps_the_fresh_tail():
    mb = token_micro_batch(
        [
            ([0, 1, 1, 1, 1], [-1, 5, 6, 7, 8]),  # lag 5; tokens of versions 5 and 6 are stale
            ([0, 1, 1], [-1, 9, 10]),  # lag 1: kept whole
            ([1, 1], [4, 6]),  # every token stale: dropped
            ([0], [-1]),  # padding
        ]
    )
    result = apply_lag_gate(mb, version=10, max_lag=3, mode=LagGateMode.token)
    assert result.loss_mask == [0, 0, 0, 1, 1] + [0, 1, 1] + [0, 0] + [0]
    assert result.masked_tokens == 2
    assert result.dropped_samples == 1 and result.dropped_tokens == 2 and result.dropped_lags == [6]
    assert result.lags == {5: 1, 1: 1, 6: 1}
    assert result.samples == 2
    # Sample mode drops the first sample whole on the same data.
    whole = apply_lag_gate(mb, version=10, max_lag=3)
    assert whole.loss_mask == [0] * 5 + [0, 1, 1] + [0, 0] + [0]
    assert whole.dropped_samples == 2 and whole.masked_tokens == 0 and whole.samples == 1
