"""Weight broadcast from trainer rank 0 to every actor engine, in buckets.

The process group is standalone: a TCPStore hosted by the sender at `addr` and a
ProcessGroupGloo / ProcessGroupNCCL object built directly on it, so the trainer's own
default process group (DeepSpeed's) and vLLM's are never touched. Rank 0 is the sender; the
receivers are the actors, or with tensor-parallel engines every worker of every actor
(`group_ranks`).

One update: the sender publishes its version under the store key "latest", announces a
WeightUpdate record (names, shapes, dtypes, tensors per bucket), then broadcasts the bytes
of each bucket. Receivers read the announcement from the "weights" stream and take part in
the broadcast.

Within a bucket, each run of small tensors goes as one packed message and each large tensor
(>= 1 MiB) as a message of its own, sent from the sender's tensor without a copy. Buffers
are kept between updates of the same layout: the sender packs into one reused buffer (the
size of the largest packed run, at most a bucket), and a receiver receives into one buffer
of the whole update and returns views into it. Those views are overwritten by the next
receive(): the engine's reload copies them into its own weights before the receiver thread
receives again (LLMClient's receiver thread receives, swaps, and only then reads the next
announcement).

The group is built lazily by the first transfer and rebuilt after a failure: the sender
gives each group it builds a new name (store key "group"), and a receiver whose group has
another name rebuilds before receiving. A receiver that reads an announcement older than
"latest" (an actor restarted after that transfer ended) skips it. A receiver whose store
connection broke (the trainer restarted) connects again.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipeline_rl.streams.records import WeightUpdate

log = logging.getLogger(__name__)


def group_ranks(actor_index: int, actors: int, tensor_parallel_size: int) -> tuple[list[int], int]:
    """The weight-update group's ranks of one actor's receivers, and the group's size: rank 0 is
    trainer rank 0, then each actor's tensor-parallel workers in order (one receiver per actor
    when tensor_parallel_size is 1)."""
    first = 1 + actor_index * tensor_parallel_size
    return list(range(first, first + tensor_parallel_size)), 1 + actors * tensor_parallel_size


def backend_for(gpus_per_node: int) -> str:
    """The one backend of the weight-update group, decided from the world (the same on the
    sender and every receiver, or they could never form the group): NCCL between GPUs, else gloo."""
    return "nccl" if gpus_per_node > 0 else "gloo"


class StaleUpdate(Exception):
    """An announcement whose transfer is already over; the receiver did not take part."""


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in weight update")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
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


def _split_host_port(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"weight-sync address {addr!r} is not host:port")
    return host, int(port)


def _new_group(store: dist.Store, name: str, rank: int, world_size: int, backend: str, timeout: timedelta):
    prefixed = dist.PrefixStore(f"weights/{name}", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    raise ValueError(f"weight-sync backend must be gloo or nccl, got {backend!r}")


_ALIGN = 64
"""Each tensor starts at a multiple of this many bytes, so a typed view of any dtype can be
taken there."""

_DIRECT_BYTES = 1 << 20
"""A tensor this large is broadcast on its own, from the sender's own storage: packing it
would cost a copy, while its broadcast already amortises the per-message latency."""


class _Layout:
    """Where each tensor of an update lies in the receiver's buffer (all tensors back to back,
    each at an aligned offset), and the messages that carry them: within each bucket, a run of
    consecutive small tensors is packed into one message, and every large tensor is a message
    of its own. Sender and receivers derive it from the announcement alone, so the wire format
    needs no more than the WeightUpdate record."""

    def __init__(self, update: WeightUpdate):
        self.key = (tuple(tuple(s) for s in update.shapes), tuple(update.dtypes), tuple(update.bucket_sizes))
        self.shapes = [list(s) for s in update.shapes]
        self.dtypes = [_dtype(d) for d in update.dtypes]
        self.offsets: list[int] = []
        self.nbytes: list[int] = []
        pos = 0
        for shape, dtype in zip(self.shapes, self.dtypes):
            self.offsets.append(pos)
            self.nbytes.append(_numel(shape) * dtype.itemsize)
            pos += -(-self.nbytes[-1] // _ALIGN) * _ALIGN
        self.total_bytes = pos
        self.messages: list[tuple[int, int, list[int], bool]] = []
        """Per message: first byte, end byte, its tensors, packed (False: one tensor sent as is)."""
        first = 0
        for count in update.bucket_sizes:
            run: list[int] = []
            for i in range(first, first + count):
                if self.nbytes[i] >= _DIRECT_BYTES:
                    self._add(run, packed=True)
                    self._add([i], packed=False)
                    run = []
                else:
                    run.append(i)
            self._add(run, packed=True)
            first += count
        self.pack_bytes = max((stop - start for start, stop, _, packed in self.messages if packed), default=0)

    def _add(self, members: list[int], packed: bool) -> None:
        if members:
            start, stop = self.offsets[members[0]], self.offsets[members[-1]] + self.nbytes[members[-1]]
            if stop > start:
                self.messages.append((start, stop, members, packed))

    def views(self, buffer: torch.Tensor, packed_only: bool) -> dict[int, torch.Tensor]:
        """Typed views of the tensors in a uint8 `buffer`: every tensor where the receiver's
        buffer has it, or (packed_only) the packed tensors where a pack buffer holding one
        message at a time has them."""
        out = {}
        for start, _, members, packed in self.messages:
            if packed_only and not packed:
                continue
            base = start if packed_only else 0
            for i in members:
                at = self.offsets[i] - base
                out[i] = buffer[at : at + self.nbytes[i]].view(self.dtypes[i]).view(self.shapes[i])
        if not packed_only:  # tensors with no bytes are in no message
            for i in range(len(self.nbytes)):
                if i not in out:
                    out[i] = buffer[:0].view(self.dtypes[i]).view(self.shapes[i])
        return out


class _Endpoint:
    def __init__(self, addr: str, rank: int, world_size: int, backend: str, timeout_s: float):
        if world_size < 2:
            raise ValueError(f"weight-sync world size must be >= 2 (trainer + actors), got {world_size}")
        self.host, self.port = _split_host_port(addr)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.timeout = timedelta(seconds=timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.staging_device = self.device
        """Where the kept buffer lives (a receiver may keep it in host memory)."""
        # A c10d backend object (ProcessGroupGloo / ProcessGroupNCCL); torch's stubs omit its collectives.
        self._group: Any = None
        self._group_name: str | None = None
        # Kept between updates while the layout stays the same (it does: the same model each
        # time): neither a packing buffer nor receive memory is allocated (and page-faulted)
        # per update.
        self._layout: _Layout | None = None
        self._buffer: torch.Tensor | None = None
        self._views: dict[int, torch.Tensor] = {}

    def _prepare(self, update: WeightUpdate) -> tuple[_Layout, torch.Tensor]:
        """The update's layout and the buffer kept for it (allocated when the layout changes)."""
        layout = _Layout(update)
        if self._layout is None or self._buffer is None or layout.key != self._layout.key:
            self._layout = self._buffer = None
            self._views = {}
            size, packed_only = self._buffer_size(layout)
            pin = self.staging_device.type == "cpu" and self.device.type == "cuda"
            self._buffer = torch.empty(size, dtype=torch.uint8, device=self.staging_device, pin_memory=pin)
            self._views = layout.views(self._buffer, packed_only)
            self._layout = layout
        return self._layout, self._buffer

    def _buffer_size(self, layout: _Layout) -> tuple[int, bool]:
        raise NotImplementedError

    def _broadcast(self, buffer: torch.Tensor) -> None:
        assert self._group is not None, "broadcast before the group was built"
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._group.broadcast([buffer], opts).wait(self.timeout)

    def _drop_group(self) -> None:
        self._group = None
        self._group_name = None

    def close(self) -> None:
        self._drop_group()
        self._layout = self._buffer = None
        self._views = {}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class WeightSender(_Endpoint):
    """Trainer rank 0: hosts the store and broadcasts each published version."""

    def __init__(self, addr: str, world_size: int, backend: str = "gloo", timeout_s: float = 120):
        super().__init__(addr, 0, world_size, backend, timeout_s)
        self._store: dist.TCPStore | None = dist.TCPStore(
            self.host, self.port, world_size, is_master=True, timeout=self.timeout, wait_for_workers=False
        )

    def send(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        announce: Callable[[WeightUpdate], None],
        bucket_mb: int,
        specs: list[tuple[str, list[int], torch.dtype]] | None = None,
    ) -> float:
        """Announce `version` and broadcast it to every receiver; returns the seconds taken.
        With `specs` (name, shape, dtype of every tensor, in order) the announcement needs no
        tensor, and `named_tensors` is consumed one message at a time: a tensor is used before
        the next is asked for, so a generator of gathered chunks never holds the whole model.
        Raises when a receiver is missing or dies (after at most the timeout), or when the
        tensors differ from `specs`; the next send then builds a fresh group."""
        start = time.perf_counter()
        if specs is None:
            named_tensors = list(named_tensors)
            specs = [(name, list(t.shape), t.dtype) for name, t in named_tensors]
        update = WeightUpdate(
            version=version,
            names=[name for name, _, _ in specs],
            shapes=[list(shape) for _, shape, _ in specs],
            dtypes=[_dtype_name(dtype) for _, _, dtype in specs],
            bucket_sizes=plan_buckets([_numel(shape) * dtype.itemsize for _, shape, dtype in specs], bucket_mb),
        )
        if self._store is None:
            raise RuntimeError("WeightSender.send after close()")
        try:
            if self._group is None:
                self._group_name = f"{version}-{uuid.uuid4().hex[:8]}"
                self._store.set("group", self._group_name)
            self._store.set("latest", str(version))
            announce(update)
            if self._group is None:
                assert self._group_name is not None
                self._group = _new_group(self._store, self._group_name, 0, self.world_size, self.backend, self.timeout)
            self._send_buckets(update, iter(named_tensors))
        except Exception:
            self._drop_group()
            raise
        return time.perf_counter() - start

    def _buffer_size(self, layout: _Layout) -> tuple[int, bool]:
        return layout.pack_bytes, True

    def _send_buckets(self, update: WeightUpdate, named: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Pack each run of small tensors into the reused pack buffer (a copy_ per tensor, no
        allocation) and broadcast it; broadcast each large tensor from its own storage. Takes
        each tensor from `named` only when its message is being built."""
        layout, buffer = self._prepare(update)
        taken = 0

        def take(i: int) -> torch.Tensor:
            """Tensor i, passing by the ones before it (tensors of no bytes are in no message)."""
            nonlocal taken
            while True:
                name, tensor = next(named)
                if name != update.names[taken] or list(tensor.shape) != layout.shapes[taken]:
                    raise ValueError(
                        f"weight tensor {taken} is {name} {list(tensor.shape)}, "
                        f"announced as {update.names[taken]} {layout.shapes[taken]}"
                    )
                taken += 1
                if taken > i:
                    return tensor.detach()

        for start, stop, members, packed in layout.messages:
            if packed:
                for i in members:
                    self._views[i].copy_(take(i))
                self._broadcast(buffer[: stop - start])
            else:
                tensor = take(members[0]).to(self.device).contiguous()
                self._broadcast(tensor.reshape(-1).view(torch.uint8))
        if taken < len(layout.nbytes):
            take(len(layout.nbytes) - 1)

    def close(self) -> None:
        super().close()
        self._store = None


class WeightReceiver(_Endpoint):
    """An actor engine's end: joins the sender's store on first use and receives updates.

    stage_on_host: keep the whole update in host memory (pinned when the group is NCCL) rather
    than on the device; each message then lands in a bounce buffer on the device, at most the
    largest message (a bucket, or one tensor larger than a bucket), and is copied out. The GPU
    then holds no model-sized buffer; the engine copies to it when it loads, under its lock."""

    def __init__(
        self,
        addr: str,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 120,
        stage_on_host: bool = False,
    ):
        if not 1 <= rank < world_size:
            raise ValueError(f"receiver rank must be in 1..{world_size - 1}, got {rank}")
        super().__init__(addr, rank, world_size, backend, timeout_s)
        self.stage_on_host = stage_on_host
        if stage_on_host:
            self.staging_device = torch.device("cpu")
        self._bounce: torch.Tensor | None = None
        self._store: dist.TCPStore | None = None

    def receive(self, update: WeightUpdate) -> list[tuple[str, torch.Tensor]]:
        """Take part in the broadcast announced by `update`; returns (name, tensor) pairs whose
        tensors are views into the receive buffer, valid until the next receive() (copy them
        to keep them).
        Raises StaleUpdate for an announcement whose transfer is over, ValueError for an
        inconsistent announcement, and RuntimeError/DistStoreError when the sender dies or
        stalls past the timeout."""
        _check_announcement(update)
        try:
            latest = int(self._store_get("latest"))
            if update.version < latest:
                raise StaleUpdate(f"weight update {update.version} is older than the sender's latest {latest}")
            name = self._store_get("group").decode()
            if name != self._group_name:
                assert self._store is not None  # _store_get connected it
                self._group = _new_group(self._store, name, self.rank, self.world_size, self.backend, self.timeout)
                self._group_name = name
            tensors = self._receive_buckets(update)
        except StaleUpdate:
            raise
        except Exception:
            self._drop_group()
            self._store = None
            raise
        return list(zip(update.names, tensors))

    def _buffer_size(self, layout: _Layout) -> tuple[int, bool]:
        return layout.total_bytes, False

    def _receive_buckets(self, update: WeightUpdate) -> list[torch.Tensor]:
        layout, buffer = self._prepare(update)
        largest = max((stop - start for start, stop, _, _ in layout.messages), default=0)
        if self.stage_on_host and (self._bounce is None or self._bounce.numel() < largest):
            self._bounce = torch.empty(largest, dtype=torch.uint8, device=self.device)
        for start, stop, _, _ in layout.messages:
            if self._bounce is None:
                self._broadcast(buffer[start:stop])
            else:
                self._broadcast(self._bounce[: stop - start])
                buffer[start:stop].copy_(self._bounce[: stop - start])
        return [self._views[i] for i in range(len(layout.nbytes))]

    def publish(self, key: str, value: str) -> None:
        """Set `key` in the sender's store: how a receiver in a process of its own (a
        tensor-parallel worker) tells its actor that its part of a transfer ended."""
        self._connect().set(key, value)

    def _connect(self) -> dist.TCPStore:
        if self._store is None:
            self._store = dist.TCPStore(self.host, self.port, self.world_size, is_master=False, timeout=self.timeout)
        return self._store

    def _store_get(self, key: str) -> bytes:
        if self._store is not None:
            try:
                return self._store.get(key)
            except Exception as e:  # the sender's store went away (trainer restarted): connect again
                log.warning("weight-sync store at %s:%d: %s; reconnecting", self.host, self.port, e)
                self._drop_group()
                self._store = None
        return self._connect().get(key)

    def close(self) -> None:
        super().close()
        self._bounce = None
        self._store = None


def _check_announcement(update: WeightUpdate) -> None:
    n = len(update.names)
    if len(update.shapes) != n or len(update.dtypes) != n:
        raise ValueError(
            f"weight update {update.version}: {n} names, {len(update.shapes)} shapes, {len(update.dtypes)} dtypes"
        )
    if sum(update.bucket_sizes) != n or any(c < 1 for c in update.bucket_sizes):
        raise ValueError(f"weight update {update.version}: bucket sizes {update.bucket_sizes} do not cover {n} tensors")
    for name in update.dtypes:
        _dtype(name)
