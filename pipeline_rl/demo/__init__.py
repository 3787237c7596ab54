"""The tiny models the CPU demo, the tests and the benchmarks build locally (no model hub)."""

from __future__ import annotations

from pathlib import Path

BUILT = (
    "tiny_model",
    "tiny_learner",
    "multistep_policy",
    "multistep_teacher",
    "multistep_prm",
    "multistep_rm",
    "multistep_prm_quick",
    "multistep_rm_quick",
    "family_byte_small",
    "family_char_base",
    "family_char_deep",
    "family_byte_wide",
    "family_char_brief",
    "family_byte_brief",
    "tools_policy",
    "tiny_moe",
    "long_chain_policy",
    "long_chain_prm",
)
"""Directory names under the cache that `build_named` can make (and any family member's fresh
copy, NAME_sSEED: pipeline_rl/demo/family.py)."""


def build_named(cache_dir: Path, name: str, seed: int = 0) -> None:
    """Build the demo model called `name` (one of BUILT) under `cache_dir`, with what it comes with."""
    from pipeline_rl.demo import (
        family,
        long_chain,
        long_chain_prm,
        multistep,
        outcome_rm,
        prm,
        tiny_model,
        tiny_moe,
        tools_policy,
    )

    if (member := family.member(name)) is not None:
        family.build(cache_dir, seed, member)
    elif name == tiny_model.TINY.name:
        tiny_model.build(cache_dir, seed, tiny_model.TINY)
    elif name == tiny_model.LEARNER.name:
        tiny_model.build(cache_dir, seed, tiny_model.LEARNER)
    elif name == tiny_moe.NAME:
        tiny_moe.build(cache_dir, seed)
    elif name == long_chain.NAME:
        long_chain.build(cache_dir, seed)
    elif name == long_chain_prm.NAME:
        long_chain_prm.build(cache_dir, seed)
    elif name == tools_policy.NAME:
        tools_policy.build(cache_dir, seed)
    elif name in (prm.FULL.name, prm.QUICK.name):
        prm.build(cache_dir, seed, prm.FULL if name == prm.FULL.name else prm.QUICK)
    elif name in outcome_rm.BASE:
        outcome_rm.build(cache_dir, seed, outcome_rm.FULL if name == outcome_rm.FULL.name else outcome_rm.QUICK)
    elif name in BUILT:
        multistep.build(cache_dir, seed)
    else:
        raise ValueError(
            f"no demo model is called {name!r}; known: {', '.join(BUILT)} and NAME_sSEED of a family member"
        )


def buildable(name: str) -> bool:
    """Whether `build_named` can make the model called `name`."""
    from pipeline_rl.demo import family

    return name in BUILT or family.member(name) is not None


def ensure_built(path: Path, seed: int = 0) -> None:
    """Build the demo model at `path` when it is missing and the directory's name is one of
    BUILT (what `launch.py conf=tiny` and the benchmarks do on a fresh clone); raises ValueError
    for a missing directory of another name."""
    if (path / "config.json").exists():
        return
    if not buildable(path.name):
        raise ValueError(
            f"{path} does not exist, and only {', '.join(BUILT)} (and NAME_sSEED of a family member) can be built"
        )
    print(f"building the tiny model into {path} ...", flush=True)
    build_named(path.parent, path.name, seed=seed)
