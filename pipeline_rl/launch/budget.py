"""Time and Redis budgets of a run, from the model's size: what `--dry-run` prints beside the
GPU memory plan, and the limits the launcher stops and watches by.

- Checkpoint write: the DeepSpeed state (the trained parameters in model.dtype, plus 12 bytes
  each of fp32 master weights and two Adam moments) and the exported policy (the Hugging Face
  weights, or the adapter), over `world.disk_gib_per_s`.
- Model load: the policy's weights read once at start, and on resume the checkpoint read back.
- Stop grace (`trainer.stop_grace_s` unless given): STOP_BASE_S (the micro-batch in progress
  and the gathers) plus MARGIN x the checkpoint write.
- Start-up watchdog (`watchdog_startup_s` unless given): STARTUP_BASE_S (engines compiling and
  profiling, the first step's rollouts) plus MARGIN x (model load + checkpoint read).
- Collective timeout: trainer ranks wait inside collectives (DeepSpeed's and the checkpoint's
  barriers) while a checkpoint is written, so `world.collective_timeout_s` below MARGIN x the
  checkpoint write would stop every trainer at its first checkpoint on a slow file system: the
  launcher raises it to that, and says so.
- Redis: the trainer topic holds the steps not yet trained: the one being trained and those the
  preprocessor may be ahead by (admission control bounds it by the admission lag), admission
  lag + 1 steps; each trained step goes to the trainer's replay log on disk (trainer/replay.py),
  which holds at most the checkpoint_every steps since the last checkpoint.
  `MICRO_BATCH_BYTES_PER_TOKEN` is measured on orjson-encoded micro-batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pipeline_rl.actor.admission import admission_lag
from pipeline_rl.config import RunConfig
from pipeline_rl.launch.memory_plan import GIB, ModelShape

MARGIN = 2.0
"""Estimates are of a quiet file system: twice as long is still normal."""
STOP_BASE_S = 60.0
STARTUP_BASE_S = 1200.0
ADAM_BYTES = 12
"""fp32 master weights and two fp32 Adam moments per trained parameter."""
MICRO_BATCH_BYTES_PER_TOKEN = 80
"""An encoded MicroBatch: 56 bytes a token, 76 with reference logprobs (4096 tokens, orjson)."""
FALLBACK_STOP_GRACE_S = 120.0
FALLBACK_WATCHDOG_STARTUP_S = 1800.0
"""The limits when the model's config.json is not there to size them by."""

_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass
class TimePlan:
    checkpoint_bytes: int
    checkpoint_s: float
    load_bytes: int
    load_s: float
    stop_grace_s: float
    watchdog_startup_s: float


def time_plan(cfg: RunConfig, shape: ModelShape) -> TimePlan:
    size = _BYTES[cfg.model.dtype]
    lora = cfg.model.lora
    trained = shape.params if lora is None else shape.lora_params(lora)
    checkpoint = trained * (size + ADAM_BYTES) + trained * size  # DeepSpeed state + exported policy
    load = shape.params * size + (0 if lora is None else trained * size)
    bandwidth = cfg.world.disk_gib_per_s * GIB
    checkpoint_s, load_s = checkpoint / bandwidth, load / bandwidth
    grace = cfg.trainer.stop_grace_s
    startup = cfg.watchdog_startup_s
    return TimePlan(
        checkpoint,
        checkpoint_s,
        load,
        load_s,
        STOP_BASE_S + MARGIN * checkpoint_s if grace is None else grace,
        STARTUP_BASE_S + MARGIN * (load_s + checkpoint_s) if startup is None else startup,
    )


def run_limits(cfg: RunConfig) -> tuple[float, float]:
    """(trainers' stop grace, start-up watchdog) in seconds: the config's, or derived from the
    model's size, or the fallbacks when its config.json is not there."""
    if (Path(cfg.model.path) / "config.json").exists():
        plan = time_plan(cfg, ModelShape.read(cfg.model.path))
        return plan.stop_grace_s, plan.watchdog_startup_s
    grace, startup = cfg.trainer.stop_grace_s, cfg.watchdog_startup_s
    return (
        FALLBACK_STOP_GRACE_S if grace is None else grace,
        FALLBACK_WATCHDOG_STARTUP_S if startup is None else startup,
    )


def checkpoint_timeout(cfg: RunConfig) -> tuple[float, str]:
    """(the collective timeout the run uses, a line saying why): world.collective_timeout_s, or
    MARGIN x the checkpoint write when that is longer (module docstring)."""
    given = cfg.world.collective_timeout_s
    if not (Path(cfg.model.path) / "config.json").exists():
        return given, f"time: world.collective_timeout_s={given:g} (no checkpoint estimate to check it against)"
    needed = math.ceil(MARGIN * time_plan(cfg, ModelShape.read(cfg.model.path)).checkpoint_s)
    if given >= needed:
        return given, (
            f"time: world.collective_timeout_s={given:g} is at least {MARGIN:g} x the checkpoint write "
            f"({needed} s): accepted"
        )
    return float(needed), (
        f"time: world.collective_timeout_s={given:g} is below {MARGIN:g} x the checkpoint write at "
        f"world.disk_gib_per_s={cfg.world.disk_gib_per_s:g}: raised to {needed} s (trainer ranks wait inside "
        "collectives while a checkpoint is written)"
    )


def trainer_topic_steps(cfg: RunConfig) -> int:
    """Most steps of micro-batches the trainer topic holds: the one in training and those ahead."""
    return admission_lag(cfg) + 1


def step_bytes(cfg: RunConfig) -> int:
    """Bound on one step's encoded micro-batches, all ranks: every rollout at max_model_len,
    every rank's last micro-batch padded to seq_length."""
    tokens = cfg.shared.groups_per_step * cfg.actor.attempts * cfg.actor.llm.max_model_len
    tokens += cfg.world.trainers * cfg.preprocess.seq_length
    return tokens * MICRO_BATCH_BYTES_PER_TOKEN


def trainer_topic_bytes(cfg: RunConfig) -> int:
    return trainer_topic_steps(cfg) * step_bytes(cfg)


def replay_bytes(cfg: RunConfig) -> int:
    """Bound on the trainers' replay logs together (on disk, under run_dir)."""
    return (cfg.trainer.checkpoint_every or cfg.shared.max_steps) * step_bytes(cfg)


def budget_lines(cfg: RunConfig) -> list[str]:
    """What `--dry-run` prints: the time estimates, the limits they imply, the Redis bound."""
    lines = []
    config = Path(cfg.model.path) / "config.json"
    if config.exists():
        plan = time_plan(cfg, ModelShape.read(cfg.model.path))
        gib_s = cfg.world.disk_gib_per_s
        grace = f"{STOP_BASE_S:.0f} s + {MARGIN:g} x checkpoint write"
        startup = f"{STARTUP_BASE_S:.0f} s + {MARGIN:g} x (model load + checkpoint read)"
        lines += [
            f"time: checkpoint write {plan.checkpoint_bytes / GIB:.1f} GiB at {gib_s:g} GiB/s (world.disk_gib_per_s) "
            f"= {plan.checkpoint_s:.0f} s; model load {plan.load_bytes / GIB:.1f} GiB = {plan.load_s:.0f} s",
            f"time: trainers' stop grace {plan.stop_grace_s:.0f} s "
            f"({'trainer.stop_grace_s' if cfg.trainer.stop_grace_s is not None else grace}); start-up watchdog "
            f"{plan.watchdog_startup_s:.0f} s ({'watchdog_startup_s' if cfg.watchdog_startup_s is not None else startup})",
        ]
        lines.append(checkpoint_timeout(cfg)[1])
    else:
        grace, startup = run_limits(cfg)
        lines.append(
            f"time: no estimates, {config} not found; trainers' stop grace {grace:.0f} s, start-up watchdog {startup:.0f} s"
        )
    if cfg.streams.backend == "redis":
        lines.append(
            f"redis: the trainer topic holds at most {trainer_topic_steps(cfg)} steps of micro-batches "
            f"(admission lag + 1), at most {trainer_topic_bytes(cfg) / GIB:.1f} GiB ({MICRO_BATCH_BYTES_PER_TOKEN} "
            f"bytes a token, every rollout at actor.llm.max_model_len); the trainers' replay logs on disk at most "
            f"{replay_bytes(cfg) / GIB:.1f} GiB (trainer.checkpoint_every steps)"
        )
    return lines
