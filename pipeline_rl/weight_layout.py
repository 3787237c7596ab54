"""The wire layout of a weight update (pipeline_rl/weight_sync/__init__.py has the protocol): where
each tensor lies in a receiver's buffer and which messages carry it, derived by the sender and
every receiver from the WeightUpdate announcement (and the sender's plan) alone, so the wire
format needs nothing else. Built once per layout and kept while announcements match it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from pipeline_rl.streams.records import WeightUpdate


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in weight update")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_buckets(sizes_bytes: list[int], bucket_mb: int) -> list[int]:
    """Tensors per bucket: consecutive tensors, at most `bucket_mb` MiB each (a larger tensor
    gets a bucket of its own)."""
    limit = bucket_mb * 2**20
    buckets: list[int] = []
    count = filled = 0
    for size in sizes_bytes:
        if count and filled + size > limit:
            buckets.append(count)
            count = filled = 0
        count += 1
        filled += size
    if count:
        buckets.append(count)
    return buckets


ALIGN = 64
"""Each tensor starts at a multiple of this many bytes, so a typed view of any dtype can be
taken there."""

DIRECT_BYTES = 1 << 20
"""A tensor this large is broadcast on its own, from the sender's own storage: packing it
would cost a copy, while its broadcast already amortises the per-message latency."""


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Message(NamedTuple):
    start: int
    """First byte in the receiver's buffer."""
    stop: int
    members: list[int]
    """Its tensors (consecutive; a packed message may include tensors of no bytes)."""
    packed: bool
    """False: one tensor sent from its own storage."""
    bucket: int
    pack_at: int
    """Where a packed message lies in the sender's pack area (-1 for a tensor sent as is)."""
    at: list[tuple[int, int]]
    """Per member, its first byte relative to `start` and its size in bytes."""


class Layout:
    """Where each tensor of an update lies in the receiver's buffer (all tensors back to back,
    each at an aligned offset), and the messages that carry them: within each bucket, a run of
    consecutive small tensors is packed into one message, and every large tensor is a message
    of its own; a bucket the plan marks "1" is one message, all its tensors packed. Sender and
    receivers derive it from the announcement alone (the plan travels in it), so the wire format
    needs no more than the WeightUpdate record. Built once per layout: `matches`
    tells whether a later announcement and plan have the same one."""

    def __init__(self, update: WeightUpdate, plan: str = ""):
        # Copies: the key compared with later announcements, whoever owns their lists.
        self.plan = plan
        self.shapes = [list(s) for s in update.shapes]
        self.dtype_names = list(update.dtypes)
        self.bucket_sizes = list(update.bucket_sizes)
        self.sizes = [torch.Size(s) for s in self.shapes]
        self.dtypes = [dtype_of(d) for d in self.dtype_names]
        self.offsets: list[int] = []
        self.nbytes: list[int] = []
        pos = 0
        for size, dtype in zip(self.sizes, self.dtypes):
            self.offsets.append(pos)
            self.nbytes.append(size.numel() * dtype.itemsize)
            pos += aligned(self.nbytes[-1])
        self.total_bytes = pos
        self.messages: list[Message] = []
        self.pack_bytes = 0
        """The sender's pack area: the largest sum over one bucket of its packed messages."""
        if plan and len(plan) != len(self.bucket_sizes):
            raise ValueError(f"weight-update plan {plan!r} does not fit {len(self.bucket_sizes)} buckets")
        self.bucket_spans: list[Message | None] = []
        """Per bucket, all its tensors as one packed message (None when they have no bytes)."""
        self.split_counts: list[int] = []
        """Per bucket, its messages without the plan: a plan of "1" for it saves all but one."""
        first = 0
        for bucket, count in enumerate(self.bucket_sizes):
            self.bucket_spans.append(self._message(list(range(first, first + count)), True, bucket, pack_at=0))
            small = [self.nbytes[i] < DIRECT_BYTES for i in range(first, first + count)]
            self.split_counts.append(sum(not s or j == 0 or not small[j - 1] for j, s in enumerate(small)))
            whole = plan[bucket : bucket + 1] == "1"
            filled = 0
            run: list[int] = []
            for i in [*range(first, first + count), -1]:  # -1: the bucket's end
                if i >= 0 and (whole or self.nbytes[i] < DIRECT_BYTES):
                    run.append(i)
                    continue
                if run and (msg := self._message(run, True, bucket, pack_at=filled)) is not None:
                    self.messages.append(msg)
                    filled += aligned(msg.stop - msg.start)
                run = []
                if i >= 0 and (msg := self._message([i], False, bucket, pack_at=-1)) is not None:
                    self.messages.append(msg)
            self.pack_bytes = max(self.pack_bytes, filled)
            first += count
        self.largest = max((m.stop - m.start for m in self.messages), default=0)

    def _message(self, members: list[int], packed: bool, bucket: int, pack_at: int) -> Message | None:
        """The message of `members`; None when they have no bytes."""
        start, stop = self.offsets[members[0]], self.offsets[members[-1]] + self.nbytes[members[-1]]
        if stop <= start:
            return None
        at = [(self.offsets[i] - start, self.nbytes[i]) for i in members]
        return Message(start, stop, members, packed, bucket, pack_at, at)

    def matches(self, update: WeightUpdate, plan: str | None = None) -> bool:
        """Whether `update` (and `plan`, unless None) has this layout (list comparisons: no
        Python loop per tensor)."""
        return (
            (plan is None or plan == self.plan)
            and len(update.names) == len(self.shapes)
            and update.shapes == self.shapes
            and update.dtypes == self.dtype_names
            and update.bucket_sizes == self.bucket_sizes
        )

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Typed views of every tensor where the receiver's uint8 `buffer` has it."""
        return [
            buffer[at : at + n].view(dtype).view(size)
            for at, n, dtype, size in zip(self.offsets, self.nbytes, self.dtypes, self.sizes)
        ]

    def pack_views(self, area: torch.Tensor) -> dict[int, torch.Tensor]:
        """Typed views of the packed tensors where the sender's uint8 pack `area` has them."""
        out = {}
        for msg in self.messages:
            if msg.packed:
                for i in msg.members:
                    at = msg.pack_at + self.offsets[i] - msg.start
                    out[i] = area[at : at + self.nbytes[i]].view(self.dtypes[i]).view(self.sizes[i])
        return out


def flat_span(msg: Message, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """The packed message's bytes as one uint8 tensor over its tensors' own storage, when they
    lie there as the message has them (each contiguous at its offset from the first, the whole
    span inside the first one's storage; CPU and GPU memory share one address space): then the
    message needs no copy. Else None."""
    base = 0
    first: torch.Tensor | None = None
    for t, (rel, nbytes) in zip(tensors, msg.at):
        if nbytes == 0:
            continue
        if t is None or not t.is_contiguous():
            return None
        if first is None:
            first, base = t, t.data_ptr() - rel
        elif t.data_ptr() - rel != base:
            return None
    if first is None:
        return None
    storage = first.untyped_storage()
    offset = base - storage.data_ptr()
    if offset < 0 or offset + msg.stop - msg.start > storage.nbytes():
        return None
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, offset, (msg.stop - msg.start,), (1,))


def check_announcement(update: WeightUpdate) -> None:
    n = len(update.names)
    if len(update.shapes) != n or len(update.dtypes) != n:
        raise ValueError(
            f"weight update {update.version}: {n} names, {len(update.shapes)} shapes, {len(update.dtypes)} dtypes"
        )
    if sum(update.bucket_sizes) != n or any(c < 1 for c in update.bucket_sizes):
        raise ValueError(f"weight update {update.version}: bucket sizes {update.bucket_sizes} do not cover {n} tensors")
    for name in update.dtypes:
        dtype_of(name)
