"""Placement and the binding each process gets: right by construction for every shipped config."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
from fixtures.helpers import ROOT

from pipeline_rl.config import SHIPPED_CONF_DIR, ConfigError, load_config
from pipeline_rl.launch.placement import Node, child_env, plan
from pipeline_rl.weight_sync import backend_for

SHIPPED = sorted(p.stem for p in SHIPPED_CONF_DIR.glob("*.yaml"))


@pytest.mark.parametrize("name", SHIPPED)
def test_every_process_sees_exactly_its_devices(name):
    cfg = load_config(name)
    specs = plan(cfg)
    envs = {s.name: child_env(cfg, Node(s.node, cfg.world.nodes, "10.0.0.1"), s, specs, {}) for s in specs}
    per_node: Counter = Counter()
    for s in specs:
        env = envs[s.name]
        visible = [d for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d]
        assert len(visible) == len(s.gpus)
        per_node.update((s.node, d) for d in visible)
        if s.pool == "trainer":
            if cfg.world.gpus_per_node:
                # torch.cuda.set_device(LOCAL_RANK) and DeepSpeed index the devices the process sees.
                assert env["LOCAL_RANK"] == "0" and len(visible) == 1
            assert (env["RANK"], env["WORLD_SIZE"]) == (str(s.index), str(cfg.world.trainers))
    assert all(n == 1 for n in per_node.values()), "a GPU given to two processes"
    ranks = sorted(int(envs[s.name]["RANK"]) for s in specs if s.pool == "trainer")
    assert ranks == list(range(cfg.world.trainers))


def test_gpu_trainers_use_device_0_of_their_own_and_cpu_trainers_their_node_index():
    cfg = load_config("math_7b")
    specs = plan(cfg)
    trainers = [s for s in specs if s.pool == "trainer"]
    envs = [child_env(cfg, Node(s.node, 2, "h"), s, specs, {}) for s in trainers]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == [str(i) for i in range(8)]
    assert {e["LOCAL_RANK"] for e in envs} == {"0"}
    cfg = load_config("tiny", ["world.trainers=2"])
    specs = plan(cfg)
    envs = [child_env(cfg, Node(0, 1, "h"), s, specs, {}) for s in specs if s.pool == "trainer"]
    assert [(e["LOCAL_RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in envs] == [("0", ""), ("1", "")]


def test_gpu_trainers_get_expandable_segments_unless_the_user_chose():
    cfg = load_config("math_7b")
    specs = plan(cfg)
    envs = {s.pool: child_env(cfg, Node(s.node, 2, "h"), s, specs, {}) for s in specs}
    assert envs["trainer"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in envs["actor"]  # vLLM manages its own memory pool
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    trainer = next(s for s in specs if s.pool == "trainer")
    assert child_env(cfg, Node(0, 2, "h"), trainer, specs, mine)["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    cfg = load_config("tiny")
    specs = plan(cfg)
    assert all("PYTORCH_CUDA_ALLOC_CONF" not in child_env(cfg, Node(0, 1, "h"), s, specs, {}) for s in specs)


def test_scheduler_binding_is_kept_not_overwritten():
    cfg = load_config("math_7b")
    specs = plan(cfg)
    slurm = {"CUDA_VISIBLE_DEVICES": "4,5,6,7,0,1,2,3"}
    got = [child_env(cfg, Node(s.node, 2, "h"), s, specs, slurm)["CUDA_VISIBLE_DEVICES"] for s in specs[:8]]
    assert got == ["4", "5", "6", "7", "0", "1", "2", "3"]
    with pytest.raises(ConfigError, match="gpus_per_node=8 but CUDA_VISIBLE_DEVICES=0,1"):
        child_env(cfg, Node(0, 2, "h"), specs[0], specs, {"CUDA_VISIBLE_DEVICES": "0,1"})


@pytest.mark.parametrize("name", SHIPPED)
def test_weight_sync_backend_is_one_choice_for_both_ends(name):
    cfg = load_config(name)
    assert backend_for(cfg.world.gpus_per_node) == ("nccl" if cfg.world.gpus_per_node else "gloo")


def test_dry_run_prints_every_process_binding():
    out = subprocess.run(
        [sys.executable, "launch.py", "conf=math_32b", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("node ")]
    specs = plan(load_config("math_32b"))
    assert len(lines) == len(specs)
    # Several nodes run on Ray: one bundle per process, in the same order.
    bundles = [line.split()[2] for line in out.stdout.splitlines() if line.startswith("  bundle ")]
    assert bundles == [s.name for s in specs]
    for line, s in zip(lines, specs):
        assert line.startswith(f"node {s.node}: {s.name} ") and "CUDA_VISIBLE_DEVICES=" in line
        assert ("LOCAL_RANK=0" in line) == (s.pool == "trainer")
    # math_32b: 8 actors of two GPUs each on nodes 2-3; each of their 16 workers is a rank of the
    # weight-update group after trainer rank 0.
    actors = [line for line in lines if " actor " in line]
    assert len(actors) == 8
    for i, line in enumerate(actors):
        gpus = f"{2 * (i % 4)},{2 * (i % 4) + 1}"
        assert line.startswith(f"node {2 + i // 4}: actor{i} ") and f"CUDA_VISIBLE_DEVICES={gpus} " in line
        assert line.endswith(f"tensor_parallel_size=2 weight-update ranks {1 + 2 * i}-{2 + 2 * i} of 17")


def test_cpu_tensor_parallel_workers_get_disjoint_cores():
    from pipeline_rl.engine.engine_config import cpu_thread_binds

    assert cpu_thread_binds(2, [1, 0]) == "0|1"
    assert cpu_thread_binds(2, list(range(8))) == "0-3|4-7"
    assert cpu_thread_binds(1, [4, 5, 6]) == "4-6"
    with pytest.raises(ValueError, match="tensor_parallel_size=3 needs at least 3 CPU cores"):
        cpu_thread_binds(3, [0, 1])


def test_gpu_processes_share_their_nodes_cores():
    """On GPU nodes each pool process gets OMP_NUM_THREADS = the node's cores / its processes
    (OpenMP would give every process every core); a value the user set is kept."""
    cfg = load_config(
        "tiny", ["world.gpus_per_node=8", "world.actors=4", "world.trainers=4", "shared.tensor_parallel_size=1"]
    )
    specs = plan(cfg)
    on_node0 = [s for s in specs if s.node == 0]
    envs = [child_env(cfg, Node(0, cfg.world.nodes, "h", cpus=96), s, specs, {}) for s in on_node0]
    assert {e["OMP_NUM_THREADS"] for e in envs} == {str(96 // len(on_node0))}
    kept = child_env(cfg, Node(0, cfg.world.nodes, "h", cpus=96), on_node0[0], specs, {"OMP_NUM_THREADS": "3"})
    assert kept["OMP_NUM_THREADS"] == "3"
    few = child_env(cfg, Node(0, cfg.world.nodes, "h", cpus=2), on_node0[0], specs, {})
    assert few["OMP_NUM_THREADS"] == "1"
