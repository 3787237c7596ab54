"""An actor engine's end of the weight broadcast (pipeline_rl/weight_sync/__init__.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from pipeline_rl.streams.records import WeightUpdate
from pipeline_rl.weight_layout import Layout, aligned, check_announcement
from pipeline_rl.weight_sync.delta import is_delta
from pipeline_rl.weight_sync.group import (
    ABANDONED,
    FROZEN_S,
    INCARNATION,
    LEAVE_POLL_S,
    LEFT,
    RESYNC,
    Endpoint,
    Keep,
    NotMember,
    StaleUpdate,
    members_key,
    ready_key,
    split_host_port,
)

log = logging.getLogger(__name__)


class WeightReceiver(Endpoint):
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
        self._keeping = keep is not None
        """Whether the current layout keeps views (a full update) or everything (a delta)."""
        self._kept: dict[str, list[torch.Tensor]] = {}
        """Per name, the kept blocks (views of the receive buffer) in `keep`'s order."""
        self._kept_by_index: list[list[tuple[torch.Tensor, tuple]]] = []
        """Per tensor of the layout, its (block, view spec) pairs."""
        self._names: list[str] = []
        self._received = -1
        """Version of the last update received in the current group."""
        self.incarnation: str | None = None
        """The sender's incarnation (group.INCARNATION) as of the last connection to its store."""
        self.token = uuid.uuid4().hex
        """This receiver's registration (group.ready_key): a replacement of the same rank has
        another, so the sender tells it from the member it replaces."""
        self._start_heartbeat()
        self.stage_on_host = stage_on_host
        if stage_on_host:
            self.staging_device = torch.device("cpu")
        self._bounce: torch.Tensor | None = None
        self._store: dist.TCPStore | None = None
        self._closed = False
        """Closed: it connects (and so registers) no more, whatever it is asked."""
        self._buffer: torch.Tensor | None = None
        """The receive buffer of the kept layout: the whole update."""
        self._reuse: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._parts: list[list[torch.Tensor]] = []
        """Per bucket, its messages' bytes in the receive buffer."""
        self._transfer: tuple[WeightUpdate, Layout, float] | None = None
        """The transfer `begin` started: its announcement, layout and start time."""

    def receive(self, update: WeightUpdate) -> list[tuple[str, torch.Tensor]]:
        """Take part in the broadcast announced by `update`; returns (name, tensor) pairs whose
        tensors are views into the receive buffer, valid until the next receive() (copy them
        to keep them).
        Raises StaleUpdate for an announcement whose transfer is over, ValueError for an
        inconsistent announcement, and WeightGroupFailed, naming the members that did not
        finish, when a member dies or stalls past the timeout."""
        buckets = self.begin(update)
        self.receive_buckets(0, buckets)
        return self.end()

    def begin(self, update: WeightUpdate) -> int:
        """The first part of `receive`, in three calls for a caller that must order each
        bucket's transfer against other collectives (a tensor-parallel worker between two engine
        steps, engine/tp_worker.py): check the announcement and join its group. Returns the
        number of buckets; then `receive_buckets` for each, and `end`."""
        kept = self._kept_layout(update, None)
        if kept is None:
            check_announcement(update)
        started = time.monotonic()
        with self._failing(update.version, started):
            self._join(update)
            plan = update.plan
            keeping = self.keep is not None and not is_delta(update)  # a delta's pieces are kept whole
            if keeping != self._keeping:
                self._release()
                self._keeping = keeping
                kept = None
            if keeping and update.names != self._names:
                self._release()  # the kept blocks are laid out by name
                self._names = list(update.names)
                kept = None
            layout = kept if kept is not None and kept.plan == plan else self._new_layout(update, plan)
            self._transfer = (update, layout, started)
        return len(layout.bucket_sizes)

    def receive_buckets(self, first: int, stop: int) -> None:
        """Receive buckets first .. stop - 1 of the transfer `begin` started."""
        assert self._transfer is not None, "receive_buckets before begin"
        update, layout, started = self._transfer
        with self._failing(update.version, started):
            self._receive_messages(layout, first, stop)

    def end(self) -> list[tuple[str, torch.Tensor]]:
        """Close the transfer `begin` started (every bucket received): the update's tensors, as
        `receive` returns them."""
        assert self._transfer is not None, "end before begin"
        update, _, started = self._transfer
        self._transfer = None
        with self._failing(update.version, started):
            if self.backend == "gloo" and time.monotonic() - started >= FROZEN_S:
                # Long enough to have been taken for frozen (this process, stopped, wakes to
                # find its transfer done): the sender may have given it up and unregistered
                # this receiver, which then registers again through the failure path.
                self._frozen_check({})
            self._received = update.version
        return list(zip(update.names, self._views))

    @contextlib.contextmanager
    def _failing(self, version: int, started: float) -> Iterator[None]:
        """What a failure inside a transfer becomes: StaleUpdate as it is; ValueError (an
        announcement this receiver cannot take, not a fault of the group) after leaving the
        group; anything else WeightGroupFailed, naming the members that are gone."""
        try:
            yield
        except StaleUpdate:
            self._transfer = None
            raise
        except ValueError:
            self._transfer = None
            self._drop_group()
            self._store = None
            raise
        except Exception as e:
            self._transfer = None
            self._drop_group()
            failed = self._failed(self._store, version, started, e)
            self._store = None  # a trainer that restarted hosts a new store: connect again next time
            raise failed from e

    def _join(self, update: WeightUpdate) -> None:
        """Make sure `update` is current and this receiver is in the group that broadcasts it.

        An update of this receiver's group newer than the last one it received there is
        current without asking: the sender broadcasts in announcement order, no broadcast of a
        group ends without each of its members, and after a failed one the sender names a new
        group, so it cannot have gone past an update of this group that this member has not
        taken part in. That saves a store round trip per update (a large share of a
        small model's broadcast). Any other update (another group's, or one already
        received: a re-delivered announcement) is checked with the sender's store. It is over
        (StaleUpdate) when the sender has gone past it (a receiver that starts reads the
        announcements made before it); when the sender has named another group since (the
        same version sent again to a group that takes in a receiver that joined: that group's
        own announcement follows, and its members receive only by it, or one member would
        wait in the new group for another still told the old announcement is over); and when
        this receiver's group broadcast it already (each version once per group). Else the
        group is joined."""
        if self._group is not None and update.group == self._group_name and update.version > self._received:
            return
        latest, named, planned = self._store_get(["latest", "group", "plan"])
        name = named.decode()
        plan_version = planned.decode().partition(":")[0]
        newest = max(int(latest), int(plan_version))  # "plan" is set before the announcement
        if update.version < newest:
            raise StaleUpdate(f"weight update {update.version} is older than the sender's latest {newest}")
        if update.group != name:
            raise StaleUpdate(
                f"weight update {update.version} was announced to group {update.group}; "
                f"the sender has formed group {name} since"
            )
        if name == self._group_name and update.version <= self._received:
            raise StaleUpdate(f"weight update {update.version} of group {name} was received already")
        if name != self._group_name:
            assert self._store is not None  # _store_get connected it
            self._drop_group()
            members = [tuple(m) for m in json.loads(self._store.get(members_key(name)))]
            if (self.rank, self.token) not in members:
                raise NotMember(f"weight update {update.version}'s group was formed without this receiver")
            group_rank = members.index((self.rank, self.token))
            self._group_name = name
            self._group = self._build_group(group_rank, len(members))
            self._received = -1

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
        if self._keeping:
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

    def _receive_messages(self, layout: Layout, first: int, stop: int) -> None:
        """Into the receive buffer, buckets first .. stop - 1: the messages of two buckets
        started at a time, bucket b + 2's once bucket b's are done (a message never waits behind
        more than two buckets: NCCL counts a collective's timeout from its start). Staged on
        host: one message at a time through the bounce buffer."""
        parts = self._parts
        if not self.stage_on_host:
            started = {b: [self._start(part) for part in parts[b]] for b in range(first, min(first + 2, stop))}
            for b in range(first, stop):
                for work in started.pop(b):
                    self._wait_for(work)
                if b + 2 < stop:
                    started[b + 2] = [self._start(part) for part in parts[b + 2]]
            return
        if self._bounce is None or self._bounce.numel() < layout.largest:
            self._bounce = None
            self._bounce = torch.empty(layout.largest, dtype=torch.uint8, device=self.device)
        if self._keeping:
            for msg in layout.messages:
                if not first <= msg.bucket < stop:
                    continue
                bounce = self._bounce[: msg.stop - msg.start]
                self._wait_for(self._start(bounce))
                for i, (at, n) in zip(msg.members, msg.at):
                    if self._kept_by_index[i]:
                        tensor = bounce[at : at + n].view(layout.dtypes[i])
                        for block, (shape, stride, offset) in self._kept_by_index[i]:
                            block.copy_(tensor.as_strided(shape, stride, tensor.storage_offset() + offset))
            return
        for bucket in parts[first:stop]:
            for part in bucket:
                bounce = self._bounce[: part.numel()]
                self._wait_for(self._start(bounce))
                part.copy_(bounce)

    def _frozen_check(self, seen: dict[int, tuple[bytes | None, float]]) -> None:
        """Give the transfer up when the sender gave its group up (ABANDONED names it: the
        sender's end failed, or a member froze or was replaced); the next announcement's group is
        joined as usual."""
        assert self._store is not None
        name = self._group_name
        if self._store.check([ABANDONED]) and self._store.get(ABANDONED).decode() == name:
            raise self._give_up(
                f"the sender gave group {name} up (its transfer failed, or a member froze or was replaced)"
            )

    def request_full(self) -> None:
        """Ask the sender for a full update next (this receiver's weights failed their checksum,
        or it could not apply a delta)."""
        self._connect().add(RESYNC, 1)

    def publish(self, key: str, value: str) -> None:
        """Set `key` in the sender's store: how a receiver in a process of its own (a
        tensor-parallel worker) tells its actor that its part of a transfer ended."""
        self._connect().set(key, value)

    def _connect(self) -> dist.TCPStore:
        """The sender's store, connected (and this receiver registered in it) if it was not.
        A closed receiver never registers again: an announcement read after it closed (an actor
        that stops while its update thread holds announcements it has not taken yet) would
        otherwise register a receiver that is gone, and the sender's next group would wait for
        it until the transfer's timeout."""
        if self._closed:
            raise StaleUpdate("the receiver is closed")
        if self._store is None:
            store = dist.TCPStore(self.host, self.port, self.world_size, is_master=False, timeout=self.timeout)
            self.incarnation = store.get(INCARNATION).decode()
            store.set(ready_key(self.rank), self.token)
            self._store = store
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
        self._closed = True
        super().close()
        self._bounce = None
        self._store = None


def withdraw(store: dist.Store, ranks: list[int]) -> None:
    """Withdraw the registrations of `ranks` (group.LEFT): the sender forms no group with them
    until they register again."""
    for rank in ranks:
        store.set(ready_key(rank), LEFT)


def leave_group(addr: str, ranks: list[int], timeout_s: float) -> bool:
    """Take the receivers of `ranks` out of the weight-update group for good: withdraw their
    registrations (group.LEFT), then wait until the sender names a group without them (it forms
    one at its next update), at most `timeout_s`. Their receivers must keep taking part until then: a
    transfer of the current group still counts on them. Returns whether the group re-formed
    in time (False too when the sender's store is gone). A registration made again meanwhile (a
    receiver whose transfer failed registers when it reconnects) is withdrawn again."""
    host, port = split_host_port(addr)
    deadline = time.monotonic() + timeout_s
    try:
        store = dist.TCPStore(host, port, None, is_master=False, timeout=timedelta(seconds=timeout_s))
        while time.monotonic() < deadline:
            withdraw(store, ranks)
            name = store.get("group").decode() if store.check(["group"]) else ""
            if name and store.check([members_key(name)]):
                members = json.loads(store.get(members_key(name)))
                if not any(rank in ranks for rank, _ in members):
                    return True
            time.sleep(LEAVE_POLL_S)
    except Exception as e:  # the sender (trainer rank 0) is gone or restarting
        log.warning("leaving the weight-update group at %s: %s", addr, e)
    return False


def published_version(addr: str, timeout_s: float) -> int:
    """The last version the sender at `addr` published (0 before any)."""
    host, port = split_host_port(addr)
    store = dist.TCPStore(host, port, None, is_master=False, timeout=timedelta(seconds=timeout_s))
    return int(store.get("latest")) if store.check(["latest"]) else 0
