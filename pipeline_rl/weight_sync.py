"""Weight broadcast from trainer rank 0 to every actor engine, in buckets.

The process group is standalone: a TCPStore hosted by the sender at `addr` and a
ProcessGroupGloo / ProcessGroupNCCL object built directly on it, so the trainer's own
default process group (DeepSpeed's) and vLLM's are never touched. Rank 0 is the sender; the
receivers are the actors, or with tensor-parallel engines every worker of every actor
(`group_ranks`).

One update: the sender publishes its version under the store key "latest" (and, when it
changes, the plan below under "plan"; the sender hosts the store, so both are local sets),
announces a WeightUpdate record (names, shapes, dtypes, tensors per bucket), then broadcasts
the bytes of each bucket. Receivers read the announcement from the "weights" stream, read
"latest", "group" and "plan" in one store round trip, and take part in the broadcast.

Within a bucket, each run of small tensors goes as one packed message and each large tensor
(>= 1 MiB) as a message of its own, sent from the sender's tensor without a copy. A packed
run whose tensors already lie in one storage as the message has them (parameters that are
views of one flat buffer, as DeepSpeed ZeRO-1/2 keeps them, when no tensor needs padding) is
sent from that storage without a copy too; any other is packed by one `_foreach_copy_`.
The plan ("VERSION:BITS", one bit per bucket) makes a bucket whose tensors all lay flat in
the previous update a single message (still without a copy; gloo costs about 0.5 ms per
message on 2-core VMs): the sender notes flatness after each update and publishes a change
before the next announcement; a bucket planned whole that is not flat after all is packed
whole, once, and the plan goes back. Messages are not waited for one by one: the sender
starts every message of a bucket and waits for them all before it takes the first tensor of
the next bucket (so a tensor is used before the next bucket's tensors are asked for); a
receiver keeps the messages of two buckets started (one message at a time when staging on
host, through its bounce buffer) and waits for them in order, each within the timeout.

Everything that depends only on the layout (shapes, dtypes, buckets, plan: the same model
each time) is computed once and kept until an announcement differs (told by list
comparisons): the messages, the buffers and the tensor views into them, and on the sender
the announcement's lists. An update of a kept layout allocates nothing, and its per-tensor
Python work is the sender's check of each tensor against the announcement (and whether its
runs lie flat) and the receiver's (name, view) pairs. The sender packs into one reused area
(the packed messages of one bucket side by side, at most a bucket; allocated the first time
a run must be packed), and a receiver receives into one buffer of the whole update and
returns views into it. Those views are overwritten by the next receive(): the engine's
reload copies them into its own weights before the receiver thread receives again
(LLMClient's receiver thread receives, swaps, and only then reads the next announcement).

The group is built lazily by the first transfer and rebuilt after a failure: the sender
gives each group it builds a new name (store key "group", set before the announcement), and a
receiver whose group has another name rebuilds before receiving. A receiver that reads an
announcement older than "latest" or than "plan" (an actor restarted after that transfer
ended) skips it. A receiver whose store connection broke (the trainer restarted) connects
again.

A failed transfer names who is gone: every member beats a counter in the store ("alive/RANK",
every HEARTBEAT_S, from a thread with a store connection of its own, made once the member
has reached the store, so it beats while the member waits in a collective), and the member whose transfer fails reads the counters twice,
DIAGNOSE_S apart, and raises WeightGroupFailed naming the members whose counter stood still
(dead, or hung with the interpreter stuck; names by rank under the store key "members", which
the sender sets). A store that cannot be reached means the sender, which hosts it, is gone.
The timeout of every wait is `world.collective_timeout_s` (pipeline_rl/collectives.py).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipeline_rl.streams.records import WeightUpdate
from pipeline_rl.weight_layout import Layout, aligned, check_announcement, dtype_name, flat_span, plan_buckets

log = logging.getLogger(__name__)

Keep = dict[str, list[tuple[tuple[int, ...], tuple[int, ...], int]]]
"""Per tensor name, the views (shape, stride, storage offset) of it that a receiver keeps."""


def group_ranks(actor_index: int, actors: int, tensor_parallel_size: int) -> tuple[list[int], int]:
    """The weight-update group's ranks of one actor's receivers, and the group's size: rank 0 is
    trainer rank 0, then each actor's tensor-parallel workers in order (one receiver per actor
    when tensor_parallel_size is 1)."""
    first = 1 + actor_index * tensor_parallel_size
    return list(range(first, first + tensor_parallel_size)), 1 + actors * tensor_parallel_size


def member_names(actors: int, tensor_parallel_size: int) -> list[str]:
    """The process behind each rank of the weight-update group (see group_ranks)."""
    names = [SENDER]
    for actor in range(actors):
        if tensor_parallel_size == 1:
            names.append(f"actor{actor}")
        else:
            names += [f"actor{actor} TP worker {w}" for w in range(tensor_parallel_size)]
    return names


SENDER = "trainer0"
"""Rank 0 of the weight-update group is always trainer rank 0."""
HEARTBEAT_S = 1.0
DIAGNOSE_S = 2.5 * HEARTBEAT_S
"""A counter that did not move in this long belongs to a member that is gone."""


class WeightGroupFailed(RuntimeError):
    """A weight transfer failed; the message names the members that did not finish it."""


def backend_for(gpus_per_node: int) -> str:
    """The one backend of the weight-update group, decided from the world (the same on the
    sender and every receiver, or they could never form the group): NCCL between GPUs, else gloo."""
    return "nccl" if gpus_per_node > 0 else "gloo"


class StaleUpdate(Exception):
    """An announcement whose transfer is already over; the receiver did not take part."""


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


class _Endpoint:
    def __init__(self, addr: str, rank: int, world_size: int, backend: str, timeout_s: float):
        if world_size < 2:
            raise ValueError(f"weight-sync world size must be >= 2 (trainer + actors), got {world_size}")
        self.host, self.port = _split_host_port(addr)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.timeout = timedelta(seconds=timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.staging_device = self.device
        """Where a receiver's kept buffer lives (it may keep it in host memory)."""
        # A c10d backend object (ProcessGroupGloo / ProcessGroupNCCL); torch's stubs omit its collectives.
        self._group: Any = None
        self._group_name: str | None = None
        self._opts = dist.BroadcastOptions()
        self._opts.rootRank = 0
        # Kept between updates while the layout stays the same (it does: the same model each
        # time), with the buffers the subclass allocates for it: neither a packing buffer nor
        # receive memory is allocated (and page-faulted), nor any view taken, per update.
        self._layout: Layout | None = None

    def _kept_layout(self, update: WeightUpdate, plan: str | None) -> Layout | None:
        """The kept layout, when `update` and `plan` (unless None) have it."""
        layout = self._layout
        return layout if layout is not None and layout.matches(update, plan) else None

    def _new_layout(self, update: WeightUpdate, plan: str) -> Layout:
        """Compute the layout of `update` and `plan` and keep it, with its buffers (the kept
        ones are let go first, so the old and new buffers are never held together)."""
        self._release()
        layout = Layout(update, plan)
        self._allocate(layout)
        self._layout = layout
        return layout

    def _allocate(self, layout: Layout) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        self._layout = None

    def _start(self, buffer: torch.Tensor) -> Any:
        """Start broadcasting `buffer` (rank 0's bytes into every other rank's); returns the
        work to wait for."""
        assert self._group is not None, "broadcast before the group was built"
        return self._group.broadcast([buffer], self._opts)

    def _drop_group(self) -> None:
        self._group = None
        self._group_name = None

    def _start_heartbeat(self) -> None:
        """Beat "alive/RANK" in the sender's store, through `_beat_store`, until close()."""
        self._beating = threading.Event()
        self._beat_store: dist.TCPStore | None = None

        def beat() -> None:
            count = 0
            while not self._beating.wait(HEARTBEAT_S):
                store = self._beat_store
                if store is None:
                    continue
                try:
                    count += 1
                    store.set(f"alive/{self.rank}", str(count))
                except Exception:  # the store went away: _beat_connected gives the next one
                    self._beat_store = None

        threading.Thread(target=beat, name=f"weight-sync-heartbeat-{self.rank}", daemon=True).start()

    def _beat_connected(self) -> None:
        """Give the heartbeat a store connection of its own, once the store is known to be up:
        connecting to a store that is not there yet retries for seconds and logs each try."""
        self._beat_store = dist.TCPStore(self.host, self.port, self.world_size, is_master=False, timeout=self.timeout)

    def _failed(self, store: dist.Store | None, version: int, started: float, error: Exception) -> WeightGroupFailed:
        """This member's transfer of `version` failed: name the members that are gone."""
        what = f"weight update {version} failed after {time.monotonic() - started:.1f} s: {error}"
        try:
            if store is None:
                raise RuntimeError("no store connection")
            names = json.loads(store.get("members")) if store.check(["members"]) else []
            gone = self._gone(store)
        except Exception as e:  # the store is hosted by the sender: unreachable, the sender is gone
            return WeightGroupFailed(
                f"{what}; the weight-sync store at {self.host}:{self.port} is unreachable ({e}): "
                f"{SENDER} (weight-update rank 0, the sender) is gone"
            )
        if not gone:
            return WeightGroupFailed(f"{what}; every other member is alive (a hung collective or a network fault?)")
        named = ", ".join(f"{names[r] if r < len(names) else 'rank'} (weight-update rank {r})" for r in gone)
        return WeightGroupFailed(f"{what}; gone (no heartbeat for {DIAGNOSE_S:g} s): {named}")

    def _gone(self, store: dist.Store) -> list[int]:
        """Ranks whose heartbeat did not move over DIAGNOSE_S."""
        others = [r for r in range(self.world_size) if r != self.rank]

        def beats() -> dict[int, bytes | None]:
            return {r: store.get(f"alive/{r}") if store.check([f"alive/{r}"]) else None for r in others}

        before = beats()
        time.sleep(DIAGNOSE_S)
        after = beats()
        return [r for r in others if after[r] is None or after[r] == before[r]]

    def close(self) -> None:
        self._beating.set()
        self._drop_group()
        self._release()


class WeightSender(_Endpoint):
    """Trainer rank 0: hosts the store and broadcasts each published version."""

    def __init__(self, addr: str, world_size: int, backend: str, timeout_s: float, members: list[str] | None = None):
        """`members`: the process behind each rank (member_names), for failure messages."""
        super().__init__(addr, 0, world_size, backend, timeout_s)
        self._store: dist.TCPStore | None = dist.TCPStore(
            self.host, self.port, world_size, is_master=True, timeout=self.timeout, wait_for_workers=False
        )
        self._store.set("members", json.dumps(members or [f"rank {r}" for r in range(world_size)]))
        self._start_heartbeat()
        self._beat_connected()
        self._pack: torch.Tensor | None = None
        """The pack area, allocated when the kept layout first packs a message (never when every
        packed run goes from a flat source)."""
        self._pack_views: dict[int, torch.Tensor] = {}
        self._pack_parts: dict[int, torch.Tensor] = {}
        """Per packed message (by index), its bytes in the pack area."""
        self._specs: tuple[list[tuple[str, list[int], torch.dtype]], int] | None = None
        self._announced: tuple[list[str], list[list[int]], list[str], list[int]] = ([], [], [], [])
        """names, shapes, dtypes and bucket sizes announced for `_specs` (specs, bucket_mb)."""
        self._plan = ""
        """The plan of the next update: per bucket "1" when the last update found all its
        tensors flat (flat_span of the whole bucket), "" before any such update."""
        self._published: str | None = None

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
        tensor, and `named_tensors` is consumed one message at a time: every tensor of a bucket
        is used (its broadcast done) before the first tensor of the next bucket is asked for,
        so a generator of gathered chunks in the same buckets (full_weights.gathered_chunks)
        never holds more than one chunk. Raises when a receiver is missing or dies (after at
        most the timeout), or when the tensors differ from `specs` (name, shape or dtype); the
        next send then builds a fresh group."""
        start = time.perf_counter()
        if specs is None:
            named_tensors = list(named_tensors)
            specs = [(name, list(t.shape), t.dtype) for name, t in named_tensors]
        update = self._announcement(version, specs, bucket_mb)
        if self._store is None:
            raise RuntimeError("WeightSender.send after close()")
        plan = self._plan
        started = time.monotonic()
        try:
            layout = self._kept_layout(update, plan) or self._new_layout(update, plan)
            if self._group is None:
                self._group_name = f"{version}-{uuid.uuid4().hex[:8]}"
                self._store.set("group", self._group_name)
            self._store.set("latest", str(version))
            if self._published != plan:
                self._store.set("plan", f"{version}:{plan}")
                self._published = plan
            assert self._group_name is not None
            update.group, update.plan = self._group_name, plan
            announce(update)
            if self._group is None:
                assert self._group_name is not None
                self._group = _new_group(self._store, self._group_name, 0, self.world_size, self.backend, self.timeout)
            self._send_messages(update, layout, iter(named_tensors))
        except ValueError:  # the tensors differ from the announcement: the sender's own fault
            self._drop_group()
            raise
        except Exception as e:
            self._drop_group()
            raise self._failed(self._store, version, started, e) from e
        return time.perf_counter() - start

    def _announcement(
        self, version: int, specs: list[tuple[str, list[int], torch.dtype]], bucket_mb: int
    ) -> WeightUpdate:
        """The WeightUpdate of `version`; its lists are computed again only when the specs or the
        bucket size change (one list comparison otherwise). They are shared between updates:
        nobody may modify them."""
        if self._specs is None or self._specs[1] != bucket_mb or self._specs[0] != specs:
            self._plan = ""  # observed on other buckets
            self._announced = (
                [name for name, _, _ in specs],
                [list(shape) for _, shape, _ in specs],
                [dtype_name(dtype) for _, _, dtype in specs],
                plan_buckets([torch.Size(shape).numel() * dtype.itemsize for _, shape, dtype in specs], bucket_mb),
            )
            self._specs = ([(name, list(shape), dtype) for name, shape, dtype in specs], bucket_mb)
        names, shapes, dtypes, buckets = self._announced
        return WeightUpdate(version=version, names=names, shapes=shapes, dtypes=dtypes, bucket_sizes=buckets)

    def _allocate(self, layout: Layout) -> None:
        pass  # the pack area waits for a message to pack (_packed)

    def _packed(self, layout: Layout, k: int) -> torch.Tensor:
        """Packed message k's bytes in the pack area, which is allocated (with its views) the
        first time the kept layout needs it."""
        if self._pack is None:
            self._pack = torch.empty(layout.pack_bytes, dtype=torch.uint8, device=self.device)
            self._pack_views = layout.pack_views(self._pack)
            self._pack_parts = {
                j: self._pack[m.pack_at : m.pack_at + m.stop - m.start]
                for j, m in enumerate(layout.messages)
                if m.packed
            }
        return self._pack_parts[k]

    def _release(self) -> None:
        super()._release()
        self._pack = None
        self._pack_views = {}
        self._pack_parts = {}

    def _send_messages(self, update: WeightUpdate, layout: Layout, named: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Start each message of a bucket: a packed run from its tensors' own storage when they
        are flat there (flat_span), else packed into the reused pack area by one
        _foreach_copy_; a large tensor from its own storage. Wait for the bucket's messages
        before taking the next bucket's first tensor. Takes each tensor from `named` only when
        its message is being built."""
        names, sizes, dtypes = update.names, layout.sizes, layout.dtypes
        taken = 0
        bucket_tensors: dict[int, torch.Tensor] = {}
        """The current bucket's tensors as taken, to tell whether the bucket lies flat."""

        def take(i: int) -> torch.Tensor:
            """Tensor i, passing by the ones before it (tensors of no bytes are in no message)."""
            nonlocal taken
            while True:
                name, tensor = next(named)
                if name != names[taken] or tensor.shape != sizes[taken]:
                    raise ValueError(
                        f"weight tensor {taken} is {name} {list(tensor.shape)}, "
                        f"announced as {names[taken]} {layout.shapes[taken]}"
                    )
                if tensor.dtype != dtypes[taken]:
                    raise ValueError(
                        f"weight tensor {taken} ({name}) is {dtype_name(tensor.dtype)}, "
                        f"announced as {dtype_name(dtypes[taken])}"
                    )
                bucket_tensors[taken] = tensor
                taken += 1
                if taken > i:
                    return tensor

        flat = ["0"] * len(layout.bucket_sizes)

        def bucket_done(b: int) -> None:
            """Wait for bucket b's messages; note whether it lies flat (the next plan)."""
            self._wait(in_flight)
            span = layout.bucket_spans[b] if b < len(layout.bucket_spans) else None
            if span is not None and layout.split_counts[b] > 1:
                source = flat_span(span, [bucket_tensors.get(i) for i in span.members])
                flat[b] = "1" if source is not None and source.device == self.device else "0"
            bucket_tensors.clear()

        in_flight: list[tuple[Any, object]] = []
        """Started messages, each with what must stay alive until it is done."""
        bucket = 0
        with torch.no_grad():
            for k, msg in enumerate(layout.messages):
                if msg.bucket != bucket:
                    bucket_done(bucket)
                    bucket = msg.bucket
                if msg.packed:
                    tensors = [take(i) for i in msg.members]
                    source = flat_span(msg, tensors)
                    if source is None or source.device != self.device:
                        part = self._packed(layout, k)
                        if source is not None:  # flat elsewhere (another device): one copy
                            part.copy_(source)
                        else:
                            torch._foreach_copy_([self._pack_views[i] for i in msg.members], tensors)
                        source = part
                    in_flight.append((self._start(source), tensors))
                else:
                    tensor = take(msg.members[0]).to(self.device).contiguous()
                    in_flight.append((self._start(tensor.reshape(-1).view(torch.uint8)), tensor))
            bucket_done(bucket)
        if taken < len(names):
            take(len(names) - 1)
        self._plan = "".join(flat) if "1" in flat else ""

    def _wait(self, in_flight: list[tuple[Any, object]]) -> None:
        for work, _ in in_flight:
            work.wait(self.timeout)
        in_flight.clear()

    def close(self) -> None:
        super().close()
        self._store = None


class WeightReceiver(_Endpoint):
    """An actor engine's end: joins the sender's store on first use and receives updates.

    stage_on_host: keep the whole update in host memory (pinned when the group is NCCL) rather
    than on the device; each message then lands in a bounce buffer on the device, at most the
    largest message (a bucket, or one tensor larger than a bucket), and is copied out. The GPU
    then holds no model-sized buffer; the engine copies to it when it loads, under its lock.

    keep (staged on host only): per tensor name, the views (shape, stride, storage offset) of
    the incoming tensor that this receiver's engine reads: a tensor-parallel worker's shard, from
    its copy plan. Only those views are kept, each as a contiguous block (`receive_kept`), so a
    worker's host memory holds its shard of an update, not the whole model."""

    def __init__(
        self,
        addr: str,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        stage_on_host: bool = False,
        keep: Keep | None = None,
    ):
        if not 1 <= rank < world_size:
            raise ValueError(f"receiver rank must be in 1..{world_size - 1}, got {rank}")
        if keep is not None and not stage_on_host:
            raise ValueError("a receiver keeps views of the update only when it stages it on host")
        super().__init__(addr, rank, world_size, backend, timeout_s)
        self.keep = keep
        self._kept: dict[str, list[torch.Tensor]] = {}
        """Per name, the kept blocks (views of the receive buffer) in `keep`'s order."""
        self._kept_by_index: list[list[tuple[torch.Tensor, tuple]]] = []
        """Per tensor of the layout, its (block, view spec) pairs."""
        self._names: list[str] = []
        self._received = -1
        """The last version received in the current group."""
        self._start_heartbeat()
        self.stage_on_host = stage_on_host
        if stage_on_host:
            self.staging_device = torch.device("cpu")
        self._bounce: torch.Tensor | None = None
        self._store: dist.TCPStore | None = None
        self._buffer: torch.Tensor | None = None
        """The receive buffer of the kept layout: the whole update."""
        self._reuse: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._parts: list[list[torch.Tensor]] = []
        """Per bucket, its messages' bytes in the receive buffer."""

    def receive(self, update: WeightUpdate) -> list[tuple[str, torch.Tensor]]:
        """Take part in the broadcast announced by `update`; returns (name, tensor) pairs whose
        tensors are views into the receive buffer, valid until the next receive() (copy them
        to keep them).
        Raises StaleUpdate for an announcement whose transfer is over, ValueError for an
        inconsistent announcement, and WeightGroupFailed, naming the members that did not
        finish, when a member dies or stalls past the timeout."""
        kept = self._kept_layout(update, None)
        if kept is None:
            check_announcement(update)
        started = time.monotonic()
        try:
            if self._group is not None and update.group == self._group_name:
                # A member takes part in every broadcast of its group, in order: none can be
                # over without it, so the store need not say whether this one is current. An
                # announcement read twice (streams deliver at least once) is not newer.
                if update.version <= self._received:
                    raise StaleUpdate(
                        f"weight update {update.version} is not newer than {self._received}, "
                        "the last this receiver took part in"
                    )
                plan = update.plan
            else:
                plan = self._join(update)
            if self.keep is not None and update.names != self._names:
                self._release()  # the kept blocks are laid out by name
                self._names = list(update.names)
                kept = None
            layout = kept if kept is not None and kept.plan == plan else self._new_layout(update, plan)
            self._receive_messages(layout)
            self._received = update.version
        except StaleUpdate:
            raise
        except ValueError:  # an announcement this receiver cannot take: not a fault of the group
            self._drop_group()
            self._store = None
            raise
        except Exception as e:
            self._drop_group()
            failed = self._failed(self._store, update.version, started, e)
            self._store = None  # a trainer that restarted hosts a new store: connect again next time
            raise failed from e
        return list(zip(update.names, self._views))

    def _join(self, update: WeightUpdate) -> str:
        """Check with the sender's store that `update` is current (StaleUpdate otherwise: a
        receiver that starts reads the announcements made before it), join the group that
        broadcasts it when this receiver is not in it yet; returns the update's plan."""
        latest, name, planned = self._store_get(["latest", "group", "plan"])
        plan_version, _, plan = planned.decode().partition(":")
        newest = max(int(latest), int(plan_version))  # "plan" is set before the announcement
        if update.version < newest:
            raise StaleUpdate(f"weight update {update.version} is older than the sender's latest {newest}")
        if name.decode() != self._group_name:
            assert self._store is not None  # _store_get connected it
            self._group = _new_group(self._store, name.decode(), self.rank, self.world_size, self.backend, self.timeout)
            self._group_name = name.decode()
            self._received = -1  # a resumed trainer counts again from its checkpoint
        return plan

    def receive_kept(self, update: WeightUpdate) -> dict[str, list[torch.Tensor]]:
        """`receive` for a receiver with `keep`: per name, its kept views as contiguous blocks,
        in `keep`'s order (valid until the next receive)."""
        if self.keep is None:
            raise ValueError("receive_kept needs a receiver made with keep")
        self.receive(update)
        return self._kept

    def _new_layout(self, update: WeightUpdate, plan: str) -> Layout:
        self._reuse = self._buffer  # a layout of the same size (another plan) keeps the buffer
        try:
            return super()._new_layout(update, plan)
        finally:
            self._reuse = None

    def _allocate(self, layout: Layout) -> None:
        if self.keep is not None:
            self._allocate_kept(layout)
            return
        buffer, self._reuse = self._reuse, None
        if buffer is None or buffer.numel() != layout.total_bytes:
            buffer = None  # let go of the old buffer before allocating the new one
            pin = self.staging_device.type == "cpu" and self.device.type == "cuda"
            buffer = torch.empty(layout.total_bytes, dtype=torch.uint8, device=self.staging_device, pin_memory=pin)
        self._buffer = buffer
        self._views = layout.views(self._buffer)
        self._parts = [[] for _ in layout.bucket_sizes]
        for m in layout.messages:
            self._parts[m.bucket].append(self._buffer[m.start : m.stop])

    def _allocate_kept(self, layout: Layout) -> None:
        """One pinned host buffer holding every kept view back to back."""
        assert self.keep is not None
        specs = [(i, spec) for i, name in enumerate(self._names) for spec in self.keep.get(name, ())]
        sizes = [math.prod(shape) * layout.dtypes[i].itemsize for i, (shape, _, _) in specs]
        self._buffer = None
        pin = self.device.type == "cuda"
        self._buffer = torch.empty(sum(aligned(n) for n in sizes), dtype=torch.uint8, pin_memory=pin)
        self._kept = {}
        self._kept_by_index = [[] for _ in self._names]
        at = 0
        for (i, spec), n in zip(specs, sizes):
            block = self._buffer[at : at + n].view(layout.dtypes[i]).view(spec[0])
            self._kept.setdefault(self._names[i], []).append(block)
            self._kept_by_index[i].append((block, spec))
            at += aligned(n)
        self._views = []
        self._parts = []

    def _release(self) -> None:
        super()._release()
        self._buffer = None
        self._views = []
        self._parts = []
        self._kept = {}
        self._kept_by_index = []

    def _receive_messages(self, layout: Layout) -> None:
        """Into the receive buffer: the messages of two buckets started at a time, bucket b + 2's
        once bucket b's are done (a message never waits behind more than two buckets: NCCL
        counts a collective's timeout from its start). Staged on host: one message at a time
        through the bounce buffer."""
        parts = self._parts
        if not self.stage_on_host:
            started = [[self._start(part) for part in bucket] for bucket in parts[:2]]
            for b in range(len(parts)):
                for work in started[b]:
                    work.wait(self.timeout)
                if b + 2 < len(parts):
                    started.append([self._start(part) for part in parts[b + 2]])
            return
        if self._bounce is None or self._bounce.numel() < layout.largest:
            self._bounce = None
            self._bounce = torch.empty(layout.largest, dtype=torch.uint8, device=self.device)
        if self.keep is not None:
            for msg in layout.messages:
                bounce = self._bounce[: msg.stop - msg.start]
                self._start(bounce).wait(self.timeout)
                for i, (at, n) in zip(msg.members, msg.at):
                    if self._kept_by_index[i]:
                        tensor = bounce[at : at + n].view(layout.dtypes[i])
                        for block, (shape, stride, offset) in self._kept_by_index[i]:
                            block.copy_(tensor.as_strided(shape, stride, tensor.storage_offset() + offset))
            return
        for bucket in parts:
            for part in bucket:
                bounce = self._bounce[: part.numel()]
                self._start(bounce).wait(self.timeout)
                part.copy_(bounce)

    def publish(self, key: str, value: str) -> None:
        """Set `key` in the sender's store: how a receiver in a process of its own (a
        tensor-parallel worker) tells its actor that its part of a transfer ended."""
        self._connect().set(key, value)

    def _connect(self) -> dist.TCPStore:
        if self._store is None:
            self._store = dist.TCPStore(self.host, self.port, self.world_size, is_master=False, timeout=self.timeout)
            self._beat_connected()
        return self._store

    def _store_get(self, keys: list[str]) -> list[bytes]:
        """The values of `keys` (waiting for missing ones), in one round trip."""
        if self._store is not None:
            try:
                return self._store.multi_get(keys)
            except Exception as e:  # the sender's store went away (trainer restarted): connect again
                log.warning("weight-sync store at %s:%d: %s; reconnecting", self.host, self.port, e)
                self._drop_group()
                self._store = None
        return self._connect().multi_get(keys)

    def close(self) -> None:
        super().close()
        self._bounce = None
        self._store = None
