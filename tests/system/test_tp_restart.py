"""A tensor-parallel actor whose vLLM worker dies is replaced and the run goes on
(launch/restarts.py); once the restarts are spent, a dead worker stops the run naming the actor. Its own file so that CI runs it in the lane of the other TP launches, never
beside one: three processes that each import vLLM, twice, are what its time bound measures."""

from __future__ import annotations

import subprocess
import time

import pytest
from fixtures.launches import (
    REPLACED_WITHIN_S,
    launch,
    pool_process_once_running,
    restarts,
    run_processes,
    stop,
    version,
    wait_until,
)

from pipeline_rl.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.deepspeed]


def test_a_tensor_parallel_actor_whose_worker_dies_is_replaced_once_then_stops_the_run(tmp_path, tiny_model):
    """SIGKILL one vLLM worker of a TP = 2 actor: vLLM fails the engine (no step on the shard
    that is left) and the actor exits non-zero; the launcher starts another in its slot, whose two
    workers register at their own weight-update ranks and receive the current weights (a TP
    engine swaps a version only when both shards have it), and the run goes on with the new
    engine's rollouts. The replacement reports within REPLACED_WITHIN_S, or, on a machine where
    starting the run's actor took longer than that, within that start's time: a TP = 2 actor is
    three processes that each import vLLM (vLLM's CPU platform spawns its workers), which on two
    slow cores can take longer than the promise, but a replacement does the same work with the
    other pools already up, and is never slower than the first start unless something held it
    up. Then a worker of the replacement is killed with world.max_restarts spent: the launcher
    stops the run at once, saying it was actor0 and that its vLLM engine failed."""
    import psutil

    run_dir = tmp_path / "run"
    launched_at = time.time()
    proc = launch(
        run_dir,
        "shared.tensor_parallel_size=2",
        "shared.max_steps=100000",
        "trainer.checkpoint_every=0",
        "world.max_restarts=1",
        wait=False,
    )

    def workers() -> list:
        actor = psutil.Process(pool_process_once_running(proc, run_dir, "actor", 300))
        found = [c for c in actor.children() if "resource_tracker" not in " ".join(c.cmdline())]
        assert len(found) == 2, [c.cmdline() for c in found]
        return found

    try:
        wait_until(lambda: version(run_dir) >= 2, proc, 540, "version 2", run_dir)
        at_kill = version(run_dir)
        workers()[1].kill()
        killed_at = time.time()
        # The trainer's steps past at_kill + max_lag need groups only the replacement can have made.
        wait_until(lambda: version(run_dir) >= at_kill + 10, proc, 300, f"version {at_kill + 10}", run_dir)
        (restart,) = restarts(run_dir)
        swaps_until = time.time()
        workers()[1].kill()
        killed_again_at = time.time()
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            tail = (run_dir / "logs" / "actor0.log").read_text(errors="replace")[-4000:]
            pytest.fail(f"the run did not stop within 120 s of the kill; actor0.log ends with:\n{tail}")
    finally:
        stop(proc)
    assert "process actor0 failed" in out and "restarting actor0 (restart 1 of 1" in out, out[-4000:]
    assert restart["restarted_at"] > killed_at, restart
    first_start_s = min(r["time"] for r in read_metrics(run_dir) if r["process"] == "actor0") - launched_at
    within = max(REPLACED_WITHIN_S, first_start_s)
    assert restart["recovered_s"] is not None and restart["recovered_s"] < within, (restart, first_start_s)
    # The replacement's reports (the failed actor may still report its failed swap).
    after = [
        r["values"]
        for r in read_metrics(run_dir)
        if r["process"] == "actor0" and restart["restarted_at"] < r["time"] < swaps_until
    ]
    written = [r["groups_written_total"] for r in after if r["version"] >= at_kill]
    assert written and max(written) > min(written), after[-1:]
    swaps = [r.get("swap_failures_total", 0) for r in after]
    assert swaps and max(swaps) == 0, swaps
    # vLLM's worker monitor takes up to 9 s to stop the other worker and report; failing every
    # pending rollout, exiting, and the launcher's stop take a few more.
    assert time.time() - killed_again_at < 40, out[-3000:]
    assert proc.returncode != 0
    assert "actor0" in out and "vLLM engine failed" in out, out[-3000:]
    assert "actor0 was already restarted 1 times" in out, out[-3000:]
    assert run_processes(run_dir) == {}
