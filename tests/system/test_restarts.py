"""A run that heals itself on one node (launch/restarts.py): a killed actor is replaced and the
run goes on; a killed preprocessor is started again and goes on from its position; a killed
trainer rank restarts the trainer pool from its checkpoint while the other pools keep their
processes; a process that dies at every start stops the run once
world.max_restarts is spent, naming it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import orjson
import pytest
from fixtures.helpers import ROOT, TESTS
from fixtures.launches import (
    REPLACED_WITHIN_S,
    launch,
    pool_process_once_running,
    restarts,
    run_processes,
    stop,
    stream_records,
    trainer_steps,
    version,
    wait_until,
)

from pipeline_rl.actor.in_flight import InFlight
from pipeline_rl.metrics import read_metrics
from pipeline_rl.streams.records import PAD_GROUP_ID

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.deepspeed]


def pid_of(run_dir: Path, name: str) -> int:
    pool, index = name.rstrip("0123456789"), name[len(name.rstrip("0123456789")) :]
    module = {"actor": "actor", "preprocessor": "preprocess", "trainer": "trainer"}[pool]
    found = [
        pid
        for pid, args in run_processes(run_dir).items()
        if f"-m pipeline_rl.{module} " in args and f"--index {index}" in args
    ]
    assert len(found) == 1, (name, run_processes(run_dir))
    return found[0]


def assert_no_group_in_two_steps(run_dir: Path) -> None:
    """Every group id of the trainer stream is in one step only (a step trained again after a
    restart holds the same groups)."""
    seen: dict[str, int] = {}
    for b in stream_records(run_dir, "trainer"):
        for gid in set(b["group_ids"]) - {PAD_GROUP_ID}:
            assert seen.setdefault(gid, b["step"]) == b["step"], f"group {gid} in steps {seen[gid]} and {b['step']}"


def test_a_killed_actor_is_replaced_a_killed_preprocessor_restarted_and_the_run_goes_on(tmp_path, tiny_model):
    """kill -9 the one actor mid-run: the launcher starts another in its slot, which gets the
    current weights (the trainer sends them again while it waits for groups) and generates on
    them within REPLACED_WITHIN_S; of the groups the dead actor had in flight (its position
    file, frozen by SIGSTOP before the kill), those of its last in-flight save that did not land
    after it are continued, the others counted lost. Then kill -9 the preprocessor: the launcher
    starts it again in its slot and it goes on from its saved position in the actor stream. The
    trainer reaches max_steps training every step once, with no group in two steps."""
    run_dir = tmp_path / "run"
    final = 100  # far more groups after the kill than an actor gets ahead of the trainer by
    proc = launch(
        run_dir,
        f"shared.max_steps={final}",
        "trainer.checkpoint_every=0",
        "world.max_restarts=2",
        "actor.in_flight_save_s=1",
        wait=False,
    )
    try:
        pid = pool_process_once_running(proc, run_dir, "actor", 240)
        wait_until(lambda: version(run_dir) >= 2, proc, 240, "version 2")
        os.kill(pid, signal.SIGSTOP)  # its position file and its stream hold still from here
        saved = orjson.loads((run_dir / "positions" / "actor0.json").read_bytes())
        stream = (run_dir / "streams" / "actor" / "0.jsonl").read_bytes()
        # Groups that reached the stream after the last save: written, not lost.
        unsaved = stream[int(saved["stream_end"] or 0) :].count(b"\n")
        # Groups of the last in-flight save that did not land after it: continued, not lost.
        # Saved every second (actor.in_flight_save_s): by version 2 the actor has saved.
        in_flight = InFlight.load(run_dir / "in_flight" / "actor0.json")
        assert in_flight is not None, "the actor never saved its groups in flight"
        after = {orjson.loads(line)["group_id"] for line in stream[int(in_flight.stream_end or 0) :].splitlines()}
        continued = sum(g.group_id not in after for g in in_flight.groups)
        at_kill = version(run_dir)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()

        def replaced() -> bool:
            return any(r["what"] == "actor0" and r["recovered_s"] is not None for r in restarts(run_dir))

        wait_until(replaced, proc, 240, "actor0 generating again", run_dir)
        assert version(run_dir) < final, "the run ended before the preprocessor was killed"
        os.kill(pid_of(run_dir, "preprocessor0"), signal.SIGKILL)
        out, _ = proc.communicate(timeout=420)
    finally:
        stop(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "process actor0 failed: killed by SIGKILL; restarting actor0 (restart 1 of 2" in out, out[-4000:]
    assert "process preprocessor0 failed: killed by SIGKILL; restarting preprocessor0 (restart 1 of 2" in out, out[
        -4000:
    ]
    versions = [s["values"]["version"] for s in trainer_steps(run_dir)]
    assert versions == list(range(1, final + 1)), versions
    assert [s["values"]["version"] for s in trainer_steps(run_dir) if s["time"] > killed_at][-1] == final
    assert_no_group_in_two_steps(run_dir)

    records = read_metrics(run_dir)
    replacement = [r["values"] for r in records if r["process"] == "actor0" and r["time"] > killed_at]
    assert replacement, "the replacement actor reported nothing"
    generating = [
        r
        for r in records
        if r["process"] == "actor0"
        and r["time"] > killed_at
        and r["values"]["version"] >= at_kill
        and r["values"]["groups_written_total"] > saved["written"] + unsaved
    ]
    assert generating, replacement[-1]
    assert generating[0]["time"] - killed_at < REPLACED_WITHIN_S, generating[0]["time"] - killed_at
    lost = saved.get("lost_stopped", 0) + max(0, saved["in_flight"] - unsaved - continued)
    assert all(r["groups_lost/stopped_total"] == lost for r in replacement), (lost, replacement[-1])
    assert all(r["groups_continued_total"] == continued for r in replacement), (continued, replacement[-1])
    # It counted the groups written after its predecessor's last save, and went on from there.
    assert replacement[0]["groups_written_total"] >= saved["written"] + unsaved

    restart, again = restarts(run_dir)
    assert restart["what"] == "actor0" and "SIGKILL" in restart["reason"]
    assert restart["recovered_s"] is not None and restart["recovered_s"] < REPLACED_WITHIN_S
    assert again["what"] == "preprocessor0" and "SIGKILL" in again["reason"] and again["recovered_s"] is not None
    launcher = [r["values"] for r in records if r["process"] == "launcher"]
    assert launcher[-1]["restarts_total"] == 2 and launcher[-1]["restarts/actor0_total"] == 1
    assert launcher[-1]["restarts/preprocessor0_total"] == 1
    assert run_processes(run_dir) == {}


def test_a_killed_trainer_rank_restarts_the_trainer_pool_from_its_checkpoint(tmp_path, tiny_model):
    """kill -9 trainer rank 1 of 2 after a checkpoint: the launcher restarts both ranks, which
    resume from the checkpoint and train the later steps again, once each (every group in one
    step, by group id, in the trainer stream); the actor and the preprocessor keep their
    processes; no trained sample is older than max_lag (the gate's own accounting)."""
    run_dir = tmp_path / "run"
    final = 10
    proc = launch(
        run_dir,
        f"shared.max_steps={final}",
        "trainer.checkpoint_every=2",
        "world.trainers=2",
        "world.max_restarts=1",
        wait=False,
    )
    try:
        wait_until(
            lambda: (run_dir / "checkpoints" / "latest").exists() and version(run_dir) >= 3,
            proc,
            300,
            "a checkpoint and version 3",
        )
        others = {name: pid_of(run_dir, name) for name in ("actor0", "preprocessor0")}
        os.kill(pid_of(run_dir, "trainer1"), signal.SIGKILL)
        wait_until(
            lambda: any(r["recovered_s"] is not None for r in restarts(run_dir)), proc, 300, "a step after the restart"
        )
        assert {name: pid_of(run_dir, name) for name in others} == others
        out, _ = proc.communicate(timeout=420)
    finally:
        stop(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "process trainer1 failed: killed by SIGKILL; restarting trainer pool (restart 1 of 1" in out, out[-4000:]

    # Rank 0 may still finish the step it was in and log it after the kill: the restarted pool's
    # steps are those logged after it was started.
    (restart,) = restarts(run_dir)
    steps = trainer_steps(run_dir)
    trained_before = [s["values"]["version"] for s in steps if s["time"] <= restart["restarted_at"]]
    after = [s["values"]["version"] for s in steps if s["time"] > restart["restarted_at"]]
    checkpointed = after[0] - 1
    # A step's checkpoint is written before its metrics line: the kill can fall in between.
    assert checkpointed >= 2 and checkpointed % 2 == 0 and checkpointed <= trained_before[-1] + 1, (
        trained_before,
        after,
    )
    assert after == list(range(checkpointed + 1, final + 1)), after
    assert_no_group_in_two_steps(run_dir)
    max_lag = 2  # QUICK
    for s in steps:
        values = s["values"]
        stale = sum(n for lag, n in values["lag_hist"].items() if int(lag) > max_lag)
        assert values["dropped_samples"] == stale, values
    assert restart["what"] == "trainer pool" and restart["died"] == "trainer1"
    assert restart["recovered_s"] is not None
    assert run_processes(run_dir) == {}


def test_a_process_that_dies_at_every_start_stops_the_run_naming_it(tmp_path, tiny_model):
    """A preprocessor whose scorer fails in its constructor: restarted world.max_restarts
    times, then the run stops (exit 1) naming it, its restarts and its error."""
    run_dir = tmp_path / "run"
    scorer = "preprocess.scorers=[{cls: 'fixtures.faulty_scorer:FailsAtStart'}]"
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    code, out = launch(run_dir, "shared.max_steps=5", scorer, "world.max_restarts=2", env=env, timeout=300)
    assert code == 1, out[-4000:]
    assert out.count("restarting preprocessor0") == 2, out[-4000:]
    assert "restart 2 of 2" in out
    assert "process preprocessor0 failed: exit code 1; preprocessor0 was already restarted 2 times within 1 h" in out
    assert "world.max_restarts=2" in out and "injected start-up failure" in out
    assert [r["what"] for r in restarts(run_dir)] == ["preprocessor0", "preprocessor0"]
    assert run_processes(run_dir) == {}
