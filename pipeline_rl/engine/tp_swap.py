"""The in-flight weight swap for tensor-parallel engines (shared.tensor_parallel_size > 1).

With TP > 1, vLLM runs one model shard per worker process, while the engine core and its
scheduler stay in the actor process (VLLM_ENABLE_V1_MULTIPROCESSING=0). As with TP = 1,
`TensorParallelSwapHook` wraps the engine core's step (schedule, forward pass in every worker,
sample, update) in the lock, and `on_new_version` fires before the first step with new weights.

A swap has two phases:
1. Staging: each worker receives the whole update into a buffer of its own (every TP worker is
   a rank of the weight-update group, see weight_sync.group_ranks), in parts: the join, each
   bucket, the end. Each part is a call the actor queues to every worker between two engine
   steps (`SwapGate.between_steps`), and the engine steps once between two parts. A worker runs
   it in its own loop, after the last step's collectives have finished on its device and
   finishing its own before it returns. So the weight-sync communicator and the engine's TP
   communicator are never active at once in a worker, and every worker meets their collectives
   in one order, the order of its message queue, which vLLM broadcasts to all workers alike.
   NCCL asks exactly that of several communicators in one process: without it two workers that
   launch them in different orders can deadlock. The price: the engine does not step while a
   bucket is on the wire (docs/performance.md has the measured cost).
   At the end each worker checks what it received (complete, the checkpoint's names and
   shapes) and replies with the verdict; the actor's `Staged` carries any failure.
2. Under the lock, between two steps: if any worker's check failed, nothing loads (the old
   version keeps serving); otherwise a load message goes to every worker without waiting for
   the replies, and the new version is set. Each worker reads its messages in order, so it
   copies its staged update into its shard (engine/engine_weights.py's plan) before the next
   step's forward pass: every shard changes between the same two engine steps, and the
   workers copy while the actor schedules that step instead of a round trip holding the lock.
   The replies are read after that step (`_after_call`). A load that failed on any worker
   discards that step's result; the hook then refuses every later step, the engine thread
   fails, and the actor exits with that error. A worker that dies makes vLLM fail the engine:
   no step runs on the shards that are left.

Every call into the workers shares one message queue with the engine's own step messages, so
each takes the lock. The worker methods never raise: vLLM raises on the first failing worker
and leaves the other workers' replies in their queues, where the next call would read them;
they return an error text instead.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save as save_safetensors

from pipeline_rl.engine.vllm_hook import Staged, SwapGate
from pipeline_rl.engine.weight_delta import mismatches
from pipeline_rl.streams.records import WeightUpdate, encode
from pipeline_rl.weight_sync import INCARNATION, SENDER, PeerGone, StaleUpdate, WeightGroupFailed
from pipeline_rl.weight_sync.delta import weight_names
from pipeline_rl.weight_sync.group import RESYNC

log = logging.getLogger(__name__)

WORKER_EXTENSION = "pipeline_rl.engine.tp_worker.TensorParallelWorker"
"""vLLM's worker_extension_cls for TP > 1 engines."""

STALE = "stale: "
GROUP_FAILED = "group failed: "
"""Prefix of a worker's report whose transfer failed (weight_sync.WeightGroupFailed): fatal to the actor."""
PEER_GONE = "peer gone: "
"""The same, failed because members are gone (weight_sync.PeerGone)."""
CHECK = "check: "
"""Prefix of a worker's reply whose staged update failed its check."""
SUMS = "sums: "
"""Prefix of a worker's checksums of its part of the weights (pipeline_rl_checksums)."""
BUCKETS_PER_CALL = 1
"""Buckets of an update each worker receives in one call between two engine steps: the engine
steps once between two calls."""


def _failures(replies: list[str | None]) -> str | None:
    failed = [r for r in replies if r is not None]
    return "; ".join(failed) if failed else None


def _staged(ticket: str, replies: list[str | None], what: str, base: int = -1) -> Staged:
    """The `Staged` of the workers' replies to staging: a failed check goes to the swap, which
    refuses it (ValueError); any other failure raises RuntimeError now."""
    failed = _failures([r for r in replies if r is None or not r.startswith(CHECK)])
    if failed:
        raise RuntimeError(f"{what}: {failed}")
    problem = _failures([r.removeprefix(CHECK) if r is not None else None for r in replies])
    return Staged(ticket, problem=problem, base=base)


class TensorParallelSwapHook(SwapGate):
    """Gates the engine core's step and swaps the weights of every TP worker between two
    steps (the swap contract: pipeline_rl/engine/vllm_hook.py); each worker holds its own copy
    of the update."""

    def __init__(self, llm_engine, version: int, tensor_parallel_size: int, history: int = 10000):
        # The in-process engine core, which vLLM's annotation types as the general client.
        super().__init__(llm_engine.engine_core.engine_core, "step_fn", version, history)
        self.tensor_parallel_size = tensor_parallel_size
        self._engine = llm_engine
        self._executor = llm_engine.engine_core.engine_core.model_executor
        self._pending: tuple[str, Any] | None = None
        """The ticket of a load queued to the workers and the future of their replies."""

    @classmethod
    def install(
        cls, llm_engine, model_path: str | Path, version: int, adapter_dir: str | Path | None = None
    ) -> TensorParallelSwapHook:
        """Hook an in-process LLMEngine whose workers run WORKER_EXTENSION; with `adapter_dir`
        (the adapter the engine serves in its LoRA slot) updates are adapters."""
        tp = llm_engine.vllm_config.parallel_config.tensor_parallel_size
        hook = cls(llm_engine, version, tp)
        with hook.lock:
            failed = _failures(
                hook._rpc("pipeline_rl_setup", str(model_path), None if adapter_dir is None else str(adapter_dir))
            )
        if failed:
            raise RuntimeError(f"tensor-parallel weight swap set-up failed: {failed}")
        return hook

    def _rpc(self, method: str, *args: Any) -> list[str | None]:
        """Call `method` in every worker; the caller holds the lock."""
        if self._executor.is_failed:
            # Set by vLLM's worker monitor when a worker died; the executor is then shut down.
            raise RuntimeError("a vLLM worker process of this engine died; vLLM shut the engine down")
        return self._engine.collective_rpc(method, args=args)

    def stage(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Staged:
        """Send an update to every worker inline (as safetensors bytes through vLLM's RPC queue:
        fine for small models and tests; real updates come by broadcast, see `receiver`)."""
        blob = save_safetensors({name: t.detach().contiguous() for name, t in named_tensors})
        ticket = uuid.uuid4().hex
        with self._turnstile, self.lock:
            replies = self._rpc("pipeline_rl_stage", ticket, blob)
        return _staged(ticket, replies, "staging a weight update")

    def _check(self, staged: Staged) -> None:
        """Nothing to look up here: each worker's load call checks that it staged `staged`."""

    def _load(self, staged: Staged) -> None:
        self._after_call()  # a load no step has read the replies of yet
        if self._executor.is_failed:
            raise RuntimeError("a vLLM worker process of this engine died; vLLM shut the engine down")
        # Queued ahead of the next step's messages (each worker reads its queue in order): every
        # worker copies its shard before that step's forward pass, while the actor schedules it.
        self._pending = (
            staged.ticket,
            self._executor.collective_rpc("pipeline_rl_load", args=(staged.ticket,), non_block=True),
        )

    def _after_call(self) -> None:
        """Read the workers' replies to a queued load (the step just taken read them off the
        queue already, or they come right away): if any failed, the step ran on partly loaded
        shards, so its result is discarded and the engine refuses every later step."""
        if self._pending is None:
            return
        ticket, replies = self._pending
        self._pending = None
        failed = _failures(replies.result())
        if failed:
            self.failures += 1
            self._broken = f"loading update {ticket} failed: {failed}"
            raise RuntimeError(self._broken)

    def mismatches(self, update: WeightUpdate) -> list[str]:
        """Every worker's checksums of its part, combined (engine/weight_delta.py)."""
        if not update.checksums:
            return []
        replies = self.between_steps(lambda: self._rpc("pipeline_rl_checksums", encode(update)))
        failed = [r for r in replies if r is None or not r.startswith(SUMS)]
        if failed:
            raise RuntimeError(f"checksums of weight update {update.version}: {failed[0]}")
        held = [json.loads(r.removeprefix(SUMS)) for r in replies if r is not None]
        parts = [{name: (v[0], v[1]) for name, v in worker.items()} for worker in held]
        numels = {name: v[2] for worker in held for name, v in worker.items()}
        return mismatches(parts, weight_names(update), numels, update.checksums)

    def receiver(
        self, addr: str, first_rank: int, world_size: int, backend: str, timeout_s: float, stage_on_host: bool = False
    ) -> TensorParallelReceiver:
        return TensorParallelReceiver(self, addr, first_rank, world_size, backend, timeout_s, stage_on_host)


class TensorParallelReceiver:
    """An actor's end of the weight broadcast when its TP workers are the receivers:
    `receive` has every worker stage the update and returns a `Staged` for the hook's swap
    (the same two calls as with a WeightReceiver and WeightSwapHook)."""

    def __init__(
        self,
        hook: TensorParallelSwapHook,
        addr: str,
        first_rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        stage_on_host: bool,
    ):
        self.hook, self.addr, self.first_rank, self.world_size = hook, addr, first_rank, world_size
        self.backend, self.stage_on_host, self.timeout = backend, stage_on_host, timedelta(seconds=timeout_s)
        host, _, port = addr.rpartition(":")
        self._host, self._port = host, int(port)
        self._store: dist.TCPStore | None = None
        self.incarnation: str | None = None

    def receive(self, update: WeightUpdate) -> Staged:
        """Have every worker receive the update and stage it, in parts that each run between two
        engine steps (`SwapGate.between_steps`): the join, each bucket, the end and check."""
        ticket = f"{update.version}-{uuid.uuid4().hex[:8]}"
        hook = self.hook
        self._between_steps(
            update,
            "pipeline_rl_receive",
            ticket,
            self.addr,
            self.first_rank,
            self.world_size,
            self.backend,
            self.timeout.total_seconds(),
            self.stage_on_host,
            encode(update),
        )
        if self.incarnation is None or self._store is None:
            self._read_incarnation(update)
        buckets = len(update.bucket_sizes)
        for first in range(0, buckets, BUCKETS_PER_CALL):
            self._between_steps(
                update, "pipeline_rl_receive_buckets", ticket, first, min(first + BUCKETS_PER_CALL, buckets)
            )
        replies = hook.between_steps(lambda: hook._rpc("pipeline_rl_receive_end", ticket))
        self._raise_failed(update, replies)
        return _staged(ticket, replies, f"weight update {update.version}", update.base)

    def request_full(self) -> None:
        if self._store is None:
            self._store = dist.TCPStore(self._host, self._port, self.world_size, is_master=False, timeout=self.timeout)
        self._store.add(RESYNC, 1)

    def _between_steps(self, update: WeightUpdate, method: str, *args: Any) -> None:
        """Call `method` in every worker between two engine steps and raise any worker's failure.
        The workers whose part went through keep the group: the sender names a new one after a
        failed transfer, and their next join leaves this one for it."""
        hook = self.hook
        replies = hook.between_steps(lambda: hook._rpc(method, *args))
        if _failures(replies) is None:
            return
        self._raise_failed(update, replies)
        raise RuntimeError(f"weight update {update.version}: {_failures(replies)}")

    @staticmethod
    def _raise_failed(update: WeightUpdate, replies: list[str | None]) -> None:
        """Raise what a worker's failed transfer means for the actor (a failed check is the
        swap's to refuse, not raised here)."""
        statuses = [r for r in replies if r is not None]
        gone = [s for s in statuses if s.startswith(PEER_GONE)]
        if gone:
            raise PeerGone(gone[0].removeprefix(PEER_GONE))
        failed = [s for s in statuses if s.startswith(GROUP_FAILED)]
        if failed:
            raise WeightGroupFailed(failed[0].removeprefix(GROUP_FAILED))
        stale = [s for s in statuses if s.startswith(STALE)]
        if stale:
            raise StaleUpdate(stale[0].removeprefix(STALE))

    def _read_incarnation(self, update: WeightUpdate) -> None:
        """The sender's incarnation, from its store (the workers joined it already)."""
        try:
            self._store = dist.TCPStore(self._host, self._port, self.world_size, is_master=False, timeout=self.timeout)
            self.incarnation = self._store.get(INCARNATION).decode()
        except Exception as e:
            self._store = None  # the sender's store went away (trainer restarted): connect again next time
            raise WeightGroupFailed(
                f"weight update {update.version}: the weight-sync store at {self.addr} is unreachable ({e}): "
                f"{SENDER} (weight-update rank 0, the sender, hosts it) is gone"
            ) from e

    def close(self) -> None:
        self._store = None
