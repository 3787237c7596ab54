"""Nothing generated is lost at a stop (actor/in_flight.py), end to end on the tiny model: a run
stopped with Ctrl-C saves every rollout in flight, and the resumed run continues each of them:
it lands once, as one group, its saved tokens kept with the versions they were generated with.
An actor added to a running job (launch/scaling.py) generates on the current weights; scaled away,
it hands its rollouts in flight over to the one that stays and leaves."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import orjson
import pytest
from fixtures.helpers import ROOT, TESTS
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

from pipeline_rl.actor.in_flight import InFlight
from pipeline_rl.metrics import read_metrics
from pipeline_rl.streams.records import PAD_GROUP_ID
from pipeline_rl.wire import ExitCode

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.deepspeed]

LONG = [
    "actor.domain=fixtures.long_domain:rollout",
    "actor.max_new_tokens=40",
    "trainer.checkpoint_every=2",
    "actor.admission_lag=100000",
]
"""Completions of 40 tokens each (EOS ignored): a stop finds them half-way. Admission without a
bound: an actor always has its groups in flight, even one whose weights fall behind (its groups
land too stale to train, and the trainer's gate drops them: these tests look at what lands)."""
ENV = {"PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
STOPS = 3


def test_a_run_stopped_with_ctrl_c_continues_its_rollouts_in_flight_when_resumed(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    # The groups in flight generate in step (same length, started together): a stop can find every
    # sequence just finished, its group not yet written. That stop is kept and continued too; the
    # run is stopped again (at most STOPS times) until a stop finds sequences half-way.
    for attempt in range(STOPS):
        target = version(run_dir) + 4 if attempt else 4
        # No periodic save (actor.in_flight_save_s=0): what the resumed run continues is the stop's.
        proc = launch(run_dir, *LONG, "shared.max_steps=100000", "actor.in_flight_save_s=0", env=ENV, wait=False)
        try:
            wait_until(lambda: version(run_dir) >= target, proc, 300, f"version {target}", run_dir)
            if attempt == 0:
                assert not (run_dir / "in_flight" / "actor0.json").exists(), "saved with actor.in_flight_save_s=0"
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=60)
        finally:
            stop(proc)
        assert proc.returncode == ExitCode.INTERRUPTED, out[-4000:]
        saved = InFlight.load(run_dir / "in_flight" / "actor0.json")
        assert saved is not None and saved.groups, "no rollout in flight was saved at the stop"
        parts = {
            (g.group_id, i): p for g in saved.groups for (call,) in [g.calls] for i, p in enumerate(call.parts) if p
        }
        if any(not p.finish_reason for p in parts.values()):
            break
    else:
        raise AssertionError(f"no sequence was half-way at any of {STOPS} stops")
    stopped_at = version(run_dir)
    before = {g["group_id"] for g in stream_records(run_dir, "actor")}

    # The resumed run is stopped once every saved group landed: a run that ends at a step count
    # can reach it on the groups already in the stream before its actor finishes one.
    saved_ids = {g.group_id for g in saved.groups}
    proc = launch(run_dir, *LONG, "shared.max_steps=100000", env=ENV, wait=False)
    try:
        wait_until(
            lambda: saved_ids <= {g["group_id"] for g in stream_records(run_dir, "actor")},
            proc,
            300,
            "every group saved at the stop landing",
            run_dir,
        )
        wait_until(lambda: version(run_dir) > stopped_at, proc, 120, "a version after the resume", run_dir)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        stop(proc)
    assert proc.returncode == ExitCode.INTERRUPTED, out[-4000:]
    landed: dict[str, list[dict]] = {}
    for g in stream_records(run_dir, "actor"):
        landed.setdefault(g["group_id"], []).append(g)
    for group in saved.groups:
        assert group.group_id not in before
        # Every group in flight at the stop landed once, each sequence its saved tokens then more.
        (record,) = landed.get(group.group_id, [None])
        assert record is not None, f"group {group.group_id} in flight at the stop never landed"
        for i, rollout in enumerate(record["rollouts"]):
            part = parts.get((group.group_id, i))
            k = len(part.token_ids) if part else 0
            assert len(rollout["completion_ids"]) == 40
            if part is not None:
                assert rollout["completion_ids"][:k] == part.token_ids
                assert rollout["logprobs"][:k] == part.logprobs
                assert rollout["versions"][:k] == part.versions  # generated before the stop
            assert all(v >= rollout["versions"][0] for v in rollout["versions"])
    resumed = [
        r["values"]
        for r in read_metrics(run_dir)
        if r["process"] == "actor0" and "groups_continued_total" in r["values"]
    ]
    last = resumed[-1]
    assert last["groups_continued_total"] == len(saved.groups), last
    assert last["tokens_continued_total"] == sum(g.tokens for g in saved.groups), last
    assert last["groups_lost/stopped_total"] == 0 and last["groups_lost_total"] == 0, last


ADDED_WITHIN_S = 120.0
"""A liveness bound: an added actor generates on the current version within this (it starts a
vLLM engine; CI runs another lane of tests beside this one)."""


def actor_records(run_dir: Path, name: str) -> list[dict]:
    return [r["values"] for r in read_metrics(run_dir) if r["process"] == name]


def test_an_actor_added_to_a_running_job_generates_and_scaled_away_hands_its_rollouts_in_flight_over(
    tmp_path, tiny_model
):
    """A running job scaled on one node (launch/scaling.py), with completions long enough that an
    actor always has rollouts in flight: `--actors 2` adds an actor that generates on the current
    weights; `--actors 1` then drains it: it hands its groups in flight over (it does not finish
    them), leaves the weight-update group before it stops and is not restarted; actor0 claims
    them, continues each and writes it once; the run goes on with one actor, every group the
    added actor wrote taken into a step."""
    run_dir = tmp_path / "run"
    proc = launch(run_dir, *LONG, "shared.max_steps=100000", "trainer.checkpoint_every=0", env=ENV, wait=False)
    try:
        pool_process_once_running(proc, run_dir, "actor", 240)
        wait_until(lambda: version(run_dir) >= 2, proc, 240, "version 2", run_dir)
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
        asked_at = time.time()
        down = scale_actors(run_dir, 1)
        assert down.returncode == 0 and "actors 1..1 drain and leave" in down.stdout, down.stdout + down.stderr

        def left() -> bool:  # the launcher saw it go
            return any(r.get("actors_drained_total") == 1 for r in actor_records(run_dir, "launcher"))

        wait_until(left, proc, 120, "actor1 leaving", run_dir)
        left_in = time.time() - asked_at
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

    # The groups it had in flight were handed over: actor0 continued each to its full length and
    # wrote it once.
    assert handed > 0, "actor1 had no group in flight to hand over"
    adopted = [g for g in stream_records(run_dir, "actor") if g["actor"] == 0 and g["group_id"].startswith("actor1-")]
    assert len(adopted) == len({g["group_id"] for g in adopted}) == handed, (len(adopted), handed)
    for g in adopted:
        for r in g["rollouts"]:
            assert len(r["completion_ids"]) == 40 and r["versions"] == sorted(r["versions"])
    assert max(r["groups_continued_total"] for r in actor_records(run_dir, "actor0")) == handed
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
    # A liveness bound: leaving waits for the weight transfer in progress, not for the groups.
    print(f"\nactor1 handed {handed} groups over and left {left_in:.1f} s after the request")
    assert left_in < 60, left_in
