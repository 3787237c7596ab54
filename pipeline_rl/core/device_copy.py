"""Host tensors to the device without making the host wait: a copy from pageable memory, or a
tensor made on the device from a list, waits for the device's queue; a pinned one does not."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device (pinned, asynchronous copy)."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
