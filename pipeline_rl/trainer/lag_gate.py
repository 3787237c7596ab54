"""The max_lag gate: the one place that decides which samples are too stale to train on.

A sample's lag is the trainer's current version minus the oldest policy version among its
trained tokens (MicroBatch.sample_versions). A sample with lag > max_lag keeps its place in
the micro-batch but its loss mask is zeroed; it is counted and its lag reported. Sequences
without trained tokens (sample version -1: padding) are neither gated nor counted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pipeline_rl.streams.records import MicroBatch


@dataclass
class GateResult:
    loss_mask: list[int]
    """The micro-batch's loss mask with the dropped samples' tokens zeroed."""
    lags: Counter = field(default_factory=Counter)
    """Samples per lag value, kept and dropped alike."""
    dropped_samples: int = 0
    dropped_tokens: int = 0
    """Trained tokens removed (they leave the step's token denominator)."""
    dropped_lags: list[int] = field(default_factory=list)


def apply_lag_gate(mb: MicroBatch, version: int, max_lag: int) -> GateResult:
    result = GateResult(loss_mask=list(mb.loss_mask))
    start = 0
    for length, sample_version in zip(mb.seq_lengths, mb.sample_versions):
        end = start + length
        if sample_version >= 0:
            lag = version - sample_version
            result.lags[lag] += 1
            if lag > max_lag:
                result.dropped_samples += 1
                result.dropped_tokens += sum(result.loss_mask[start:end])
                result.dropped_lags.append(lag)
                result.loss_mask[start:end] = [0] * length
        start = end
    return result
