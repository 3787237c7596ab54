"""The max_lag gate: the one place that decides which samples and tokens are too stale to train on.

A token's lag is the trainer's current version minus the policy version that sampled it
(MicroBatch.versions); a sample's lag is that of its oldest trained token
(MicroBatch.sample_versions). Two modes (`trainer.lag_gate`):

- sample: a sample with lag > max_lag keeps its place in the micro-batch but its loss mask is
  zeroed; it is counted as dropped.
- token: only the tokens with lag > max_lag are masked (counted as masked tokens); the fresh
  tail of the sample is trained on, with the importance weights of its own behaviour logprobs.
  A sample with no fresh trained token left is dropped and counted as in sample mode.

A long answer spans many weight swaps, so its first tokens are the oldest: sample mode drops
long answers more often than short ones; token mode keeps what is fresh. Sequences without
trained tokens (sample version -1: padding) are neither gated nor counted. Every sample's lag
goes into the histogram, kept and dropped alike.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pipeline_rl.config import LagGateMode
from pipeline_rl.streams.records import MicroBatch


@dataclass
class GateResult:
    loss_mask: list[int]
    """The micro-batch's loss mask with the dropped samples' and masked tokens zeroed."""
    lags: Counter = field(default_factory=Counter)
    """Samples per lag value, kept and dropped alike."""
    dropped_samples: int = 0
    dropped_tokens: int = 0
    """Trained tokens of dropped samples (they leave the step's token denominator)."""
    masked_tokens: int = 0
    """Stale tokens masked inside samples that are kept (token mode only)."""
    dropped_lags: list[int] = field(default_factory=list)

    @property
    def samples(self) -> int:
        """Sequences with at least one trained token left."""
        return sum(self.lags.values()) - self.dropped_samples


def apply_lag_gate(mb: MicroBatch, version: int, max_lag: int, mode: LagGateMode = LagGateMode.sample) -> GateResult:
    result = GateResult(loss_mask=list(mb.loss_mask))
    mask = result.loss_mask
    oldest_fresh = version - max_lag
    start = 0
    for length, sample_version in zip(mb.seq_lengths, mb.sample_versions):
        end = start + length
        if sample_version >= 0:
            lag = version - sample_version
            result.lags[lag] += 1
            if lag > max_lag:
                trained = sum(mask[start:end])
                stale = trained
                if mode == LagGateMode.token:
                    stale = sum(1 for t in range(start, end) if mask[t] and mb.versions[t] < oldest_fresh)
                if stale == trained:
                    result.dropped_samples += 1
                    result.dropped_tokens += trained
                    result.dropped_lags.append(lag)
                    mask[start:end] = [0] * length
                else:
                    result.masked_tokens += stale
                    for t in range(start, end):
                        if mb.versions[t] < oldest_fresh:
                            mask[t] = 0
        start = end
    return result
