"""A running job scaled on one node (launch/scaling.py): `--actors 2` adds an actor that
generates on the current weights; `--actors 1` then drains it (its groups in flight land, it
leaves the weight-update group before it stops, it is not restarted), and the run goes on with
one actor, every group the added actor wrote trained."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest
from fixtures.launches import (
    launch,
    pool_process_once_running,
    run_processes,
    scale_actors,
    stop,
    stream_records,
    trainer_steps,
    version,
    wait_until,
)

from pipeline_rl.metrics import read_metrics
from pipeline_rl.streams.records import PAD_GROUP_ID
from pipeline_rl.wire import ExitCode

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.deepspeed]

ADDED_WITHIN_S = 120.0
"""A liveness bound: an added actor generates on the current version within this (it starts a
vLLM engine; CI runs another lane of tests beside this one)."""


def actor_records(run_dir: Path, name: str) -> list[dict]:
    return [r["values"] for r in read_metrics(run_dir) if r["process"] == name]


def test_an_actor_added_to_a_running_job_generates_and_drains_when_scaled_back(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "shared.max_steps=100000", "trainer.checkpoint_every=0", wait=False)
    try:
        pool_process_once_running(proc, run_dir, "actor", 240)
        wait_until(lambda: version(run_dir) >= 2, proc, 240, "version 2")
        up = scale_actors(run_dir, 2)
        scaled_at, at_scale = time.time(), version(run_dir)
        assert up.returncode == 0 and "the job has 2 actors (added actors 1..1)" in up.stdout, up.stdout + up.stderr
        assert scale_actors(run_dir, 2).stdout.strip() == "the job already has 2 actors"

        def generating() -> bool:
            return any(
                r["version"] >= at_scale and r["groups_written_total"] > 0 for r in actor_records(run_dir, "actor1")
            )

        wait_until(generating, proc, ADDED_WITHIN_S, "group from actor1", run_dir)
        first = next(
            r for r in read_metrics(run_dir) if r["process"] == "actor1" and r["values"]["groups_written_total"] > 0
        )
        down = scale_actors(run_dir, 1)
        assert down.returncode == 0 and "actors 1..1 drain and leave" in down.stdout, down.stdout + down.stderr

        def left() -> bool:  # the launcher saw it go
            return any(r.get("actors_drained_total") == 1 for r in actor_records(run_dir, "launcher"))

        # A liveness bound, not a speed goal: the groups in flight are handed over, but leaving
        # the weight-update group waits for the transfer in progress to end.
        wait_until(left, proc, 300, "actor1 draining", run_dir)
        assert "drained after writing" in (run_dir / "logs" / "actor1.log").read_text()
        handed = max(r.get("groups_handed_over_total", 0) for r in actor_records(run_dir, "actor1"))
        drained_at = version(run_dir)
        # The run goes on with one actor (its share is the whole step again).
        wait_until(lambda: version(run_dir) >= drained_at + 20, proc, 120, "20 versions after the drain", run_dir)
    finally:
        stop(proc)
    out = proc.stdout.read() if proc.stdout else ""
    assert proc.returncode == ExitCode.INTERRUPTED, out[-4000:]  # stopped by the test's Ctrl-C, not by a failure
    assert first["time"] - scaled_at < ADDED_WITHIN_S, (first["time"] - scaled_at, first)
    assert first["values"]["version"] >= at_scale, (at_scale, first)
    assert "scaled the job from 1 to 2 actors" in out and "scaled the job from 2 to 1 actors" in out, out[-4000:]
    assert "actor1 drained and left the job" in out and "restarting" not in out, out[-4000:]
    versions = [s["values"]["version"] for s in trainer_steps(run_dir)]
    assert versions == list(range(1, versions[-1] + 1)), versions

    # The groups it had in flight were handed over: actor0 continued each and wrote it once.
    adopted = [
        g["group_id"]
        for g in stream_records(run_dir, "actor")
        if g["actor"] == 0 and g["group_id"].startswith("actor1-")
    ]
    assert len(adopted) == len(set(adopted)) == handed, (adopted, handed)
    # Every group the added actor wrote was taken into a step (it drained: nothing in flight was
    # dropped): the preprocessor's saved position in its partition is the partition's end, and
    # its groups are in the trainer stream but for those whose advantages were all zero.
    written = {g["group_id"] for g in stream_records(run_dir, "actor") if g["actor"] == 1}
    end = (run_dir / "streams" / "actor" / "1.jsonl").stat().st_size
    taken = orjson.loads((run_dir / "positions" / "preprocessor0.json").read_bytes())["actor"]
    assert written and int(taken["1"]) == end, (taken, end)
    trained = {gid for b in stream_records(run_dir, "trainer") for gid in b["group_ids"]} - {PAD_GROUP_ID}
    assert written & trained
    # It left the weight-update group before it stopped: no transfer failed, and the group
    # had two receivers while it was there and one at the end.
    trainer = [r for r in actor_records(run_dir, "trainer0") if "weight_update_members" in r]
    assert max(r.get("weight_update_failed_total", 0) for r in trainer) == 0
    assert 2 in {r["weight_update_members"] for r in trainer} and trainer[-1]["weight_update_members"] == 1
    counts = [
        r["values"]["actors"] for r in read_metrics(run_dir) if r["process"] == "launcher" and "actors" in r["values"]
    ]
    assert counts == [2, 1]  # the launcher's metrics follow the job's size
    assert run_processes(run_dir) == {}
