"""An actor's partition and position file (actor/partition.py) on real JSONL streams, and its
running totals (actor/totals.py)."""

from __future__ import annotations

from pathlib import Path

from pipeline_rl.actor.partition import Partition
from pipeline_rl.actor.resume import SavedCounts
from pipeline_rl.actor.totals import Totals
from pipeline_rl.streams.jsonl_backend import JsonlStreams
from pipeline_rl.streams.records import Rollout, RolloutGroup


def group(gid: str) -> RolloutGroup:
    rollout = Rollout(
        prompt_ids=[1], completion_ids=[2], logprobs=[-0.5], versions=[0], reward=1.0, finish_reason="stop"
    )
    return RolloutGroup(problem_id="p", group_id=gid, rollouts=[rollout], actor=1)


def partition(tmp_path: Path) -> Partition:
    return Partition(JsonlStreams(tmp_path / "streams"), 1, tmp_path / "positions" / "actor1.json")


def test_a_killed_actors_groups_after_its_last_save_are_found_from_the_saved_end(tmp_path: Path):
    first = partition(tmp_path)
    assert not first.saved().was_saved and first.landed_since(None) == []
    for i in range(3):
        first.write(group(f"g{i}"))
    first.save(SavedCounts(written=3, problems=3, actors=2))
    # Written and flushed after the save, then the actor is killed before it saves again.
    for i in range(3, 5):
        first.write(group(f"g{i}"))
    first.flushed_end()

    again = partition(tmp_path)
    saved = again.saved()
    assert saved.written == 3 and saved.stream_end is not None
    assert again.landed_since(saved.stream_end) == ["g3", "g4"]
    assert again.landed_since(None) == [f"g{i}" for i in range(5)]
    # Before it writes, the restarted actor's end is the end it found; after, the writer's.
    assert again.end() == first.end()
    again.write(group("g5"))
    again.save(SavedCounts(written=6, problems=6, actors=2))
    assert partition(tmp_path).landed_since(again.saved().stream_end) == []


def test_a_save_counts_only_groups_in_the_stream_never_buffered_ones(tmp_path: Path):
    p = partition(tmp_path)
    p.write(group("a"))  # possibly still in the writer's buffer
    p.save(SavedCounts(written=1, problems=1, actors=1))
    assert partition(tmp_path).landed_since(None) == ["a"]
    assert partition(tmp_path).landed_since(p.saved().stream_end) == []


def test_the_totals_count_failures_in_a_row_and_every_lost_group_once():
    t = Totals(lost_reported=2, lost_stopped=1)
    for _ in range(3):
        t.rollout_failed(ValueError("bad"))
    assert t.consecutive_failures == 3 and t.last_rollout_error == "ValueError: bad"
    t.group_written(["no answer", "timeout"])
    assert t.consecutive_failures == 0 and t.written == 1 and t.reward_errors == 2
    t.lost_by_cause["scorer"] += 2
    t.lost_continuation = 1
    values = t.values()
    # Reported (2), rollouts that raised (3), stopped (1) and continuation (1).
    assert values["groups_lost_total"] == 7 and values["groups_lost/rollout_total"] == 3
    assert values["groups_lost/scorer_total"] == 2 and values["last_reward_error"] == "timeout"
