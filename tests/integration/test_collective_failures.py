"""A weight-update group whose peer is killed, on gloo with real processes: the survivors raise
PeerGone (a WeightGroupFailed) within world.collective_timeout_s (plus weight_sync.DIAGNOSE_S to hear from
the others) naming the dead member by process and rank; the group goes on without it and
takes its replacement back; a trainer whose receiver dies names it and trains on. And the wiring of the one timeout and NCCL's settings into the trainers' group (no GPU here; the settings themselves: tests/unit/test_collectives.py)."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from fixtures.helpers import free_port, wait_for
from fixtures.trainer_runs import make_steps, start_ranks, trainer_config, trainer_metrics, wait_all, write_steps
from fixtures.weight_peers import (
    CHURNING,
    HOLD_S,
    TIMEOUT_S,
    churning_receivers,
    hanging_sender,
    killed_receiver,
    receiver_main,
    stream_receiver,
    weights,
)

from pipeline_rl.collectives import nccl_env
from pipeline_rl.weight_sync import (
    DIAGNOSE_S,
    FROZEN_S,
    WAIT_SLICE_S,
    MemberFrozen,
    PeerGone,
    WeightGroupFailed,
    WeightReceiver,
    WeightSender,
    member_names,
)
from pipeline_rl.wire import WEIGHT_SYNC_ADDR_ENV

_SPAWN = multiprocessing.get_context("spawn")


def _start_receiver(addr: str, rank: int, world: int, queues: dict, results: dict):
    """A `receiver_main` process at `rank`, started and past its imports."""
    proc = _SPAWN.Process(target=receiver_main, args=(addr, rank, world, queues[rank], results[rank]), daemon=True)
    proc.start()
    assert results[rank].get(timeout=120) == (rank, 0, "ready")
    return proc


def test_member_names_follow_the_group_ranks():
    assert member_names(2, 1) == ["trainer0", "actor0", "actor1"]
    assert member_names(1, 2) == ["trainer0", "actor0 TP worker 0", "actor0 TP worker 1"]


def test_the_trainer_group_gets_the_one_timeout(monkeypatch, tmp_path):
    """deepspeed.init_distributed receives world.collective_timeout_s, after the NCCL settings
    are in the environment (they are read when a group is built)."""
    import deepspeed
    import torch.distributed as dist

    from pipeline_rl.config import load_config
    from pipeline_rl.trainer import trainer

    seen = {}

    def init_distributed(**kwargs):
        seen.update(kwargs, handling=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))

    monkeypatch.setattr(deepspeed, "init_distributed", init_distributed)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    for key in nccl_env(1):
        monkeypatch.delenv(key, raising=False)
    trainer._init_distributed(load_config("base", ["world.collective_timeout_s=1234"]))
    assert seen["timeout"] == timedelta(seconds=1234) and seen["handling"] == "2"


def test_the_sender_names_a_receiver_that_was_killed():
    addr = f"127.0.0.1:{free_port()}"
    world = 3
    sender = WeightSender(addr, world, "gloo", TIMEOUT_S, member_names(2, 1))
    queues = [_SPAWN.Queue() for _ in range(world)]
    # A queue per receiver: a process killed while its queue's feeder thread holds the queue's
    # write lock would block every other writer of that queue for good (this test once failed
    # so, the survivor done but its report stuck behind the dead process's lock).
    results = {rank: _SPAWN.Queue() for rank in (1, 2)}
    procs = [
        _SPAWN.Process(target=receiver_main, args=(addr, rank, world, queues[rank], results[rank]), daemon=True)
        for rank in (1, 2)
    ]
    for p in procs:
        p.start()
    try:

        def announce(update):
            for q in queues[1:]:
                q.put(update)

        # A spawned receiver imports torch first: on a busy machine that alone can take longer
        # than the timeout the first update would be held to.
        assert [results[rank].get(timeout=120) for rank in (1, 2)] == [(1, 0, "ready"), (2, 0, "ready")]
        sender.send(1, weights(1), announce, bucket_mb=1)
        assert [results[rank].get(timeout=30) for rank in (1, 2)] == [(1, 1, "ok"), (2, 1, "ok")]
        procs[1].kill()  # actor1, weight-update rank 2
        procs[1].join(10)
        started = time.monotonic()
        with pytest.raises(PeerGone) as failed:
            sender.send(2, weights(2), announce, bucket_mb=1)
        took = time.monotonic() - started
        message = str(failed.value)
        assert "gone (no heartbeat" in message and "actor1 (weight-update rank 2)" in message, message
        assert "actor0" not in message, message
        assert took < TIMEOUT_S + DIAGNOSE_S + 2, took
        # The survivor reported its end of update 2 (done, or failed with the group).
        assert results[1].get(timeout=TIMEOUT_S + DIAGNOSE_S + 5)[:2] == (1, 2)
    finally:
        for p in procs:
            p.kill()
        sender.close()


def test_the_group_goes_on_without_a_dead_receiver_and_takes_its_replacement_back():
    """After a member dies the next update goes to the survivors only; a replacement of the
    same rank registers when it reads an announcement (that update's group was formed without
    it: NotMember, nothing received), and the update after that reaches both."""
    addr = f"127.0.0.1:{free_port()}"
    world = 3
    sender = WeightSender(addr, world, "gloo", TIMEOUT_S, member_names(2, 1))
    queues = {rank: _SPAWN.Queue() for rank in (1, 2)}
    results = {rank: _SPAWN.Queue() for rank in (1, 2)}

    def start(rank: int):
        return _start_receiver(addr, rank, world, queues, results)

    procs = [start(1), start(2)]

    announced = []

    def announce(update):
        announced.append(update)
        for q in queues.values():
            q.put(update)

    def reports(version: int) -> dict[int, str]:
        return {rank: _report(results[rank], version) for rank in (1, 2)}

    try:
        sender.send(1, weights(1), announce, bucket_mb=1)
        assert reports(1) == {1: "ok", 2: "ok"}
        procs[1].kill()  # rank 2
        procs[1].join(10)
        with pytest.raises(PeerGone):
            sender.send(2, weights(2), announce, bucket_mb=1)
        _report(results[1], 2)  # the survivor's end of the failed update, whichever it was
        queues[2] = _SPAWN.Queue()  # the dead process's queue may be left locked
        results[2] = _SPAWN.Queue()

        sender.send(3, weights(3), announce, bucket_mb=1)
        assert sender.members == [0, 1]
        assert _report(results[1], 3) == "ok"

        procs.append(start(2))  # the replacement, at the same rank
        sender.send(4, weights(4), announce, bucket_mb=1)
        got = reports(4)
        # A group takes the receivers registered by the time it is formed: the replacement, if
        # it registered by then (under load it can), receives update 4; if not, it is told
        # NotMember and receives nothing.
        if sender.members == [0, 1]:
            assert got[1] == "ok" and got[2].startswith("NotMember"), got
        else:
            assert sender.members == [0, 1, 2] and got == {1: "ok", 2: "ok"}, (sender.members, got)

        sender.send(5, weights(5), announce, bucket_mb=1)
        assert sender.members == [0, 1, 2]
        assert reports(5) == {1: "ok", 2: "ok"}

        # Rank 2 dies between two updates (no transfer fails) and its replacement registers by
        # reading an announcement already made: the sender tells it from the member it replaces
        # (what a trainer waiting for that actor's groups asks before sending its weights again).
        procs[-1].kill()
        procs[-1].join(10)
        queues[2], results[2] = _SPAWN.Queue(), _SPAWN.Queue()
        assert not sender.has_joiners()
        procs.append(start(2))
        queues[2].put(announced[-1])  # update 5, of a group formed without it: registered all the same
        assert _report(results[2], 5).startswith("NotMember")
        assert sender.has_joiners()
        sender.send(6, weights(6), announce, bucket_mb=1)
        assert sender.members == [0, 1, 2]
        assert reports(6) == {1: "ok", 2: "ok"}
    finally:
        for p in procs:
            p.kill()
        sender.close()


def test_an_announcement_of_a_group_formed_again_since_is_over_for_every_receiver():
    """The race of a tensor-parallel actor's replacement, whose two workers (ranks 1 and 2)
    register as they read the announcements made before they started: rank 1 reads the last
    one (update 3, of a group formed without them) before the sender, seeing them registered,
    sends update 3 again to a group of both; rank 2 reads it after. That announcement is over
    for rank 2 as well: joining the new group with it, rank 2 would wait there for rank 1, which
    its actor gives the new group's announcement only once rank 2 has reported, and the sender
    for both, until the timeout. Both receive update 3 by the new announcement; a second
    delivery of that one is over at once."""
    addr = f"127.0.0.1:{free_port()}"
    sender = WeightSender(addr, 3, "gloo", TIMEOUT_S, member_names(1, 2))
    queues = {rank: _SPAWN.Queue() for rank in (1, 2)}
    results = {rank: _SPAWN.Queue() for rank in (1, 2)}

    def start(rank: int):
        return _start_receiver(addr, rank, 3, queues, results)

    announced: list = []

    def announce(update):
        announced.append(update)
        for q in queues.values():
            q.put(update)

    procs = [start(1), start(2)]
    try:
        sender.send(1, weights(1), announce, bucket_mb=1)
        assert [_report(results[rank], 1) for rank in (1, 2)] == ["ok", "ok"]
        for p in procs:  # the actor and its workers are gone
            p.kill()
            p.join(10)
        queues = {rank: _SPAWN.Queue() for rank in (1, 2)}
        results = {rank: _SPAWN.Queue() for rank in (1, 2)}
        with pytest.raises(PeerGone):
            sender.send(2, weights(2), announced.append, bucket_mb=1)
        sender.send(3, weights(3), announced.append, bucket_mb=1)
        assert sender.members == [0]  # nobody registered: announced only
        first, before = announced[0], announced[-1]

        procs += [start(1), start(2)]  # the replacement's workers read the announcements so far
        queues[2].put(first)
        assert _report(results[2], 1).startswith("StaleUpdate")  # registered, nothing received
        queues[1].put(before)
        assert _report(results[1], 3).startswith("NotMember")
        assert sender.has_joiners()
        again = threading.Thread(target=sender.send, args=(3, weights(3), announced.append, 1), daemon=True)
        again.start()
        while announced[-1] is before and again.is_alive():
            time.sleep(0.05)
        started = time.monotonic()
        queues[2].put(before)  # read after the group of both was named
        report = _report(results[2], 3)
        assert report.startswith("StaleUpdate") and time.monotonic() - started < TIMEOUT_S, report
        for q in queues.values():
            q.put(announced[-1])
        assert [_report(results[rank], 3) for rank in (1, 2)] == ["ok", "ok"]
        again.join(TIMEOUT_S)
        assert not again.is_alive() and sender.members == [0, 1, 2]
        queues[1].put(announced[-1])
        assert "received already" in _report(results[1], 3)
    finally:
        for p in procs:
            p.kill()
        sender.close()


def _two_receivers(timeout_s: float, sender_timeout_s: float | None = None):
    """A sender (of `sender_timeout_s`, by default `timeout_s`) and two receiver processes
    (actor0 and actor1, ranks 1 and 2) of `timeout_s`: (sender, processes by rank, result queues
    by rank, announce); announce(update, ranks) gives the update to those ranks only."""
    addr = f"127.0.0.1:{free_port()}"
    sender = WeightSender(addr, 3, "gloo", sender_timeout_s or timeout_s, member_names(2, 1))
    queues = {rank: _SPAWN.Queue() for rank in (1, 2)}
    results = {rank: _SPAWN.Queue() for rank in (1, 2)}
    procs = {
        rank: _SPAWN.Process(
            target=receiver_main, args=(addr, rank, 3, queues[rank], results[rank], timeout_s), daemon=True
        )
        for rank in (1, 2)
    }
    for p in procs.values():
        p.start()

    def announce(update, ranks=(1, 2)):
        for rank in ranks:
            queues[rank].put(update)

    return sender, procs, results, announce


def test_the_first_update_waits_only_for_the_actors_there():
    """A trainer started again after actor1 left the job (or while it is absent): its first
    update waits for actor0 alone, not for the whole timeout for a rank nobody will take."""
    timeout_s = 60.0
    addr = f"127.0.0.1:{free_port()}"
    sender = WeightSender(addr, 3, "gloo", timeout_s, member_names(2, 1))
    sender.expect([1])
    queues, results = {1: _SPAWN.Queue()}, {1: _SPAWN.Queue()}
    proc = _start_receiver(addr, 1, 3, queues, results)
    try:
        started = time.monotonic()
        sender.send(1, weights(1), lambda update: queues[1].put(update), bucket_mb=1)
        assert _report(results[1], 1) == "ok"
        assert sender.members == [0, 1]
        assert time.monotonic() - started < timeout_s / 2
    finally:
        proc.kill()
        sender.close()


def test_a_leaving_receiver_that_registers_again_is_still_left_out():
    """An actor scaled away leaves the group (leave_group: its registration withdrawn, then the
    wait for a group formed without it). A registration made again meanwhile, as a receiver
    whose transfer failed makes when it reconnects, is withdrawn again: the next group is formed
    without it and the leave ends there, instead of waiting for the whole timeout."""
    from pipeline_rl.weight_sync import leave_group
    from pipeline_rl.weight_sync.group import LEAVE_POLL_S, LEFT, ready_key

    sender, procs, results, announce = _two_receivers(TIMEOUT_S)
    addr = f"{sender.host}:{sender.port}"
    store = dist.TCPStore(sender.host, sender.port, None, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    left: list[bool] = []
    try:
        assert [results[rank].get(timeout=120) for rank in (1, 2)] == [(1, 0, "ready"), (2, 0, "ready")]
        sender.send(1, weights(1), announce, bucket_mb=1)
        assert [_report(results[rank], 1) for rank in (1, 2)] == ["ok", "ok"]
        token = store.get(ready_key(2))
        leaving = threading.Thread(target=lambda: left.append(leave_group(addr, [2], 60.0)))
        leaving.start()
        wait_for(lambda: store.get(ready_key(2)).decode() == LEFT, 10.0, "the withdrawal of the registration")
        store.set(ready_key(2), token)  # registered again
        wait_for(lambda: store.get(ready_key(2)).decode() == LEFT, 20 * LEAVE_POLL_S, "its second withdrawal")
        sender.send(2, weights(2), lambda update: announce(update, (1,)), bucket_mb=1)
        assert sender.members == [0, 1] and _report(results[1], 2) == "ok"
        leaving.join(10 * LEAVE_POLL_S)
        assert left == [True]
    finally:
        for proc in procs.values():
            proc.kill()
        sender.close()


def test_a_receiver_closed_after_leaving_does_not_register_again():
    """An actor that left the group stops while its update thread still holds announcements it
    has not taken: an announcement taken after the receiver closed is skipped without connecting
    to the sender's store, so the registration stays withdrawn and the sender forms no group with
    a receiver that is gone (one would wait for it until the transfer's timeout)."""
    from pipeline_rl.streams.records import WeightUpdate
    from pipeline_rl.weight_sync import StaleUpdate
    from pipeline_rl.weight_sync.group import LEFT, ready_key
    from pipeline_rl.weight_sync.receiver import withdraw

    addr = f"127.0.0.1:{free_port()}"
    sender = WeightSender(addr, 2, "gloo", TIMEOUT_S, member_names(1, 1))
    store = dist.TCPStore(sender.host, sender.port, None, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    receiver = WeightReceiver(addr, 1, 2, "gloo", TIMEOUT_S)
    try:
        receiver.publish("probe", "1")  # its first use of the store registers it
        assert store.get(ready_key(1)).decode() == receiver.token
        withdraw(store, [1])  # it left the group (leave_group)
        receiver.close()
        update = WeightUpdate(1, ["w0"], [[64, 64]], ["float32"], [1], "group1", "1")
        with pytest.raises(StaleUpdate, match="closed"):
            receiver.receive(update)
        assert store.get(ready_key(1)).decode() == LEFT
    finally:
        receiver.close()
        sender.close()


def test_a_frozen_receiver_is_given_up_and_the_group_goes_on_without_it():
    """A receiver that freezes (SIGSTOP: its sockets stay open, so gloo would wait for the whole
    timeout) while the sender broadcasts to it: the sender gives the transfer up once the
    receiver's heartbeat has stood still for FROZEN_S, long before the timeout, naming it and
    no other member; the next update goes to the others; woken, the receiver registers again and
    is back in the group. The update is large enough (64 MiB) that the kernel's socket buffers
    cannot take it whole for the frozen receiver."""
    import signal

    timeout_s = 120.0
    sender, procs, results, announce = _two_receivers(timeout_s)

    def large(seed: int) -> list[tuple[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        return [(f"w{i}", torch.randn(2048, 2048, generator=g)) for i in range(4)]

    try:
        assert [results[rank].get(timeout=120) for rank in (1, 2)] == [(1, 0, "ready"), (2, 0, "ready")]
        sender.send(1, large(1), announce, bucket_mb=16)
        assert [_report(results[rank], 1, timeout_s) for rank in (1, 2)] == ["ok", "ok"]
        os.kill(procs[2].pid, signal.SIGSTOP)  # actor1, weight-update rank 2
        started = time.monotonic()
        with pytest.raises(PeerGone) as failed:
            sender.send(2, large(2), announce, bucket_mb=16)
        took = time.monotonic() - started
        message = str(failed.value)
        assert isinstance(failed.value.__cause__, MemberFrozen), repr(failed.value.__cause__)
        assert "actor1 (weight-update rank 2)" in message and "actor0" not in message, message
        # Frozen for FROZEN_S, seen at the end of a slice, then DIAGNOSE_S to name it: far below
        # the timeout, which alone would have ended the transfer.
        assert took < FROZEN_S + 2 * WAIT_SLICE_S + DIAGNOSE_S + 5 < timeout_s, took
        _report(results[1], 2, timeout_s)  # the live receiver's end of update 2, whichever it was

        sender.send(3, large(3), announce, bucket_mb=16)
        assert sender.members == [0, 1]
        assert _report(results[1], 3, timeout_s) == "ok"

        os.kill(procs[2].pid, signal.SIGCONT)  # woken: it was only slow
        # It gives update 2 up (ABANDONED), and registers again on reading update 3.
        assert not _report(results[2], 2, timeout_s).startswith("ok")
        _report(results[2], 3, timeout_s)
        assert sender.has_joiners()
        sender.send(4, large(4), announce, bucket_mb=16)
        assert sender.members == [0, 1, 2]
        assert [_report(results[rank], 4, timeout_s) for rank in (1, 2)] == ["ok", "ok"]
    finally:
        for p in procs.values():
            p.kill()
        sender.close()


def test_a_group_is_not_held_up_by_a_member_that_died_after_it_registered():
    """Both receivers of a group die, one in a transfer (found gone, unregistered) and one after
    it (still registered, as a tensor-parallel actor's other worker is while vLLM stops it): the
    next group is formed with the second, which never connects. The sender gives that up once
    its heartbeat has stood still for FROZEN_S, naming it, instead of waiting for the timeout."""
    timeout_s = 120.0
    sender, procs, results, announce = _two_receivers(timeout_s)

    try:
        assert [results[rank].get(timeout=120) for rank in (1, 2)] == [(1, 0, "ready"), (2, 0, "ready")]
        sender.send(1, weights(1), announce, bucket_mb=1)
        assert [_report(results[rank], 1, timeout_s) for rank in (1, 2)] == ["ok", "ok"]
        time.sleep(2 * WAIT_SLICE_S)  # both have beaten since they connected
        procs[2].kill()
        procs[2].join(10)
        with pytest.raises(PeerGone):
            sender.send(2, weights(2), announce, bucket_mb=1)
        procs[1].kill()
        procs[1].join(10)
        started = time.monotonic()
        with pytest.raises(PeerGone) as failed:
            sender.send(3, weights(3), announce, bucket_mb=1)
        took = time.monotonic() - started
        assert sender.members == [0, 1]
        assert isinstance(failed.value.__cause__, MemberFrozen), repr(failed.value.__cause__)
        assert "actor0 (weight-update rank 1)" in str(failed.value), str(failed.value)
        assert took < FROZEN_S + 2 * WAIT_SLICE_S + DIAGNOSE_S + 5 < timeout_s, took
        sender.send(4, weights(4), announce, bucket_mb=1)  # no receiver left: announced only
        assert sender.members == [0]
    finally:
        for p in procs.values():
            p.kill()
        sender.close()


def test_a_receiver_building_a_group_whose_sender_failed_gives_it_up():
    """A member that died after connecting to the sender alone fails the sender's end of a new
    group at once, while another receiver, still building the group, would wait for it until its
    own timeout and hold the next group up as long. Here the member that never connects is a
    live receiver that is not given the announcement (its heartbeat beats: no member is taken
    for frozen), and the sender's timeout, shorter than the receivers', stands for its early
    failure. The sender names the group given up (ABANDONED); the building receiver gives it up
    at the end of its next wait slice."""
    sender_timeout_s, timeout_s = 5.0, 120.0
    sender, procs, results, announce = _two_receivers(timeout_s, sender_timeout_s)
    try:
        assert [results[rank].get(timeout=120) for rank in (1, 2)] == [(1, 0, "ready"), (2, 0, "ready")]
        sender.send(1, weights(1), announce, bucket_mb=1)
        assert [_report(results[rank], 1, timeout_s) for rank in (1, 2)] == ["ok", "ok"]
        started = time.monotonic()
        with pytest.raises(WeightGroupFailed) as failed:  # sent again: a new group of all three
            sender.send(1, weights(1), lambda update: announce(update, (1,)), bucket_mb=1)
        assert not isinstance(failed.value.__cause__, MemberFrozen), repr(failed.value.__cause__)
        # The sender's build times out, it sets ABANDONED, the receiver sees it at the end of a
        # slice and takes DIAGNOSE_S to name who is gone: far below the receiver's own timeout.
        bound = sender_timeout_s + WAIT_SLICE_S + DIAGNOSE_S + 5
        rank, version, report = results[1].get(timeout=bound - (time.monotonic() - started))
        assert (rank, version) == (1, 1) and "the sender gave group" in report, report
        assert time.monotonic() - started < bound < timeout_s
    finally:
        for p in procs.values():
            p.kill()
        sender.close()


def _report(results, version: int, timeout_s: float = TIMEOUT_S) -> str:
    """A receiver's report of `version` (earlier versions' reports are skipped)."""
    while True:
        _, got, report = results.get(timeout=timeout_s + DIAGNOSE_S + 30)
        if got == version:
            return report
        assert got < version, (got, version, report)


def test_a_receiver_names_the_sender_that_was_killed():
    addr = f"127.0.0.1:{free_port()}"
    announced = _SPAWN.Queue()
    proc = _SPAWN.Process(target=hanging_sender, args=(addr, announced), daemon=True)
    proc.start()
    receiver = WeightReceiver(addr, 1, 2, "gloo", TIMEOUT_S)
    try:
        update = announced.get(timeout=60)
        threading_error: list[BaseException] = []
        started = time.monotonic()

        def kill_soon():
            time.sleep(1.0)
            proc.kill()

        import threading

        killer = threading.Thread(target=kill_soon)
        killer.start()
        try:
            receiver.receive(update)
        except WeightGroupFailed as e:
            threading_error.append(e)
        killer.join()
        took = time.monotonic() - started
        assert threading_error, "the receive did not fail"
        assert isinstance(threading_error[0], PeerGone)
        message = str(threading_error[0])
        assert "trainer0 (weight-update rank 0" in message, message
        assert took < TIMEOUT_S + DIAGNOSE_S + 2, took
    finally:
        proc.kill()
        receiver.close()


@pytest.mark.deepspeed
def test_a_trainer_whose_receiver_dies_goes_on_without_it(tmp_path, tiny_model):
    """Real DeepSpeed rank 0 broadcasting to a receiver process that is killed after version 1:
    the trainer's next broadcast fails within the timeout and the diagnosis, its log names
    actor0, and it trains on (the launcher restarts the actor or stops the run), later versions
    announced to a group without the dead member; it ends with exit 0."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = trainer_config(run_dir, tiny_model, "shared.max_steps=4", f"world.collective_timeout_s={TIMEOUT_S}")
    write_steps(cfg, make_steps(tiny_model, 4, 2, seed=0), ranks=1)
    addr = f"127.0.0.1:{free_port()}"
    ready = _SPAWN.Queue()
    receiver = _SPAWN.Process(target=killed_receiver, args=(str(run_dir / "config.yaml"), addr, ready), daemon=True)
    receiver.start()
    # The trainer waits only the collective timeout for the receiver to join its first
    # broadcast: start it once the receiver is up (a loaded machine takes seconds to spawn one).
    assert ready.get(timeout=120) == "listening"
    procs = start_ranks(run_dir, 1, env={WEIGHT_SYNC_ADDR_ENV: addr})
    try:
        assert ready.get(timeout=120) == 1
        receiver.kill()
        wait_all(procs, run_dir, timeout=TIMEOUT_S + DIAGNOSE_S + 90)
    finally:
        receiver.kill()
        for p in procs:
            p.kill()
    log = (run_dir / "trainer0.log").read_text()
    assert "weight update 2 failed" in log and "actor0 (weight-update rank 1)" in log, log[-3000:]
    assert "re-forms at the next version" in log
    steps = trainer_metrics(run_dir)
    published = {r["version"]: r for r in steps if "weight_update_failed_total" in r}
    assert sorted(published) == [1, 2, 3, 4], published
    assert published[1]["weight_update_members"] == 1 and published[1]["weight_update_failed_total"] == 0
    assert "weight_update_members" not in published[2] and published[2]["weight_update_failed_total"] == 1
    assert all(published[v]["weight_update_members"] == 0 for v in (3, 4)), published


def _without_frozen_check() -> None:
    """In a trainer rank: never take a member for frozen by its heartbeat, as if no heartbeat
    reached the sender: only the transfer's timeout ends a wait for a frozen receiver."""
    from pipeline_rl.weight_sync import sender

    sender.FROZEN_S = float("inf")


@pytest.mark.deepspeed
def test_a_frozen_receiver_costs_one_update_not_the_zero3_trainer_pool(tmp_path):
    """Two ZeRO-3 trainer ranks broadcast to two receivers; one stops itself (SIGSTOP) after
    version 1. With the heartbeat check off, rank 0's wait for it ends only at the transfer's
    timeout (half the collective timeout), while rank 1 waits for rank 0 in the next bucket's
    gather, a collective of the collective timeout: both ranks survive, the update fails naming
    the frozen actor within the bound, and the later updates go to the other receiver. The model
    (4 layers of width 384, 38 MB in float32) is larger than the kernel's socket buffers can take
    for the frozen receiver, so the broadcast does wait for it."""
    import re
    import signal

    from transformers import Qwen2ForCausalLM

    from pipeline_rl.demo.tiny_model import qwen2_config
    from pipeline_rl.weight_sync import transfer_timeout_s

    model = tmp_path / "model"
    torch.manual_seed(0)
    Qwen2ForCausalLM(qwen2_config(97, hidden=384, layers=4, heads=6, kv_heads=6)).save_pretrained(model)
    collective_s = 24.0
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = trainer_config(
        run_dir,
        model,
        "shared.max_steps=4",
        "trainer.zero_stage=3",
        "world.trainers=2",
        "world.actors=2",
        f"world.collective_timeout_s={collective_s}",
    )
    write_steps(cfg, make_steps(model, 4, 2, seed=0), ranks=2)
    addr = f"127.0.0.1:{free_port()}"
    ready = _SPAWN.Queue()
    receivers = [
        _SPAWN.Process(
            target=stream_receiver,
            args=(str(run_dir / "config.yaml"), addr, rank, 3, ready, 1 if rank == 2 else None),
            daemon=True,
        )
        for rank in (1, 2)
    ]
    for p in receivers:
        p.start()
    assert sorted(ready.get(timeout=120) for _ in receivers) == [(1, "listening"), (2, "listening")]
    procs = start_ranks(run_dir, 2, before_main=_without_frozen_check, env={WEIGHT_SYNC_ADDR_ENV: addr})
    try:
        wait_all(procs, run_dir, timeout=collective_s + 120)
    finally:
        for p in procs:
            p.kill()
        for p in receivers:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
    log = (run_dir / "trainer0.log").read_text()
    failed = re.search(r"weight update 2 failed after ([\d.]+) s", log)
    assert failed is not None and "actor1 (weight-update rank 2)" in log, log[-3000:]
    bound = transfer_timeout_s(collective_s)
    # The transfer's wait ends at its timeout, seen at the end of a slice; DIAGNOSE_S names the member.
    assert bound <= float(failed.group(1)) < bound + 2 * WAIT_SLICE_S + 1, failed.group(0)
    assert bound + DIAGNOSE_S < collective_s  # what keeps rank 1's gather from timing out
    published = {r["version"]: r for r in trainer_metrics(run_dir) if "weight_update_failed_total" in r}
    assert sorted(published) == [1, 2, 3, 4], published
    assert published[1]["weight_update_members"] == 2
    assert "weight_update_members" not in published[2] and published[2]["weight_update_failed_total"] == 1
    assert all(published[v]["weight_update_members"] == 1 for v in (3, 4)), published


def test_reading_the_registrations_is_not_held_up_by_a_receiver_leaving_meanwhile():
    """The trainer reads the registrations (has_joiners, whenever it waits for data) while an
    actor scaled away withdraws its own (leave_group): a registration seen present is still
    readable a round trip later, so no read waits for a key (a store read of a missing key waits
    until it is set: for an actor that left, the whole timeout, and the trainer stalls)."""
    addr = f"127.0.0.1:{free_port()}"
    sender = WeightSender(addr, CHURNING + 1, "gloo", TIMEOUT_S, member_names(CHURNING, 1))
    sender.expect([])
    sender.send(1, weights(1), lambda update: None, bucket_mb=1)  # formed, with no receiver
    ready, done = _SPAWN.Event(), _SPAWN.Event()
    proc = _SPAWN.Process(target=churning_receivers, args=(addr, ready, done), daemon=True)
    proc.start()
    slowest, reads = 0.0, 0
    try:
        assert ready.wait(120), "the churning receivers did not start"
        until = time.monotonic() + 8 * HOLD_S  # 8 withdrawals: a read waits on one with p ~ 1 - 2**-8
        while time.monotonic() < until:
            started = time.monotonic()
            assert sender.has_joiners()  # registered since the group was formed
            slowest, reads = max(slowest, time.monotonic() - started), reads + 1
    finally:
        done.set()
        proc.join(TIMEOUT_S)
        proc.kill()
        sender.close()
    assert reads > 100, reads
    assert slowest < HOLD_S / 2, slowest  # a read of a withdrawn key waits until it is set again
