"""Actor engine benchmark: what the weight-swap hook and in-flight weight updates cost.

One engine, three ways of generating the same load (64 prompts x n=4 x 64 new tokens,
ignore_eos), interleaved in short rounds (order reversed every other round) so that load from
other processes on a shared machine hits all alike:
  (1) plain vLLM `LLM.generate`, with the hook bypassed;
  (2) LLMClient (engine thread, asyncio futures, per-token versions) with the hook, no updates;
  (3) as (2) while a real sender process broadcasts new weights over gloo every
      --update-every seconds (announced on a JSONL "weights" stream and received by
      LLMClient.start_receiver, as in a run).
Prints tokens/s of each, the ratios (2)/(1) and (3)/(2) (overall and the median of the rounds'
ratios), the swap pauses (lock wait and lock hold, p50/p99; each wait against the engine call
it waited for) beside a memcpy of the update's bytes measured in the same run, the engine step
time p50, and the peak RSS of each process. Goals: lock hold p50 <= 5x the memcpy; (3)/(2) >=
0.97. With TP > 1 the hold only queues the load: each worker copies its shard at the head of
the next step, and the workers' copy times are printed beside it.

With --tp 2 the engine is tensor parallel (two worker processes, each a receiver of the
broadcast; on CPU each bound to its own cores) and (1) is plain vLLM with the same TP size.
With --lora RANK the engine serves a LoRA adapter of that rank (alpha 2 x rank) in its slot,
every request names it (plain vLLM's too), and each update is a new adapter written in place
(scripts/bench_lora.py runs both and compares them). --json PATH also keeps the figures there
(a row named by the run's TP size, model and LoRA rank; scripts/bench_tables.py).

    python scripts/bench_actor.py [--model DIR] [--tp 1] [--lora RANK] [--seconds 15] [--loads-per-round 2]
        [--update-every 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS, N, NEW_TOKENS = 64, 4, 64


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q))] if s else float("nan")


def run_config(run_dir: str, tp: int, lora_rank: int = 0):
    from pipeline_rl.config import load_config

    lora = [f"model.lora.rank={lora_rank}", f"model.lora.alpha={2 * lora_rank}"] if lora_rank else []
    return load_config(
        "base",
        [
            f"run_dir={run_dir}",
            "actor.llm.max_model_len=256",
            "actor.llm.max_num_seqs=256",
            f"shared.tensor_parallel_size={tp}",
            *lora,
        ],
    )


def update_sets(model_dir: str, cfg) -> list[dict]:
    """Two updates to alternate between: the model and a perturbed copy, or with LoRA two random
    adapters (A and B of std 0.05: the tiny model's answers change, its decoding does not stall)."""
    import torch
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(0)
    if cfg.model.lora is not None:
        from pipeline_rl.lora import adapter_shapes

        shapes = adapter_shapes(model_dir, cfg.model.lora)
        return [{k: 0.05 * torch.randn(s, generator=g) for k, s in shapes.items()} for _ in range(2)]
    base = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        base.update(load_file(str(file)))
    noisy = {k: t + 0.1 * t.std() * torch.randn(t.shape, generator=g) if t.dim() > 1 else t for k, t in base.items()}
    return [noisy, base]


def sender_main(addr: str, model_dir: str, run_dir: str, tp: str, lora_rank: str) -> None:
    """The trainer side: one update per `send VERSION` line on stdin, alternating between two
    weight sets; prints `sent VERSION SECONDS`, and its peak RSS when stdin closes."""
    from pipeline_rl.streams import open_streams
    from pipeline_rl.weight_sync import WeightSender

    cfg = run_config(run_dir, int(tp), int(lora_rank))
    streams = open_streams(cfg)
    writer = streams.writer("weights")

    def announce(update):
        writer.write(update)
        writer.flush()

    sets = update_sets(model_dir, cfg)
    sender = WeightSender(addr, world_size=1 + int(tp), backend="gloo", timeout_s=60)
    print("ready", flush=True)
    for line in sys.stdin:
        version = int(line.split()[1])
        seconds = sender.send(version, sets[version % 2].items(), announce, bucket_mb=1)
        print(f"sent {version} {seconds:.4f}", flush=True)
    print(f"rss {peak_rss_mib():.0f}", flush=True)


def memcpy_ms(src: dict, repeats: int = 50) -> tuple[float, float]:
    """Median time to copy an update's tensors into preallocated tensors of the same shapes,
    one copy_ per tensor (what a swap's load cannot beat), and the update's size in MiB."""
    import torch

    dst = {k: torch.empty_like(t) for k, t in src.items()}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k, t in src.items():
            dst[k].copy_(t)
        times.append(time.perf_counter() - t0)
    return percentile(times, 0.5) * 1e3, sum(t.numel() * t.element_size() for t in src.values()) / 2**20


class Updater:
    """Asks the sender for a new version every `every` seconds of phase (3); the clock runs
    only while started, so short rounds still get one update per `every` seconds."""

    def __init__(self, stdin: IO[str], stdout: IO[str], every: float):
        self.stdin, self.stdout, self.every = stdin, stdout, every
        self.version = 0
        self.send_s: list[float] = []
        self._due = every / 4
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            started = time.monotonic()
            if self._stop.wait(self._due):
                self._due -= time.monotonic() - started
                return
            self._due = self.every
            self.version += 1
            self.stdin.write(f"send {self.version}\n")
            self.stdin.flush()
            reply = self.stdout.readline().split()
            if not reply or reply[0] != "sent":
                raise RuntimeError(f"sender failed: {reply}")
            self.send_s.append(float(reply[2]))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default=os.path.join(os.environ.get("PIPELINE_RL_CACHE", ROOT / ".cache"), "tiny_model")
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the engine")
    parser.add_argument("--seconds", type=float, default=15.0, help="time per phase")
    parser.add_argument("--loads-per-round", type=int, default=2, help="loads per phase in one round")
    parser.add_argument("--update-every", type=float, default=2.0)
    parser.add_argument("--lora", type=int, default=0, metavar="RANK", help="serve and update a LoRA adapter")
    parser.add_argument("--json", type=Path, help="also keep the figures in this JSON (its row of this run replaced)")
    parser.add_argument("--sender", nargs=5, metavar=("ADDR", "MODEL", "RUN_DIR", "TP", "LORA"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sender:
        sender_main(*args.sender)
        return
    from pipeline_rl.demo import ensure_built

    ensure_built(Path(args.model))  # the tiny model, on a fresh clone

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs.engine import tokens_input

    from pipeline_rl.engine.adapter_slot import lora_request
    from pipeline_rl.engine.engine_config import engine_args, set_engine_environment
    from pipeline_rl.engine.llm_client import LLMClient
    from pipeline_rl.engine.tp_swap import TensorParallelSwapHook
    from pipeline_rl.engine.vllm_hook import WeightSwapHook
    from pipeline_rl.lora import write_zero_adapter
    from pipeline_rl.streams import open_streams
    from pipeline_rl.streams.records import WeightUpdate

    run_dir = tempfile.mkdtemp(prefix="bench_actor_")
    cfg = run_config(run_dir, args.tp, args.lora)
    set_engine_environment(cfg)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    sender = subprocess.Popen(
        [sys.executable, __file__, "--sender", addr, args.model, run_dir, str(args.tp), str(args.lora)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert sender.stdin is not None and sender.stdout is not None  # both are PIPE
    start = time.perf_counter()
    llm = LLM(**engine_args(cfg, args.model))
    print(f"engine start-up: {time.perf_counter() - start:.1f} s")
    lora = None
    if cfg.model.lora is not None:
        lora = lora_request(write_zero_adapter(Path(run_dir) / "adapter", args.model, cfg.model.lora, torch.float32))
        llm.llm_engine.add_lora(lora)
        llm.llm_engine.pin_lora(lora.lora_int_id)
        hook = WeightSwapHook.install(llm.llm_engine, args.model, 0, lora.lora_path)
    else:
        hook_cls = TensorParallelSwapHook if args.tp > 1 else WeightSwapHook
        hook = hook_cls.install(llm.llm_engine, args.model, version=0)
    client = LLMClient(llm.llm_engine, hook, llm.get_tokenizer(), lora)
    streams = open_streams(cfg)
    receiver = client.weight_receiver(addr, actor_index=0, actors=1, backend="gloo", timeout_s=60)
    client.start_receiver(receiver, streams.reader("weights", WeightUpdate))
    assert sender.stdout.readline().strip() == "ready"
    updater = Updater(sender.stdin, sender.stdout, args.update_every)

    tok = client.tokenizer
    prompts = [tok.encode(f"{i} + {3 * i % 97} =") for i in range(PROMPTS)]
    plain_params = SamplingParams(
        n=N, max_tokens=NEW_TOKENS, temperature=1.0, logprobs=0, flat_logprobs=True, ignore_eos=True
    )

    def plain_rep() -> int:
        with hook.bypassed():
            outs = llm.generate([tokens_input(p) for p in prompts], plain_params, use_tqdm=False, lora_request=lora)  # pyright: ignore[reportArgumentType]  (generate takes these at run time; its annotation does not list them)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    def client_rep() -> int:
        async def run():
            return await asyncio.gather(*(client.generate(p, N, NEW_TOKENS, 1.0, ignore_eos=True) for p in prompts))

        return sum(len(c.token_ids) for g in asyncio.run(run()) for c in g)

    def timed(rep) -> tuple[int, float]:
        t0 = time.perf_counter()
        tokens = sum(rep() for _ in range(args.loads_per_round))
        return tokens, time.perf_counter() - t0

    plain_rep()  # warm-up
    client_rep()
    totals = {1: [0, 0.0], 2: [0, 0.0], 3: [0, 0.0]}
    ratios: dict[str, list[float]] = {"2/1": [], "3/2": []}
    step_times: list[float] = []
    r = 0
    while totals[1][1] < args.seconds:
        rates = {}
        for name in (1, 2, 3) if r % 2 == 0 else (3, 2, 1):
            if name == 2:
                client.step_times.clear()
            if name == 3:
                updater.start()
            tokens, seconds = timed(plain_rep if name == 1 else client_rep)
            if name == 3:
                updater.stop()
                # The last swap lands inside this phase (and counts against it), not in the next one.
                t0 = time.perf_counter()
                while client.version != updater.version:
                    time.sleep(0.001)
                seconds += time.perf_counter() - t0
            if name == 2:
                step_times += client.step_times
            totals[name][0] += tokens
            totals[name][1] += seconds
            rates[name] = tokens / seconds
        ratios["2/1"].append(rates[2] / rates[1])
        ratios["3/2"].append(rates[3] / rates[2])
        print(f"round {r}: (1) {rates[1]:6.0f}  (2) {rates[2]:6.0f}  (3) {rates[3]:6.0f} tok/s")
        r += 1
    sender.stdin.close()
    sender_rss = sender.stdout.read().split()[-1]
    sender.wait()

    rate = {k: t / s for k, (t, s) in totals.items()}
    copy_ms, update_mib = memcpy_ms(update_sets(args.model, cfg)[0])
    swaps, _ = hook.recent_swaps()
    waits = [s.lock_wait_s * 1e3 for s in swaps]
    loads = [s.load_s * 1e3 for s in swaps]
    step50 = percentile(step_times, 0.5) * 1e3
    print()
    print(
        f"load: {PROMPTS} prompts x n={N} x {NEW_TOKENS} tokens, {r} rounds of {args.loads_per_round} loads "
        f"per phase, model {args.model}, tensor_parallel_size {args.tp}"
        + (f", LoRA rank {args.lora}" if args.lora else "")
    )
    print(f"(1) plain vLLM generate:       {rate[1]:8.0f} tok/s")
    print(
        f"(2) LLMClient + hook:          {rate[2]:8.0f} tok/s   (2)/(1) = {rate[2] / rate[1]:.3f}, "
        f"median of rounds {percentile(ratios['2/1'], 0.5):.3f}  (goal >= 0.97)"
    )
    print(
        f"(3) + update every {args.update_every:g} s:      {rate[3]:8.0f} tok/s   (3)/(2) = {rate[3] / rate[2]:.3f}, "
        f"median of rounds {percentile(ratios['3/2'], 0.5):.3f}  (goal >= 0.97)"
    )
    print(
        f"updates sent {updater.version}, swapped {hook.swap_count}, failures {client.stats()['swap_failures']}, "
        f"final version {client.version}"
    )
    print(
        f"sender send() time:  p50 {percentile(updater.send_s, 0.5) * 1e3:6.1f} ms  p99 {percentile(updater.send_s, 0.99) * 1e3:6.1f} ms"
    )
    print(
        f"swap lock wait:      p50 {percentile(waits, 0.5):6.2f} ms  p99 {percentile(waits, 0.99):6.2f} ms  max {max(waits, default=float('nan')):6.2f} ms"
    )
    print(f"swap lock hold:      p50 {percentile(loads, 0.5):6.2f} ms  p99 {percentile(loads, 0.99):6.2f} ms")
    print(
        f"memcpy of the update ({update_mib:.1f} MiB, tensor by tensor): p50 {copy_ms:6.3f} ms  -> lock hold p50 / memcpy "
        f"= {percentile(loads, 0.5) / copy_ms:.1f} (goal <= 5)"
    )
    print(
        f"engine step (2):     p50 {step50:6.2f} ms  -> p99 lock wait / step p50 = {percentile(waits, 0.99) / step50:.2f}"
    )
    # The bound is the call the swap found running, whatever its length (a prefill can take
    # several decode steps), not the median step.
    bound = [s.lock_wait_s / s.call_s for s in swaps if s.call_s > 0]
    calls_started = max((s.calls_started for s in swaps), default=0)
    print(
        f"swap lock wait / the engine call it waited for: p50 {percentile(bound, 0.5):.2f}  max "
        f"{max(bound, default=float('nan')):.2f} ({len(bound)} of {len(swaps)} swaps waited); calls started "
        f"while a swap waited: max {calls_started} (goal: <= 1; a wait over 1 call is the GIL's hand-off after it)"
    )
    workers = ""
    if args.tp > 1:
        with hook.lock:
            worker_loads = llm.llm_engine.collective_rpc(lambda worker: list(worker._pipeline_rl.load_s))  # pyright: ignore[reportAttributeAccessIssue]  (TensorParallelWorker's state, mixed into vLLM's worker)
        print(
            "TP workers' copies (queued ahead of the next step, outside the lock hold): p50 "
            + " / ".join(f"{percentile(w, 0.5) * 1e3:.2f}" for w in worker_loads)
            + " ms"
        )
        with hook.lock:
            rss = llm.llm_engine.collective_rpc(lambda _worker: peak_rss_mib())
        workers = ", TP workers " + " / ".join(f"{r:.0f}" for r in rss) + " MiB"
    print(f"peak RSS: actor (engine) process {peak_rss_mib():.0f} MiB{workers}, sender process {sender_rss} MiB")
    if args.json:
        from bench_tables import keep, machine

        lora = f", LoRA rank {args.lora}" if args.lora else ""
        figures = {
            "name": f"TP={args.tp}, `{Path(args.model).name}`{lora}",
            "machine": machine(),
            "update_bytes": update_mib * 2**20,
            "plain_tok_s": rate[1],
            "client_tok_s": rate[2],
            "updating_tok_s": rate[3],
            "updating_over_client": rate[3] / rate[2],
            "updating_over_client_median": percentile(ratios["3/2"], 0.5),
            "lock_hold_p50_ms": percentile(loads, 0.5),
            "lock_hold_p99_ms": percentile(loads, 0.99),
            "lock_wait_p50_ms": percentile(waits, 0.5),
            "send_p50_ms": percentile(updater.send_s, 0.5) * 1e3,
            "memcpy_ms": copy_ms,
            "step_p50_ms": step50,
            "wait_over_call_max": max(bound, default=0.0),
            "calls_started_max": calls_started,
            "swaps": hook.swap_count,
            "failures": client.stats()["swap_failures"],
            "actor_rss_mib": peak_rss_mib(),
            "sender_rss_mib": float(sender_rss),
        }
        keep(args.json, [figures])
    client.close()
    streams.close()


if __name__ == "__main__":
    main()
