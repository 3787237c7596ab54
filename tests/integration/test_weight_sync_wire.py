"""WeightSender/WeightReceiver on gloo, sender and receiver in one process (the receiver in a
thread), no engine: what is kept between updates (layout, buffers, views, the announcement's
lists) and when it is let go, packed runs sent from a flat source without a copy, messages in
flight per bucket, stale announcements and a group rebuilt after a failure."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from fixtures.helpers import free_port, record_messages

from pipeline_rl.weight_sync import StaleUpdate, WeightReceiver, WeightSender

TIMEOUT_S = 10.0


@pytest.fixture
def ends():
    addr = f"127.0.0.1:{free_port()}"
    sender = WeightSender(addr, world_size=2, backend="gloo", timeout_s=TIMEOUT_S)
    receiver = WeightReceiver(addr, rank=1, world_size=2, backend="gloo", timeout_s=TIMEOUT_S)
    yield sender, receiver
    receiver.close()
    sender.close()


def transfer(sender, receiver, version, named, bucket_mb=1, **kw):
    """One update, the receiver in a thread started by the announcement; returns the received
    pairs cloned (they are views valid until the next receive) and the announcement."""
    announced, got, errors = [], [], []

    def receive():
        try:
            got.append([(n, t.clone()) for n, t in receiver.receive(announced[0])])
        except Exception as e:
            errors.append(e)

    thread = threading.Thread(target=receive)
    try:
        sender.send(version, named, lambda u: (announced.append(u), thread.start()), bucket_mb=bucket_mb, **kw)
    finally:
        if announced:
            thread.join(TIMEOUT_S)
            assert not thread.is_alive(), "the receiver is still receiving"
    if errors:
        raise errors[0]
    return got[0], announced[0]


def assert_exact(got, named):
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, received), (_, sent) in zip(got, named):
        assert received.dtype == sent.dtype and received.shape == sent.shape and torch.equal(received, sent)


def weights(seed: int, hidden: int = 32) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed", torch.randn(50, hidden, generator=g)),
        ("norm", torch.randn(hidden, generator=g)),
        ("big", torch.randn(600, 600, generator=g)),  # >= 1 MiB: a message of its own
        ("bias", torch.randn(3, generator=g)),  # 12 bytes: padded to 64 in the layout
        ("proj", torch.randn(hidden, 16, generator=g)),
    ]


def test_consecutive_updates_with_different_values_each_arrive_exactly_in_kept_buffers(ends):
    sender, receiver = ends
    first, _ = transfer(sender, receiver, 1, weights(1))
    assert_exact(first, weights(1))
    layout, buffer, views = receiver._layout, receiver._buffer, receiver._views
    sender_layout, pack = sender._layout, sender._pack
    second, _ = transfer(sender, receiver, 2, weights(2))
    assert_exact(second, weights(2))
    assert not torch.equal(first[0][1], second[0][1])
    # The same layout: nothing was computed or allocated again on either end.
    assert receiver._layout is layout and receiver._buffer is buffer and receiver._views is views
    assert sender._layout is sender_layout and sender._pack is pack and pack is not None
    # The views returned are the kept ones, into the one receive buffer.
    assert buffer is not None
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    assert all(start <= t.data_ptr() <= end for t in views)


def test_a_changed_layout_is_computed_again_and_arrives_exactly(ends):
    """The kept layout is let go when the announced shapes (or dtypes, or buckets) change, on
    both ends, and the new one is kept in turn; going back to the first shapes works too."""
    sender, receiver = ends
    got, _ = transfer(sender, receiver, 1, weights(1))
    assert_exact(got, weights(1))
    layout = receiver._layout

    wider = weights(2, hidden=40)  # every shape but big's changes
    got, _ = transfer(sender, receiver, 2, wider)
    assert_exact(got, wider)
    assert receiver._layout is not layout and sender._layout is not None
    assert receiver._buffer is not None and receiver._layout is not None
    assert receiver._buffer.numel() == receiver._layout.total_bytes

    retyped = [(n, t.double()) if n == "norm" else (n, t) for n, t in weights(3, hidden=40)]
    got, _ = transfer(sender, receiver, 3, retyped)
    assert_exact(got, retyped)
    assert receiver._layout.dtype_names[1] == "float64"

    rebucketed = weights(4, hidden=40)  # the same tensors in other buckets
    got, update = transfer(sender, receiver, 4, rebucketed, bucket_mb=2)
    assert_exact(got, rebucketed)
    assert receiver._layout.bucket_sizes == update.bucket_sizes

    got, _ = transfer(sender, receiver, 5, weights(5))
    assert_exact(got, weights(5))


def test_the_announcement_is_kept_while_the_specs_stay_the_same(ends):
    sender, receiver = ends
    _, first = transfer(sender, receiver, 1, weights(1))
    _, second = transfer(sender, receiver, 2, weights(2))
    assert second.version == 2 and second.shapes is first.shapes and second.names is first.names
    _, third = transfer(sender, receiver, 3, weights(3, hidden=40))
    assert third.shapes is not first.shapes and third.shapes[0] == [50, 40]


def flat_source(named):
    """The tensors as views of one flat buffer, back to back (DeepSpeed ZeRO-1/2's layout)."""
    flat = torch.cat([t.reshape(-1) for _, t in named])
    out, at = [], 0
    for n, t in named:
        out.append((n, flat[at : at + t.numel()].view(t.shape)))
        at += t.numel()
    return flat, out


def recording(sender):
    """Record the first byte of every buffer the sender broadcasts."""
    sent: list[int] = []
    start = sender._start
    sender._start = lambda buffer: (sent.append(buffer.data_ptr()), start(buffer))[1]
    return sent


def test_a_flat_source_is_sent_without_packing(ends):
    """Packed runs of tensors that lie back to back in one storage as the message has them go
    from that storage; a run that needs padding (a tensor of 12 bytes), or any run of separate
    tensors, is packed into the pack area. Every update arrives exactly."""
    sender, receiver = ends
    sent = recording(sender)
    aligned = [(n, t) for n, t in weights(1) if n != "bias"]  # every size a multiple of 64 bytes
    flat, named = flat_source(aligned)
    got, _ = transfer(sender, receiver, 1, named)
    assert_exact(got, named)
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * 4
    assert sent and all(lo <= p < hi for p in sent)  # the packed runs and "big", from `flat`
    assert sender._pack is None  # nothing to pack: no pack area

    sent.clear()
    flat, named = flat_source(weights(2))  # "bias" (12 bytes) breaks the run it is in
    got, _ = transfer(sender, receiver, 2, named)
    assert_exact(got, named)
    pack = sender._pack
    assert pack is not None and any(pack.data_ptr() <= p < pack.data_ptr() + pack.numel() for p in sent)

    sent.clear()
    got, _ = transfer(sender, receiver, 3, weights(3))  # separate tensors: packed
    assert_exact(got, weights(3))
    assert sum(pack.data_ptr() <= p < pack.data_ptr() + pack.numel() for p in sent) == 2


def test_a_bucket_is_all_in_flight_and_done_before_the_next_bucket_is_taken(ends):
    """Within a bucket every message starts before any is waited for; the next bucket's first
    tensor is taken only after all are done."""
    sender, receiver = ends
    g = torch.Generator().manual_seed(0)
    named = [
        ("a", torch.randn(100, generator=g)),
        ("big", torch.randn(300, 1000, generator=g)),  # 1.2 MB
        ("b", torch.randn(100, generator=g)),
        ("c", torch.randn(230_000, generator=g)),  # 920 kB: packed, and the next bucket (2 MiB)
        ("big2", torch.randn(270_000, generator=g)),  # 1.08 MB
    ]
    events: list[str] = []
    record_messages(sender, events, lambda buffer: (buffer.numel(), "send"))

    def generate():
        for name, t in named:
            events.append(f"take {name}")
            yield name, t

    specs = [(n, list(t.shape), t.dtype) for n, t in named]
    got, update = transfer(sender, receiver, 1, generate(), bucket_mb=2, specs=specs)
    assert_exact(got, named)
    assert update.bucket_sizes == [3, 2]
    big, c, big2 = 300 * 1000 * 4, 230_000 * 4, 270_000 * 4
    assert events == [
        *["take a", "send 400", "take big", f"send {big}", "take b", "send 400"],
        *["done 400", f"done {big}", "done 400"],
        *["take c", f"send {c}", "take big2", f"send {big2}", f"done {c}", f"done {big2}"],
    ], events


def test_a_stale_announcement_is_skipped_without_taking_part(ends):
    sender, receiver = ends
    _, first = transfer(sender, receiver, 1, weights(1))
    got, _ = transfer(sender, receiver, 2, weights(2))
    with pytest.raises(StaleUpdate, match="older than the sender's latest 2"):
        receiver.receive(first)
    # The receiver is still in step: the next update arrives, into the same buffer.
    got, _ = transfer(sender, receiver, 3, weights(3))
    assert_exact(got, weights(3))


def test_a_newer_update_of_the_receivers_group_needs_no_store_round_trip(ends):
    """The sender takes each broadcast of a group to its end with every member, so an
    announcement of the receiver's group newer than the last it received there is current:
    only joining, and an announcement already received (re-delivered), ask the store."""
    sender, receiver = ends
    asked = []
    store_get = receiver._store_get
    receiver._store_get = lambda keys: (asked.append(keys), store_get(keys))[1]
    _, first = transfer(sender, receiver, 1, weights(1))
    assert len(asked) == 1 and first.group == receiver._group_name
    for version in (2, 3):
        got, update = transfer(sender, receiver, version, weights(version))
        assert_exact(got, weights(version))
        assert update.group == first.group
    assert len(asked) == 1
    with pytest.raises(StaleUpdate, match="older than the sender's latest 3"):
        receiver.receive(first)
    assert len(asked) == 2


def test_after_a_failed_update_both_ends_rebuild_the_group(ends):
    """The sender fails after announcing (its first message never starts): it drops the group,
    the receiver's pending messages fail, and the next update goes through a new group on
    both ends, exactly."""
    sender, receiver = ends
    got, _ = transfer(sender, receiver, 1, weights(1))
    group_name = receiver._group_name
    start = sender._start

    def fail(buffer):
        raise RuntimeError("the sender failed")

    sender._start = fail
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="the sender failed"):
        transfer(sender, receiver, 2, weights(2))
    assert sender._group is None
    # The receiver's messages failed as soon as the sender let go of the group, not at the timeout.
    assert time.monotonic() - started < TIMEOUT_S / 2
    sender._start = start
    got, _ = transfer(sender, receiver, 3, weights(3))
    assert_exact(got, weights(3))
    assert receiver._group_name != group_name and receiver._group_name == sender._group_name


def test_a_receiver_keeps_two_buckets_of_messages_started(ends):
    """Bucket b + 2's messages start once bucket b's are done (with NCCL a collective's timeout
    runs from its start: no message waits behind more than two buckets)."""
    sender, receiver = ends
    g = torch.Generator().manual_seed(0)
    named = [(f"w{i}", torch.randn(150_000, generator=g)) for i in range(4)]  # 600 kB: one per 1 MiB bucket
    events: list[str] = []
    record_messages(receiver, events, lambda buffer: (sum(e.startswith("start") for e in events), "start"))

    got, update = transfer(sender, receiver, 1, named, bucket_mb=1)
    assert_exact(got, named)
    assert update.bucket_sizes == [1, 1, 1, 1]
    assert events == ["start 0", "start 1", "done 0", "start 2", "done 1", "start 3", "done 2", "done 3"], events


def test_a_bucket_found_flat_goes_as_one_message_from_the_next_update_on(ends):
    """The plan: a bucket whose tensors all lay flat in the last update (views of one buffer,
    as ZeRO-1/2 parameters are) is one message from then on, on both ends; when the source
    stops being flat, that bucket is packed whole once (exact still) and the plan goes back."""
    sender, receiver = ends
    g = torch.Generator().manual_seed(0)
    shapes = [("a", 128), ("big", 300 * 1024), ("b", 48), ("c", 16), ("big2", 270_016)]  # sizes: multiples of 64 B

    def named(seed):
        g.manual_seed(seed)
        return [(n, torch.randn(k, generator=g)) for n, k in shapes]

    sent = recording(sender)
    flat, source = flat_source(named(1))
    got, _ = transfer(sender, receiver, 1, source, bucket_mb=8)  # one bucket: a, big, [b, c], big2
    assert_exact(got, source)
    assert len(sent) == 4 and sender._plan == "1" and receiver._layout is not None and receiver._layout.plan == ""

    buffer = receiver._buffer
    sent.clear()
    flat, source = flat_source(named(2))
    got, _ = transfer(sender, receiver, 2, source, bucket_mb=8)
    assert_exact(got, source)
    assert sent == [flat.data_ptr()] and receiver._layout.plan == "1" and sender._pack is None
    assert receiver._buffer is buffer  # another plan, the same bytes: the buffer is kept

    sent.clear()
    separate = named(3)  # planned whole, not flat: packed whole, into a pack area of the bucket
    got, _ = transfer(sender, receiver, 3, separate, bucket_mb=8)
    assert_exact(got, separate)
    assert sender._pack is not None and sent == [sender._pack.data_ptr()] and sender._plan == ""

    sent.clear()
    got, _ = transfer(sender, receiver, 4, named(4), bucket_mb=8)
    assert_exact(got, named(4))
    assert len(sent) == 4 and receiver._layout.plan == ""


def test_a_plan_newer_than_the_announcement_makes_it_stale(ends):
    """ "plan" is set before its update's announcement: a plan of a later version than the
    announcement read means that transfer is over."""
    sender, receiver = ends
    _, first = transfer(sender, receiver, 1, weights(1))
    assert sender._store is not None
    sender._store.set("plan", "2:")
    with pytest.raises(StaleUpdate, match="older than the sender's latest 2"):
        receiver.receive(first)
