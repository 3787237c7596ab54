"""Plug-ins' own settings. A domain, a loss or an agent environment declares the dataclass of
its settings with `@takes_settings(Settings)`; the mapping under its config key
(`actor.domain_settings`, `trainer.loss.settings`, the agent domain's `environment_settings`) is
read into that type when the plug-in is loaded, with the core schema's rules: an unknown key is
refused with a suggestion, a wrong type or a value outside a field's declared bounds
(config/bounds.py) names the key. A settings type may define `check(key)`, called once its
settings are read, for what types and bounds cannot say (an environment that must import)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import is_dataclass
from typing import Any, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline_rl.config.loader import merge_layer
from pipeline_rl.config.validate import ConfigError, check_bounds

SETTINGS_TYPE = "settings_type"
"""The attribute `takes_settings` puts on a plug-in."""

P = TypeVar("P")


def takes_settings(settings: type) -> Callable[[P], P]:
    """Declare a plug-in's settings type (a dataclass whose fields have defaults)."""
    if not (isinstance(settings, type) and is_dataclass(settings)):
        raise TypeError(f"takes_settings needs a dataclass, got {settings!r}")

    def mark(plugin: P) -> P:
        setattr(plugin, SETTINGS_TYPE, settings)
        return plugin

    return mark


def settings_type(plugin: Any) -> type | None:
    return getattr(plugin, SETTINGS_TYPE, None)


def read_settings(plugin: Any, data: Mapping[str, Any], key: str, name: str) -> Any:
    """`data`, the mapping under config key `key`, read into the settings type `plugin` (called
    `name` in errors) declares; None for a plug-in that declares none, which must then be given
    none. Raises ConfigError naming the key."""
    settings = settings_type(plugin)
    if settings is None:
        if data:
            raise ConfigError(f"unknown key '{key}.{next(iter(data))}': {name} takes no settings")
        return None
    source = f"'{key}' of {name}"
    merged = merge_layer(OmegaConf.structured(settings), dict(data), source, settings, key + ".")
    try:
        value = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:  # a required field (MISSING) left unset
        raise ConfigError(f"{source}: missing value for '{key}.{e.full_key}'") from None
    check_bounds(value, key + ".")
    check = getattr(value, "check", None)
    if callable(check):
        check(key)
    return value
