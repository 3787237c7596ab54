"""A tensor-parallel actor whose vLLM worker dies is replaced and the run goes on
(launch/restarts.py). Its own file so that CI runs it in the lane of the other TP launches, never
beside one: three processes that each import vLLM, twice, are what its time bound measures."""

from __future__ import annotations

import time

import pytest
from fixtures.launches import (
    REPLACED_WITHIN_S,
    launch,
    pool_process_once_running,
    restarts,
    run_processes,
    stop,
    trainer_steps,
    version,
    wait_until,
)

from pipeline_rl.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.deepspeed]


def test_a_tensor_parallel_actor_whose_worker_dies_is_replaced_and_the_run_goes_on(tmp_path, tiny_model):
    """SIGKILL one vLLM worker of a TP = 2 actor: the actor fails (test_launch.py says how, with
    no restarts), the launcher starts another in its slot, whose two workers register at their
    own weight-update ranks and receive the current weights (a TP engine swaps a version only
    when both shards have it), and the run reaches max_steps with the new engine's rollouts.
    The replacement reports within REPLACED_WITHIN_S, or, on a machine where starting the run's
    actor took longer than that, within that start's time: a TP = 2 actor is three processes
    that each import vLLM (vLLM's CPU platform spawns its workers), which on two slow cores can
    take longer than the promise, but a replacement does the same work with the other pools
    already up, and is never slower than the first start unless something held it up."""
    import psutil

    run_dir = tmp_path / "run"
    final = 12
    launched_at = time.time()
    proc = launch(
        run_dir,
        "shared.tensor_parallel_size=2",
        f"shared.max_steps={final}",
        "trainer.checkpoint_every=0",
        "world.max_restarts=1",
        wait=False,
    )
    try:
        pid = pool_process_once_running(proc, run_dir, "actor", 300)
        wait_until(lambda: version(run_dir) >= 2, proc, 240, "version 2")
        workers = [c for c in psutil.Process(pid).children() if "resource_tracker" not in " ".join(c.cmdline())]
        assert len(workers) == 2, [c.cmdline() for c in workers]
        at_kill = version(run_dir)
        workers[1].kill()
        killed_at = time.time()
        out, _ = proc.communicate(timeout=420)
    finally:
        stop(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "process actor0 failed" in out and "restarting actor0 (restart 1 of 1" in out, out[-4000:]
    assert [s["values"]["version"] for s in trainer_steps(run_dir)][-1] == final
    (restart,) = restarts(run_dir)
    assert restart["restarted_at"] > killed_at, restart
    first_start_s = min(r["time"] for r in read_metrics(run_dir) if r["process"] == "actor0") - launched_at
    within = max(REPLACED_WITHIN_S, first_start_s)
    assert restart["recovered_s"] is not None and restart["recovered_s"] < within, (restart, first_start_s)
    # The replacement's reports (the failed actor may still report its failed swap).
    after = [
        r["values"] for r in read_metrics(run_dir) if r["process"] == "actor0" and r["time"] > restart["restarted_at"]
    ]
    # The trainer's steps past at_kill + max_lag need groups only the replacement can have made.
    written = [r["groups_written_total"] for r in after if r["version"] >= at_kill]
    assert written and max(written) > min(written), after[-1:]
    # Until the trainer's last step: the trainer then exits with the store its TP workers report
    # the last transfer through, which can fail that one swap (the run is ending).
    last_step = trainer_steps(run_dir)[-1]["time"]
    swaps = [
        r.get("swap_failures_total", 0)
        for r in read_metrics(run_dir)
        if r["process"] == "actor0" and restart["restarted_at"] < r["time"] < last_step
    ]
    assert swaps and max(swaps) == 0, swaps
    assert run_processes(run_dir) == {}
