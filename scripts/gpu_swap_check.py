"""The TP=1 weight swap on a GPU: is the copy ordered before the next forward pass, and what
does it cost against a raw device copy of the same bytes?

    python scripts/gpu_swap_check.py [--gib 1.0] [--rounds 20]

A model with fused (qkv-style) parameters on the GPU gets its copy plan traced by
`LoadPlan.capture` through its own `load_weights`, exactly as an engine's at start-up; each round
stages a new update on the GPU (as the weight receiver does), copies it with `LoadPlan.copy` (all a
swap does under the lock) and at once reads every parameter on another CUDA stream, as the
engine's next forward pass may. It counts rounds whose read saw anything but the new update: with
the plan's synchronize (ordered), and with the synchronize disabled, to show the read can race.
Prints JSON; exits 1 if an ordered round saw old weights. No vLLM needed.

    python scripts/gpu_swap_check.py --concurrent [--gib 1.0] [--rounds 10]

The TP = 1 swap as the actor runs it (engine/swap_streams.py): an "engine" thread launches forward
passes (matrix products over every parameter, then each parameter's minimum and maximum) on its
stream under the swap lock, and reads back after each one, as vLLM's sampler does; a receiver
thread transfers each update from pinned host memory into staging buffers on its own stream (the
broadcast's stand-in: NCCL refuses two ranks on one GPU), then takes the lock and queues the load
on the engine's stream. Counts forward passes that ran on the device during a transfer (the
engine keeps generating), and torn or stale reads: a pass that saw two versions at once, or a
version older than one already seen. `--unordered` queues the load on the receiver's stream
without the events, to show that the check can fail.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline_rl.engine.load_plan import LoadPlan
from pipeline_rl.engine.swap_streams import SwapStreams


class Fused(torch.nn.Module):
    """Parameters like a vLLM engine's: q, k and v checkpoint tensors land in slices of one
    fused parameter, the rest one to one."""

    def __init__(self, layers: int, rows: int, width: int, device: torch.device):
        super().__init__()
        self.qkv = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(3 * rows, width, device=device), requires_grad=False) for _ in range(layers)
        )
        self.out = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(rows, width, device=device), requires_grad=False) for _ in range(layers)
        )
        self.rows = rows

    def names(self) -> list[tuple[str, tuple[int, int]]]:
        shape = (self.rows, self.qkv[0].shape[1])
        return [(f"{i}.{p}", shape) for i in range(len(self.qkv)) for p in ("q", "k", "v", "o")]

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            layer, part = name.split(".")
            if part == "o":
                self.out[int(layer)].copy_(tensor)
            else:
                shard = "qkv".index(part)
                self.qkv[int(layer)][shard * self.rows : (shard + 1) * self.rows].copy_(tensor)


def stale_rounds(model: Fused, plan: LoadPlan, rounds: int, ordered: bool) -> tuple[int, list[float]]:
    """Rounds whose read on another stream saw weights other than that round's update, and the
    copy times (ms, host side, what the lock would hold)."""
    reader = torch.cuda.Stream()
    synchronize = torch.cuda.synchronize
    stale, holds = 0, []
    try:
        if not ordered:
            torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
        for r in range(rounds):
            value = float(r + 1)
            update = [(name, torch.full(shape, value, device="cuda")) for name, shape in model.names()]
            pairs = plan.bind(update)
            synchronize()  # the staged update is complete before the swap, as after a receive
            start = time.perf_counter()
            plan.copy(pairs)
            holds.append((time.perf_counter() - start) * 1e3)
            with torch.cuda.stream(reader):  # the next forward pass, on the engine's stream
                seen = [p.amin() for p in model.parameters()] + [p.amax() for p in model.parameters()]
            reader.synchronize()
            stale += any(float(x) != value for x in seen)
    finally:
        torch.cuda.synchronize = synchronize
    return stale, holds


def concurrent(model: Fused, plan: LoadPlan, rounds: int, ordered: bool) -> dict:
    """The module docstring's second check; returns its counts."""
    dev = torch.device("cuda")
    streams = SwapStreams(dev)
    lock = threading.Lock()
    width = model.qkv[0].shape[1]
    x = torch.randn(2048, width, device=dev)
    seen: list[torch.Tensor] = []
    passes: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    transfers: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    stop = threading.Event()
    base = torch.cuda.Event(enable_timing=True)
    base.record()

    def engine() -> None:
        with torch.cuda.stream(torch.cuda.Stream(dev)):
            while not stop.is_set():
                with lock:
                    streams.note_engine_stream()
                    began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    began.record()
                    for p in model.parameters():
                        (x @ p.T).sum()
                    lows = torch.stack([p.amin() for p in model.parameters()])
                    highs = torch.stack([p.amax() for p in model.parameters()])
                    seen.append(torch.stack([lows.amin(), highs.amax()]))
                    ended.record()
                    passes.append((began, ended))
                ended.synchronize()  # the sampler reads the step's tokens back

    names = model.names()
    staging = [(name, torch.empty(shape, device=dev)) for name, shape in names]
    pairs = plan.bind(staging)
    sources = [torch.empty(shape, pin_memory=True) for _, shape in names]
    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    time.sleep(0.5)
    for r in range(rounds):
        for s in sources:
            s.fill_(float(r + 1))
        receive = streams.receiving() if ordered else torch.cuda.stream(streams.receive)  # type: ignore[arg-type]
        with receive:
            began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began.record()
            for (_, buf), src in zip(staging, sources):
                buf.copy_(src, non_blocking=True)
            ended.record()
        transfers.append((began, ended))
        if ordered:
            ended.synchronize()  # the receiver returns once the last message is in
            with lock, streams.loading():
                plan.copy(pairs, synchronize=False)
        else:
            with lock, torch.cuda.stream(streams.receive):  # type: ignore[arg-type]
                plan.copy(pairs, synchronize=False)
        time.sleep(0.05)
    time.sleep(0.2)
    stop.set()
    thread.join()
    torch.cuda.synchronize()
    lo_hi = torch.stack(seen).tolist()
    torn = sum(1 for lo, hi in lo_hi if lo != hi)
    stale, newest = 0, 0.0
    for lo, _ in lo_hi:
        stale += lo < newest
        newest = max(newest, lo)
    spans = [(base.elapsed_time(b), base.elapsed_time(e)) for b, e in passes]
    during = sum(
        1 for b, e in spans if any(b < base.elapsed_time(te) and e > base.elapsed_time(tb) for tb, te in transfers)
    )
    return {
        "ordered": ordered,
        "forward_passes": len(spans),
        "passes_on_device_during_transfers": during,
        "torn_reads": torn,
        "stale_reads": stale,
        "last_version_seen": newest,
        "transfer_ms_p50": round(sorted(span_ms(t) for t in transfers)[len(transfers) // 2], 2),
    }


def span_ms(span: tuple[torch.cuda.Event, torch.cuda.Event]) -> float:
    return span[0].elapsed_time(span[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="update size")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--concurrent", action="store_true", help="the engine and receiver threads (docstring)")
    parser.add_argument("--unordered", action="store_true", help="with --concurrent: without the stream ordering")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no GPU: this check needs one", file=sys.stderr)
        return 2
    layers, width = 24, 4096
    rows = max(1, int(args.gib * 2**30 / 4 / (4 * layers * width)))
    model = Fused(layers, rows, width, torch.device("cuda"))
    checkpoint = [(name, torch.zeros(shape, device="cuda")) for name, shape in model.names()]
    plan = LoadPlan.capture(model, checkpoint, [name for name, _ in checkpoint])
    if args.concurrent:
        result = {"device": torch.cuda.get_device_name(), **concurrent(model, plan, args.rounds, not args.unordered)}
        print(json.dumps(result, indent=1))
        failed = result["torn_reads"] or result["stale_reads"] or not result["passes_on_device_during_transfers"]
        return 1 if failed and not args.unordered else 0
    update_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    src = torch.empty(update_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    memcpy = []
    for _ in range(args.rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        memcpy.append((time.perf_counter() - start) * 1e3)
    ordered_stale, ordered_holds = stale_rounds(model, plan, args.rounds, ordered=True)
    racing_stale, _ = stale_rounds(model, plan, args.rounds, ordered=False)
    median = sorted(ordered_holds)[len(ordered_holds) // 2]
    raw = sorted(memcpy)[len(memcpy) // 2]
    result = {
        "device": torch.cuda.get_device_name(),
        "update_gib": round(update_bytes / 2**30, 3),
        "tensors": len(model.names()),
        "copies_in_plan": sum(len(v) for v in plan.copies.values()),
        "rounds": args.rounds,
        "stale_reads_ordered": ordered_stale,
        "stale_reads_without_synchronize": racing_stale,
        "swap_copy_ms_p50": round(median, 3),
        "raw_device_copy_ms_p50": round(raw, 3),
        "swap_over_raw": round(median / raw, 2),
    }
    print(json.dumps(result, indent=1))
    return 1 if ordered_stale else 0


if __name__ == "__main__":
    sys.exit(main())
