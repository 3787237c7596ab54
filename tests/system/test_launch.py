"""launch.py end to end on the tiny model: real actor (vLLM), preprocessor and trainer
(DeepSpeed) processes, supervision, resume, Redis. Several nodes (Ray): test_ray_cluster.py."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import orjson
import psutil
import pytest
import torch
from fixtures.faulty_domain import MALFORMED
from fixtures.helpers import CACHE, ROOT, TESTS, RedisServer, free_port, hf_model
from fixtures.launches import (
    QUICK,
    launch,
    pool_process_once_running,
    ports,
    run_processes,
    stop,
    stream_records,
    trainer_steps,
)

from pipeline_rl.config import load_saved_config
from pipeline_rl.core.checkpoint_layout import latest_checkpoint
from pipeline_rl.launch.budget import run_limits
from pipeline_rl.launch.supervisor import STOP_GRACE_S
from pipeline_rl.metrics import read_metrics
from pipeline_rl.streams import open_streams
from pipeline_rl.streams.records import GroupsLost, MicroBatch
from pipeline_rl.streams.redis_secret import PASSWORD_FILE
from pipeline_rl.trainer.replay import replay_path
from pipeline_rl.wire import CACHE_ENV, ExitCode, Topic

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.deepspeed]


def test_pipeline_learns_end_to_end_stops_cleanly_and_resumes_without_double_training(tmp_path, tiny_model):
    """A run of 6 steps, stopped at max_steps, then run again to 8: the second resumes from the
    first's last checkpoint and trains no version and no group twice."""
    run_dir = tmp_path / "run"
    code, out = launch(run_dir, "shared.max_steps=6", "trainer.checkpoint_every=4", "metrics.plot_at_end=true")
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

    code, out = launch(run_dir, "shared.max_steps=8", "trainer.checkpoint_every=4")
    assert code == 0, out
    assert "resuming" in out
    versions = [s["values"]["version"] for s in trainer_steps(run_dir)]
    assert versions == sorted(versions) and versions[-1] == 8
    assert len(versions) == len(set(versions)), f"a step was trained twice: {versions}"
    # Every group reached the trainer in exactly one step.
    seen: dict[str, int] = {}
    for b in stream_records(run_dir, "trainer"):
        for gid in b["group_ids"]:
            assert seen.setdefault(gid, b["step"]) == b["step"], f"group {gid} in steps {seen[gid]} and {b['step']}"


def test_tensor_parallel_actor_trains(tmp_path, tiny_model):
    """conf=tiny with a TP = 2 actor (two vLLM worker processes, each a weight-update rank): the
    version rises, every version is swapped into both shards, and the held-out reward improves.
    Eval: 500 problems at T=1, so one eval's sd is <= 0.022 and that of (mean of the last two -
    the first) <= 0.027; untrained, a rise of 0.1 would be a 3.7-sd fluke, and the demo gains
    0.15-0.2 by version 50-90 (TP = 2 on 2 cores: 0.315 -> 0.45-0.5), but a tiny model built on
    another CPU gained only 0.097 by version 81 (0.0013 a version). The run is stopped with
    Ctrl-C as soon as all of that is shown (at the latest at version 135, where that slower pace
    gives 0.15), which is also checked to stop it cleanly."""
    run_dir = tmp_path / "run"
    versions_needed = 45

    def shown(actor: list[dict]) -> bool:
        evals = [(v["eval/version"], v["eval/reward"]) for v in actor if "eval/reward" in v]
        return (
            max((v.get("swaps_total", 0) for v in actor), default=0) >= versions_needed
            and len(evals) >= 3
            and evals[-1][0] >= versions_needed
            and (evals[-1][1] + evals[-2][1]) / 2 - evals[0][1] >= 0.1
        )

    proc = launch(
        run_dir,
        "shared.tensor_parallel_size=2",
        "actor.attempts=8",
        "shared.groups_per_step=32",
        "actor.max_groups_in_flight=64",
        "shared.max_lag=1",
        f"shared.max_steps={3 * versions_needed}",
        # The gain above was measured at a constant lr; a cosine over max_steps would halve it by version 45.
        "trainer.optimizer.decay=constant",
        "trainer.checkpoint_every=0",
        "actor.eval_every_s=15",
        "actor.eval_problems=500",
        wait=False,
    )
    try:
        deadline = time.time() + 600
        while proc.poll() is None and time.time() < deadline:
            if shown([r["values"] for r in read_metrics(run_dir) if r["process"] == "actor0"]):
                proc.send_signal(signal.SIGINT)
                break
            time.sleep(2)
        out, _ = proc.communicate(timeout=120)
    finally:
        stop(proc)
    assert proc.returncode in (0, 130), out
    actor = [r["values"] for r in read_metrics(run_dir) if r["process"] == "actor0"]
    assert max(v.get("swaps_total", 0) for v in actor) >= versions_needed
    assert all(v.get("swap_failures_total", 0) == 0 for v in actor)
    versions = {v for g in stream_records(run_dir, "actor") for r in g["rollouts"] for v in r["versions"]}
    assert len(versions) >= versions_needed, f"rollouts came from only {len(versions)} versions"
    evals = [(v["eval/version"], v["eval/reward"]) for v in actor if "eval/reward" in v]
    assert evals[0][0] == 0 and evals[-1][0] >= versions_needed, evals
    gain = (evals[-1][1] + evals[-2][1]) / 2 - evals[0][1]
    assert gain >= 0.1, f"held-out reward {evals}"
    assert run_processes(run_dir) == {}


def test_kill_9_of_one_process_stops_the_run(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "shared.max_steps=1000", "world.max_restarts=0", wait=False)
    try:
        os.kill(pool_process_once_running(proc, run_dir, "preprocess", 180), signal.SIGKILL)
        killed_at = time.time()
        out, _ = proc.communicate(timeout=60)
    finally:
        stop(proc)
    assert time.time() - killed_at < 10.0 + 2.0  # 10 s promise, 2 s for Python start-up slack
    assert proc.returncode != 0
    assert "preprocessor0" in out and "SIGKILL" in out
    assert run_processes(run_dir) == {}


def test_lora_run_resumes_with_the_engine_on_the_checkpoint_adapter(tmp_path, tiny_model):
    """Sync mode with LoRA, stopped at version 3 and resumed to 5: the actor's engine starts from
    the checkpoint's adapter, so on the resumed steps (every token of lag 0) the behaviour
    logprobs are the trainer's up to numerics, while the base model's differ by far more.
    Groups without reward spread are kept, so that every step trains on tokens: at this lr the
    policy soon answers every attempt of a problem alike, and a step of only such groups would
    have nothing to compare."""
    run_dir = tmp_path / "run"
    lora = ["model.lora.rank=8", "trainer.optimizer.lr=1e-2", "actor.mode=sync", "trainer.checkpoint_every=3"]
    lora += ["preprocess.advantage.filter_zero=false"]
    code, out = launch(run_dir, "shared.max_steps=3", *lora)
    assert code == 0, out
    found = latest_checkpoint(run_dir)
    assert found is not None and found[0].name == "adapter" and found[1] == 3, found
    code, out = launch(run_dir, "shared.max_steps=5", *lora)
    assert code == 0, out
    assert f"starting the engine from {found[0]} at version 3" in (run_dir / "logs" / "actor0.log").read_text()
    resumed = [s["values"] for s in trainer_steps(run_dir) if s["values"]["version"] > 3]
    assert [s["version"] for s in resumed] == [4, 5]
    # fp32 engine and trainer differ by summation order only (about 1e-6 per token here).
    assert all(s["mismatch/lag0_abs_logprob_diff"] < 1e-3 for s in resumed), resumed
    from peft import PeftModel

    tokens = torch.tensor([stream_records(run_dir, "trainer")[-1]["input_ids"][:32]])

    def token_logprobs(model) -> torch.Tensor:
        with torch.no_grad():
            return model(tokens).logits[0, :-1].log_softmax(-1).gather(-1, tokens[0, 1:, None])[:, 0]

    trained = token_logprobs(PeftModel.from_pretrained(hf_model(tiny_model, {}), str(found[0])))
    assert (trained - token_logprobs(hf_model(tiny_model, {}))).abs().mean() > 1e-2


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_lost_groups_do_not_stall_the_run(tmp_path, tiny_model, mode):
    """Three faults in one run: a scorer that fails on every third batch (its groups are
    dead-lettered), a reward check that raises on half of the problems, and two malformed
    lines appended to the actor's JSONL stream mid-run. The actors learn of each lost group and
    make another, so the run reaches max_steps in both modes, and every loss is counted by cause.
    The config is a user config in ./conf of a directory outside the checkout."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "flaky.yaml").write_text(
        "extends: tiny\nactor:\n  domain: fixtures.faulty_domain:reward_raises_and_stream_breaks\n"
        "preprocess:\n  scorers:\n    - cls: fixtures.faulty_scorer:EveryThirdBatchFails\n"
    )
    run_dir = tmp_path / "run"
    argv = [sys.executable, str(ROOT / "launch.py"), "conf=flaky", f"run_dir={run_dir}", *QUICK, *ports()]
    argv += ["shared.max_steps=6", "trainer.checkpoint_every=0", f"actor.mode={mode}", "watchdog_s=120"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]), CACHE_ENV: str(CACHE)}
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert trainer_steps(run_dir)[-1]["values"]["version"] == 6
    offsets, offset = {}, 0
    lines = (run_dir / "streams" / "actor" / "0.jsonl").read_bytes().splitlines(keepends=True)
    for line in lines:
        offsets[line.rstrip(b"\n")] = offset
        offset += len(line)
    bad_ids = {f"actor:0:{offsets[payload]}" for payload in MALFORMED}
    assert lines[-1].rstrip(b"\n") not in MALFORMED, "the malformed lines should sit mid-stream"
    lost = stream_records(run_dir, "lost")
    lost_ids = {cause: {i for r in lost if r["cause"] == cause for i in r["ids"]} for cause in ("scorer", "decode")}
    assert {r["cause"] for r in lost} == {"scorer", "decode"}
    assert lost_ids["decode"] == bad_ids
    dead = stream_records(run_dir, "scorer.dead")
    assert dead and {orjson.loads(d["payload"])["group_id"] for d in dead} == lost_ids["scorer"]
    # No lost group reached the trainer, and every actor counted the losses it was told of.
    trained = {g for b in stream_records(run_dir, "trainer") for g in b["group_ids"]}
    assert not trained & lost_ids["scorer"]
    actor = [r for r in read_metrics(run_dir) if r["process"] == "actor0"][-1]["values"]
    # A loss reported in the run's last moments may reach the actor after its last poll.
    assert 1 <= actor["groups_lost/scorer_total"] <= len(lost_ids["scorer"])
    assert actor["groups_lost/decode_total"] == len(bad_ids)
    assert actor["reward_errors_total"] >= 1 and "injected reward failure" in actor["last_reward_error"]


def test_watchdog_stops_a_stalled_run_and_says_who_waits(tmp_path, tiny_model):
    """A scorer that hangs after three steps' worth of groups: every process stays alive, the
    version stops moving; the launcher must stop the run, exit non-zero and show what the trainer
    and the preprocessor were doing. The hung preprocessor ignores SIGTERM, so it is killed after
    the rest's STOP_GRACE_S, not kept for the trainers' stop grace (launch/budget.py)."""
    run_dir = tmp_path / "run"
    scorer = "preprocess.scorers=[{cls: 'fixtures.faulty_scorer:HangsAfterGroups', kwargs: {after_groups: 12}}]"
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    proc = launch(
        run_dir, "shared.max_steps=50", scorer, "watchdog_s=15", "watchdog_startup_s=240", env=env, wait=False
    )
    try:
        lines, stopping = [], None
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if stopping is None and line.startswith("stopping the run"):
                stopping = time.monotonic()
        code = proc.wait(timeout=30)
        stopped_in = time.monotonic() - (stopping or 0.0)
    finally:
        stop(proc)
    out = "".join(lines)
    assert code == ExitCode.STALLED, out
    # The trainer's checkpoint of a tiny model takes seconds, then at most STOP_GRACE_S for the rest.
    trainer_stop_grace_s, _ = run_limits(load_saved_config(run_dir / "config.yaml"))
    assert stopped_in < STOP_GRACE_S + 30 < trainer_stop_grace_s, out
    assert "no progress: the policy version has stayed at" in out
    assert "trainer0: last report" in out and "waiting on: micro-batches of step" in out
    assert "preprocessor0: last report" in out
    assert run_processes(run_dir) == {}


def _password_nowhere(password: str, run_dir: Path, *outputs: str) -> None:
    """The run's Redis password is in no process's command line, no file of the run directory
    but its two 0600 secret files, and no launcher output."""
    assert len(password) >= 40
    for pid, args in run_processes(run_dir).items():
        assert password not in args, f"the Redis password is in the command line of process {pid}"
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            assert password.encode() not in cmdline.read_bytes(), f"the Redis password is in {cmdline}"
        except OSError:
            continue
    secrets = {run_dir / PASSWORD_FILE, run_dir / "redis" / "redis.conf"}
    # os.walk, and reads that may miss: a live run renames and prunes checkpoint directories.
    for root, _, names in os.walk(run_dir):
        for path in (Path(root) / name for name in names):
            try:
                data = b"" if path in secrets else path.read_bytes()
            except FileNotFoundError:
                continue
            assert password.encode() not in data, f"the Redis password is in {path}"
    for path in secrets:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for out in outputs:
        assert password not in out


def test_redis_run_resumes_after_everything_is_killed(tmp_path, tiny_model):
    """Launcher, pools and the launcher's own redis-server all get SIGKILL after a checkpoint;
    the restarted run loads the streams from Redis's append-only file, resumes from the
    checkpoint, trains each later step once more and reaches max_steps; no group is in two steps.
    The server has the run's random password, which appears in no command line, log, metric,
    config or output of the run; a client without it is refused."""
    run_dir = tmp_path / "run"
    port = free_port()
    redis = ["streams.backend=redis", "streams.redis.start_server=true", f"streams.redis.port={port}"]
    first = launch(run_dir, *redis, "shared.max_steps=50", "trainer.checkpoint_every=2", wait=False)
    try:
        deadline = time.time() + 240
        while not trainer_steps(run_dir):
            assert first.poll() is None and time.time() < deadline, "no first step in time"
            time.sleep(1)
        password = (run_dir / PASSWORD_FILE).read_text().strip()
        _password_nowhere(password, run_dir)
        refused = subprocess.run(["redis-cli", "-p", str(port), "PING"], capture_output=True, text=True)
        assert "NOAUTH" in refused.stdout + refused.stderr
        # redis-cli takes the password from its environment, not from its command line.
        auth = {**os.environ, "REDISCLI_AUTH": password}
        # Two records no reader can decode, added with redis-cli into the actor stream mid-run.
        bad_ids = set()
        for payload in ('{"problem_id": "p1", "rollouts": [', '{"no_such_field": 1}'):
            xadd = ["redis-cli", "-p", str(port), "XADD", "pipeline_rl:tiny:actor:0", "*", "data", payload]
            added = subprocess.run(xadd, capture_output=True, text=True, check=True, env=auth)
            bad_ids.add("actor:0:" + added.stdout.strip())
        # The preprocessor reads on only as steps need groups: wait until it has reported both
        # records lost, or a kill (or the resumed run's end) can come before it reaches the second.
        lost_key = "pipeline_rl:tiny:lost:0"

        def reported() -> bool:
            xrange = ["redis-cli", "-p", str(port), "XRANGE", lost_key, "-", "+"]
            lost_log = subprocess.run(xrange, capture_output=True, text=True, check=True, env=auth).stdout
            return all(i in lost_log for i in bad_ids)

        while not (run_dir / "checkpoints" / "latest").exists() or len(trainer_steps(run_dir)) < 3 or not reported():
            assert first.poll() is None and time.time() < deadline, "no checkpoint, three steps and both lost in time"
            time.sleep(1)
        launcher = psutil.Process(first.pid)
        everything = [launcher, *launcher.children(recursive=True)]
        assert any(p.name().startswith("redis-server") for p in everything)
        for p in everything:
            p.send_signal(signal.SIGKILL)
        psutil.wait_procs(everything, timeout=30)
    finally:
        stop(first)
    assert run_processes(run_dir) == {}
    trained_before = [r["values"]["version"] for r in trainer_steps(run_dir)]
    saved = latest_checkpoint(run_dir)
    assert saved is not None
    checkpointed = saved[1]
    final = trained_before[-1] + 3

    code, out = launch(run_dir, *redis, f"shared.max_steps={final}", "trainer.checkpoint_every=2")
    assert code == 0, out
    assert "resuming" in out
    # The resumed run kept the run's password (the server's append-only file is the same run's).
    assert (run_dir / PASSWORD_FILE).read_text().strip() == password
    _password_nowhere(password, run_dir, out)
    # The steps after the checkpoint were lost with the trainer and are trained again, once each.
    versions = [r["values"]["version"] for r in trainer_steps(run_dir)]
    assert versions == trained_before + list(range(checkpointed + 1, final + 1))

    # Read what the trainer was sent from the append-only file the run left behind.
    server = RedisServer(run_dir / "redis", appendonly=True)
    server.start()
    try:
        cfg = load_saved_config(run_dir / "config.yaml")
        cfg.streams.redis.port = server.port
        cfg.streams.redis.start_server = False  # the test's own server, without the run's password
        streams = open_streams(cfg)
        reader = streams.reader(Topic.TRAINER, MicroBatch)
        steps_of: dict[str, set[int]] = {}
        while batch := reader.read(timeout=1):
            for entry in batch:
                for gid in entry.record.group_ids:
                    steps_of.setdefault(gid, set()).add(entry.record.step)
        lost = [e.record for e in streams.reader(Topic.LOST, GroupsLost).read(timeout=1, max_count=1000)]
        streams.close()
    finally:
        server.stop()
    # Trained steps left the stream as they were trained (the replay logs kept those after the
    # last checkpoint until the final one): it holds only what was never trained, and the last
    # entry read (XTRIM MINID keeps the entry at the trimmed position), of step final - 1.
    assert all(step >= final - 1 for steps in steps_of.values() for step in steps), steps_of
    assert replay_path(run_dir, 0).read_bytes() == b""
    twice = {gid: steps for gid, steps in steps_of.items() if len(steps) > 1}
    assert not twice, f"groups in more than one step: {twice}"
    # The undecodable records were counted as lost (possibly twice: at-least-once after the kill).
    assert {i for r in lost if r.cause == "decode" for i in r.ids} == bad_ids
