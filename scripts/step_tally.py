"""What a training step asks of any device, counted on CPU: the FLOPs and the bytes of every
operator the step runs, by kind, for the trainer against the bare loop of `gpu_check.py`. On a
GPU a step's matrix products are bound by its FLOP rate and the rest by its memory bandwidth, so
the two counts, and the least time a device with a given peak and bandwidth needs for them (each
operator the longer of its FLOPs at the peak and its bytes at the bandwidth), say where the
trainer does more device work than the bare loop when no GPU is lent.

    python scripts/step_tally.py                 # bare, ZeRO-2 (compiled and eager logprobs), ZeRO-3
    python scripts/step_tally.py --peak-tflops 989 --bandwidth-gbs 4800   # the device to price (H200)

Each loop runs `gpu_check.py --tally` (bf16, the 0.5 B shape's width and vocabulary, sequences of
512 tokens, two micro-batches a step, the step after the first counted) in its own process at 1
and 2 decoder layers and 1,024 and 2,048 tokens a micro-batch. Every count is bilinear in the
layers and the tokens (what a layer or the output layer does grows with the tokens; the
optimizer's and DeepSpeed's passes over the parameters grow with the layers only), so the four
points give each count at 24 layers and 8,192 tokens, a 0.5 B step on a GPU. Prints a table per kind,
writes step_tally.json and step_tally.png (the least time by kind, each loop a bar) to --out.

What the count cannot see: the host (launch gaps, synchronizations: `gpu_check.py --profile`
on a GPU measures the device's busy share) and how near each kernel comes to the device's
limits. A compiled function counts as one operator reading its inputs and writing its outputs,
as its generated kernel does; elsewhere CPU and GPU run the same operators, except attention
(CPU's sdpa kernels for flash-attention's) and AdamW, which runs fused as on a GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

sys.path.insert(0, str(Path(__file__).resolve().parent))  # step_profile, beside this file
from step_profile import kind_of

_ATEN = torch.ops.aten
# CPU's fused attention kernels take the arguments torch's flop formulas read (the shapes of
# query, key and value, and in backward of the output's gradient first).
_FLOPS = {
    **flop_registry,
    _ATEN._scaled_dot_product_flash_attention_for_cpu: flop_registry[_ATEN._scaled_dot_product_flash_attention],
    _ATEN._scaled_dot_product_flash_attention_for_cpu_backward: flop_registry[
        _ATEN._scaled_dot_product_flash_attention_backward
    ],
}
# Operators that write their first argument without reading it, and allocations (nothing moved).
_WRITE_ONLY = {_ATEN.copy_, _ATEN.fill_, _ATEN.zero_, _ATEN.zeros_like, _ATEN.full_like}
_ALLOCATIONS = {_ATEN.empty, _ATEN.empty_like, _ATEN.empty_strided, _ATEN.new_empty, _ATEN.new_empty_strided}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of `tensors`, a tensor passed twice counted once."""
    return sum(map(_nbytes, {(t.data_ptr(), t.shape, t.dtype): t for t in tensors}.values()))


def _mutated(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an operator writes in place (its schema's written arguments; fused optimizers
    list the gradients too, written only when unscaling fp16 gradients: left out)."""
    values = {**dict(zip((a.name for a in func._schema.arguments), args, strict=False)), **kwargs}
    return [
        t
        for a in func._schema.arguments
        if a.alias_info is not None and a.alias_info.is_write and a.name != "grads"
        for t in _tensors(values.get(a.name))
    ]


class StepTally(TorchDispatchMode):
    """Counts, by kind (step_profile.kind_of, plus "compiled"), the operators run while it is
    entered, their FLOPs (torch's flop counter formulas: matrix products and attention) and their
    bytes: each tensor an operator reads and each it writes, once. Views move nothing; a mutated
    argument is read and written, a copied-into one only written."""

    def __init__(self, peak_flops: float, bandwidth: float) -> None:
        super().__init__()
        self.peak_flops, self.bandwidth = peak_flops, bandwidth
        self.ops: list[tuple[str, str, float, float]] = []  # (kind, name, flops, bytes) of each, in order
        self.entered = 0  # `fused` counts only while the tally is entered

    def __enter__(self):
        self.entered += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self.entered -= 1
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or func.overloadpacket in _ALLOCATIONS:
            return out
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        if not func._schema.is_mutable and {t.data_ptr() for t in outputs} <= {t.data_ptr() for t in inputs}:
            return out  # metadata only (an alias, a detach)
        read = inputs[1:] if func.overloadpacket in _WRITE_ONLY else inputs
        nbytes = _unique_bytes(read) + _unique_bytes(outputs + _mutated(func, args, kwargs))
        formula = _FLOPS.get(func.overloadpacket)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        self.ops.append((kind_of(func._schema.name), str(func), float(flops), float(nbytes)))
        return out

    def fused(self, fn: Callable) -> Callable:
        """`fn` (a compiled function) counted as one operator: its tensor inputs read and its
        outputs written once, as its generated kernel does, and run compiled (a dispatch mode
        would run it eagerly)."""

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if not self.entered:
                return fn(*args, **kwargs)
            with _disable_current_modes():
                out = fn(*args, **kwargs)
            nbytes = _unique_bytes(_tensors((args, kwargs))) + _unique_bytes(_tensors(out))
            self.ops.append(("compiled", f"compiled {fn.__name__}", 0.0, float(nbytes)))
            return out

        return counted

    def summary(self) -> dict:
        """By kind: the operators, their FLOPs and their bytes."""
        kinds: dict[str, dict[str, float]] = defaultdict(lambda: {"ops": 0, "flops": 0.0, "bytes": 0.0})
        for kind, _, flops, nbytes in self.ops:
            entry = kinds[kind]
            entry["ops"] += 1
            entry["flops"] += flops
            entry["bytes"] += nbytes
        return {kind: kinds[kind] for kind in sorted(kinds)}

    def most_bytes(self, n: int = 12) -> list[tuple[str, float]]:
        """The `n` operators that moved the most bytes in all (GB)."""
        by_name: dict[str, float] = defaultdict(float)
        for _, name, _, nbytes in self.ops:
            by_name[name] += nbytes
        ranked = sorted(by_name.items(), key=lambda item: -item[1])[:n]
        return [(name, round(nbytes / 1e9, 3)) for name, nbytes in ranked]

    def least_seconds(self) -> dict[str, float]:
        """By kind, the least time a device with the given peak (FLOP/s) and memory bandwidth
        (bytes/s) spends on the counted operators: each the longer of its FLOPs and its bytes."""
        seconds: dict[str, float] = defaultdict(float)
        for kind, _, flops, nbytes in self.ops:
            seconds[kind] += max(flops / self.peak_flops, nbytes / self.bandwidth)
        return dict(seconds)


def tally_compiled_logprobs(tally: StepTally) -> None:
    """Count the compiled logprob kernel's functions (`core/logprobs.py` _compiled) as fused
    operators for the rest of the process."""
    import pipeline_rl.core.logprobs as logprobs

    stats, grad = logprobs._compiled()
    fused = (tally.fused(stats), tally.fused(grad))
    logprobs._compiled = lambda: fused  # pyright: ignore[reportAttributeAccessIssue]


def fuse_adamw() -> None:
    """Have every torch AdamW made from here on run in one fused pass, as the trainer and the bare
    loop do on a GPU (on CPU they take torch's multi-tensor implementation, several passes). The
    class stays AdamW: DeepSpeed accepts only the optimizer classes it knows."""
    init = torch.optim.AdamW.__init__

    def fused_init(self, params, *args, **kwargs) -> None:
        init(self, params, *args, **{**kwargs, "fused": True})

    torch.optim.AdamW.__init__ = fused_init


# The loops `main` counts: name, gpu_check.py arguments.
LOOPS: list[tuple[str, list[str]]] = [
    ("bare", ["--bare"]),
    ("ZeRO-2", ["--zero-stage", "2", "model.logprob_kernel=compiled"]),  # the GPU's default
    ("ZeRO-2, eager logprobs", ["--zero-stage", "2", "model.logprob_kernel=eager"]),
    ("ZeRO-3", ["--zero-stage", "3", "model.logprob_kernel=compiled"]),
]
POINTS = [(1, 1024), (1, 2048), (2, 1024), (2, 2048)]  # (decoder layers, tokens a micro-batch)


def bilinear(points: dict[tuple[int, int], float], layers: int, tokens: int) -> float:
    """The value at (layers, tokens) of a + b L + c T + d L T through the four POINTS."""
    (l0, t0), (l1, t1) = POINTS[0], POINTS[3]
    a, b, c, d = points[(l0, t0)], points[(l0, t1)], points[(l1, t0)], points[(l1, t1)]
    u, v = (layers - l0) / (l1 - l0), (tokens - t0) / (t1 - t0)
    return a + (b - a) * v + (c - a) * u + (a - b - c + d) * u * v


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H200: 989)")
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="memory bandwidth (H200: 4,800 GB/s)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--only", action="append", default=[], help="the loops whose names start with this")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="step_tally_"))
    out.mkdir(parents=True, exist_ok=True)
    check = Path(__file__).resolve().parent / "gpu_check.py"
    counts: dict[str, dict[tuple[int, int], dict]] = {}
    for name, loop_args in LOOPS:
        if args.only and not any(name.startswith(o) for o in args.only):
            continue
        counts[name] = {}
        for layers, tokens in POINTS:
            run = out / f"{name.replace(' ', '_').replace(',', '')}_{layers}x{tokens}"
            cmd = [sys.executable, str(check), "--tally", f"{args.peak_tflops},{args.bandwidth_gbs}"]
            cmd += ["--steps", "2", "--out", str(run)]
            cmd += ["--layers", str(layers), "--seq-length", str(tokens), "--sequences-per-row", str(tokens // 512)]
            proc = subprocess.run([*cmd, *loop_args], capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"{name} at {layers} layers, {tokens} tokens failed: exit {proc.returncode}")
            counts[name][(layers, tokens)] = json.loads((run / "gpu_check.json").read_text())["tally"]
            print(f"counted {name}, {layers} layers, {tokens} tokens", flush=True)
    # Each count at the asked shape, per step (two micro-batches).
    at: dict[str, dict[str, dict[str, float]]] = {}
    for name, by_point in counts.items():
        kinds = dict.fromkeys(k for point in by_point.values() for k in point["by_kind"])
        at[name] = {
            kind: {
                q: bilinear(
                    {p: c["by_kind"].get(kind, {}).get(q, 0.0) for p, c in by_point.items()}, args.layers, args.tokens
                )
                for q in ("ops", "flops", "bytes")
            }
            for kind in kinds
        }
        for kind in at[name]:  # each operator priced at the counted points, then extrapolated
            at[name][kind]["least_ms"] = 1e3 * bilinear(
                {p: c["least_s"].get(kind, 0.0) for p, c in by_point.items()}, args.layers, args.tokens
            )
    report(at, args, out)
    return 0


def report(at: dict[str, dict[str, dict[str, float]]], args, out: Path) -> None:
    names = list(at)
    kinds = list(dict.fromkeys(k for loop in at.values() for k in loop))
    kinds.sort(key=lambda k: -max(loop.get(k, {}).get("least_ms", 0) for loop in at.values()))
    print(
        f"\nA step of 2 micro-batches of {args.tokens} tokens, {args.layers} layers; least time at "
        f"{args.peak_tflops:g} TFLOP/s and {args.bandwidth_gbs:g} GB/s"
    )
    header = "".join(f"{n:>26}" for n in names)
    for quantity, unit, scale in (
        ("least_ms", "ms", 1),
        ("flops", "TFLOP", 1e-12),
        ("bytes", "GB", 1e-9),
        ("ops", "ops", 1),
    ):
        print(f"\n{quantity + ' (' + unit + ')':<22}{header}")
        for kind in kinds:
            print(f"{kind:<22}" + "".join(f"{at[n].get(kind, {}).get(quantity, 0) * scale:>26.1f}" for n in names))
        total = {n: sum(e[quantity] for e in at[n].values()) for n in names}
        print(f"{'total':<22}" + "".join(f"{total[n] * scale:>26.1f}" for n in names))
    least = {n: sum(e["least_ms"] for e in at[n].values()) for n in names}
    if "bare" in least:
        print(f"\n{'bare / loop (least)':<22}" + "".join(f"{least['bare'] / least[n]:>26.2f}" for n in names))
    (out / "step_tally.json").write_text(json.dumps({"shape": vars(args), "per_step": at}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    bottom = [0.0] * len(names)
    for kind in kinds:
        values = [at[n].get(kind, {}).get("least_ms", 0.0) for n in names]
        ax.bar(names, values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel(f"ms a step at {args.peak_tflops:g} TFLOP/s, {args.bandwidth_gbs:g} GB/s")
    ax.set_title(f"Least device time a step, {args.layers} layers, {args.tokens} tokens a micro-batch (counted on CPU)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(out / "step_tally.png", dpi=120)
    print(f"\nwrote {out / 'step_tally.json'} and {out / 'step_tally.png'}")


if __name__ == "__main__":
    sys.exit(main())
