"""LLMClient: one in-process vLLM engine, driven step by step, for asyncio rollouts.

`generate` hands its requests to an engine thread that adds them between engine steps and
steps the engine while it has work; vLLM's continuous batching puts the requests of all
rollouts into the same forward passes. Finished groups resolve their asyncio future.

Per-token versions: right before the first forward pass with new weights (the hook's
`on_new_version`, under its lock), the engine thread notes for every live request how many
tokens it has so far; those came from earlier forward passes, with the old weights, and the
rest come from the new ones. So a completion that spans a swap carries exactly where the swap
happened, and the engine only reports finished requests (no per-step output objects, which
cost ~10% throughput on the tiny model).

The engine runs in its own thread so that the event loop (rewards, environments) and the
forward passes overlap; the loop and the engine thread share only a queue and futures.

Logprobs are the sampled tokens' logprobs at the sampling temperature: the engine runs with
logprobs_mode="processed_logprobs" (after temperature, and after top-p/top-k when those are
set; the trainer computes them at the temperature, so top_p < 1 makes them differ).
Async scheduling is off: with it, a step's outputs would come from the previous forward
pass and the version tags would be one step off.

Rollouts in flight (actor/in_flight.py): `snapshot()` returns, between two engine steps, every
sequence of the calls it is asked about as far as it has got (engine/sequences.py: its tokens,
logprobs and versions; finish_reason "" while unfinished), and with `hold` steps no more, so
that nothing generated after the snapshot is thrown away at a stop. `generate(..., resume=...)` takes such a snapshot
back: a finished sequence is returned as it was, an unfinished one is continued, its tokens
re-entered after the prompt and its completion the saved part followed by what the engine
generates now, under its current weights and version.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipeline_rl.config import RunConfig
from pipeline_rl.engine.adapter_slot import POLICY_LORA_ID, lora_request
from pipeline_rl.engine.engine_config import engine_args, set_engine_environment
from pipeline_rl.engine.routes import RouteRecorder
from pipeline_rl.engine.sequences import CallGroup, Completion, SequenceRequest, part_of, parts_so_far, post
from pipeline_rl.engine.tp_swap import TensorParallelSwapHook
from pipeline_rl.engine.vllm_hook import Receiver, SwapGate, WeightSwapHook, check_vllm_version
from pipeline_rl.engine.weight_updates import WeightUpdates
from pipeline_rl.streams.api import Reader
from pipeline_rl.streams.records import WeightUpdate
from pipeline_rl.weight_sync import WeightGroupFailed, group_ranks

if TYPE_CHECKING:  # vllm is imported when an engine is created, not when this module is
    from vllm import LLMEngine
    from vllm.tokenizers import TokenizerLike

log = logging.getLogger(__name__)


def _percentiles(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return 0.0, 0.0, 0.0
    s = sorted(values)
    return s[len(s) // 2], s[min(len(s) - 1, int(len(s) * 0.99))], s[-1]


class LLMClient:
    def __init__(
        self,
        engine: LLMEngine,
        hook: SwapGate,
        tokenizer: TokenizerLike,
        lora: Any = None,
        routes: RouteRecorder | None = None,
    ):
        self.engine = engine
        self.hook = hook
        self.routes = routes
        """With routing replay, what records each token's experts."""
        self.tokenizer = tokenizer
        self.lora = lora
        """The LoRARequest every request names (the policy's adapter slot), or None."""
        self.tokens_generated = 0
        self.step_times: deque[float] = deque(maxlen=10000)
        self._ids = itertools.count()
        self._requests: dict[str, SequenceRequest] = {}
        self._incoming: list[tuple[str, list[int], Any, SequenceRequest]] = []
        self._aborts: list[str] = []
        self._snapshots: list[tuple[list[CallGroup], bool, CallGroup]] = []
        self._cuts: list[tuple[CallGroup, int, int, Completion | None]] = []
        self.cuts_missed = 0
        """Cuts of sequences that had finished (or been cut) by the time the engine came to them."""
        self.tokens_cut = 0
        """Tokens generated past the end a cut kept (thrown away)."""
        self.branches = 0
        """Sequences a cut added to its call (step guidance's branch)."""
        self._held = False
        """Set by a holding snapshot: the engine takes no more steps."""
        self._cv = threading.Condition()
        self._closed = threading.Event()
        self._error: BaseException | None = None
        # The in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0), which vLLM's annotation
        # types as the general EngineCoreClient.
        self._scheduler = engine.engine_core.engine_core.scheduler  # pyright: ignore[reportAttributeAccessIssue]
        self.max_model_len = engine.vllm_config.model_config.max_model_len
        hook.on_new_version = self._mark_new_version
        self.updates = WeightUpdates(hook, self._closed, self._fail)
        # With TP > 1, a worker that dies mid-step leaves the step waiting up to
        # VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300 s) for a reply that never comes; vLLM's worker
        # monitor calls this at once (a no-op for the in-process executor of TP = 1).
        engine.engine_core.engine_core.model_executor.register_failure_callback(self._executor_failed)  # pyright: ignore[reportAttributeAccessIssue]
        self._thread = threading.Thread(target=self._run_engine, name="vllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def create(cls, cfg: RunConfig, model_path: str, version: int, adapter_dir: str | None = None) -> LLMClient:
        """Start an in-process engine for `model_path` (weights of policy `version`) and hook it.
        With LoRA (cfg.model.lora), `model_path` is the base and `adapter_dir` the PEFT adapter of
        policy `version`, which the engine serves in its one LoRA slot."""
        set_engine_environment(cfg)
        tp = cfg.shared.tensor_parallel_size
        import vllm
        from vllm import EngineArgs, LLMEngine

        check_vllm_version(vllm.__version__)
        engine = LLMEngine.from_engine_args(EngineArgs(**engine_args(cfg, model_path)))
        # vLLM asks the workers for this at the first request, through the queue the weight
        # receiver's calls use from another thread (TP > 1): asked now, before either runs, so
        # the two never read each other's replies.
        engine.get_supported_tasks()
        request = None
        if cfg.model.lora is not None:
            if adapter_dir is None:
                raise ValueError("model.lora is set: the engine needs the policy's adapter directory")
            request = lora_request(adapter_dir)
            engine.add_lora(request)  # loads it into a slot (in every worker)
            engine.pin_lora(POLICY_LORA_ID)  # and keeps it there
        routes = None
        if cfg.shared.routing_replay:
            # before the hook, which then gates the recorder's wrapper of the forward pass
            runner = engine.model_executor.driver_worker.worker.model_runner  # pyright: ignore[reportAttributeAccessIssue]
            top_k = engine.vllm_config.model_config.get_num_experts_per_tok()
            routes = RouteRecorder(runner, top_k)
        installer = TensorParallelSwapHook if tp > 1 else WeightSwapHook
        hook = installer.install(engine, model_path, version, adapter_dir)
        return cls(engine, hook, engine.get_tokenizer(), request, routes)

    def weight_receiver(
        self, addr: str, actor_index: int, actors: int, backend: str, timeout_s: float, stage_on_host: bool = False
    ) -> Receiver:
        """This engine's end of the weight-update group: the actor process itself, or with TP > 1
        every worker of the engine (see weight_sync.group_ranks); every wait of a transfer
        within `timeout_s` (weight_sync.transfer_timeout_s)."""
        ranks, world = group_ranks(actor_index, actors, self.hook.tensor_parallel_size)
        return self.hook.receiver(addr, ranks[0], world, backend, timeout_s, stage_on_host)

    @property
    def failure(self) -> str | None:
        """Why the engine can serve no more (a failed step, a dead worker), or None."""
        return None if self._error is None else repr(self._error)

    @property
    def version(self) -> int:
        return self.hook.version

    async def generate(
        self,
        prompt_ids: list[int],
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        *,
        ignore_eos: bool = False,
        resume: Sequence[Completion | None] | None = None,
        handle: list[CallGroup] | None = None,
    ) -> list[Completion]:
        """Sample `n` completions of `prompt_ids`; each token carries its logprob and version.
        `resume`: per completion, a finished one to return as it is, a part to continue
        (finish_reason ""), or None to start afresh (the module's docstring). `handle`: the
        call's group is appended to it, for `snapshot`."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if self._error is not None:
            raise RuntimeError(f"the vLLM engine failed: {self._error!r}")
        if self._closed.is_set():
            raise RuntimeError("LLMClient is closed")
        if n < 1 or max_tokens < 1:
            raise ValueError(f"generate needs n >= 1 and max_tokens >= 1, got n={n}, max_tokens={max_tokens}")
        if not 0 < len(prompt_ids) < self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens: must be 1 to {self.max_model_len - 1} tokens "
                f"(actor.llm.max_model_len = {self.max_model_len})"
            )
        resume = list(resume) if resume is not None else [None] * n
        if len(resume) != n:
            raise ValueError(f"resume holds {len(resume)} completions for a call of n={n}")

        def params(prefix: Completion | None) -> SamplingParams:
            return SamplingParams(
                n=1,
                max_tokens=max_tokens - (len(prefix.token_ids) if prefix else 0),
                temperature=temperature,
                top_p=top_p,
                stop=stop,
                logprobs=0,
                flat_logprobs=True,
                ignore_eos=ignore_eos,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )

        loop = asyncio.get_running_loop()
        future = loop.create_future()
        group = CallGroup(
            future, loop, [None] * n, n, prompt_ids=list(prompt_ids), params=params, max_tokens=max_tokens
        )
        if handle is not None:
            handle.append(group)
        ids = []
        with self._cv:
            for i, saved in enumerate(resume):
                if saved is not None and saved.finish_reason:
                    group.completions[i] = saved
                    group.remaining -= 1
                    continue
                prefix = saved if saved is not None and saved.token_ids else None
                if prefix is not None and not len(prefix.token_ids) < max_tokens:
                    raise ValueError(
                        f"a part of {len(prefix.token_ids)} tokens to continue with max_tokens={max_tokens}"
                    )
                ids.append(rid := str(next(self._ids)))
                ids_in = list(prompt_ids) + (prefix.token_ids if prefix else [])
                request = SequenceRequest(group, i, [], prompt_len=len(ids_in), prefix=prefix)
                self._incoming.append((rid, ids_in, params(prefix), request))
            self._cv.notify()
        if group.remaining == 0:
            return list(group.completions)  # pyright: ignore[reportReturnType]
        try:
            return await group.future
        except asyncio.CancelledError:
            with self._cv:
                self._aborts.extend(ids)
                self._cv.notify()
            raise

    def _run_engine(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (
                        self._incoming
                        or self._aborts
                        or self._snapshots
                        or self._cuts
                        or (self._requests and not self._held)
                        or self._closed.is_set()
                    ):
                        self._cv.wait()
                    if self._closed.is_set():
                        break
                    incoming, self._incoming = self._incoming, []
                    aborts, self._aborts = self._aborts, []
                    snapshots, self._snapshots = self._snapshots, []
                    cuts, self._cuts = self._cuts, []
                    if incoming:
                        self._held = False  # a new call after a holding snapshot: serving again
                for rid, prompt_ids, params, request in incoming:
                    self._add(rid, prompt_ids, params, request)
                aborted = [self._requests.pop(rid, None) for rid in aborts]
                aborts = [rid for rid, request in zip(aborts, aborted) if request is not None]
                for request in aborted:
                    if request is not None:
                        request.group.requests.remove(request)
                        if self.routes is not None:
                            self.routes.forget(request.engine_id)
                if aborts:
                    self.engine.abort_request(aborts)
                for group, index, keep, refill in cuts:
                    self._cut(group, index, keep, refill)
                for groups, hold, done in snapshots:
                    self._held = self._held or hold
                    post(done, [parts_so_far(g, self.engine.output_processor.request_states) for g in groups])
                if self._requests and not self._held:
                    self._step()
        except BaseException as e:
            log.exception("vLLM engine thread failed")
            self._error = e
            self._fail_pending(RuntimeError(f"the vLLM engine failed: {e!r}"))
            return
        self._fail_pending(RuntimeError("LLMClient closed"))

    def _add(self, rid: str, prompt_ids: list[int], params: Any, request: SequenceRequest) -> None:
        from vllm.inputs.engine import tokens_input

        request.segments.append((0, self.hook.version))
        # Prefix-cache blocks are keyed by the policy version that admitted the request: a new
        # request never reuses prompt KV computed by older weights (a group's samples still share
        # theirs). Requests in flight keep their own KV by design.
        prompt = tokens_input(prompt_ids, cache_salt=f"policy-v{self.hook.version}")
        try:
            request.engine_id = self.engine.add_request(rid, prompt, params, lora_request=self.lora)
        except Exception as e:
            post(request.group, None, e)
            return
        self._requests[rid] = request
        request.group.requests.append(request)

    def _fail(self, error: BaseException) -> None:
        """The weight receiver thread failed: this engine would keep its weights for good."""
        self._error = error

    def _executor_failed(self) -> None:
        self._error = RuntimeError("a vLLM worker process died; vLLM shut the engine down (its log says which)")
        self._fail_pending(RuntimeError(f"the vLLM engine failed: {self._error}"))

    def _fail_pending(self, error: BaseException) -> None:
        with self._cv:
            pending = [r.group for r in self._requests.values()] + [r.group for *_, r in self._incoming]
            pending += [done for *_, done in self._snapshots]  # else an actor's save waits forever
            self._requests.clear()
            self._incoming.clear()
            self._snapshots.clear()
        for group in pending:
            post(group, None, error)

    async def snapshot(self, groups: Sequence[CallGroup], hold: bool = False) -> list[list[Completion | None]]:
        """Each of `groups` (the handles of `generate` calls) as far as it has got, taken between
        two engine steps: per sequence, the finished completion, its part so far (finish_reason
        "", text ""), or None before its first token. With `hold` the engine steps no more until
        the next generate call (the actor is stopping: what it generated after this would be
        lost)."""
        loop = asyncio.get_running_loop()
        done = CallGroup(loop.create_future(), loop, [], 0)
        with self._cv:
            # Checked under the lock: an engine failing after this fails the snapshot (_fail_pending).
            if self._error is not None or self._closed.is_set():
                raise RuntimeError(f"the vLLM engine failed: {self._error!r}" if self._error else "LLMClient is closed")
            self._snapshots.append((list(groups), hold, done))
            self._cv.notify()
        return await done.future

    def cut(self, group: CallGroup, index: int, keep: int, refill: Completion | None = None) -> None:
        """End sequence `index` of a generate call (`group`, its handle) with its first `keep`
        tokens and finish_reason "cut" (step guidance: a step scored too low); what it generated
        after them is thrown away. With `refill` (a part of a sequence of the same call), the
        call gets one more sequence, which continues `refill` with the call's sampling settings;
        its Completion's `shared` counts the tokens it took from `refill`. A sequence that has
        finished by then is left as it is, and refilled by none (`cuts_missed`)."""
        with self._cv:
            self._cuts.append((group, index, keep, refill))
            self._cv.notify()

    def _cut(self, group: CallGroup, index: int, keep: int, refill: Completion | None) -> None:
        request = next((r for r in group.requests if r.index == index), None)
        if request is None:
            self.cuts_missed += 1
            return
        part = part_of(request, self.engine.output_processor.request_states)
        rid = next(rid for rid, r in self._requests.items() if r is request)
        del self._requests[rid]
        group.requests.remove(request)
        if self.routes is not None:
            self.routes.forget(request.engine_id)
        self.engine.abort_request([rid])
        generated = len(part.token_ids) - (len(request.prefix.token_ids) if request.prefix else 0)
        self.tokens_generated += generated
        self.tokens_cut += max(0, len(part.token_ids) - keep)
        ids = part.token_ids[:keep]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = Completion(ids, part.logprobs[:keep], part.versions[:keep], "cut", text, shared=min(part.shared, keep))
        group.completions[index] = cut
        if refill is not None:
            ids_in = group.prompt_ids + refill.token_ids
            shared = len(refill.token_ids)
            slot = len(group.completions)
            branch = SequenceRequest(group, slot, [], prompt_len=len(ids_in), prefix=refill, shared=shared)
            group.completions.append(None)
            group.remaining += 1
            self.branches += 1
            self._add(str(next(self._ids)), ids_in, group.params(refill), branch)
        group.remaining -= 1
        if group.remaining == 0:
            post(group, group.completions)

    def _mark_new_version(self, version: int) -> None:
        for request in self._requests.values():
            state = self._scheduler.requests.get(request.engine_id)
            request.segments.append((state.num_output_tokens if state is not None else 0, version))

    def _step(self) -> None:
        start = time.perf_counter()
        # RequestOutputs (no pooling requests here) whose logprobs are FlatLogprobs
        # (flat_logprobs=True), which vLLM's annotation does not list.
        outputs: list[Any] = self.engine.step()
        self.step_times.append(time.perf_counter() - start)
        for out in outputs:
            if not out.finished:
                continue
            request = self._requests.pop(out.request_id, None)
            if request is None:
                continue
            seq = out.outputs[0]
            token_ids = list(seq.token_ids)
            logprobs = list(seq.logprobs.logprobs) if seq.logprobs is not None else []
            if len(logprobs) != len(token_ids):
                raise RuntimeError(f"request {out.request_id}: {len(token_ids)} tokens but {len(logprobs)} logprobs")
            self.tokens_generated += len(token_ids)
            group = request.group
            group.requests.remove(request)
            completion = request.completion(token_ids, logprobs, seq.finish_reason or "abort", seq.text)
            if request.prefix is not None:  # the engine's text holds the continued part only
                completion.text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            if self.routes is not None:
                completion.routes = self.routes.routes(request.engine_id, request.prompt_len, len(token_ids))
            group.completions[request.index] = completion
            group.remaining -= 1
            if group.remaining == 0:
                post(group, group.completions)

    def start_receiver(self, receiver: Receiver, updates_reader: Reader) -> threading.Thread:
        """Take every weight update announced on `updates_reader` (engine/weight_updates.py)."""
        return self.updates.start(receiver, updates_reader)

    def apply_update(self, receiver: Receiver, update: WeightUpdate) -> bool:
        """Receive one announced update and swap it in; False (logged, counted) on failure."""
        return self.updates.apply(receiver, update)

    @property
    def group_failure(self) -> WeightGroupFailed | None:
        return self.updates.group_failure

    def stats(self) -> dict[str, float]:
        """Counters and recent timings for metrics."""
        swaps, swap_count = self.hook.recent_swaps()
        waits = [s.lock_wait_s for s in swaps]
        loads = [s.load_s for s in swaps]
        wait50, wait99, wait_max = _percentiles(waits)
        load50, load99, load_max = _percentiles(loads)
        step50, step99, _ = _percentiles(list(self.step_times))
        return {
            "version": self.hook.version,
            "tokens_generated": self.tokens_generated,
            "forward_passes": self.hook.forward_passes,
            "swaps": swap_count,
            "swap_failures": self.hook.failures + self.updates.failures,
            "updates_skipped": self.updates.skipped,
            "weight_checksum_mismatches": self.updates.checksum_mismatches,
            "weight_full_requests": self.updates.full_requests,
            "lock_wait_p50_s": wait50,
            "lock_wait_p99_s": wait99,
            "lock_wait_max_s": wait_max,
            "load_p50_s": load50,
            "load_p99_s": load99,
            "load_max_s": load_max,
            "step_p50_s": step50,
            "step_p99_s": step99,
            "running_requests": len(self._requests),
        }

    def close(self) -> None:
        """Stop the engine thread and the engine; pending generate calls raise RuntimeError."""
        self._closed.set()
        with self._cv:
            self._cv.notify()
        if self._error is None:  # a failed engine's thread may be stuck in a step for good
            self._thread.join(timeout=30)
        # Stops the engine's worker processes (TP > 1), which would otherwise live until exit.
        self.engine.engine_core.shutdown()
