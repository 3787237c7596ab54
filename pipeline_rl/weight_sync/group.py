"""The weight-update group's common part: ranks and member names, errors, and the endpoint
(store, group, kept layout, heartbeat, failure diagnosis) that the sender and receivers share.
How an update travels: pipeline_rl/weight_sync/__init__.py."""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipeline_rl.streams.records import WeightUpdate
from pipeline_rl.weight_layout import Layout

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
LEAVE_POLL_S = 0.2
"""How often a leaving receiver looks for the group formed without it."""
WAIT_SLICE_S = 1.0
"""A gloo transfer is waited for in slices this long; between two, the waiter looks for a
member that froze (`Endpoint._wait_for`)."""
FROZEN_S = 10.0
"""A member whose heartbeat stood still this long while a transfer waited on it is taken for
frozen (its node hung or was cut off: its sockets stay open, so the transfer would wait for the
whole timeout): the transfer is given up. Four times DIAGNOSE_S, so that a receiver whose
heartbeat thread is only starved of the CPU for a while is not taken for frozen."""
TRANSFER_SHARE = 0.5
"""The weight-update group's timeout as a share of the run's collective timeout
(`transfer_timeout_s`)."""
POLL_S = 1e-4
"""How often an NCCL transfer's completion is polled within a slice of its wait."""


def transfer_timeout_s(collective_timeout_s: float) -> float:
    """The bound on every wait of the weight-update group (a transfer, forming a group, the first
    update's wait for its receivers). Under ZeRO-3 the other trainer ranks wait for rank 0's
    broadcast inside a collective of their own (the next bucket's gather) that times out at the
    run's collective timeout: bounded well below it (and its diagnosis, DIAGNOSE_S, with it), a
    receiver that hangs costs the trainer pool one failed update, never its collectives."""
    return collective_timeout_s * TRANSFER_SHARE


ABANDONED = "abandoned"
"""Store key the sender sets to the name of a group it gave up (its transfer failed, or a
member froze or was replaced): the receivers still waiting in that group give up too."""


class WeightGroupFailed(RuntimeError):
    """A weight transfer failed; the message names the members that did not finish it."""


class PeerGone(WeightGroupFailed):
    """A weight transfer failed because the members it names are gone: their own failure is the
    cause, and their processes report it (the launcher waits for that report: core/process.py)."""


def backend_for(gpus_per_node: int) -> str:
    """The one backend of the weight-update group, decided from the world (the same on the
    sender and every receiver, or they could never form the group): NCCL between GPUs, else gloo."""
    return "nccl" if gpus_per_node > 0 else "gloo"


class MemberFrozen(WeightGroupFailed):
    """A transfer was given up because a member it waited on froze (FROZEN_S), its timeout ran
    out, or the sender gave its group up (ABANDONED)."""


class StaleUpdate(Exception):
    """An announcement whose transfer is already over; the receiver did not take part."""


class NotMember(StaleUpdate):
    """An announcement of a group formed without this receiver (it registered after the sender
    chose the members, or the sender found it gone): it takes part from the next version."""


RESYNC = "resync"
"""Store counter a receiver adds to when it needs a full update (weight_sync/delta.py)."""


def ready_key(rank: int) -> str:
    """Store key a receiver of weight-update rank `rank` sets, to a token of its own, once it
    can join a group; withdrawn by setting it to LEFT."""
    return f"ready/{rank}"


LEFT = "left"
"""The value of a withdrawn registration (ready_key). A registration is never deleted: the
sender reads the registrations in two round trips (which keys exist, then their values), and a
store read of a key deleted in between would wait for the whole timeout."""


def members_key(group: str) -> str:
    """Store key of the members of the group named `group`: a JSON list of [rank, token], the
    sender's [0, ""] first; a member's rank within the group is its index there."""
    return f"members/{group}"


INCARNATION = "incarnation"
"""Store key the sender sets once when it starts: a receiver told by it that the trainer
restarted accepts versions older than its own (the restarted trainer's, from its checkpoint)."""


def named(names: list[str], ranks: list[int]) -> str:
    """`ranks` by the process behind each (`names`: the store's "members"), for messages."""
    return ", ".join(f"{names[r] if r < len(names) else 'rank'} (weight-update rank {r})" for r in ranks)


def split_host_port(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"weight-sync address {addr!r} is not host:port")
    return host, int(port)


def new_group(store: dist.Store, name: str, rank: int, world_size: int, backend: str, timeout: timedelta):
    prefixed = dist.PrefixStore(f"weights/{name}", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    raise ValueError(f"weight-sync backend must be gloo or nccl, got {backend!r}")


class Endpoint:
    def __init__(self, addr: str, rank: int, world_size: int, backend: str, timeout_s: float):
        if world_size < 2:
            raise ValueError(f"weight-sync world size must be >= 2 (trainer + actors), got {world_size}")
        self.host, self.port = split_host_port(addr)
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
        self.gone: list[int] = []
        """The ranks the last failed transfer found gone (their heartbeats stood still)."""
        self._abandoned: list[Any] = []
        """Groups whose transfer was given up (MemberFrozen): kept for good, since destroying one
        joins its threads, which wait on the frozen member for as long as it stays frozen."""

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

    def _wait_for(self, work: Any) -> None:
        """Wait for `work` of the current group within the timeout, in slices of WAIT_SLICE_S,
        between which `_frozen_check` may give the transfer up (raising MemberFrozen) before the
        timeout would end it. gloo waits each slice itself; NCCL's completion is polled (a
        blocking NCCL wait that runs out aborts the communicator, so it cannot be sliced), then
        waited for once done, which raises its error if it failed."""
        seen: dict[int, tuple[bytes | None, float]] = {}
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            if self.backend == "gloo":
                try:
                    work.wait(timedelta(seconds=WAIT_SLICE_S))
                    return
                except RuntimeError:
                    if work.is_completed():  # failed, not a slice that ran out: gloo's own error
                        raise
            else:
                slice_end = min(time.monotonic() + WAIT_SLICE_S, deadline)
                while not work.is_completed() and time.monotonic() < slice_end:
                    time.sleep(POLL_S)
                if work.is_completed():
                    work.wait()
                    return
            if time.monotonic() >= deadline:
                raise self._give_up(f"gave the transfer up after its timeout, {self.timeout.total_seconds():g} s")
            self._frozen_check(seen)

    def _build_group(self, rank: int, size: int) -> Any:
        """The group named `self._group_name`, this member at `rank` of `size`, on a store
        connection of its own (a group being made blocks its connection in waits for the other
        members' addresses). Its members connect as it is made (gloo: every pair; NCCL: at a
        first one-element broadcast, made here so that the connection is not the first
        transfer's, where it would block the calling thread), so a member that registered and
        then died or froze would hold that for the whole timeout: the group is made on a thread
        of its own and waited for like a transfer (`_frozen_check` between slices, and for NCCL,
        whose connection has no timeout of its own, the group's timeout; a thread given up ends
        at the group's timeout, or never, for a frozen NCCL peer: it is a daemon)."""
        assert self._group_name is not None
        name = self._group_name
        store = dist.TCPStore(self.host, self.port, None, is_master=False, timeout=self.timeout)
        made: dict[str, Any] = {}

        def build() -> None:
            try:
                group: Any = new_group(store, name, rank, size, self.backend, self.timeout)
                if self.backend == "nccl":
                    torch.cuda.set_device(self.device)  # the current device is per thread
                    group.broadcast([torch.zeros(1, device=self.device)], self._opts).wait()
                made["group"] = group
            except Exception as e:  # raised below, unless the wait was given up meanwhile
                made["error"] = e

        thread = threading.Thread(target=build, name=f"weight-group-{name}", daemon=True)
        thread.start()
        seen: dict[int, tuple[bytes | None, float]] = {}
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            thread.join(WAIT_SLICE_S)
            if not thread.is_alive():
                break
            if self.backend == "nccl" and time.monotonic() >= deadline:  # gloo's own timeout ends its thread
                raise WeightGroupFailed(
                    f"forming the group took longer than its timeout, {self.timeout.total_seconds():g} s"
                )
            self._frozen_check(seen)
        if "error" in made:
            raise made["error"]
        return made["group"]

    def _frozen_check(self, seen: dict[int, tuple[bytes | None, float]]) -> None:
        """Between two slices of a wait: raise MemberFrozen to give the transfer up (the sender
        and the receivers each say when)."""

    def _give_up(self, why: str) -> MemberFrozen:
        """Keep the current group for good (its threads wait on a frozen member) and leave it;
        an NCCL communicator is aborted first, so that its kernel waiting on the member ends."""
        if self.backend == "nccl" and self._group is not None:
            self._group.abort()
        self._abandoned.append(self._group)
        self._drop_group()
        return MemberFrozen(why)

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
        self.gone = []
        try:
            if store is None:
                raise RuntimeError("no store connection")
            names = json.loads(store.get("members")) if store.check(["members"]) else []
            gone = self._gone(store)
        except Exception as e:  # the store is hosted by the sender: unreachable, the sender is gone
            return PeerGone(
                f"{what}; the weight-sync store at {self.host}:{self.port} is unreachable ({e}): "
                f"{SENDER} (weight-update rank 0, the sender) is gone"
            )
        self.gone = gone
        if not gone:
            return WeightGroupFailed(f"{what}; every other member is alive (a hung collective or a network fault?)")
        return PeerGone(f"{what}; gone (no heartbeat for {DIAGNOSE_S:g} s): {named(names, gone)}")

    def _peers(self) -> list[int]:
        """The ranks a failed transfer of this member may have waited for."""
        return [r for r in range(self.world_size) if r != self.rank]

    def _gone(self, store: dist.Store) -> list[int]:
        """Ranks whose heartbeat did not move over DIAGNOSE_S."""
        others = self._peers()

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
