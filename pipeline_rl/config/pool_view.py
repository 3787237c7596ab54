"""A pool process's view of the run config: its own section, `shared` and the run's machinery
(model, world, streams, metrics). The other pools' sections are withheld: reading one fails at
once, naming the key, so no pool comes to depend on another's settings (a key more than one pool
reads belongs in `shared`, where the schema says who reads it)."""

from __future__ import annotations

import copy
from typing import Any, cast

from pipeline_rl.config.schema import RunConfig

SECTION_OF_POOL = {"actor": "actor", "preprocessor": "preprocess", "trainer": "trainer"}
"""Each pool's own section of RunConfig."""


class WithheldKeyError(LookupError):
    """A pool read a key of another pool's config section. Not an AttributeError, so that
    getattr(..., default) and hasattr cannot hide the read."""


class WithheldSection:
    """Stands for another pool's section in a pool process."""

    __slots__ = ("_pool", "_section")

    def __init__(self, section: str, pool: str) -> None:
        object.__setattr__(self, "_section", section)
        object.__setattr__(self, "_pool", pool)

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__"):  # copy, pickle and repr probes, not a config read
            raise AttributeError(key)
        section, pool = object.__getattribute__(self, "_section"), object.__getattribute__(self, "_pool")
        raise WithheldKeyError(
            f"the {pool} pool read '{section}.{key}', another pool's section: a key more than one pool "
            "reads belongs in 'shared' (pipeline_rl/config/schema.py)"
        )

    def __setattr__(self, key: str, value: Any) -> None:
        self.__getattr__(key)

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return WithheldSection, (object.__getattribute__(self, "_section"), object.__getattribute__(self, "_pool"))

    def __repr__(self) -> str:
        return f"<{object.__getattribute__(self, '_section')}: withheld from the {object.__getattribute__(self, '_pool')} pool>"


def for_pool(cfg: RunConfig, pool: str) -> RunConfig:
    """A shallow copy of `cfg` in which the sections of the pools other than `pool` are withheld."""
    if pool not in SECTION_OF_POOL:
        raise ValueError(f"no pool is called {pool!r}; pools: {', '.join(SECTION_OF_POOL)}")
    view = copy.copy(cfg)
    for other, section in SECTION_OF_POOL.items():
        if other != pool:
            setattr(view, section, cast(Any, WithheldSection(section, pool)))
    return view
