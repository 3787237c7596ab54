"""Checks of a loaded configuration that its types cannot express (`validate`): each field's
declared bounds (`check_bounds`, config/bounds.py), then the rules that span several keys; and
the error every configuration problem raises."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any, get_args, get_type_hints

from pipeline_rl.config.bounds import BOUNDS, Bounds
from pipeline_rl.config.choices import Attention, StepGuidanceMode
from pipeline_rl.config.resolve import on_ray
from pipeline_rl.config.schema import RunConfig


class ConfigError(ValueError):
    """A config that cannot run; the message names the key and where it came from."""


def check_bounds(section: Any, prefix: str = "") -> None:
    """Every field of `section` (a schema dataclass) and of the sections within it against the
    bounds declared on it (config/bounds.py); null passes where the field may be null."""
    hints = get_type_hints(type(section))
    for f in fields(section):
        value: Any = getattr(section, f.name)
        key = prefix + f.name
        bounds: Bounds | None = f.metadata.get(BOUNDS)
        if bounds is not None and value is not None and not bounds.allows(value):
            nullable = type(None) in get_args(hints[f.name])
            why = f" ({bounds.why})" if bounds.why else ""
            raise ConfigError(
                f"bad value for '{key}': {value}, {bounds.describe()}{' or null' if nullable else ''}{why}"
            )
        if is_dataclass(value):
            check_bounds(value, key + ".")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if is_dataclass(item):
                    check_bounds(item, f"{key}.{i}.")


def validate(cfg: RunConfig) -> None:
    """Checks of values that types alone cannot express. The schema describes; what a named
    plug-in must be is checked where it is loaded (`pipeline_rl.launch.launcher.check_plugins`
    runs those checks at launch)."""
    check_bounds(cfg)
    high = cfg.trainer.loss.ppo_clip_high
    if high is not None and high < cfg.trainer.loss.ppo_clip:
        raise ConfigError(
            f"bad value for 'trainer.loss.ppo_clip_high': {high}, must be >= 'trainer.loss.ppo_clip' "
            f"({cfg.trainer.loss.ppo_clip}) or null"
        )
    if cfg.trainer.optimizer.offload and cfg.trainer.zero_stage == 0:
        raise ConfigError("'trainer.optimizer.offload' needs 'trainer.zero_stage' >= 1 (ZeRO-Offload)")
    if (
        cfg.trainer.attention in (Attention.flash_attention_2, Attention.flex_attention, Attention.varlen)
        and cfg.shared.share_prompts
    ):
        raise ConfigError(
            f"'trainer.attention' {cfg.trainer.attention} cannot run 'shared.share_prompts' rows (they need an "
            "explicit [T, T] mask): use sdpa or auto"
        )
    for i, scorer in enumerate(cfg.preprocess.scorers):
        if ":" not in scorer.cls:
            raise ConfigError(f"bad value for 'preprocess.scorers.{i}.cls': {scorer.cls!r}, expected module:Class")
    if cfg.actor.skip_solved > 0 and cfg.preprocess.scorers:
        raise ConfigError(
            "'actor.skip_solved' judges groups by the actor's rewards, which 'preprocess.scorers' may change: "
            "set it to 0 with scorers"
        )
    if len(cfg.trainer.optimizer.betas) != 2:
        raise ConfigError(
            f"bad value for 'trainer.optimizer.betas': {cfg.trainer.optimizer.betas}, expected [beta1, beta2]"
        )
    if cfg.shared.routing_replay and cfg.shared.tensor_parallel_size > 1:
        raise ConfigError(
            "'shared.routing_replay' records routes in the engine's one worker: it needs "
            f"'shared.tensor_parallel_size' 1, got {cfg.shared.tensor_parallel_size}"
        )
    if cfg.shared.routing_replay and cfg.world.gpus_per_node > 0 and not cfg.actor.llm.enforce_eager:
        # The recorder is a Python function each MoE router calls in the forward pass: a replayed
        # CUDA graph runs the captured kernels only, so it would record no routes.
        raise ConfigError(
            "'shared.routing_replay' records each token's experts from a Python hook inside the forward "
            "pass, which CUDA graphs skip when they replay: set 'actor.llm.enforce_eager' true "
            "(or 'shared.routing_replay' false) on GPUs"
        )
    if cfg.step_guidance.mode != StepGuidanceMode.none:
        if ":" not in cfg.step_guidance.scorer.cls:
            raise ConfigError(
                f"bad value for 'step_guidance.scorer.cls': {cfg.step_guidance.scorer.cls!r}, expected module:Class "
                f"(a step scorer, needed by 'step_guidance.mode' {cfg.step_guidance.mode})"
            )
        if cfg.step_guidance.mode == StepGuidanceMode.branch and cfg.step_guidance.branch_tokens == 0:
            raise ConfigError("'step_guidance.mode' branch needs 'step_guidance.branch_tokens' > 0")
        if cfg.shared.routing_replay:
            raise ConfigError(
                f"'step_guidance.mode' {cfg.step_guidance.mode} cannot run with 'shared.routing_replay': "
                "a cut attempt has no routes"
            )
    if cfg.model.lora is not None and not cfg.model.lora.target_modules:
        raise ConfigError("bad value for 'model.lora.target_modules': empty, name at least one linear layer")
    _validate_redis(cfg)
    if on_ray(cfg) and cfg.streams.backend != "redis":
        key = "world.nodes' > 1" if cfg.world.nodes > 1 else "world.ray_address' is set"
        raise ConfigError(f"'streams.backend' must be redis when '{key} (JSONL files are one node only)")
    if on_ray(cfg):
        lo, hi = RAY_WORKER_PORTS
        for key, port in run_ports(cfg).items():
            if lo <= port <= hi:
                raise ConfigError(
                    f"'{key}' {port} is inside Ray's worker port range {lo}-{hi}, where a Ray worker can take it "
                    "before the run binds it: pick a port outside it"
                )


RAY_WORKER_PORTS = (10002, 19999)
"""Ray's default worker ports (`ray start --min-worker-port/--max-worker-port`)."""


def run_ports(cfg: RunConfig) -> dict[str, int]:
    """The ports the run itself listens on, by key: the trainers' rendezvous, the weight-update
    store and the run's own redis-server."""
    ports = {"world.trainer_port": cfg.world.trainer_port, "world.weight_sync_port": cfg.world.weight_sync_port}
    if cfg.streams.backend == "redis" and cfg.streams.redis.start_server:
        ports["streams.redis.port"] = cfg.streams.redis.port
    return ports


def _validate_redis(cfg: RunConfig) -> None:
    r = cfg.streams.redis
    files = {"tls_ca_file": r.tls_ca_file, "tls_cert_file": r.tls_cert_file, "tls_key_file": r.tls_key_file}
    given = [k for k, v in files.items() if v]
    if given and not r.tls:
        raise ConfigError(f"'streams.redis.{given[0]}' is set but 'streams.redis.tls' is false")
    if bool(r.tls_cert_file) != bool(r.tls_key_file):
        raise ConfigError(
            "'streams.redis.tls_cert_file' and 'streams.redis.tls_key_file' go together: set both or neither"
        )
    if r.start_server and (r.tls or r.password_env):
        key = "tls" if r.tls else "password_env"
        raise ConfigError(
            f"'streams.redis.{key}' is for an external Redis: the one 'streams.redis.start_server' starts has no "
            "TLS and a random password of its own (RUN_DIR/redis.password)"
        )
