"""launch.py end to end on the tiny model: real actor (vLLM), preprocessor and trainer
(DeepSpeed) processes, supervision, resume, and two "nodes" on loopback with Redis."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest

from conftest import ROOT, free_port
from pipeline_rl.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.deepspeed]

# Small, quick settings: a few steps of 4 groups x 4 attempts, weights after every step.
QUICK = [
    "actor.attempts=4", "trainer.groups_per_step=4", "actor.max_groups_in_flight=8",
    "actor.eval_every_s=0", "actor.metrics_every_s=1", "trainer.max_lag=2",
    "metrics.tensorboard=false", "metrics.plot_at_end=true", "max_time_s=0",
]


def ports() -> list[str]:
    """Ports of the run's own process groups: tests never share them."""
    return [f"world.trainer_port={free_port()}", f"world.weight_sync_port={free_port()}"]


def launch(run_dir: Path, *overrides: str, env: dict | None = None, wait: bool = True, timeout: float = 300):
    argv = [sys.executable, "launch.py", "conf=tiny", f"run_dir={run_dir}", *QUICK, *ports(), *overrides]
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if not wait:
        return proc
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        stop(proc)
    return proc.returncode, out


def stop(proc: subprocess.Popen) -> None:
    """Ctrl-C a launcher a failed test leaves behind (it then stops its own processes)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_processes(run_dir: Path) -> dict[int, str]:
    """Live processes started for this run directory (none may survive a run): pid -> command."""
    found = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(run_dir) in args and "pipeline_rl." in args:
            found[int(cmdline.parent.name)] = args
    return found


def stream_records(run_dir: Path, topic: str) -> list[dict]:
    records = []
    for path in sorted((run_dir / "streams" / topic).glob("*.jsonl")):
        records += [orjson.loads(line) for line in path.read_bytes().splitlines() if line.endswith(b"}")]
    return records


def trainer_steps(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r["process"] == "trainer0" and "version" in r["values"]]


def test_pipeline_learns_end_to_end_and_stops_cleanly(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    code, out = launch(run_dir, "trainer.max_steps=6", "trainer.checkpoint_every=0")
    assert code == 0, out
    groups = stream_records(run_dir, "actor")
    versions = {v for g in groups for r in g["rollouts"] for v in r["versions"]}
    assert len(versions) >= 2, f"actors saw only versions {versions}"
    batches = stream_records(run_dir, "trainer")
    assert {b["step"] for b in batches} >= set(range(6))
    trained_versions = {v for b in batches for v in b["sample_versions"]}
    assert len(trained_versions) >= 2, "the trainer trained on samples of a single policy version"
    steps = trainer_steps(run_dir)
    assert steps[-1]["values"]["version"] == 6
    lags = Counter()
    for s in steps:
        lags.update({int(k): v for k, v in s["values"].get("lag_hist", {}).items()})
    trained_lags = {lag for lag in lags if lag <= 2}
    assert trained_lags, "no sample was trained on"
    dropped = steps[-1]["values"].get("dropped_total", 0)
    assert dropped == sum(n for lag, n in lags.items() if lag > 2), "dropped samples are not all counted"
    assert (run_dir / "plots" / "reward.png").exists() and (run_dir / "plots" / "lag_histogram.png").exists()
    assert run_processes(run_dir) == {}


def test_kill_9_of_one_process_stops_the_run(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "trainer.max_steps=1000", wait=False)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not list((run_dir / "streams" / "actor").glob("*.jsonl")):
            time.sleep(0.5)
        assert proc.poll() is None, proc.stdout.read()
        victim = [pid for pid, args in run_processes(run_dir).items() if "pipeline_rl.preprocessor" in args]
        assert victim, f"no preprocessor process among {run_processes(run_dir)}"
        os.kill(victim[0], signal.SIGKILL)
        killed_at = time.time()
        out, _ = proc.communicate(timeout=60)
    finally:
        stop(proc)
    assert time.time() - killed_at < 10.0 + 2.0  # 10 s promise, 2 s for Python start-up slack
    assert proc.returncode != 0
    assert "preprocessor0" in out and "SIGKILL" in out
    assert run_processes(run_dir) == {}


def test_resume_continues_from_checkpoint_without_double_training(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    code, out = launch(run_dir, "trainer.max_steps=3", "trainer.checkpoint_every=2")
    assert code == 0, out
    assert trainer_steps(run_dir)[-1]["values"]["version"] == 3
    code, out = launch(run_dir, "trainer.max_steps=5", "trainer.checkpoint_every=2")
    assert code == 0, out
    assert "resuming" in out
    versions = [s["values"]["version"] for s in trainer_steps(run_dir)]
    assert versions == sorted(versions) and versions[-1] == 5
    assert len(versions) == len(set(versions)), f"a step was trained twice: {versions}"
    # Every group reached the trainer in exactly one step.
    seen: dict[str, int] = {}
    for b in stream_records(run_dir, "trainer"):
        for gid in b["group_ids"]:
            assert seen.setdefault(gid, b["step"]) == b["step"], f"group {gid} in steps {seen[gid]} and {b['step']}"


def test_two_nodes_on_loopback_with_redis(tmp_path, tiny_model):
    port = free_port()
    common = ["world.nodes=2", "streams.backend=redis", "streams.redis.start_server=true",
              f"streams.redis.port={port}", "trainer.max_steps=3", "name=two_nodes", *ports()]
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    node0 = launch(tmp_path / "node0", *common, env={**env, "RANK": "0"}, wait=False)
    node1 = launch(tmp_path / "node1", *common, env={**env, "RANK": "1"}, wait=False)
    try:
        out0, _ = node0.communicate(timeout=300)
        out1, _ = node1.communicate(timeout=60)
    finally:
        stop(node1)
        stop(node0)
    assert node0.returncode == 0, out0
    assert node1.returncode == 0, out1
    assert "started trainer0, preprocessor0" in out0 and "started actor0" in out1
    # The actor on node 1 received new weights from the trainer on node 0.
    actor = [r for r in read_metrics(tmp_path / "node1") if r["process"] == "actor0"]
    assert max(r["values"].get("version", 0) for r in actor) >= 1
    assert trainer_steps(tmp_path / "node0")[-1]["values"]["version"] == 3
