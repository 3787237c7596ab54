"""A killed actor's saved groups in flight against a real redis-server whose actor stream the
preprocessor trims as it consumes (streams/redis_backend.py `trim_below`): a saved group that
landed after the save and was trimmed must not be continued, or it would be trained twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline_rl.actor.in_flight import InFlight, SavedCall, SavedGroup
from pipeline_rl.actor.in_flight_keeper import InFlightKeeper
from pipeline_rl.actor.partition import Partition
from pipeline_rl.actor.resume import SavedCounts
from pipeline_rl.config import load_config
from pipeline_rl.streams import open_streams
from pipeline_rl.streams.records import Rollout, RolloutGroup
from pipeline_rl.wire import Topic

pytestmark = pytest.mark.redis


def group(gid: str) -> RolloutGroup:
    rollout = Rollout(
        prompt_ids=[1], completion_ids=[2], logprobs=[-0.5], versions=[0], reward=1.0, finish_reason="stop"
    )
    return RolloutGroup(problem_id="p", group_id=gid, rollouts=[rollout], actor=0)


def saved_group(gid: str) -> SavedGroup:
    return SavedGroup(gid, {"q": gid}, [SavedCall([1, 2], 1, [None])])


@pytest.fixture
def streams(tmp_path: Path, redis_server):
    cfg = load_config(
        "base",
        [f"run_dir={tmp_path / 'run'}", "streams.backend=redis", f"streams.redis.port={redis_server.port}"],
    )
    s = open_streams(cfg)
    yield s
    s.close()


def test_an_entry_dropped_after_a_position_is_told_from_one_kept(streams):
    """trimmed_after is exact where nothing or everything after the position went, and counts the
    first kept entry past it as a gap (whether a dropped entry came after it is not recorded)."""
    writer = streams.writer(Topic.ACTOR, partitions=1)
    assert not streams.trimmed_after(Topic.ACTOR, 0, None)  # no stream yet
    for i in range(5):
        writer.write(group(f"g{i}"), partition=0)
    writer.flush()
    positions = []  # after each of g0..g4
    reader = streams.reader(Topic.ACTOR, RolloutGroup, partitions=(0,))
    for _ in range(5):
        reader.read(timeout=0.0, max_count=1)
        positions.append(reader.position()[0])
    assert not any(streams.trimmed_after(Topic.ACTOR, 0, p) for p in [None, *positions])
    streams.trim_below(Topic.ACTOR, {0: positions[1]})  # g0 dropped, g1 (the reader's last) kept
    assert streams.trimmed_after(Topic.ACTOR, 0, None)
    assert not streams.trimmed_after(Topic.ACTOR, 0, positions[1])
    assert not streams.trimmed_after(Topic.ACTOR, 0, positions[3])
    streams.trim_below(Topic.ACTOR, {0: positions[4]})  # g2 and g3 dropped
    assert streams.trimmed_after(Topic.ACTOR, 0, positions[1])
    assert not streams.trimmed_after(Topic.ACTOR, 0, positions[4])


def test_a_saved_group_that_landed_and_was_trimmed_is_not_continued(tmp_path: Path, streams):
    """The actor saves g3 and g4 in flight after g0..g2 landed; g3, g5 and g6 land, the
    preprocessor consumes through g6 and trims below it (g3 and g5 go), and the actor is killed.
    Restarted, it sees only g6 after the save: it must not take g3 for a group that never landed."""
    position_file = tmp_path / "positions" / "actor0.json"
    actor = Partition(streams, 0, position_file)
    for i in range(3):
        actor.write(group(f"g{i}"))
    keeper = InFlightKeeper(tmp_path / "run", "actor0", None, continuable=True, save_every_s=10)
    keeper.dir.mkdir(parents=True)
    InFlight([saved_group("g3"), saved_group("g4")], actor.flushed_end()).save(keeper.path)
    actor.save(SavedCounts(written=3, problems=5, in_flight=2, actors=1))
    for gid in ("g3", "g5", "g6"):
        actor.write(group(gid))
    actor.flushed_end()
    consumer = streams.reader(Topic.ACTOR, RolloutGroup, partitions=(0,))
    taken = []
    while entries := consumer.read(timeout=0.0, max_count=10):
        taken += [e.record.group_id for e in entries]
    assert taken == ["g0", "g1", "g2", "g3", "g5", "g6"]
    # Untrimmed, the saved groups seen after the save are told apart from the others: g4 goes on.
    assert [g.group_id for g in keeper.saved(actor.landed_since, actor.trimmed_after)] == ["g4"]
    streams.trim_below(Topic.ACTOR, consumer.position())

    restarted = Partition(streams, 0, position_file)
    assert restarted.landed_since(restarted.saved().stream_end) == ["g6"]
    assert keeper.saved(restarted.landed_since, restarted.trimmed_after) == []
    # Not told of the trim, it would continue g3 as well: a group trained twice.
    assert [g.group_id for g in keeper.saved(restarted.landed_since, lambda end: False)] == ["g3", "g4"]
