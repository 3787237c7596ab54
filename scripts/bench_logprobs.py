"""The output layer and its logprobs, side by side in one run: the trainer's chunked head
(`core/logprobs.py` token_logprobs) with the eager and with the compiled logprob kernel
(`model.logprob_kernel`), against a bare loop's head (the logits of every token, a float32
log_softmax, a gather: what `gpu_check.py --bare` does), forward and backward of one
micro-batch whose second half is trained. Each runs in its own process: seconds per micro-batch
(the best of --repeats after a warm-up step, which holds the compile), the ratio to the bare
head's, and the peak memory the timed steps added (CPU: resident set, sampled; GPU: allocated). Then the same
for the arithmetic alone, from given logits to the logits' gradient (no matrix product): on a
GPU that is where the kernels differ (passes over [rows, V] tensors, bound by memory
bandwidth), while on a CPU the products dominate the whole head's time.

    python scripts/bench_logprobs.py                        # CPU, float32, 512 tokens (about 2 minutes)
    python scripts/bench_logprobs.py --tokens 8192 --dtype bfloat16   # on a GPU
    python scripts/bench_logprobs.py --json docs/bench_logprobs.json   # keep the rows (docs/gpu.md's table)

The shapes default to Qwen2.5-0.5B's output layer (152k vocabulary, width 896); the trainer's
head runs on the trained half of the tokens only, with `--chunk` rows at a time, and computes
the entropy beside the logprobs (the bare head does not).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_tables import commit, keep, machine  # noqa: E402

from pipeline_rl.core.logprobs import token_logprobs  # noqa: E402

VARIANTS = ("bare", "eager", "compiled")


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class ResidentPeak:
    """The largest resident set seen while it runs, sampled every millisecond: on CPU a step's
    [rows, V] tensors are large allocations, returned to the system when freed, and live for far
    longer than a millisecond."""

    def __init__(self):
        self.peak = resident_bytes()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self.done.wait(0.001):
            self.peak = max(self.peak, resident_bytes())

    def __enter__(self) -> ResidentPeak:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


def measure(variant: str, args: argparse.Namespace) -> dict:
    """One variant's seconds per micro-batch and the peak memory its steps added."""
    gpu = torch.cuda.is_available()
    dev, dtype = ("cuda" if gpu else "cpu"), getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    tokens, half = args.tokens, args.tokens // 2
    hidden = torch.randn(tokens, args.hidden, generator=g).to(dev, dtype).requires_grad_()
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(args.vocab, args.hidden, generator=g) * 0.05)
    head.to(dev, dtype)
    targets = torch.randint(0, args.vocab, (tokens,), generator=g).to(dev)
    coef = torch.randn(tokens - half, generator=g).to(dev)

    def step() -> None:
        if variant == "bare":
            logits = F.linear(hidden, head.weight)[half - 1 : -1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, targets[half:, None])[:, 0]
        else:
            rows = hidden[half - 1 : -1]
            logp, _ = token_logprobs(rows, head, targets[half:], 1.0, args.chunk, compiled=variant == "compiled")
        (-(logp * coef).sum()).backward()
        hidden.grad = head.weight.grad = None

    logits = F.linear(hidden, head.weight).detach()
    if variant == "bare":
        logits.requires_grad_()
    else:
        from pipeline_rl.core.logprobs import _chunk_stats, _compiled, _logits_grad_in_place

        stats = _compiled()[0] if variant == "compiled" else _chunk_stats

    def arithmetic() -> None:
        if variant == "bare":
            logp = torch.log_softmax(logits[half - 1 : -1].float(), -1).gather(-1, targets[half:, None])[:, 0]
            (-(logp * coef).sum()).backward()
            logits.grad = None
        else:
            rows = logits[half - 1 : -1]
            lse, _, entropy = stats(rows, targets[half:], 1.0)
            if variant == "compiled":
                _compiled()[1](rows, targets[half:], lse, entropy, -coef, torch.zeros_like(coef), 1.0)
            else:
                z = rows.to(torch.float32, copy=True)  # the float32 copy eager makes
                _logits_grad_in_place(z, targets[half:], lse, entropy, -coef, None, 1.0, rows.dtype)

    def synced() -> None:
        if gpu:
            torch.cuda.synchronize()

    start = time.perf_counter()
    step()  # warm-up: kernels, the allocator, and the compile
    synced()
    warm_up = time.perf_counter() - start
    before = torch.cuda.memory_allocated() if gpu else resident_bytes()
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    times = []
    with ResidentPeak() as resident:
        for _ in range(args.repeats):
            start = time.perf_counter()
            step()
            synced()
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if gpu else resident.peak
    arithmetic()
    synced()
    arithmetic_times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        arithmetic()
        synced()
        arithmetic_times.append(time.perf_counter() - start)
    return {
        "arithmetic_s": min(arithmetic_times),
        "variant": variant,
        "seconds": min(times),
        "warm_up_s": round(warm_up, 2),
        "peak_added_mib": round(max(peak - before, 0) / 2**20),
        "device": torch.cuda.get_device_name() if gpu else "cpu",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512, help="tokens of the micro-batch (its second half trained)")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--chunk", type=int, default=2048, help="model.logprob_chunk_tokens")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--json", type=Path, default=None, metavar="PATH", help="keep a row per head in this JSON (bench_tables.keep)"
    )
    parser.add_argument("--variant", choices=VARIANTS, help="measure this one in this process (internal)")
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant, args)))
        return 0
    passed = sys.argv[1:]
    results = {}
    for variant in VARIANTS:
        out = subprocess.run(
            [sys.executable, __file__, *passed, "--variant", variant], capture_output=True, text=True, check=False
        )
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            print(f"{variant}: failed (exit {out.returncode})", file=sys.stderr)
            return 1
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    if args.json:
        setup = f"{args.dtype}, {args.tokens} tokens, vocabulary {args.vocab}, width {args.hidden}"
        provenance = {"setup": setup, "machine": machine(), "commit": commit()}
        keep(args.json, [provenance | {"name": variant} | r for variant, r in results.items()])
    bare = results["bare"]["seconds"]
    print(
        f"output layer + logprobs, {args.tokens} tokens ({args.tokens - args.tokens // 2} trained), "
        f"vocab {args.vocab}, width {args.hidden}, {args.dtype}, chunk {args.chunk}, on {results['bare']['device']}"
    )
    print(
        f"{'head':10s} {'s/micro-batch':>14s} {'of bare':>8s} {'warm-up s':>10s} {'peak added MiB':>15s}"
        f" {'arithmetic s':>13s} {'of bare':>8s}"
    )
    for variant, r in results.items():
        print(
            f"{variant:10s} {r['seconds']:14.3f} {bare / r['seconds']:8.2f} {r['warm_up_s']:10.2f} {r['peak_added_mib']:15d}"
            f" {r['arithmetic_s']:13.3f} {results['bare']['arithmetic_s'] / r['arithmetic_s']:8.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
