"""The job's actor count as the pools read it (core/actor_count.py): world.actors until the
launcher writes a count, then the last count written since this launch; a count written before
the launch (an earlier launch of the run directory) does not count; `largest` keeps the bound
the preprocessors read up to while actors drain."""

from __future__ import annotations

import pytest

from pipeline_rl.core.actor_count import ActorCountWatch
from pipeline_rl.streams.jsonl_backend import JsonlStreams
from pipeline_rl.streams.records import ActorCount
from pipeline_rl.wire import LAUNCHED_AT_ENV, Topic


def write(streams: JsonlStreams, count: int, at: float) -> None:
    writer = streams.writer(Topic.ACTOR_COUNT)
    writer.write(ActorCount(count, at))
    writer.close()


def test_the_last_count_since_the_launch_holds(tmp_path, monkeypatch):
    streams = JsonlStreams(tmp_path)
    write(streams, 5, at=100.0)  # an earlier launch's
    monkeypatch.setenv(LAUNCHED_AT_ENV, "200.0")
    watch = ActorCountWatch(streams, initial=2)
    assert (watch.count, watch.largest, watch.scaled) == (2, 2, False)
    write(streams, 3, at=250.0)
    write(streams, 1, at=260.0)
    assert watch.read() == 1 and watch.largest == 3 and watch.scaled
    # Started later (a replacement, an added actor): the same answer from the start.
    later = ActorCountWatch(streams, initial=2)
    assert (later.count, later.largest) == (1, 3)
    streams.close()


def test_started_by_hand_every_count_holds(tmp_path, monkeypatch):
    monkeypatch.delenv(LAUNCHED_AT_ENV, raising=False)
    streams = JsonlStreams(tmp_path)
    write(streams, 4, at=1.0)
    assert ActorCountWatch(streams, initial=2).count == 4
    streams.close()


@pytest.mark.parametrize("every", [True, False])
def test_poll_reads_at_most_every_check_interval(tmp_path, monkeypatch, every):
    monkeypatch.delenv(LAUNCHED_AT_ENV, raising=False)
    streams = JsonlStreams(tmp_path)
    watch = ActorCountWatch(streams, initial=1)
    write(streams, 2, at=1.0)
    if every:
        monkeypatch.setattr("pipeline_rl.core.actor_count.CHECK_EVERY_S", 0.0)
        assert watch.poll() == 2
    else:
        watch._checked = float("inf")  # just read
        assert watch.poll() == 1 and watch.read() == 2
    streams.close()


def test_absent_actors_leave_the_step_to_those_present(tmp_path, monkeypatch):
    """An actor lost with no room to start again is absent: the count stays, the actors present
    share the steps (admission's count), at least the one asking; back, it counts again."""
    monkeypatch.delenv(LAUNCHED_AT_ENV, raising=False)
    streams = JsonlStreams(tmp_path)
    watch = ActorCountWatch(streams, initial=3)
    assert watch.present == 3 and watch.absent == frozenset()
    writer = streams.writer(Topic.ACTOR_COUNT)
    writer.write(ActorCount(3, 1.0, absent=[0]))
    writer.flush()
    assert watch.read() == 3 and watch.present == 2 and watch.absent == {0}
    writer.write(ActorCount(2, 2.0, absent=[0, 2]))  # scaled below an absent actor: it no longer counts
    writer.flush()
    assert watch.read() == 2 and watch.present == 1
    writer.write(ActorCount(1, 3.0, absent=[0]))
    writer.flush()
    assert watch.read() == 1 and watch.present == 1  # the actor asking is there
    writer.write(ActorCount(3, 4.0))
    writer.close()
    assert watch.read() == 3 and watch.present == 3 and watch.largest == 3
    streams.close()
