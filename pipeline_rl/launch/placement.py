"""Where each process of a run goes: which node, which GPUs, which addresses.

The placement follows from the config alone. Trainers come first (so trainer rank 0, which
owns the weight-update group, sits on node 0 next to the Redis server), then preprocessors,
then actors. On GPUs a process takes whole GPUs and an actor engine never spans nodes; on CPU
each node gets an equal share of the processes. On several nodes the Ray driver reserves one
bundle per process in this order (bundles.py) and Ray picks the nodes; the node indices are
then where Ray put them.

GPU binding (child_env): a process sees exactly its GPUs through CUDA_VISIBLE_DEVICES, so
inside it they are devices 0..n-1 and a trainer's LOCAL_RANK (what torch.cuda.set_device and
DeepSpeed use) is 0. GPU ids of the plan index the GPUs the launcher itself sees: when a job
scheduler has already set CUDA_VISIBLE_DEVICES, the children get subsets of that list. On Ray,
Ray sets each process's CUDA_VISIBLE_DEVICES to the GPUs of its bundle.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from pipeline_rl.config import ConfigError, RunConfig
from pipeline_rl.weight_sync import group_ranks
from pipeline_rl.wire import WEIGHT_SYNC_ADDR_ENV


@dataclass
class ProcessSpec:
    name: str
    """actor0, preprocessor0, trainer0, ..."""
    pool: str
    """actor, preprocessor or trainer."""
    index: int
    """Index within the pool (the trainer's rank)."""
    node: int
    gpus: list[int] = field(default_factory=list)
    """GPU ids on its node (empty on CPU)."""


@dataclass
class Node:
    rank: int
    """This node's index, 0 .. nodes-1."""
    nodes: int
    master_addr: str
    """Address of node 0, reachable from every node."""
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    """CPU cores of the node (this machine's unless the cluster says otherwise)."""


_GPU_KEYS = {
    "trainer": "one GPU per trainer",
    "preprocessor": "world.preprocessor_gpus",
    "actor": "shared.tensor_parallel_size",
}


def _pools(cfg: RunConfig) -> list[tuple[str, int, int]]:
    w = cfg.world
    return [
        ("trainer", w.trainers, 1),
        ("preprocessor", w.preprocessors, w.preprocessor_gpus),
        ("actor", w.actors, cfg.shared.tensor_parallel_size),
    ]


def plan(cfg: RunConfig) -> list[ProcessSpec]:
    """All processes of the run; raises ConfigError when they do not fit the world."""
    w = cfg.world
    specs: list[ProcessSpec] = []
    if w.gpus_per_node == 0:
        total = w.trainers + w.preprocessors + w.actors
        per_node = math.ceil(total / w.nodes)
        slot = 0
        for pool, count, _ in _pools(cfg):
            for i in range(count):
                specs.append(ProcessSpec(f"{pool}{i}", pool, i, node=slot // per_node))
                slot += 1
        return specs
    free = {node: list(range(w.gpus_per_node)) for node in range(w.nodes)}
    node = 0
    for pool, count, gpus in _pools(cfg):
        if gpus > w.gpus_per_node:
            raise ConfigError(
                f"{_GPU_KEYS[pool]}={gpus} but world.gpus_per_node={w.gpus_per_node}: one {pool} cannot span nodes"
            )
        for i in range(count):
            while node < w.nodes and len(free[node]) < gpus:
                node += 1
            if node >= w.nodes:
                tp = cfg.shared.tensor_parallel_size
                need = w.trainers + w.preprocessors * w.preprocessor_gpus + w.actors * tp
                raise ConfigError(
                    f"placement impossible: the pools need {need} GPUs (world.trainers={w.trainers}, "
                    f"world.actors={w.actors} x shared.tensor_parallel_size={tp}, world.preprocessors="
                    f"{w.preprocessors} x world.preprocessor_gpus={w.preprocessor_gpus}) but world.nodes="
                    f"{w.nodes} x world.gpus_per_node={w.gpus_per_node} = {w.nodes * w.gpus_per_node} exist"
                )
            taken, free[node] = free[node][:gpus], free[node][gpus:]
            specs.append(ProcessSpec(f"{pool}{i}", pool, i, node=node, gpus=taken))
    return specs


def visible_gpus(cfg: RunConfig, env: dict[str, str]) -> list[str]:
    """The device ids a launcher on this node may hand out: the scheduler's CUDA_VISIBLE_DEVICES
    when it set one, else 0 .. gpus_per_node-1."""
    inherited = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not inherited:
        return [str(i) for i in range(cfg.world.gpus_per_node)]
    if len(inherited) < cfg.world.gpus_per_node:
        raise ConfigError(
            f"world.gpus_per_node={cfg.world.gpus_per_node} but CUDA_VISIBLE_DEVICES="
            f"{env['CUDA_VISIBLE_DEVICES']} shows this node only {len(inherited)}"
        )
    return inherited


def child_env(
    cfg: RunConfig, node: Node, spec: ProcessSpec, specs: list[ProcessSpec], env: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment of one pool process: the launcher's own `env` plus its binding."""
    env = dict(os.environ if env is None else env)
    env["PYTHONUNBUFFERED"] = "1"
    master = node.master_addr if node.nodes > 1 else "127.0.0.1"
    env[WEIGHT_SYNC_ADDR_ENV] = f"{master}:{cfg.world.weight_sync_port}"
    if cfg.world.gpus_per_node:
        visible = visible_gpus(cfg, env)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[g] for g in spec.gpus)
        # The node's cores shared among its processes: OpenMP's default (every core in every
        # process) oversubscribes a node of 8 GPU processes 8 times.
        sharing = sum(1 for s in specs if s.node == spec.node)
        env.setdefault("OMP_NUM_THREADS", str(max(1, node.cpus // sharing)))
    else:
        # Two OpenMP threads in one process are much slower than one on small CPU VMs.
        env.setdefault("OMP_NUM_THREADS", "1")
        env["CUDA_VISIBLE_DEVICES"] = ""
    if spec.pool == "trainer":
        local = [s for s in specs if s.pool == "trainer" and s.node == spec.node]
        env.update(
            RANK=str(spec.index),
            WORLD_SIZE=str(cfg.world.trainers),
            # On GPUs each trainer sees one device, its device 0; on CPU its index on the node.
            LOCAL_RANK="0" if cfg.world.gpus_per_node else str(local.index(spec)),
            LOCAL_WORLD_SIZE="1" if cfg.world.gpus_per_node else str(len(local)),
            MASTER_ADDR=master,
            MASTER_PORT=str(cfg.world.trainer_port),
        )
        if cfg.world.gpus_per_node:
            # Packed micro-batches change length every step: with fixed segments the allocator
            # reserved 34.8 GiB for a 29.1 GiB peak (gpu_check.py, ZeRO-3, 8k tokens, H200),
            # with expandable ones 31.0. Trainers only: vLLM manages its own pool.
            env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


def describe(cfg: RunConfig, specs: list[ProcessSpec], env: dict[str, str] | None = None) -> list[str]:
    """One line per process for `--dry-run`: node, name, role and the binding it will get."""
    env = dict(os.environ if env is None else env)
    lines = []
    for spec in specs:
        node = Node(rank=spec.node, nodes=cfg.world.nodes, master_addr=env.get("MASTER_ADDR", "<node 0>"))
        child = child_env(cfg, node, spec, specs, env)
        binding = f"CUDA_VISIBLE_DEVICES={child['CUDA_VISIBLE_DEVICES'] or '(none: cpu)'}"
        if spec.pool == "trainer":
            binding += f" RANK={child['RANK']} LOCAL_RANK={child['LOCAL_RANK']}"
        if spec.pool == "actor":
            tp = cfg.shared.tensor_parallel_size
            ranks, world = group_ranks(spec.index, cfg.world.actors, tp)
            binding += f" tensor_parallel_size={tp} weight-update ranks {ranks[0]}-{ranks[-1]} of {world}"
        lines.append(f"node {spec.node}: {spec.name:<14} {spec.pool:<12} {binding}")
    return lines
