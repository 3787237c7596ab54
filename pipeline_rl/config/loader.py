"""Loading a run config: shipped and user configs, `extends:` chains, command-line overrides.

Lookup of `conf=NAME`: `./conf/NAME.yaml` in the working directory first (a user's own
configs), then the configs shipped inside the package. `base.yaml` always comes from the
package. Each layer is merged into the schema separately so an error names its file or
override.
"""

from __future__ import annotations

import difflib
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, get_args, get_type_hints

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline_rl.config.schema import RunConfig
from pipeline_rl.config.validate import ConfigError, validate

SHIPPED_CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def conf_dirs() -> list[Path]:
    """Where `conf=NAME` is looked up, first match wins."""
    return [Path.cwd() / "conf", SHIPPED_CONF_DIR]


def _all_keys(schema: type, prefix: str = "") -> list[str]:
    keys = []
    hints = get_type_hints(schema)
    for f in fields(schema):
        full = prefix + f.name
        keys.append(full)
        # A section that may be null (model.lora) is a dataclass in a union with None.
        for kind in get_args(hints[f.name]) or (hints[f.name],):
            if isinstance(kind, type) and is_dataclass(kind):
                keys += _all_keys(kind, full + ".")
    return keys


_RENAMED = {
    "world.actor_gpus": "shared.tensor_parallel_size",
    "actor.llm.tensor_parallel_size": "shared.tensor_parallel_size",
    "actor.temperature": "shared.temperature",
    "trainer.groups_per_step": "shared.groups_per_step",
    "trainer.max_lag": "shared.max_lag",
    "trainer.max_steps": "shared.max_steps",
    "trainer.weight_update_interval": "shared.weight_update_interval",
    "preprocess.share_prompts": "shared.share_prompts",
}
"""Keys of earlier releases and their names now."""
_MOVED = {
    "actor.math_reward.": "actor.domain_settings.",
    "actor.agent.": "actor.domain_settings.",
    "actor.verifiers.": "actor.domain_settings.",
}
"""Sections of earlier releases that are now a plug-in's own settings."""


def _suggest(key: str, schema: type = RunConfig, prefix: str = "") -> str:
    renamed = _RENAMED if schema is RunConfig else {}
    if key in renamed:
        return f" (renamed '{renamed[key]}')"
    moved = [
        (new + (key + ".").removeprefix(old)).rstrip(".") for old, new in _MOVED.items() if (key + ".").startswith(old)
    ]
    if moved and schema is RunConfig:
        return f" (the domain's own settings moved to '{moved[0]}')"
    keys = _all_keys(schema, prefix)
    leaf = key.rsplit(".", 1)[-1]
    # A right name at the wrong depth (trainer.lr) is the commonest slip: match the last part first.
    close = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    # Near a key's old name (trainer.max_stepz): its name now.
    close = close or difflib.get_close_matches(key, keys + list(renamed), n=1, cutoff=0.6)
    return f" (did you mean '{renamed.get(close[0], close[0])}'?)" if close else ""


def merge_layer(base: DictConfig, layer: Any, source: str, schema: type = RunConfig, prefix: str = "") -> DictConfig:
    """`layer` merged into `base` (a structured config of `schema`, whose keys sit under
    `prefix` in the run's config); an unknown key or a bad value is a ConfigError naming the
    key and `source`."""
    try:
        merged = OmegaConf.merge(base, layer)
    except OmegaConfBaseException as e:
        key = prefix + (e.full_key or "")
        what = type(e).__name__
        if what == "ConfigKeyError":
            raise ConfigError(f"{source}: unknown key '{key}'{_suggest(key, schema, prefix)}") from None
        raise ConfigError(f"{source}: bad value for '{key}': {(e.msg or what).splitlines()[0]}") from None
    assert isinstance(merged, DictConfig)
    return merged


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def find_config(name: str, dirs: list[Path]) -> Path:
    """The file of config NAME: the first `DIR/NAME.yaml` of `dirs`."""
    for d in dirs:
        if (d / f"{name}.yaml").is_file():
            return d / f"{name}.yaml"
    known = sorted({p.stem for d in dirs for p in d.glob("*.yaml")})
    raise ConfigError(f"config '{name}' not found in {', '.join(map(str, dirs))} (available: {', '.join(known)})")


def _layers(name: str, dirs: list[Path]) -> list[tuple[Path, dict]]:
    """NAME's file and the configs it extends, outermost last; base.yaml is not included."""
    chain: list[tuple[Path, dict]] = []
    seen = set()
    while name and name != "base":
        if name in seen:
            raise ConfigError(f"config '{name}' extends itself through {sorted(seen)}")
        seen.add(name)
        path = find_config(name, dirs)
        data = _read_yaml(path)
        parent = data.pop("extends", "base")
        chain.append((path, data))
        name = parent
    return chain[::-1]


def parse_overrides(args: list[str]) -> tuple[str | None, list[str]]:
    """Split `conf=NAME` from the dotted `key=value` overrides."""
    name, overrides = None, []
    for arg in args:
        if "=" not in arg:
            raise ConfigError(f"override '{arg}' is not of the form key=value")
        if arg.startswith("conf="):
            name = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    return name, overrides


def load_config(
    name: str = "base", overrides: list[str] | tuple[str, ...] = (), dirs: list[Path] | None = None
) -> RunConfig:
    """Load, merge and validate a run config. Raises ConfigError naming the key and source.
    `dirs` defaults to `conf_dirs()`."""
    dirs = conf_dirs() if dirs is None else dirs
    cfg = OmegaConf.structured(RunConfig)
    base_path = SHIPPED_CONF_DIR / "base.yaml"
    cfg = merge_layer(cfg, _read_yaml(base_path), str(base_path))
    for path, data in _layers(name, dirs):
        cfg = merge_layer(cfg, data, str(path))
    for item in overrides:
        key, eq, _ = item.partition("=")
        if not eq:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        try:
            layer = OmegaConf.from_dotlist([item])
        except OmegaConfBaseException as e:
            raise ConfigError(f"override '{item}': {e}") from None
        cfg = merge_layer(cfg, layer, f"override '{key}'")
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(f"cannot resolve '{e.full_key}': {e.msg}") from None
    run = OmegaConf.to_object(cfg)
    assert isinstance(run, RunConfig)
    validate(run)
    return run


def save_config(cfg: RunConfig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def load_saved_config(path: Path) -> RunConfig:
    """Read back the resolved config a launcher wrote into a run directory."""
    run = OmegaConf.to_object(merge_layer(OmegaConf.structured(RunConfig), _read_yaml(path), str(path)))
    assert isinstance(run, RunConfig)
    return run
