"""Typed run configuration: the schema (`schema.py`), its checks (`validate.py`) and how YAML layers load into it (`loader.py`)."""

from pipeline_rl.config.choices import *  # noqa: F403  (the Enums of choice-valued keys)
from pipeline_rl.config.loader import (
    SHIPPED_CONF_DIR,
    conf_dirs,
    find_config,
    load_config,
    load_saved_config,
    parse_overrides,
    save_config,
)
from pipeline_rl.config.plugin_settings import read_settings, takes_settings
from pipeline_rl.config.pool_sections import *  # noqa: F403  (the pools' sections)
from pipeline_rl.config.resolve import MASK_FREE_ATTENTION, attention_kernel, logprob_kernel, on_ray
from pipeline_rl.config.schema import *  # noqa: F403  (the schema's dataclasses)
from pipeline_rl.config.schema import RunConfig
from pipeline_rl.config.validate import ConfigError, validate

__all__ = [
    "MASK_FREE_ATTENTION",
    "SHIPPED_CONF_DIR",
    "ConfigError",
    "RunConfig",
    "attention_kernel",
    "conf_dirs",
    "find_config",
    "load_config",
    "load_saved_config",
    "logprob_kernel",
    "on_ray",
    "parse_overrides",
    "read_settings",
    "save_config",
    "takes_settings",
    "validate",
]
