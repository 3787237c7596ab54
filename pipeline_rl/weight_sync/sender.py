"""Trainer rank 0's end of the weight broadcast (pipeline_rl/weight_sync/__init__.py)."""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from pipeline_rl.streams.records import WeightUpdate
from pipeline_rl.weight_layout import Layout, dtype_name, flat_span, plan_buckets
from pipeline_rl.weight_sync.delta import DeltaHeader
from pipeline_rl.weight_sync.group import (
    ABANDONED,
    FROZEN_S,
    INCARNATION,
    LEFT,
    RESYNC,
    WAIT_SLICE_S,
    Endpoint,
    members_key,
    named,
    ready_key,
)

log = logging.getLogger(__name__)


class WeightSender(Endpoint):
    """Trainer rank 0: hosts the store and broadcasts each published version."""

    def __init__(self, addr: str, world_size: int, backend: str, timeout_s: float, members: list[str] | None = None):
        """`members`: the process behind each rank (member_names), for failure messages."""
        super().__init__(addr, 0, world_size, backend, timeout_s)
        self._store: dist.TCPStore | None = dist.TCPStore(
            self.host, self.port, world_size, is_master=True, timeout=self.timeout, wait_for_workers=False
        )
        self._store.set("members", json.dumps(members or [f"rank {r}" for r in range(world_size)]))
        self._store.set(INCARNATION, uuid.uuid4().hex)
        self._formed = False
        """Whether a group was formed before (the first waits for every receiver)."""
        self.members: list[int] = []
        self.awaited: list[int] | None = None
        """The receiver ranks the first update waits for (`expect`); None: every rank."""
        """The weight-update ranks of the current group (0 first), for logs and tests."""
        self._tokens: dict[int, str] = {}
        """Rank -> registration token of each receiver in the current group: a rank registered
        under another token is a replacement (a new process), to take in by a new group."""
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
        self._resyncs_seen = 0
        """The store's RESYNC count when the sender last read it."""
        self._sent = -1
        """The last version broadcast: one version is broadcast once per group (a receiver
        takes a second announcement of it in the same group for over: receiver._join)."""

    def send(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        announce: Callable[[WeightUpdate], None],
        bucket_mb: int,
        specs: list[tuple[str, list[int], torch.dtype]] | None = None,
        header: DeltaHeader | None = None,
    ) -> float:
        """Announce `version` and broadcast it to every receiver; returns the seconds taken.
        With `specs` (name, shape, dtype of every tensor, in order) the announcement needs no
        tensor, and `named_tensors` is consumed one message at a time: every tensor of a bucket
        is used (its broadcast done) before the first tensor of the next bucket is asked for,
        so a generator of gathered chunks in the same buckets (full_weights.gathered_chunks)
        never holds more than one chunk. `header`: the announcement's delta fields (a delta's
        pieces as the tensors, or a full update's checksums; weight_sync/delta.py). Raises when a receiver is missing or dies (after at
        most the timeout), or when the tensors differ from `specs` (name, shape or dtype); the
        next send then builds a fresh group."""
        start = time.perf_counter()
        check = specs is not None  # specs made here from the tensors need no check against them
        if specs is None:
            named_tensors = list(named_tensors)
            specs = [(name, list(t.shape), t.dtype) for name, t in named_tensors]
        if self._store is None:
            raise RuntimeError("WeightSender.send after close()")
        started = time.monotonic()
        group = self._group_name
        try:
            reform = group is None or version <= self._sent or self._registered() != self._tokens
            if reform:
                self._drop_group()
                group = self._group_name = f"{version}-{uuid.uuid4().hex[:8]}"
                self._store.set("group", group)
            update = self._announcement(version, specs, bucket_mb, header)
            plan = update.plan
            layout = self._kept_layout(update, plan) or self._new_layout(update, plan)
            self._store.set("latest", str(version))
            if self._published != plan:
                self._store.set("plan", f"{version}:{plan}")
                self._published = plan
            announce(update)
            if reform:
                self._form_group()
            if self._group is not None:
                plan = self._send_messages(update, layout, iter(named_tensors), check)
                if not update.base >= 0:  # a delta's pieces say nothing of the next full update's
                    self._plan = plan
            self._sent = version
        except ValueError:  # the tensors differ from the announcement: the sender's own fault
            self._abandon_group(group)
            raise
        except Exception as e:
            self._abandon_group(group)
            failure = self._failed(self._store, version, started, e)
            for rank in self.gone:  # left out of the next group until they register again
                self._unregister(rank)
            raise failure from e
        return time.perf_counter() - start

    def _abandon_group(self, name: str | None) -> None:
        """Drop the group `name` after a failed transfer (`_frozen_check` may have let go of it
        already) and say so to its receivers (ABANDONED): one still building it may wait there
        for a member that died after connecting to the sender alone, or one that froze, and
        would hold the next group up for the whole timeout."""
        self._drop_group()
        if name is not None:
            assert self._store is not None  # send checked it
            self._store.set(ABANDONED, name)

    def _form_group(self) -> None:
        """Choose the members of the group just named and build it: at the first update every
        receiver (waiting up to the timeout for them, after which the group takes those
        registered: under ZeRO-3 the other trainer ranks wait in a gather meanwhile, which must
        not time out with this wait), later the receivers registered by then (a member found
        gone is unregistered; a replacement registers when it connects, and joins at the next
        version). No group when no receiver is registered: the update is announced only."""
        assert self._store is not None and self._group_name is not None
        if not self._formed:
            self._formed = True
            self._wait_for_receivers()
        self._tokens = self._registered()
        members = [0, *self._tokens]
        self.members = members
        self._store.set(members_key(self._group_name), json.dumps([[0, ""], *self._tokens.items()]))
        if len(members) > 1:
            self._group = self._build_group(0, len(members))

    def expect(self, ranks: list[int]) -> None:
        """The first update waits for these receiver ranks only: the actors of the job that are
        there (one scaled away or absent would hold it up for the whole timeout). The others
        join at a later version if they register."""
        self.awaited = sorted(ranks)

    def _wait_for_receivers(self) -> None:
        """Wait up to the timeout for every awaited receiver to register; say which did not."""
        assert self._store is not None
        awaited = self.awaited if self.awaited is not None else list(range(1, self.world_size))
        deadline = time.monotonic() + self.timeout.total_seconds()
        while missing := sorted(set(awaited) - self._registered().keys()):
            if time.monotonic() >= deadline:
                names = json.loads(self._store.get("members"))
                log.warning(
                    "the first weight update goes without %s: not registered within %g s; they join at the next version",
                    named(names, missing),
                    self.timeout.total_seconds(),
                )
                return
            time.sleep(WAIT_SLICE_S / 10)

    def _peers(self) -> list[int]:
        # The members of the group that failed: a rank registered since, or one that left the
        # job (scaled away), was not in the transfer.
        return [r for r in self.members if r != 0] if self.members else super()._peers()

    def resize(self, world_size: int, members: list[str]) -> None:
        """The job was scaled up: ranks up to `world_size` may register (`members`: the process
        behind each rank, for failure messages)."""
        assert self._store is not None
        if world_size > self.world_size:
            self.world_size = world_size
            self._store.set("members", json.dumps(members))

    def delta_base(self) -> int | None:
        """The version every member of the current group holds, for the next update to be a
        delta against; None when it must be full: no group yet, or one that a receiver joined,
        left or was replaced in since, or a receiver asked for a full update
        (WeightReceiver.request_full: its weights failed their checksum, or it could not apply
        a delta). Each request is answered once."""
        if self._store is None or self._group is None or self._sent < 0:
            return None
        asked = self._store.add(RESYNC, 0)
        if asked != self._resyncs_seen:
            self._resyncs_seen = asked
            return None
        if self._registered() != self._tokens:
            return None
        return self._sent

    def has_joiners(self) -> bool:
        """Whether a receiver registered that the current group lacks (after the first group)."""
        if not self._formed or self._store is None:
            return False
        return any(self._tokens.get(rank) != token for rank, token in self._registered().items())

    def _registered(self, store: dist.Store | None = None) -> dict[int, str]:
        """Rank -> registration token of the receivers registered in the store (two round trips
        when every rank has set its key once), through `store` (the main connection by default).
        A key once set stays (group.LEFT), so the values read exist for every key found."""
        store = store or self._store
        assert store is not None
        receivers = range(1, self.world_size)
        keys = [ready_key(r) for r in receivers]
        if not store.check(keys):
            receivers = [r for r in receivers if store.check([ready_key(r)])]
            keys = [ready_key(r) for r in receivers]
        values = [v.decode() for v in store.multi_get(keys)] if keys else []
        return {r: token for r, token in zip(receivers, values) if token != LEFT}

    def _unregister(self, rank: int) -> None:
        """Withdraw the registration the current group has of `rank` (not a replacement's, made
        since under a token of its own: compared and set in one step)."""
        assert self._store is not None
        token = self._tokens.get(rank)
        if token is not None:
            self._store.compare_set(ready_key(rank), token, LEFT)

    def _announcement(
        self,
        version: int,
        specs: list[tuple[str, list[int], torch.dtype]],
        bucket_mb: int,
        header: DeltaHeader | None = None,
    ) -> WeightUpdate:
        """The WeightUpdate of `version`, in the current group, with the current plan; its lists
        are computed again only when the specs or the bucket size change (one list comparison
        otherwise). They are shared between updates: nobody may modify them. A delta's lists
        (its pieces differ every time) are made for it alone, with no plan."""
        assert self._group_name is not None
        if header is not None and header.base >= 0:
            return WeightUpdate(
                version=version,
                names=[name for name, _, _ in specs],
                shapes=[list(shape) for _, shape, _ in specs],
                dtypes=[dtype_name(dtype) for _, _, dtype in specs],
                bucket_sizes=plan_buckets([math.prod(s) * d.itemsize for _, s, d in specs], bucket_mb),
                group=self._group_name,
                plan="",
                base=header.base,
                forms=header.forms,
                checksums=header.checksums,
            )
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
        return WeightUpdate(
            version=version,
            names=names,
            shapes=shapes,
            dtypes=dtypes,
            bucket_sizes=buckets,
            group=self._group_name,
            plan=self._plan,
            checksums=header.checksums if header is not None else [],
        )

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

    def _send_messages(
        self, update: WeightUpdate, layout: Layout, named: Iterator[tuple[str, torch.Tensor]], check: bool
    ) -> str:
        """Start each message of a bucket: a packed run from its tensors' own storage when they
        are flat there (flat_span), else packed into the reused pack area by one
        _foreach_copy_; a large tensor from its own storage. Wait for the bucket's messages
        before taking the next bucket's first tensor. Takes each tensor from `named` only when
        its message is being built, and with `check` compares it with the announcement.
        Returns the plan these tensors make for the next update of this layout."""
        names, sizes, dtypes = update.names, layout.sizes, layout.dtypes
        taken = 0
        bucket_tensors: dict[int, torch.Tensor] = {}
        """The current bucket's tensors as taken, to tell whether the bucket lies flat."""

        def take(i: int) -> torch.Tensor:
            """Tensor i, passing by the ones before it (tensors of no bytes are in no message)."""
            nonlocal taken
            while True:
                name, tensor = next(named)
                if check and (name != names[taken] or tensor.shape != sizes[taken] or tensor.dtype != dtypes[taken]):
                    raise ValueError(
                        f"weight tensor {taken} is {name} {list(tensor.shape)} {dtype_name(tensor.dtype)}, "
                        f"announced as {names[taken]} {layout.shapes[taken]} {dtype_name(dtypes[taken])}"
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
        return "".join(flat) if "1" in flat else ""

    def _wait(self, in_flight: list[tuple[Any, object]]) -> None:
        for work, _ in in_flight:
            self._wait_for(work)
        in_flight.clear()

    def _frozen_check(self, seen: dict[int, tuple[bytes | None, float]]) -> None:
        """Give the transfer up when a member is gone without its sockets saying so: its
        heartbeat has stood still for FROZEN_S since this wait began (`seen`: per rank, its last
        beat and since when), or a replacement registered at its rank (whose heartbeat is then
        the one at that rank). `send`'s failure path tells the receivers still in the group
        (ABANDONED) and unregisters the members found gone, so the next version forms a group
        without them."""
        assert self._store is not None
        store = self._store
        now = time.monotonic()
        replaced = self._replaced(store)
        frozen = []
        for rank in self._peers():
            key = f"alive/{rank}"
            beat = store.get(key) if store.check([key]) else None
            if rank not in seen or seen[rank][0] != beat:
                seen[rank] = (beat, now)
            elif now - seen[rank][1] >= FROZEN_S and rank not in replaced:  # also one that froze before its first beat
                frozen.append(rank)
        if not (frozen or replaced):
            return
        names = json.loads(store.get("members"))
        why = []
        if frozen:
            why.append(f"no heartbeat for {FROZEN_S:g} s from {named(names, frozen)}")
        if replaced:
            why.append(f"{named(names, replaced)} replaced by a new process")
        raise self._give_up(f"gave the transfer up: {'; '.join(why)}")

    def _replaced(self, store: dist.Store) -> list[int]:
        """The members of the current group whose rank a new process registered at since."""
        registered = self._registered(store)
        return [r for r, token in self._tokens.items() if registered.get(r, token) != token]

    def _gone(self, store: dist.Store) -> list[int]:
        return sorted(set(super()._gone(store)) | set(self._replaced(store)))

    def close(self) -> None:
        super().close()
        self._store = None
