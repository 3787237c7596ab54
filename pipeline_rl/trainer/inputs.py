"""A packed micro-batch's per-token inputs on the trainer's device, and the consistency sums
its logprobs give, without making the device wait: inputs are built as host tensors, then each
copied from pinned memory asynchronously (a copy from pageable memory, or a tensor made on the
device from a list, waits for the device's queue), and the sums use no boolean indexing (which
waits for the device to count the tokens)."""

from __future__ import annotations

import torch

from pipeline_rl.core.device_copy import to_device
from pipeline_rl.streams.records import MicroBatch


def micro_batch_inputs(mb: MicroBatch, loss_mask: list[int], device: torch.device) -> dict[str, torch.Tensor]:
    """input_ids, position_ids, seq_index (each token's packed sequence), old_logprobs,
    advantages, loss_mask, versions and, when the micro-batch has them, ref_logprobs: [T] each."""
    host = {
        "input_ids": torch.tensor(mb.input_ids),
        "position_ids": torch.tensor(mb.position_ids),
        "seq_index": torch.repeat_interleave(torch.arange(len(mb.seq_lengths)), torch.tensor(mb.seq_lengths)),
        "old_logprobs": torch.tensor(mb.old_logprobs, dtype=torch.float32),
        "advantages": torch.tensor(mb.advantages, dtype=torch.float32),
        "loss_mask": torch.tensor(loss_mask),
        "versions": torch.tensor(mb.versions),
    }
    if mb.ref_logprobs is not None:
        host["ref_logprobs"] = torch.tensor(mb.ref_logprobs, dtype=torch.float32)
    return {k: to_device(t, device) for k, t in host.items()}


CONSISTENCY_KEYS = ("lag0_tokens", "lag0_abs_diff", "lag0_kl", "behaviour_tokens", "behaviour_kl")


def consistency_sums(
    logprobs: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, versions: torch.Tensor, version: int
) -> torch.Tensor:
    """Sums named by CONSISTENCY_KEYS: over the trained tokens sampled by `version` (the weights
    being trained), their count, sum |logprob - behaviour logprob| and the k3 estimate of
    KL(behaviour || trainer); then the count and k3 sum over all trained tokens, whatever their lag."""
    trained = mask > 0
    lag0 = trained & (versions == version)
    d = (logprobs - old).double()
    k3 = d.exp() - 1 - d
    return torch.stack(
        [
            lag0.sum().double(),
            torch.where(lag0, d.abs(), 0).sum(),
            torch.where(lag0, k3, 0).sum(),
            trained.sum().double(),
            torch.where(trained, k3, 0).sum(),
        ]
    )
