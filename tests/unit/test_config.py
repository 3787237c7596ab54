"""Config loading: every shipped config validates; bad keys, types, values and files are rejected
with a message naming the key and where it came from."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.helpers import ROOT

from pipeline_rl.config import SHIPPED_CONF_DIR, ConfigError, load_config, load_saved_config, save_config
from pipeline_rl.config.bounds import BOUNDS, Bounds
from pipeline_rl.config.schema import RunConfig
from pipeline_rl.launch.placement import plan


@pytest.mark.parametrize("name", sorted(p.stem for p in SHIPPED_CONF_DIR.glob("*.yaml")))
def test_shipped_configs_load_validate_and_place(name):
    cfg = load_config(name)
    specs = plan(cfg)
    assert sum(s.pool == "trainer" for s in specs) == cfg.world.trainers
    assert sum(s.pool == "actor" for s in specs) == cfg.world.actors
    assert all(0 <= s.node < cfg.world.nodes for s in specs)


def test_gpu_configs_are_multi_node_redis():
    for name in ("math_7b", "math_32b"):
        cfg = load_config(name)
        assert cfg.world.nodes > 1 and cfg.world.gpus_per_node > 0 and cfg.streams.backend == "redis"


def test_extends_chain_and_overrides():
    cfg = load_config("math_32b", ["shared.max_lag=3", "actor.llm.kv_cache_gib=2.5"])
    assert cfg.actor.domain == "math"  # from math_7b, which math_32b extends
    assert cfg.world.nodes == 4  # math_32b's own value wins
    assert cfg.shared.max_lag == 3 and cfg.actor.llm.kv_cache_gib == 2.5


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["shared.max_lagg=3"],
            "override 'shared.max_lagg': unknown key 'shared.max_lagg' (did you mean 'shared.max_lag'?)",
        ),
        (["trainer.lr=1e-3"], "did you mean 'trainer.optimizer.lr'?"),
        (["shared.max_lag=abc"], "override 'shared.max_lag': bad value for 'shared.max_lag'"),
        (["actor.mode=fast"], "bad value for 'actor.mode': Invalid value 'fast', expected one of [async, sync]"),
        (
            ["trainer.loss.kind=dpo"],
            "bad value for 'trainer.loss.kind': Invalid value 'dpo', expected one of [reinforce, ppo, cispo]",
        ),
        (["trainer.zero_stage=5"], "'trainer.zero_stage'"),
        (["world.actors=0"], "'world.actors': 0, must be >= 1"),
        (["world.nodes=2"], "'streams.backend' must be redis"),
        (["world.actor_gpus=2"], "unknown key 'world.actor_gpus' (renamed 'shared.tensor_parallel_size')"),
        (["trainer.max_lag=2"], "unknown key 'trainer.max_lag' (renamed 'shared.max_lag')"),
        (["actor.temperature=0.7"], "unknown key 'actor.temperature' (renamed 'shared.temperature')"),
        (["preprocess.share_prompts=false"], "unknown key 'preprocess.share_prompts' (renamed 'shared.share_prompts')"),
        (["shared.tensor_parallel_size=0"], "'shared.tensor_parallel_size': 0, must be >= 1"),
        (["trainer.loss.ppo_clip_high=0.1"], "'trainer.loss.ppo_clip_high': 0.1, must be >= 'trainer.loss.ppo_clip'"),
        (["trainer.loss.ratio_mask=1.0"], "bad value for 'trainer.loss.ratio_mask': 1.0, must be > 1"),
        (["trainer.updates_per_step=0"], "'trainer.updates_per_step': 0, must be >= 1"),
        (["trainer.epochs=0"], "'trainer.epochs': 0, must be >= 1"),
        (["actor.admission_lag=-1"], "'actor.admission_lag': -1, must be >= 0 or null"),
        (["trainer.optimizer.decay=linear"], "bad value for 'trainer.optimizer.decay': Invalid value 'linear'"),
        (["trainer.optimizer.min_lr_ratio=1.5"], "'trainer.optimizer.min_lr_ratio': 1.5, must be >= 0 and <= 1"),
        (["trainer.lag_gate=tokens"], "bad value for 'trainer.lag_gate': Invalid value 'tokens'"),
        (["trainer.loss.ratio=seq"], "bad value for 'trainer.loss.ratio': Invalid value 'seq'"),
        (["noequals"], "not of the form key=value"),
        (["model.lora.rnk=8"], "unknown key 'model.lora.rnk' (did you mean 'model.lora.rank'?)"),
        (["model.lora.rank=0"], "'model.lora.rank': 0, must be >= 1 and <= 512"),
        (["model.lora.rank=1024"], "'model.lora.rank': 1024, must be >= 1 and <= 512"),
        (["model.lora.dropout=1"], "'model.lora.dropout': 1.0, must be >= 0 and < 1"),
        (["model.lora.target_modules=[]"], "'model.lora.target_modules': empty"),
    ],
)
def test_bad_overrides_name_the_key(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides)
    assert expected in str(err.value)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["trainer.loss.function=nowhere:loss"], "bad value for 'trainer.loss.function': cannot import 'nowhere:loss'"),
        (["trainer.loss.kl_coef=0.1"], "needs a scorer in 'preprocess.scorers' that produces ref_logprobs"),
        (["preprocess.scorers=[{cls: 'nowhere:Scorer'}]"], "bad value for 'preprocess.scorers.0.cls': cannot import"),
        (
            ["actor.domain=agent", "actor.domain_settings.environment=nowhere:run"],
            "bad value for 'actor.domain_settings.environment': cannot import",
        ),
        (
            [
                "actor.domain=agent",
                "actor.domain_settings.environment=fixtures.agent_envs:two_questions",
                "actor.domain_settings.tools=[nowhere:add]",
            ],
            "bad value for 'actor.domain_settings.tools.0': cannot import",
        ),
        (
            [
                "actor.domain=agent",
                "actor.domain_settings.environment=fixtures.agent_envs:two_questions",
                "actor.domain_settings.mcp_servers=[{command: no-such-mcp-server}]",
            ],
            "bad value for 'actor.domain_settings.mcp_servers.0.command': 'no-such-mcp-server' is not a program",
        ),
    ],
)
def test_bad_plugins_are_refused_at_launch_naming_the_key(overrides, expected, capsys):
    """The schema describes; plug-ins are checked when loaded, and the launcher loads them
    before anything starts."""
    from pipeline_rl.launch.launcher import main

    cfg = load_config("tiny", overrides)  # types and values are fine: only loading can tell
    assert main(["conf=tiny", f"run_dir={cfg.run_dir}", *overrides, "--dry-run"]) == 2
    assert expected in capsys.readouterr().err


def test_config_imports_no_plugin_code():
    """The config package describes runs: importing it loads no scorer, trainer or plug-in code
    (the import circle config -> scorers/loss -> plugins -> config is gone)."""
    code = (
        "import sys, pipeline_rl.config; "
        "print(sorted(m for m in sys.modules if m.startswith(('pipeline_rl.scorers', 'pipeline_rl.trainer', "
        "'pipeline_rl.core.plugins'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_bad_file_names_the_file(tmp_path):
    (tmp_path / "base.yaml").write_text("name: x\n")
    (tmp_path / "broken.yaml").write_text("trainer:\n  max_stepz: 3\n")
    (tmp_path / "loop.yaml").write_text("extends: loop\n")
    with pytest.raises(
        ConfigError, match=r"broken.yaml: unknown key 'trainer.max_stepz' \(did you mean 'shared.max_steps'\?\)"
    ):
        load_config("broken", dirs=[tmp_path])
    with pytest.raises(ConfigError, match=r"'missing' not found in .*\(available: base, broken, loop\)"):
        load_config("missing", dirs=[tmp_path])
    with pytest.raises(ConfigError, match="extends itself"):
        load_config("loop", dirs=[tmp_path])


def test_lora_is_off_by_default_and_a_key_turns_it_on():
    assert load_config("tiny").model.lora is None
    lora = load_config("tiny", ["model.lora.rank=8"]).model.lora
    assert lora is not None and lora.rank == 8 and lora.alpha == 32 and "down_proj" in lora.target_modules


def test_saved_config_round_trips(tmp_path):
    cfg = load_config("tiny", [f"run_dir={tmp_path}", "shared.max_lag=2"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_saved_config(tmp_path / "config.yaml") == cfg


def test_impossible_placement_fails_before_anything_starts(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "launch.py", "conf=math_7b", "world.actors=20", f"run_dir={run_dir}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "placement impossible" in out.stderr and "world.actors=20" in out.stderr
    assert not run_dir.exists()


def test_dry_run_of_several_nodes_prints_the_ray_placement_group(capsys):
    from pipeline_rl.launch.launcher import main

    assert main(["conf=math_32b", "--dry-run"]) in (0, 2)  # 2: the memory plan may not fit its GPUs
    out = capsys.readouterr().out
    assert "Ray placement group (PACK, 28 bundles, CPU 28, GPU 32; world.nodes=4):" in out
    assert "bundle   0: trainer0       plan node 0  {CPU: 1, GPU: 1} + redis-server" in out
    assert "bundle  27: actor7         plan node 3  {CPU: 1, GPU: 2}" in out


def test_installed_command_finds_shipped_and_user_configs_outside_the_checkout(tmp_path):
    """`pipeline-rl` (the console script of `pip install`) run from a directory of the user's
    own: it finds the shipped `tiny` through the package and `./conf/mine.yaml` next to it."""
    command = Path(sys.executable).parent / "pipeline-rl"
    assert command.exists(), f"{command} is missing: the package is not installed with its console script"
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "mine.yaml").write_text("extends: tiny\nworld:\n  actors: 2\n")
    out = subprocess.run(
        [str(command), "conf=mine", "--dry-run"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    placed = [line.split()[2] for line in out.stdout.splitlines() if line.startswith("node ")]
    assert placed == ["trainer0", "preprocessor0", "actor0", "actor1"]
    out = subprocess.run(
        [str(command), "conf=nosuch", "--dry-run"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "nosuch" in out.stderr


def test_make_tiny_if_missing_names_the_models_it_can_build(tmp_path):
    from pipeline_rl.launch.run_loop import ensure_tiny_model

    cfg = load_config("tiny", [f"model.path={tmp_path / 'my_model'}"])
    with pytest.raises(ConfigError, match=r"model\.path=.*my_model does not exist.*tiny_model, tiny_learner"):
        ensure_tiny_model(cfg)


@pytest.mark.parametrize(
    "key", ["streams.redis.port", "world.trainer_port", "world.weight_sync_port"], ids=lambda k: k.split(".")[-1]
)
def test_a_run_port_inside_rays_worker_ports_is_refused_on_ray(key):
    """On Ray a port of the run in Ray's worker port range can be taken by a worker first (the
    run then fails with "not reachable"); on one node there is no Ray to take it."""
    ray = ["world.nodes=2", "streams.backend=redis", "streams.redis.start_server=true"]
    with pytest.raises(ConfigError, match=rf"'{key}' 11000 is inside Ray's worker port range 10002-19999"):
        load_config("tiny", [*ray, f"{key}=11000"])
    assert load_config("tiny", [*ray, f"{key}=9000"]) is not None
    assert load_config("tiny", ["streams.backend=redis", f"{key}=11000"]) is not None


def _bounded_keys(section: type, prefix: str = "") -> list[tuple[str, Bounds, type]]:
    """(key, bounds, type) of every bounded field of the schema, sections within sections."""
    from dataclasses import fields, is_dataclass
    from typing import get_args, get_type_hints

    out = []
    hints = get_type_hints(section)
    for f in fields(section):
        kinds = get_args(hints[f.name]) or (hints[f.name],)
        inner = [k for k in kinds if isinstance(k, type) and is_dataclass(k)]
        if inner:
            out += _bounded_keys(inner[0], f"{prefix}{f.name}.")
        elif BOUNDS in f.metadata:
            out.append((prefix + f.name, f.metadata[BOUNDS], next(k for k in kinds if k is not type(None))))
    return out


BOUNDED = _bounded_keys(RunConfig)


def test_the_schema_declares_bounds():
    keys = {key for key, _, _ in BOUNDED}
    assert {"world.actors", "shared.max_lag", "model.lora.rank", "trainer.optimizer.min_lr_ratio"} <= keys


@pytest.mark.parametrize("key, bounds, kind", BOUNDED, ids=[key for key, _, _ in BOUNDED])
def test_every_declared_bound_refuses_a_value_just_outside_it(key, bounds, kind):
    """Each end of each declared range takes effect on the loading path: a value one step past
    it (an int's next integer, a float's end itself when open, or 0.5 past it when closed) is
    refused with the key and the range named; the end's own value, when closed, is not refused
    by the bound."""
    step = 1 if kind is int else 0.5
    outside = []
    if bounds.ge is not None:
        outside.append(bounds.ge - step)
    if bounds.gt is not None:
        outside.append(bounds.gt)
    if bounds.le is not None:
        outside.append(bounds.le + step)
    if bounds.lt is not None:
        outside.append(bounds.lt)
    assert outside
    for value in outside:
        value = kind(value)
        with pytest.raises(ConfigError, match=f"bad value for '{key}': {value}, {bounds.describe()}"):
            load_config("tiny", [f"{key}={value}"])
    for end in (bounds.ge, bounds.le):
        if end is not None:
            try:
                load_config("tiny", [f"{key}={kind(end)}"])
            except ConfigError as e:
                assert f"bad value for '{key}'" not in str(e), e


def test_bounds_describe_each_end():
    assert Bounds(ge=1).describe() == "must be >= 1"
    assert Bounds(ge=0, lt=1).describe() == "must be >= 0 and < 1"
    assert Bounds(gt=0.5).describe() == "must be > 0.5"
    assert Bounds(ge=0, le=1).allows(1) and not Bounds(ge=0, lt=1).allows(1) and not Bounds(gt=0).allows(0)
