"""actor/weight_link.py: the trainer's version as an actor reads it from the sender's store (a real
TCPStore, as the sender keeps one), the engine's own version where no sender answers, and an
actor without a weight-update group."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist
from fixtures.helpers import free_port

from pipeline_rl.actor import weight_link
from pipeline_rl.actor.weight_link import WeightLink
from pipeline_rl.config import load_config
from pipeline_rl.wire import WEIGHT_SYNC_ADDR_ENV, Topic


class Engine:
    """The engine's side the link uses: its version and its receiver hooks, recorded."""

    def __init__(self, version: int):
        self.version = version
        self.receiver_args: tuple | None = None
        self.started: tuple | None = None

    def weight_receiver(self, *args):
        self.receiver_args = args
        return Receiver()

    def start_receiver(self, receiver, reader) -> None:
        self.started = (receiver, reader)


class Receiver:
    closed = False

    def close(self) -> None:
        self.closed = True


class Streams:
    def reader(self, topic, record_type):
        return (topic, record_type.__name__)


@pytest.fixture
def sender_store():
    """A store where the sender publishes its latest version, as WeightSender's is."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, is_master=True, timeout=timedelta(seconds=10))
    yield f"127.0.0.1:{port}", store


def test_without_a_group_the_actor_keeps_its_own_version(monkeypatch):
    monkeypatch.delenv(WEIGHT_SYNC_ADDR_ENV, raising=False)
    engine = Engine(version=4)
    link = WeightLink(load_config("tiny"), 0, engine, Streams(), largest=2)  # type: ignore[arg-type]
    assert engine.receiver_args is None and engine.started is None
    assert link.published_version() == 0
    assert link.trainer_version() == 4
    link.leave(2)  # nothing to leave
    link.close()


def test_the_trainers_version_is_the_senders_latest_or_the_engines_if_newer(monkeypatch, sender_store):
    addr, store = sender_store
    monkeypatch.setenv(WEIGHT_SYNC_ADDR_ENV, addr)
    engine = Engine(version=3)
    link = WeightLink(load_config("tiny"), 1, engine, Streams(), largest=2)  # type: ignore[arg-type]
    # Joined as actor 1 of at most 2, taking the versions announced on the weights stream.
    assert engine.receiver_args is not None and engine.receiver_args[:3] == (addr, 1, 2)
    assert engine.started is not None and engine.started[1] == (Topic.WEIGHTS, "WeightUpdate")
    assert link.published_version() == 0  # nothing published yet
    store.set("latest", "7")
    assert link.published_version() == 7
    assert link.trainer_version() == 7
    engine.version = 9  # swapped in before the store was read again
    assert link.trainer_version() == 9
    receiver = engine.started[0]
    link.close()
    assert receiver.closed


def test_a_sender_that_does_not_answer_leaves_the_engines_version(monkeypatch):
    monkeypatch.setenv(WEIGHT_SYNC_ADDR_ENV, f"127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setattr(weight_link, "TRAINER_VERSION_WAIT_S", 0.5)
    engine = Engine(version=5)
    link = WeightLink(load_config("tiny"), 0, engine, Streams(), largest=1)  # type: ignore[arg-type]
    assert link.trainer_version() == 5
