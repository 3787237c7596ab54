"""An actor engine's settings from the run config: vLLM's engine arguments, and the process
environment vLLM must see before it starts (the model runner, the CPU threads of TP workers, the
weights kept where swaps copy into them)."""

from __future__ import annotations

import os
from typing import Any

from pipeline_rl.config import RunConfig
from pipeline_rl.engine.adapter_slot import engine_max_rank, single_slot_cpu_lora
from pipeline_rl.engine.engine_weights import keep_cpu_linear_weights
from pipeline_rl.engine.idle_spin import shorten_idle_spin
from pipeline_rl.engine.tp_swap import WORKER_EXTENSION


def engine_args(cfg: RunConfig, model_path: str) -> dict[str, Any]:
    """vLLM engine arguments of an actor (also used by scripts/bench_actor.py)."""
    llm = cfg.actor.llm
    args: dict[str, Any] = dict(
        model=str(model_path),
        dtype=cfg.model.dtype,
        seed=cfg.seed,
        enforce_eager=llm.enforce_eager,
        max_model_len=llm.max_model_len,
        max_num_seqs=llm.max_num_seqs,
        logprobs_mode="processed_logprobs",
        async_scheduling=False,
        disable_log_stats=True,
    )
    if cfg.model.lora is not None:
        # One slot, the policy's, written in place by every update (engine/adapter_slot.py).
        args.update(enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=engine_max_rank(cfg.model.lora.rank))
    if cfg.world.gpus_per_node > 0:
        args.update(gpu_memory_utilization=llm.gpu_memory_utilization)  # vLLM sizes the KV cache from it
    else:
        args.update(kv_cache_memory_bytes=int(llm.kv_cache_gib * 2**30))
    if cfg.shared.tensor_parallel_size > 1:
        # Worker processes (one per shard) that run the swap's worker half; the engine core
        # stays in this process.
        args.update(
            tensor_parallel_size=cfg.shared.tensor_parallel_size,
            distributed_executor_backend="mp",
            worker_extension_cls=WORKER_EXTENSION,
        )
    return args


PINNED_RUNNER = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
"""The model runner every engine uses, whatever the machine: V1, which the CPU runner subclasses
(what every test runs) and whose attributes engine/routes.py reads. Unset, vLLM picks V2 wherever
triton is installed (a GPU); spawned TP workers inherit it from this process's environment."""


def set_engine_environment(cfg: RunConfig) -> None:
    """Environment an actor's engine needs, set before vLLM starts (also by scripts/bench_actor.py)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: the hook reaches it
    os.environ.update(PINNED_RUNNER)
    keep_cpu_linear_weights()  # swaps copy into the weights (spawned TP workers: tp_worker.py)
    if cfg.model.lora is not None and cfg.world.gpus_per_node == 0:
        single_slot_cpu_lora()
    tp = cfg.shared.tensor_parallel_size
    if tp > 1 and cfg.world.gpus_per_node == 0:
        if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binds(tp, sorted(os.sched_getaffinity(0)))
        shorten_idle_spin()  # this process's reader of the workers' replies (tp_worker.py: the workers')
    from vllm import envs

    # vLLM freezes its environment variables when an engine starts: a later engine in the same
    # process (tests, benchmarks) must see the environment as it is now.
    envs.disable_envs_cache()


def cpu_thread_binds(workers: int, cores: list[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `workers` CPU workers: the cores in that many contiguous
    groups (vLLM refuses TP on CPU without it when the machine has fewer NUMA nodes than workers)."""
    if len(cores) < workers:
        raise ValueError(
            f"shared.tensor_parallel_size={workers} needs at least {workers} CPU cores, this process may use {len(cores)}"
        )
    cores = sorted(cores)
    size = len(cores) // workers
    groups = [cores[i * size : (i + 1) * size] for i in range(workers)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)
