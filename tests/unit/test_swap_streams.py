"""The CPU twin of the TP = 1 swap's CUDA ordering (engine/swap_streams.py): torch.cuda's streams,
events and stream contexts replaced by recorders, the order of what a receive, a load and the
next receive queue where, and that nothing waits on the host. The same code on a GPU:
scripts/gpu_swap_check.py --concurrent."""

from __future__ import annotations

import contextlib

import pytest
import torch

from pipeline_rl.engine.swap_streams import SwapStreams


class Recorder:
    def __init__(self):
        self.log: list[tuple] = []
        self.current = "engine"


class FakeStream:
    def __init__(self, rec: Recorder, name: str):
        self.rec, self.name = rec, name

    def wait_event(self, event):
        self.rec.log.append(("wait", self.name, event.name))


class FakeEvent:
    count = 0

    def __init__(self, rec: Recorder):
        FakeEvent.count += 1
        self.rec, self.name = rec, f"event{FakeEvent.count}"

    def record(self, stream):
        self.rec.log.append(("record", stream.name, self.name))


@pytest.fixture
def fake_cuda(monkeypatch):
    rec = Recorder()
    streams = {"engine": FakeStream(rec, "engine")}

    def new_stream(device=None):
        streams.setdefault("receive", FakeStream(rec, "receive"))
        return streams["receive"]

    @contextlib.contextmanager
    def use(stream):
        before, rec.current = rec.current, stream.name
        yield
        rec.current = before

    def forbidden(*args, **kwargs):
        raise AssertionError("a swap must not wait on the host")

    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda: FakeEvent(rec))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams[rec.current])
    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    return rec


def test_receive_on_its_own_stream_load_on_the_engines_in_order(fake_cuda):
    rec = fake_cuda
    s = SwapStreams(torch.device("cuda", 0))
    s.note_engine_stream()  # a forward pass, in the engine thread
    rec.log.append(("forward", rec.current))
    with s.receiving():
        rec.log.append(("messages", rec.current))  # NCCL's waits land on the current stream
    rec.log.append(("forward", rec.current))  # the engine goes on meanwhile, on its own stream
    with s.loading():
        rec.log.append(("copies", rec.current))
    with s.receiving():
        rec.log.append(("messages", rec.current))
    assert rec.log == [
        ("forward", "engine"),
        ("messages", "receive"),
        ("record", "receive", "event1"),  # the update is all in
        ("forward", "engine"),
        ("wait", "engine", "event1"),  # the copies wait for the receive...
        ("copies", "engine"),  # ...and are queued behind the pass in flight, before the next
        ("record", "engine", "event2"),
        ("wait", "receive", "event2"),  # the buffers are written again only after the copies
        ("messages", "receive"),
        ("record", "receive", "event3"),
    ]


def test_the_load_goes_on_the_stream_of_the_latest_forward_pass(fake_cuda):
    rec = fake_cuda
    s = SwapStreams(torch.device("cuda", 0))
    rec.current = "receive"  # not the engine thread: a load before any pass has no engine stream
    with s.loading():
        rec.log.append(("copies", rec.current))
    assert rec.log[0] == ("copies", "receive")
    rec.current = "engine"
    s.note_engine_stream()
    rec.current = "receive"
    with s.loading():
        rec.log.append(("copies", rec.current))
    assert rec.log[-2] == ("copies", "engine")


def test_on_cpu_nothing_is_queued(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: pytest.fail("no streams on CPU"))
    s = SwapStreams(torch.device("cpu"))
    s.note_engine_stream()
    with s.receiving(), s.loading():
        pass
    assert s.engine is None and s.received is None and s.loaded is None


def test_a_tp1_receiver_stages_on_the_receive_stream_before_its_event(fake_cuda):
    """Staging makes device work of its own (a LoRA update is packed and copied on the device):
    it is queued on the receive stream, before the event the load waits for."""
    from types import SimpleNamespace

    from pipeline_rl.engine.vllm_hook import LocalReceiver, Staged

    rec = fake_cuda

    def stage(tensors, ticket, update=None):
        rec.log.append(("stage", rec.current))
        return Staged(ticket)

    def receive(update):
        rec.log.append(("messages", rec.current))
        return []

    hook = SimpleNamespace(streams=SwapStreams(torch.device("cuda", 0)), stage=stage)
    LocalReceiver(hook, SimpleNamespace(receive=receive)).receive(SimpleNamespace(version=1))  # pyright: ignore[reportArgumentType]
    assert rec.log[:2] == [("messages", "receive"), ("stage", "receive")]
    assert rec.log[2][:2] == ("record", "receive") and len(rec.log) == 3
