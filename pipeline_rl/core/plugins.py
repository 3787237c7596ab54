"""The one plug-in loader: every `module:attr` a config key can name goes through `load_plugin`.

Datasets (`actor.dataset.loader`), domains (`actor.domain`), scorers
(`preprocess.scorers.N.cls`) and the loss (`trainer.loss.function`) are all named this way.
Whatever goes wrong (no colon, no module, no attribute, wrong kind of object) is a
ConfigError of one format that names the config key: "bad value for 'KEY': ...".
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from pipeline_rl.config import ConfigError


def import_attr(path: str) -> Any:
    """The object at `module:attr` (attr may be dotted). Raises ImportError/AttributeError/ValueError."""
    module_name, colon, attr = path.partition(":")
    if not colon or not module_name or not attr:
        raise ValueError("expected module:attr")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def load_plugin(
    spec: str, key: str, what: str, builtins: dict[str, str] | None = None, check: Callable[[Any], bool] | None = None
) -> Any:
    """Resolve config value `spec` of `key`: a built-in name (from `builtins`) or `module:attr`.
    `what` describes the expected object for the error message (e.g. "an async function");
    `check` returns whether the object is acceptable."""
    builtins = builtins or {}
    path = builtins.get(spec, spec)
    known = f"one of {sorted(builtins)} or module:attr" if builtins else "module:attr"
    if ":" not in path:
        raise ConfigError(f"bad value for '{key}': {spec!r}, expected {known}")
    try:
        obj = import_attr(path)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"bad value for '{key}': cannot import {path!r}: {type(e).__name__}: {e}") from None
    if check is not None and not check(obj):
        raise ConfigError(f"bad value for '{key}': {path!r} is not {what}")
    return obj
