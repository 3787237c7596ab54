"""launch/budget.py's arithmetic (checkpoint and load times, the stop grace and start-up
watchdog they imply, the trainer topic's Redis bound) and the config checks of the keys
behind them and of Redis security."""

from __future__ import annotations

import json
import math

import pytest

from pipeline_rl.config import ConfigError, load_config
from pipeline_rl.launch.budget import (
    FALLBACK_STOP_GRACE_S,
    FALLBACK_WATCHDOG_STARTUP_S,
    MARGIN,
    MICRO_BATCH_BYTES_PER_TOKEN,
    STARTUP_BASE_S,
    STOP_BASE_S,
    budget_lines,
    checkpoint_timeout,
    replay_bytes,
    run_limits,
    time_plan,
    trainer_topic_bytes,
)
from pipeline_rl.launch.memory_plan import GIB, ModelShape

QWEN_32B = {
    "model_type": "qwen2",
    "hidden_size": 5120,
    "num_hidden_layers": 64,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "intermediate_size": 27648,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}


@pytest.fixture
def model_32b(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_32B))
    return tmp_path


def test_times_of_a_32b_checkpoint_and_load(model_32b):
    cfg = load_config("math_32b", [f"model.path={model_32b}", "world.disk_gib_per_s=2"])
    shape = ModelShape.read(model_32b)
    plan = time_plan(cfg, shape)
    # bf16: DeepSpeed state 2 + 12 bytes and the Hugging Face export 2 bytes per parameter.
    assert plan.checkpoint_bytes == shape.params * 16
    assert plan.checkpoint_s == pytest.approx(shape.params * 16 / (2 * GIB))
    assert plan.load_s == pytest.approx(shape.params * 2 / (2 * GIB))
    assert plan.stop_grace_s == pytest.approx(STOP_BASE_S + MARGIN * plan.checkpoint_s)
    assert plan.watchdog_startup_s == pytest.approx(STARTUP_BASE_S + MARGIN * (plan.load_s + plan.checkpoint_s))
    # 32.8 B parameters: 488 GiB, about four minutes at 2 GiB/s; far beyond the old fixed 120 s.
    assert 30e9 < shape.params < 34e9 and 230 < plan.checkpoint_s < 250 and plan.stop_grace_s > 500
    # Half the bandwidth, twice the time.
    slow = time_plan(load_config("math_32b", [f"model.path={model_32b}", "world.disk_gib_per_s=1"]), shape)
    assert slow.checkpoint_s == pytest.approx(2 * plan.checkpoint_s)


def test_lora_checkpoints_hold_the_adapter_only(model_32b):
    cfg = load_config("math_32b_lora", [f"model.path={model_32b}"])
    assert cfg.model.lora is not None
    shape = ModelShape.read(model_32b)
    plan = time_plan(cfg, shape)
    assert plan.checkpoint_bytes == shape.lora_params(cfg.model.lora) * 16
    assert plan.load_bytes == (shape.params + shape.lora_params(cfg.model.lora)) * 2


def test_given_limits_win_and_a_missing_model_falls_back(model_32b, tmp_path):
    cfg = load_config("math_32b", [f"model.path={model_32b}", "trainer.stop_grace_s=42", "watchdog_startup_s=99"])
    assert run_limits(cfg) == (42, 99)
    missing = load_config("math_32b", [f"model.path={tmp_path / 'nothing'}"])
    assert run_limits(missing) == (FALLBACK_STOP_GRACE_S, FALLBACK_WATCHDOG_STARTUP_S)


def test_dry_run_lines_state_times_limits_and_the_redis_bound(model_32b):
    cfg = load_config("math_32b", [f"model.path={model_32b}", "world.collective_timeout_s=60"])
    lines = budget_lines(cfg)
    text = "\n".join(lines)
    plan = time_plan(cfg, ModelShape.read(model_32b))
    assert f"checkpoint write 488.2 GiB at 1 GiB/s (world.disk_gib_per_s) = {plan.checkpoint_s:.0f} s" in text
    assert f"trainers' stop grace {plan.stop_grace_s:.0f} s" in text
    assert (
        f"world.collective_timeout_s=60 is below 2 x the checkpoint write at world.disk_gib_per_s=1: raised to {math.ceil(2 * plan.checkpoint_s)} s"
        in text
    )
    redis = [line for line in lines if line.startswith("redis:")]
    assert len(redis) == 1 and f"{trainer_topic_bytes(cfg) / GIB:.1f} GiB" in redis[0]


def test_the_trainer_topic_bound(model_32b):
    cfg = load_config(
        "base",
        [
            "trainer.checkpoint_every=10",
            "shared.max_lag=2",
            "shared.groups_per_step=4",
            "actor.attempts=2",
            "actor.llm.max_model_len=100",
            "world.trainers=2",
            "preprocess.seq_length=64",
        ],
    )
    # (1 in training + 2 ahead) steps x (4 x 2 x 100 + 2 x 64) tokens in Redis; the 10 steps
    # since the last checkpoint in the replay logs, on disk.
    assert trainer_topic_bytes(cfg) == 3 * 928 * MICRO_BATCH_BYTES_PER_TOKEN
    assert replay_bytes(cfg) == 10 * 928 * MICRO_BATCH_BYTES_PER_TOKEN


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["streams.redis.tls_ca_file=/ca.pem"], "'streams.redis.tls_ca_file' is set but 'streams.redis.tls' is false"),
        (["streams.redis.tls=true", "streams.redis.tls_cert_file=/c.pem"], "go together"),
        (["streams.redis.start_server=true", "streams.redis.tls=true"], "'streams.redis.tls' is for an external Redis"),
        (["streams.redis.start_server=true", "streams.redis.password_env=P"], "'streams.redis.password_env' is for"),
        (["world.collective_timeout_s=0"], "'world.collective_timeout_s': 0.0, must be > 0"),
        (["trainer.stop_grace_s=-1"], "'trainer.stop_grace_s': -1.0, must be >= 0 or null"),
    ],
)
def test_bad_redis_and_limit_keys_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config("base", overrides)


def test_a_password_in_the_config_is_refused():
    """The secret itself has no key: a config that still carries one fails at load."""
    with pytest.raises(ConfigError, match=r"streams\.redis\.password"):
        load_config("base", ["streams.redis.password=hunter2"])


def test_the_collective_timeout_covers_the_checkpoint_write(model_32b, capsys):
    """math_32b's timeout is accepted as shipped; on a file system half as fast (0.5 GiB/s) the
    launcher raises it to twice the checkpoint write, and --dry-run says so."""
    from pipeline_rl.launch.launcher import main

    shipped = load_config("math_32b", [f"model.path={model_32b}"])
    timeout, line = checkpoint_timeout(shipped)
    assert timeout == shipped.world.collective_timeout_s and line.endswith("accepted")
    slow = load_config("math_32b", [f"model.path={model_32b}", "world.disk_gib_per_s=0.5"])
    needed = math.ceil(2 * time_plan(slow, ModelShape.read(model_32b)).checkpoint_s)
    assert needed > shipped.world.collective_timeout_s
    assert checkpoint_timeout(slow)[0] == needed
    main(["conf=math_32b", f"model.path={model_32b}", "world.disk_gib_per_s=0.5", "--dry-run"])
    out = capsys.readouterr().out
    assert (
        f"world.collective_timeout_s=1800 is below 2 x the checkpoint write at world.disk_gib_per_s=0.5: raised to {needed} s"
        in out
    )
    main(["conf=math_32b", f"model.path={model_32b}", "--dry-run"])
    out = capsys.readouterr().out
    assert "world.collective_timeout_s=1800 is at least 2 x the checkpoint write" in out and "accepted" in out
