"""The Ray placement group of a run: one bundle per process of the plan (placement.py).

A bundle always lies on one node, so each process's GPUs (a tensor-parallel actor's included)
are on one node. Bundles follow the plan's order (trainers, preprocessors, actors) and the group
is PACKed, so Ray fills nodes in that order as the plan does; trainer rank 0 is bundle 0, and
the Redis server the run starts shares that bundle. Pure logic: no Ray import.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline_rl.config import RunConfig
from pipeline_rl.launch.placement import ProcessSpec

STRATEGY = "PACK"
"""Ray's placement strategy: as few nodes as possible, in bundle order."""


@dataclass
class Bundle:
    spec: ProcessSpec
    resources: dict[str, float]
    """Ray resources the bundle reserves (CPU, GPU)."""


def bundles(cfg: RunConfig, specs: list[ProcessSpec]) -> list[Bundle]:
    """One bundle per process, in plan order; bundle 0 is trainer rank 0."""
    assert specs and specs[0].name == "trainer0", "the plan puts trainer rank 0 first"
    out = []
    for spec in specs:
        # One CPU each: a CPU run's processes are single-threaded; on GPU nodes the CPU is only
        # a scheduling token (the node has many).
        resources: dict[str, float] = {"CPU": 1.0}
        if spec.gpus:
            resources["GPU"] = float(len(spec.gpus))
        out.append(Bundle(spec, resources))
    return out


def describe_bundles(cfg: RunConfig, found: list[Bundle]) -> list[str]:
    """`--dry-run`'s view of the placement group: which process, on which node of the plan, with what."""
    total: dict[str, float] = {}
    for b in found:
        for k, v in b.resources.items():
            total[k] = total.get(k, 0.0) + v
    lines = [
        f"Ray placement group ({STRATEGY}, {len(found)} bundles, "
        + ", ".join(f"{k} {v:g}" for k, v in sorted(total.items()))
        + f"; world.nodes={cfg.world.nodes}):"
    ]
    for i, b in enumerate(found):
        res = ", ".join(f"{k}: {v:g}" for k, v in sorted(b.resources.items()))
        redis = cfg.streams.backend == "redis" and cfg.streams.redis.start_server
        extra = " + redis-server" if i == 0 and redis else ""
        lines.append(f"  bundle {i:>3}: {b.spec.name:<14} plan node {b.spec.node}  {{{res}}}{extra}")
    return lines
