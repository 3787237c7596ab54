"""The worker half of the tensor-parallel swap (engine/tp_swap.py has the actor half and the
whole protocol): methods vLLM mixes into each worker process of a TP > 1 engine
(`worker_extension_cls`), called by the actor through `collective_rpc`.

vLLM imports this module in every worker (they are spawned) before the worker loads its
model: the import is where the worker's CPU linear layers are told to keep their weights, so
that the copy plan (engine/engine_weights.py) can write into them, and where a CPU worker's
queue is told to let it sleep when there is nothing to do (engine/idle_spin.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from pipeline_rl.engine.adapter_slot import AdapterSlot, PreparedAdapter, single_slot_cpu_lora
from pipeline_rl.engine.engine_weights import EngineWeights, Prepared, keep_cpu_linear_weights
from pipeline_rl.engine.idle_spin import shorten_idle_spin
from pipeline_rl.engine.tp_swap import CHECK, GROUP_FAILED, PEER_GONE, STALE, SUMS
from pipeline_rl.streams.records import WeightUpdate, decode
from pipeline_rl.weight_layout import dtype_of
from pipeline_rl.weight_sync import PeerGone, StaleUpdate, WeightGroupFailed, WeightReceiver
from pipeline_rl.weight_sync.delta import is_delta

log = logging.getLogger(__name__)

keep_cpu_linear_weights()
if not torch.cuda.is_available():
    single_slot_cpu_lora()
    shorten_idle_spin()


class _WorkerState:
    def __init__(self, weights: EngineWeights | AdapterSlot):
        self.weights = weights
        """This worker's shard of the model, or (LoRA) of the policy's adapter slot."""
        self.receiver: WeightReceiver | None = None
        self.staged: tuple[str, Prepared | PreparedAdapter] | None = None
        self.receiving: tuple[str, WeightUpdate] | None = None
        """The ticket and announcement of the update being received."""
        self.load_s: deque[float] = deque(maxlen=10000)
        """Seconds each load took in this worker (at the head of the step after the swap)."""


class TensorParallelWorker:
    """Methods vLLM mixes into each of an engine's worker processes (worker_extension_cls);
    the actor calls them through `collective_rpc`."""

    model_runner: Any
    rank: int
    _pipeline_rl: _WorkerState

    def pipeline_rl_setup(self, model_path: str, adapter_dir: str | None = None) -> str | None:
        try:
            if adapter_dir is not None:  # each worker's set_lora writes its own shard of the adapter
                weights: EngineWeights | AdapterSlot = AdapterSlot(self.model_runner, adapter_dir)
            else:
                weights = EngineWeights.of(self.model_runner, model_path)
            self._pipeline_rl = _WorkerState(weights)
        except Exception as e:
            return f"worker {self.rank}: {e}"
        return None

    def pipeline_rl_stage(self, ticket: str, blob: bytes) -> str | None:
        """Stage an update sent inline as safetensors bytes (small models, tests)."""
        state = self._pipeline_rl
        state.staged = None
        try:
            named = list(load_safetensors(blob).items())
        except Exception as e:
            return f"worker {self.rank}: {e}"
        return self._pipeline_rl_prepare(ticket, named)

    def _pipeline_rl_prepare(self, ticket: str, named: list[tuple[str, torch.Tensor]]) -> str | None:
        """Check `named` and stage it bound to this worker's copy plan; else the reply saying why."""
        try:
            self._pipeline_rl.staged = (ticket, self._pipeline_rl.weights.prepare(named))
        except ValueError as e:
            return f"{CHECK}worker {self.rank}: {e}"
        return None

    def _pipeline_rl_prepare_kept(
        self, ticket: str, announced: WeightUpdate, kept: dict[str, list[torch.Tensor]]
    ) -> str | None:
        """As `_pipeline_rl_prepare`, for an update of which this worker kept only its shard:
        checked by the announcement's names, shapes and dtypes."""
        weights = self._pipeline_rl.weights
        assert isinstance(weights, EngineWeights)
        meta = [
            (name, torch.empty(shape, dtype=dtype_of(dtype), device="meta"))
            for name, shape, dtype in zip(announced.names, announced.shapes, announced.dtypes)
        ]
        try:
            self._pipeline_rl.staged = (ticket, weights.prepare_kept(meta, kept))
        except ValueError as e:
            return f"{CHECK}worker {self.rank}: {e}"
        return None

    def _pipeline_rl_prepare_delta(
        self, ticket: str, announced: WeightUpdate, pieces: list[tuple[str, torch.Tensor]]
    ) -> str | None:
        """As `_pipeline_rl_prepare`, for a delta: this worker's views select its part of it."""
        weights = self._pipeline_rl.weights
        try:
            if not isinstance(weights, EngineWeights):
                raise ValueError("a LoRA adapter slot takes no delta update")
            self._pipeline_rl.staged = (ticket, weights.prepare_delta(announced, pieces))
        except ValueError as e:
            return f"{CHECK}worker {self.rank}: {e}"
        return None

    def pipeline_rl_checksums(self, update: bytes) -> str:
        """Per tensor of the announced update, the checksum of this worker's part of it, the
        elements that part covers and the tensor's size, as JSON after SUMS (else why not)."""
        try:
            weights = self._pipeline_rl.weights
            if not isinstance(weights, EngineWeights):
                return SUMS + "{}"
            if weights.plan is not None and weights.plan.device.type == "cuda":
                torch.cuda.synchronize(weights.plan.device)
            numels = weights.numels()
            parts = weights.checksum_parts(decode(update, WeightUpdate))
            return SUMS + json.dumps({name: [value, covered, numels[name]] for name, (value, covered) in parts.items()})
        except Exception as e:
            return f"worker {self.rank}: {e}"

    def pipeline_rl_receive(
        self,
        ticket: str,
        addr: str,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        stage_on_host: bool,
        update: bytes,
    ) -> str | None:
        """Begin receiving an announced broadcast as weight-update rank `rank + self.rank`: check
        it and join its group (WeightReceiver.begin). Like every receiving call, it runs in the
        worker's own loop, between two engine steps (the module docstring of engine/tp_swap.py
        says why); the reply is None or why it failed (a STALE, PEER_GONE, GROUP_FAILED or
        CHECK prefix says how)."""
        state = self._pipeline_rl
        state.staged = None
        try:
            if state.receiver is None:
                # Staged on host, a worker keeps only its shard: the views its copy plan reads.
                keep = (
                    state.weights.source_views() if stage_on_host and isinstance(state.weights, EngineWeights) else None
                )
                state.receiver = WeightReceiver(
                    addr, rank + self.rank, world_size, backend, timeout_s, stage_on_host, keep
                )
            announced = decode(update, WeightUpdate)
        except Exception as e:
            return f"worker {self.rank}: {e}"
        state.receiving = (ticket, announced)

        def begin(receiver: WeightReceiver) -> None:
            receiver.begin(announced)

        return self._pipeline_rl_receiving(begin)

    def pipeline_rl_receive_buckets(self, ticket: str, first: int, stop: int) -> str | None:
        """Receive buckets first .. stop - 1 of the update `pipeline_rl_receive` began."""
        if self._pipeline_rl.receiving is None or self._pipeline_rl.receiving[0] != ticket:
            return f"worker {self.rank}: update {ticket} is not being received"
        return self._pipeline_rl_receiving(lambda receiver: receiver.receive_buckets(first, stop))

    def pipeline_rl_receive_end(self, ticket: str) -> str | None:
        """End the update's transfer and stage it: checked against this worker's copy plan."""
        state = self._pipeline_rl
        if state.receiving is None or state.receiving[0] != ticket:
            return f"worker {self.rank}: update {ticket} is not being received"
        announced = state.receiving[1]
        state.receiving = None

        def stage(receiver: WeightReceiver) -> str | None:
            named = receiver.end()
            if is_delta(announced):
                return self._pipeline_rl_prepare_delta(ticket, announced, named)
            if receiver.keep is not None:
                return self._pipeline_rl_prepare_kept(ticket, announced, receiver._kept)
            return self._pipeline_rl_prepare(ticket, named)

        return self._pipeline_rl_receiving(stage)

    def _pipeline_rl_receiving(self, step: Callable[[WeightReceiver], str | None]) -> str | None:
        """Run one part of a transfer on this worker's receiver, the engine's collectives
        finished before it starts and its own before it returns; the reply is None or why it
        failed."""
        receiver = self._pipeline_rl.receiver
        assert receiver is not None
        try:
            if receiver.device.type == "cuda":  # the last step's collectives may still run on the device
                torch.cuda.synchronize(receiver.device)
            reply = step(receiver)
            if receiver.device.type == "cuda":  # the engine loads from these buffers on its own streams
                torch.cuda.synchronize(receiver.device)
            return reply
        except StaleUpdate as e:
            self._pipeline_rl.receiving = None
            return f"{STALE}{e}"
        except WeightGroupFailed as e:
            self._pipeline_rl.receiving = None
            prefix = PEER_GONE if isinstance(e, PeerGone) else GROUP_FAILED
            return f"{prefix}worker {self.rank} (weight-update rank {receiver.rank}): {e}"
        except Exception as e:
            self._pipeline_rl.receiving = None
            return f"worker {self.rank} (weight-update rank {receiver.rank}): {e}"

    def pipeline_rl_load(self, ticket: str) -> str | None:
        state = self._pipeline_rl
        staged, state.staged = state.staged, None
        if staged is None or staged[0] != ticket:
            return f"worker {self.rank}: this update is not staged"
        started = time.perf_counter()
        try:
            state.weights.load(staged[1])  # pyright: ignore[reportArgumentType] (prepared by state.weights)
        except Exception as e:
            return f"worker {self.rank}: {e}"
        state.load_s.append(time.perf_counter() - started)
        return None
