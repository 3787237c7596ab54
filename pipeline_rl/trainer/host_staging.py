"""Device tensors copied to host memory chunk by chunk, each copy overlapped with the host's work
on the chunk before it (the checkpoint's disk write).

On CUDA a chunk's tensors are copied into one of two pinned host buffers on a stream of their
own: pinned memory is what lets a copy run at the link's rate and asynchronously (from pageable
memory the driver stages through a bounce buffer, one tensor at a time). The buffers are kept
for the next checkpoint. Elsewhere tensors are copied plainly.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch

_ALIGN = 64


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class HostStaging:
    """Two pinned host buffers (grown to the largest chunk) and a copy stream, per device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers = [torch.empty(0, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.stream = torch.cuda.Stream(device)
        self.copy_s = 0.0
        """Device time spent copying (CUDA events), over every chunk so far."""
        self.bytes = 0

    def stage(
        self, chunk: list[tuple[str, torch.Tensor]], slot: int
    ) -> tuple[dict[str, torch.Tensor], torch.cuda.Event]:
        """Start copying `chunk` into buffer `slot`; returns the host views and an event that
        completes with the copy. The chunk's device tensors must stay valid until then."""
        sizes = [_aligned(t.numel() * t.element_size()) for _, t in chunk]
        if self.buffers[slot].numel() < sum(sizes):
            self.buffers[slot] = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True)
        buf, out, offset = self.buffers[slot], {}, 0
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            start.record()
            for (name, t), size in zip(chunk, sizes):
                host = buf[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                host.copy_(t.detach(), non_blocking=True)
                out[name] = host
                offset += size
            done.record()
        done.start = start  # pyright: ignore[reportAttributeAccessIssue]
        self.bytes += sum(t.numel() * t.element_size() for _, t in chunk)
        return out, done

    def finish(self, done: torch.cuda.Event) -> None:
        done.synchronize()
        self.copy_s += done.start.elapsed_time(done) / 1000  # pyright: ignore[reportAttributeAccessIssue]


_STAGING: dict[torch.device, HostStaging] = {}


def host_chunks(
    chunks: Iterable[list[tuple[str, torch.Tensor]]], stats: dict[str, float] | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """Each chunk's tensors on the host, by name, valid until the next is asked for. A chunk's
    copy starts before the previous host chunk is handed out, and the next device chunk is
    asked for only once its copy is done (under ZeRO-3 asking releases the gathered storage).
    `stats` receives bytes, the device's copy seconds and the wall seconds spent waiting."""
    pending: dict[str, torch.Tensor] | None = None
    staging: HostStaging | None = None
    waited = copy_s = 0.0
    total = 0
    staged = 0
    for chunk in chunks:
        if not chunk:
            continue
        device = chunk[0][1].device
        if device.type != "cuda":  # handed out at once: the chunk's storage is only valid until the next
            host = {name: t.detach().cpu().contiguous() for name, t in chunk}
            total += sum(t.numel() * t.element_size() for t in host.values())
            yield host
            continue
        staging = _STAGING.get(device) or _STAGING.setdefault(device, HostStaging(device))
        before_bytes, before_s = staging.bytes, staging.copy_s
        host, done = staging.stage(chunk, staged % 2)  # the other buffer holds `pending`
        staged += 1
        if pending is not None:
            yield pending  # the host's work on the previous chunk overlaps this copy
        t = time.perf_counter()
        staging.finish(done)
        waited += time.perf_counter() - t
        total += staging.bytes - before_bytes
        copy_s += staging.copy_s - before_s
        pending = host
    if pending is not None:
        yield pending
    if stats is not None:
        stats.update(bytes=total, copy_s=copy_s, wait_s=waited)
