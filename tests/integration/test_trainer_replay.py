"""The trainer topic on a real redis-server is trimmed as the trainer advances, not at
checkpoints, and a trainer killed mid-run still resumes exactly: the steps after its
checkpoint come back from its replay log (pipeline_rl/trainer/replay.py). Real DeepSpeed on gloo."""

from __future__ import annotations

import functools
import os
import signal

import pytest
import redis
from fixtures.trainer_runs import (
    REL_TOL,
    final_weights,
    make_steps,
    start_ranks,
    train,
    trainer_config,
    trainer_metrics,
    update_error,
    wait_all,
    write_steps,
)
from safetensors.torch import load_file

from pipeline_rl.streams.records import MicroBatch, decode
from pipeline_rl.trainer import checkpoint
from pipeline_rl.trainer.replay import ReplayLog, replay_path
from pipeline_rl.wire import redis_namespace

pytestmark = [pytest.mark.deepspeed, pytest.mark.redis]

SETTINGS = ("trainer.optimizer.warmup_steps=2", "trainer.optimizer.decay=cosine", "trainer.optimizer.min_lr_ratio=0.1")


def _kill_self_at_step(step: int):
    """SIGKILL as the first micro-batch of `step` is computed (the steps before it are trained,
    logged and trimmed)."""
    from pipeline_rl.trainer.trainer import Trainer

    original = Trainer._micro_batch_loss

    def loss(self, mb, *args):
        if mb.step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, mb, *args)

    Trainer._micro_batch_loss = loss  # pyright: ignore[reportAttributeAccessIssue]


def _steps_in(client: redis.Redis, key: str) -> list[int]:
    return [decode(fields[b"data"], MicroBatch).step for _, fields in client.xrange(key)]


def test_trimmed_as_trained_and_resumed_from_the_replay_log(tiny_model, tmp_path, redis_server):
    steps = make_steps(tiny_model, steps=4, groups=2, seed=7)
    redis_keys = ["streams.backend=redis", f"streams.redis.port={redis_server.port}"]

    reference = trainer_config(tmp_path / "reference", tiny_model, "shared.max_steps=4", *SETTINGS)
    write_steps(reference, steps, ranks=1)  # JSONL: nothing trimmed, no replay log
    train(reference)
    expected = final_weights(reference.run_dir, 4)

    run_dir = tmp_path / "run"
    cfg = trainer_config(
        run_dir, tiny_model, "shared.max_steps=4", "trainer.checkpoint_every=2", "name=replay", *redis_keys, *SETTINGS
    )
    write_steps(cfg, steps, ranks=1)
    client = redis.Redis(port=redis_server.port)
    key = f"{redis_namespace('replay')}:trainer:0"
    written = _steps_in(client, key)
    assert sorted(set(written)) == [0, 1, 2, 3]

    wait_all(start_ranks(run_dir, 1, before_main=functools.partial(_kill_self_at_step, 3)), run_dir, 120, -9)
    # Steps 0-2 were trained: Redis holds step 3 and the last entry of step 2 (XTRIM MINID keeps
    # the entry at the trimmed position), nothing older, although the checkpoint is of version 2.
    assert checkpoint.latest_checkpoint(run_dir)[1] == 2
    left = _steps_in(client, key)
    assert left == [2] + [s for s in written if s == 3], left
    # The replay log holds what the checkpoint does not: step 2, whole.
    logged = ReplayLog(replay_path(run_dir, 0)).pending()
    assert [mb.step for mb in logged] == [s for s in written if s == 2]

    train(cfg)  # resumes at version 2: step 2 from the log, step 3 from Redis
    versions = [r["version"] for r in trainer_metrics(run_dir)]
    assert versions == [1, 2, 3, 3, 4], versions
    initial = load_file(tiny_model / "model.safetensors")
    assert update_error(final_weights(run_dir, 4), expected, initial) < REL_TOL
    # Everything trained is gone from Redis but the kept last entry; the final checkpoint
    # emptied the log.
    assert _steps_in(client, key) == [3]
    assert replay_path(run_dir, 0).read_bytes() == b""
