"""The swap gate holds a whole engine step, for a runner that samples in a second executor call.

vLLM's Model Runner V2 (a GPU's default wherever triton is installed) keeps only the hidden
states in `execute_model` and computes the logits and samples in `sample_tokens`, which
`EngineCore.step` calls after the first call returns. The stand-ins below do the same: the body's
weights make the hidden state in `execute_model`, the output layer's make the token in
`sample_tokens`, and a load copies the body first, then the output layer. A token whose body and
output layer came from different versions, or whose tag differs from them, is a token sampled
across a swap: the gate must never let one through, with one worker (TP = 1, the hook installed
as `LLMClient.create` installs it) or with several (TP > 1, loads queued to the workers).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from pipeline_rl.engine import vllm_hook
from pipeline_rl.engine.tp_swap import TensorParallelSwapHook
from pipeline_rl.engine.vllm_hook import WeightSwapHook

GAP_S = 0.002
"""Host work between the two executor calls of a step (vLLM computes the grammar bitmask there)."""
SWAPS = 25


class Shard:
    """One worker's model: the version its body and its output layer hold."""

    def __init__(self) -> None:
        self.body = 0
        self.head = 0
        self.hidden: int | None = None

    def execute_model(self) -> None:
        self.hidden = self.body  # V2: the hidden states only, no logits yet
        return None

    def sample_tokens(self) -> tuple[int, int]:
        assert self.hidden is not None, "sample_tokens without execute_model"
        token = (self.hidden, self.head)
        self.hidden = None
        return token

    def load(self, version: int) -> None:
        self.body = version
        time.sleep(0)  # a copy releases the GIL between tensors
        self.head = version


class Core:
    """vLLM 0.32's `EngineCore.step` without async scheduling: execute (non-blocking), host
    work, then `sample_tokens` when the first call returned None."""

    def __init__(self, executor) -> None:
        self.model_executor = executor
        self.step_fn = self.step
        self.tokens: list[tuple[int, int, int]] = []
        """(tagged version, body version, output layer version) per sampled token."""
        self.tag = 0

    def step(self):
        future = self.model_executor.execute_model(None, non_block=True)
        time.sleep(GAP_S)
        output = future.result()
        if output is None:
            output = self.model_executor.sample_tokens(None)
        for body, head in output:
            self.tokens.append((self.tag, body, head))
        return {}, True


class Runner(Shard):
    """TP = 1: the model runner, in the actor process."""

    def get_model(self) -> torch.nn.Module:
        return torch.nn.Linear(1, 1)


class UniProcExecutor:
    """The in-process executor of TP = 1: calls run in the engine thread, on the runner."""

    def __init__(self, runner: Runner) -> None:
        self.driver_worker = SimpleNamespace(worker=SimpleNamespace(model_runner=runner))
        self.is_failed = False

    def execute_model(self, scheduler_output, non_block: bool = False):
        future: Future = Future()
        future.set_result(self.driver_worker.worker.model_runner.execute_model())
        return future

    def sample_tokens(self, grammar_output):
        return [self.driver_worker.worker.model_runner.sample_tokens()]


class Weights:
    """The hook's EngineWeights for one shard: an update is the version number."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard

    def prepare(self, named):
        return int(named[0][1].item())

    def load(self, version: int) -> None:
        self.shard.load(version)


def run(core: Core, hook, swap) -> None:
    """Step the engine in a thread while `swap(version)` runs SWAPS times from this one."""
    hook.on_new_version = lambda version: setattr(core, "tag", version)
    stop = threading.Event()

    def engine() -> None:
        while not stop.is_set():
            core.step_fn()

    thread = threading.Thread(target=engine)
    thread.start()
    try:
        for version in range(1, SWAPS + 1):
            time.sleep(GAP_S * 1.3)  # land at varying points of a step
            swap(version)
    finally:
        stop.set()
        thread.join()


def assert_no_token_across_a_swap(core: Core) -> None:
    mixed = [t for t in core.tokens if not t[0] == t[1] == t[2]]
    assert not mixed, f"{len(mixed)} tokens sampled across a swap (tag, body, head): {mixed[:5]}"
    versions = {t[0] for t in core.tokens}
    assert len(versions) > SWAPS // 2, f"too few versions sampled to test anything: {sorted(versions)}"


def test_tp1_swaps_land_between_steps_not_between_forward_and_sampling(monkeypatch):
    runner = Runner()
    executor = UniProcExecutor(runner)
    core = Core(executor)
    engine = SimpleNamespace(engine_core=SimpleNamespace(engine_core=core), model_executor=executor)
    # As LLMClient.create installs it; the copy plan is the stand-in's.
    monkeypatch.setattr(vllm_hook.EngineWeights, "of", classmethod(lambda cls, r, path: Weights(r)))
    hook = WeightSwapHook.install(engine, "unused", version=0)
    run(core, hook, lambda v: hook.swap([("w", torch.tensor(float(v)))], v))
    assert_no_token_across_a_swap(core)


class MultiprocExecutor:
    """TP > 1: each worker reads its messages in order; a non-blocking call (the hook's load)
    is queued and runs in every worker before the next step's forward pass."""

    def __init__(self, shards: list[Shard]) -> None:
        self.shards = shards
        self.is_failed = False
        self.staged: dict[str, int] = {}
        self._queued: list[tuple[str, tuple]] = []

    def _run_queued(self) -> None:
        queued, self._queued = self._queued, []
        for method, args in queued:
            self._call(method, args)

    def _call(self, method: str, args: tuple) -> list[str | None]:
        if method == "pipeline_rl_setup":
            return [None for _ in self.shards]
        if method == "pipeline_rl_stage":
            ticket, blob = args
            from safetensors.torch import load

            self.staged[ticket] = int(load(blob)["w"].item())
            return [None for _ in self.shards]
        if method == "pipeline_rl_load":
            version = self.staged.pop(args[0])
            for shard in self.shards:
                shard.load(version)
            return [None for _ in self.shards]
        raise AssertionError(method)

    def collective_rpc(self, method: str, args: tuple = (), non_block: bool = False):
        if non_block:
            self._queued.append((method, args))
            future: Future = Future()
            future.set_result([None for _ in self.shards])
            return future
        self._run_queued()
        return self._call(method, args)

    def execute_model(self, scheduler_output, non_block: bool = False):
        self._run_queued()
        for shard in self.shards:
            shard.execute_model()
        future: Future = Future()
        future.set_result(None)
        return future

    def sample_tokens(self, grammar_output):
        return [shard.sample_tokens() for shard in self.shards]


@pytest.mark.parametrize("workers", [2, 4])
def test_tp_swaps_land_between_steps_not_between_forward_and_sampling(workers):
    executor = MultiprocExecutor([Shard() for _ in range(workers)])
    core = Core(executor)
    engine = SimpleNamespace(
        engine_core=SimpleNamespace(engine_core=core),
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=workers)),
        collective_rpc=lambda method, args=(): executor.collective_rpc(method, args),
    )
    hook = TensorParallelSwapHook.install(engine, "unused", version=0)
    run(core, hook, lambda v: hook.swap(hook.stage([("w", torch.tensor(float(v)))]), v))
    assert_no_token_across_a_swap(core)


def test_the_engine_environment_pins_the_v1_runner_where_triton_would_pick_v2(monkeypatch):
    """On a GPU (triton installed) vLLM picks Model Runner V2 unless told otherwise; every
    engine's environment tells it V1, the runner the hooks and the route recorder read."""
    import vllm.config.vllm as vllm_config

    from pipeline_rl.config import load_config
    from pipeline_rl.engine.engine_config import set_engine_environment

    for name in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.setenv(name, "")  # restored after the test
        monkeypatch.delenv(name)
    monkeypatch.setattr(vllm_config, "HAS_TRITON", True)
    config = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None), _get_v2_model_runner_unsupported_features=lambda: []
    )
    from vllm import envs

    envs.disable_envs_cache()
    assert vllm_config.VllmConfig.use_v2_model_runner.fget(config) is True  # what a GPU would pick
    set_engine_environment(load_config("tiny"))
    assert vllm_config.VllmConfig.use_v2_model_runner.fget(config) is False
