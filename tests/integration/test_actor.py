"""The actor process on a real vLLM engine, with no trainer: it must write exactly the
admission bound of groups, (max_lag + 1) * share, then block; count injected rollout and reward
errors; evaluate without writing to the stream; and, restarted, resume its count and write
nothing more."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures.helpers import CACHE, ROOT, TESTS

from pipeline_rl.config import load_config, save_config
from pipeline_rl.rollouts.datasets import load_problems
from pipeline_rl.streams import open_streams
from pipeline_rl.streams.records import RolloutGroup
from pipeline_rl.wire import WEIGHT_SYNC_ADDR_ENV

pytestmark = pytest.mark.vllm

GROUPS_PER_STEP, MAX_LAG = 4, 1
BOUND = (MAX_LAG + 1) * GROUPS_PER_STEP
EVAL_PROBLEMS = 16
START_TIMEOUT_S = 240


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics" / "actor0.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["values"] for line in path.read_text().splitlines() if line.strip()]


def stream_groups(cfg) -> list[RolloutGroup]:
    streams = open_streams(cfg)
    reader = streams.reader("actor", RolloutGroup, partitions=(0,))
    groups = []
    while batch := reader.read(timeout=0.0):
        groups += [e.record for e in batch]
    streams.close()
    return groups


class ActorProcess:
    def __init__(self, run_dir: Path):
        env = {k: v for k, v in os.environ.items() if k != WEIGHT_SYNC_ADDR_ENV}
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT)]))
        self.log = open(run_dir / "actor0.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline_rl.actor", "--run-dir", str(run_dir), "--index", "0"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.run_dir = run_dir

    def wait_for(self, condition, timeout: float) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            records = metrics(self.run_dir)
            if condition(records):
                return records
            assert self.proc.poll() is None, (self.run_dir / "actor0.log").read_text()[-3000:]
            time.sleep(0.2)
        raise AssertionError(f"timed out; log tail:\n{(self.run_dir / 'actor0.log').read_text()[-3000:]}")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.log.close()


def blocked_at(records: list[dict], groups: int) -> bool:
    """A metrics window spent (almost) entirely blocked on admission with `groups` written."""
    return any(r.get("groups_written_total") == groups and r.get("admission_blocked_frac", 0) > 0.9 for r in records)


@pytest.mark.slow
def test_stalled_trainer_bounds_the_actor_and_resume_keeps_the_count(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(
        "tiny",
        [
            f"run_dir={run_dir}",
            f"model.path={tiny_model}",
            "metrics.tensorboard=false",
            f"actor.dataset.train={CACHE / 'arithmetic' / 'train.jsonl'}",
            f"actor.dataset.test={CACHE / 'arithmetic' / 'test.jsonl'}",
            f"shared.groups_per_step={GROUPS_PER_STEP}",
            f"shared.max_lag={MAX_LAG}",
            "actor.domain=fixtures.faulty_domain:rollout",
            "actor.attempts=2",
            "actor.max_groups_in_flight=16",
            "actor.metrics_every_s=0.5",
            "actor.eval_every_s=600",
            f"actor.eval_problems={EVAL_PROBLEMS}",
            "actor.llm.kv_cache_gib=0.25",
        ],
    )
    save_config(cfg, run_dir / "config.yaml")

    actor = ActorProcess(run_dir)
    try:
        actor.wait_for(lambda rs: blocked_at(rs, BOUND) and any("eval/reward" in r for r in rs), START_TIMEOUT_S)
        time.sleep(1.5)  # three more metrics windows: still blocked, nothing more written
        records = metrics(run_dir)
        groups = stream_groups(cfg)
    finally:
        code = actor.stop()
    assert code == 0
    assert len(groups) == BOUND
    last = [r for r in records if "groups_written_total" in r][-1]
    assert last["groups_written_total"] == BOUND and last["admission_blocked_frac"] > 0.9
    assert last["version"] == 0 and last["swaps_total"] == 0

    # Injected faults: 2 failed groups (not counted against admission), one reward error per group.
    assert last["rollout_errors_total"] == 2 and "injected rollout failure" in last["last_rollout_error"]
    assert last["reward_errors_total"] == BOUND and last["last_reward_error"] == "injected reward error"

    assert len({g.group_id for g in groups}) == BOUND and {g.actor for g in groups} == {0}
    test_ids = {p["id"] for p in load_problems("jsonl", cfg.actor.dataset.test)}
    assert not test_ids & {g.problem_id for g in groups}, "evaluation groups must not be written"
    for g in groups:
        assert len(g.rollouts) == 2
        for r in g.rollouts:
            assert set(r.versions) == {0} and r.reward in (0.0, 1.0)
    evals = [r for r in records if "eval/reward" in r]
    assert len(evals) == 1 and evals[0]["eval/version"] == 0 and evals[0]["eval/problems"] == EVAL_PROBLEMS
    saved = json.loads((run_dir / "positions" / "actor0.json").read_text())
    assert {k: saved[k] for k in ("written", "problems", "lost")} == {
        "written": BOUND,
        "problems": BOUND + 2,
        "lost": 0,
    }

    # Restarted with the trainer still at version 0: the count is restored, nothing new is admitted.
    (run_dir / "metrics" / "actor0.jsonl").unlink()
    actor = ActorProcess(run_dir)
    try:
        actor.wait_for(lambda rs: blocked_at(rs, BOUND), START_TIMEOUT_S)
    finally:
        assert actor.stop() == 0
    assert len(stream_groups(cfg)) == BOUND
