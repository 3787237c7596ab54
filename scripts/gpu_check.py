"""The trainer on one device: DeepSpeed ZeRO steps of real packed RL micro-batches through the
real loss, on a locally built Qwen2-shaped model with random weights, against a bare PyTorch
loop doing the same work.

    python scripts/gpu_check.py                 # GPU: ~0.5 B parameters, bf16, NCCL, ZeRO-3
    python scripts/gpu_check.py --reduced       # CPU: a tiny model, fp32, gloo (the test suite runs this)
    python scripts/gpu_check.py --lora 16       # the same with LoRA adapters of rank 16 on the frozen base
    python scripts/gpu_check.py --bare          # the bare loop alone on the same shapes and tokens
    python scripts/gpu_check.py --suite         # the whole comparison (GPU, about 8 minutes on an H200)
    python scripts/gpu_check.py --tally --bare  # CPU, bf16: a step's FLOPs and bytes by kind (scripts/step_tally.py)
    python scripts/gpu_check.py model.logprob_chunk_tokens=512   # any config override

The bare loop: the same model in bf16 without DeepSpeed, each micro-batch's sequences as one
[sequences, length] batch with causal sdpa (exactly the packed row's block-diagonal attention,
sequences of equal length), logprobs of the second half of each sequence, fused AdamW on the
bf16 weights, gradient clipping. Prints throughput, MFU (GPU only: model FLOPs over the device's
dense bf16 peak), peak device memory against the `--dry-run` memory plan, and writes them as JSON
to OUT/gpu_check.json. The trainer's micro-batches go through the trainer stream (JSONL) and
`pipeline_rl.trainer.trainer.run`, exactly as in a run. `--suite` runs the bare loop and the
trainer at 8k, 16k and 32k tokens, ZeRO-2, ZeRO-3, LoRA, with and without gradient
checkpointing, each in its own process, profiles of the bare loop's, ZeRO-2's and ZeRO-3's steps
(device time by kind side by side, attention's share, the device's busy share: what
scripts/step_profile.py summarizes), ZeRO-2 with the eager logprob kernel beside the compiled
default, and last the checks (the varlen attention's logprobs against sdpa's, the compiled
logprob kernel's against eager's, scripts/bench_logprobs.py at 8k, the checkpoint's host
copies), and prints one table.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # step_profile, beside this file

from device_checks import logprob_kernels, staging_check, varlen_against_sdpa
from step_profile import StepProfile, around_trainer_steps, count_trainer_step_syncs, host_profile_trainer_steps

from pipeline_rl.config import load_config, logprob_kernel, save_config
from pipeline_rl.metrics import read_metrics
from pipeline_rl.preprocess.packing import Sequence, pack_step
from pipeline_rl.streams import open_streams
from pipeline_rl.wire import Topic

# Qwen2.5-0.5B's shapes (random weights), and a tiny stand-in for CPU.
FULL = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
REDUCED = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
# Between the reduced model's largest vector (64 elements) and its smallest matrix (2,048).
REDUCED_PERSISTENCE = 1000
# Dense bf16 peak FLOP/s by device name (vendor data sheets).
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}


def build_model(path: Path, shapes: dict, max_len: int) -> tuple[Qwen2Config, int]:
    """The model's config and parameter count; written to `path` unless it is already there."""
    config = Qwen2Config(**shapes, max_position_embeddings=max_len)
    with torch.device("meta"):
        params = sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(path)
    return Qwen2Config.from_pretrained(path), params


def random_step(vocab: int, total_tokens: int, sequences: int, version: int, rng: random.Random) -> list[Sequence]:
    """`sequences` rollouts of policy `version`, `total_tokens` in all: half prompt, half completion."""
    out = []
    for i in range(sequences):
        n = total_tokens // sequences
        prompt = n // 2
        reward = float(rng.random() < 0.5)
        out.append(
            Sequence(
                input_ids=[rng.randrange(vocab) for _ in range(n)],
                loss_mask=[0] * prompt + [1] * (n - prompt),
                advantages=[0.0] * prompt + [reward - 0.5] * (n - prompt),
                old_logprobs=[0.0] * prompt + [-rng.uniform(0.5, 8.0) for _ in range(n - prompt)],
                versions=[-1] * prompt + [version] * (n - prompt),
                ref_logprobs=None,
                group_id=f"g{i // 4}",
                reward=reward,
                sample_version=version,
            )
        )
    return out


def model_flops_per_token(config: Qwen2Config, seq_len: int) -> float:
    """Training FLOPs per token: 6 x parameters used in matmuls (the tied embedding counts once,
    as the LM head) plus causal attention over sequences of `seq_len` (6 x layers x width x len)."""
    d, f, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = d // config.num_attention_heads * (config.num_key_value_heads or config.num_attention_heads)
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * f
    matmul_params = L * per_layer + d * config.vocab_size
    return 6 * matmul_params + 6 * L * d * seq_len


def bare_loop(
    config: Qwen2Config,
    seq_length: int,
    rows: int,
    micro_batches: int,
    steps: int,
    gpu: bool,
    bf16: bool,
    before_step: Callable[[int], None] = lambda step: None,
) -> list[float]:
    """The bare PyTorch loop of the module docstring; returns each step's seconds."""
    dev = "cuda" if gpu else "cpu"
    torch.manual_seed(0)
    config._attn_implementation = "sdpa"
    model: Any = Qwen2ForCausalLM(config)
    model.to(device=dev, dtype=torch.bfloat16 if bf16 else torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=gpu)
    length = seq_length // rows
    times = []
    for step in range(steps):
        before_step(step)
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(micro_batches):
            ids = torch.randint(0, config.vocab_size, (rows, length), device=dev)
            logits = model(input_ids=ids).logits[:, length // 2 - 1 : -1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, length // 2 :, None]).squeeze(-1)
            (-(logp * torch.randn(rows, 1, device=dev)).mean()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def _merge_deepspeed(extra: dict) -> None:
    """Have the trainer's DeepSpeed config take `extra`'s keys (one level of nesting merged)."""
    import pipeline_rl.trainer.model as model_module
    import pipeline_rl.trainer.trainer as trainer_module

    base = model_module.deepspeed_config

    def merged(cfg) -> dict:
        config = base(cfg)
        for key, value in extra.items():
            both = isinstance(value, dict) and isinstance(config.get(key), dict)
            config[key] = {**config[key], **value} if both else value
        return config

    model_module.deepspeed_config = trainer_module.deepspeed_config = merged


def plan_gib(cfg) -> float:
    from pipeline_rl.launch.memory_plan import ModelShape, trainer_bytes

    return sum(trainer_bytes(cfg, ModelShape.read(cfg.model.path), cuda=True).values()) / 2**30


SUITE: list[tuple[str, list[str], dict[str, str]]] = [
    ("bare 8k", ["--bare", "--seq-length", "8192"], {}),
    ("ZeRO-2 8k", ["--zero-stage", "2", "--seq-length", "8192"], {}),
    ("ZeRO-3 8k", ["--zero-stage", "3", "--seq-length", "8192"], {}),
    ("profile: bare 8k", ["--bare", "--seq-length", "8192", "--profile"], {}),
    ("profile: ZeRO-2 8k", ["--zero-stage", "2", "--seq-length", "8192", "--profile"], {}),
    ("profile: ZeRO-3 8k", ["--zero-stage", "3", "--seq-length", "8192", "--profile"], {}),
    ("ZeRO-2 LoRA r16 8k", ["--zero-stage", "2", "--lora", "16", "--seq-length", "8192"], {}),
    ("ZeRO-3 LoRA r16 8k", ["--zero-stage", "3", "--lora", "16", "--seq-length", "8192"], {}),
    ("bare 16k", ["--bare", "--seq-length", "16384"], {}),
    ("ZeRO-2 16k", ["--zero-stage", "2", "--seq-length", "16384"], {}),
    (
        "ZeRO-2 16k, checkpointing",
        ["--zero-stage", "2", "--seq-length", "16384", "trainer.gradient_checkpointing=true"],
        {},
    ),
    ("bare 32k", ["--bare", "--seq-length", "32768"], {}),
    (
        "ZeRO-2 8k, eager logprobs",
        ["--zero-stage", "2", "--seq-length", "8192", "model.logprob_kernel=eager"],
        {},
    ),
    ("ZeRO-2 32k", ["--zero-stage", "2", "--seq-length", "32768"], {}),
    (
        "ZeRO-2 32k, checkpointing",
        ["--zero-stage", "2", "--seq-length", "32768", "trainer.gradient_checkpointing=true"],
        {},
    ),
    ("checks", ["--checks"], {}),  # last: the ratios first if the device's time runs out
]


def suite(out: Path, steps: int, only: list[str]) -> int:
    """Every SUITE entry (or those whose names start with one of `only`) in its own process on one
    model, then one table."""
    model_dir = out / "model"
    build_model(model_dir, FULL, 32768)
    results: dict[str, dict] = {}
    for name, args, env in SUITE:
        if only and not any(name.startswith(o) for o in only):
            continue
        run_out = out / name.replace(" ", "_").replace(",", "").replace(":", "")
        t = time.perf_counter()
        cmd = [sys.executable, __file__, "--model-dir", str(model_dir), "--out", str(run_out), "--steps", str(steps)]
        proc = subprocess.run([*cmd, *args], env={**os.environ, **env}, capture_output=True, text=True)
        log = proc.stdout + proc.stderr
        if proc.returncode == 0:
            results[name] = json.loads((run_out / "gpu_check.json").read_text())
            copied = re.findall(r"checkpoint weights: .*", log)
            if copied:
                results[name]["checkpoint_copy"] = copied[-1]
        else:
            results[name] = {"error": log.strip().splitlines()[-1][:200] if log.strip() else f"exit {proc.returncode}"}
        results[name]["seconds"] = round(time.perf_counter() - t, 1)
        print(name, json.dumps(results[name]), flush=True)
    (out / "suite.json").write_text(json.dumps(results, indent=1))
    print_suite(results)
    return 0


def print_suite(results: dict[str, dict]) -> None:
    """The suite's table: each run against the bare loop of its length, then the profiles."""
    print(f"\n{'run':<28} {'tokens/s':>9} {'of bare':>8} {'MFU':>6} {'peak GiB':>9} {'plan GiB':>9} {'peak/plan':>9}")
    for name, r in results.items():
        if "tokens_per_s" not in r:
            continue
        bare = results.get(f"bare {r['seq_length'] // 1024}k", {}).get("tokens_per_s")
        peak = r["peak_gpu_gib"] + r.get("outside_allocator_gib", 0)
        plan = r.get("plan_gib")
        print(
            f"{name:<28} {r['tokens_per_s']:>9.0f} {r['tokens_per_s'] / bare if bare else float('nan'):>8.2f} "
            f"{r.get('mfu') or 0:>6.3f} {peak:>9.2f} {plan or float('nan'):>9.2f} "
            f"{peak / plan if plan else float('nan'):>9.3f}"
        )
    profiles = {name: r["profile"] for name, r in results.items() if r.get("profile")}
    if profiles:  # device seconds by kind, the loops side by side
        print(f"\n{'device s, steps 2 on':<22}" + "".join(f"{name.removeprefix('profile: '):>14}" for name in profiles))
        for row in ("profiled_span_s", "device_busy_share", "kernel_s", "attention_share"):
            print(f"{row:<22}" + "".join(f"{p.get(row) or 0:>14.3f}" for p in profiles.values()))
        kinds = dict.fromkeys(kind for p in profiles.values() for kind in p["by_kind_s"])
        for kind in kinds:
            print(f"{kind:<22}" + "".join(f"{p['by_kind_s'].get(kind, 0):>14.3f}" for p in profiles.values()))
    for name, r in results.items():
        shown = ("error", "checkpoint_copy") + (("profile",) if name in profiles else ())
        if name == "checks" or any(k in r for k in shown):
            print(name, {k: v for k, v in r.items() if name == "checks" or k in shown})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reduced", action="store_true", help="tiny model, fp32, CPU")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-length", type=int, default=None, help="tokens per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--sequences-per-row", type=int, default=16, help="packed sequences per micro-batch")
    parser.add_argument("--out", default=None, help="directory for the run and gpu_check.json")
    parser.add_argument("--model-dir", default=None, help="use (or build) the model here instead of OUT/model")
    parser.add_argument("--zero-stage", type=int, default=3, choices=(2, 3))
    parser.add_argument("--lora", type=int, default=0, metavar="RANK", help="train LoRA adapters of this rank")
    parser.add_argument("--bare", action="store_true", help="run the bare PyTorch loop instead of the trainer")
    parser.add_argument("--suite", action="store_true", help="the whole comparison (module docstring)")
    parser.add_argument(
        "--only", action="append", default=[], help="with --suite: the runs whose names start with this"
    )
    parser.add_argument(
        "--checks",
        action="store_true",
        help="GPU: varlen against sdpa, the logprob kernels (bench_logprobs.py at 8k), the checkpoint's host copies",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile the steps after the second: device time by kind, attention's share, the device's busy share",
    )
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help="the host's time in the trainer's steps after the second, by function (cProfile): with "
        "--reduced --layers 24, where compute is small, what the host does per step",
    )
    parser.add_argument(
        "--sync-debug",
        action="store_true",
        help="GPU: count the device synchronizations in the trainer's steps after the second, by call site",
    )
    parser.add_argument(
        "--deepspeed", default=None, metavar="JSON", help="extra DeepSpeed config keys, e.g. zero_optimization settings"
    )
    parser.add_argument(
        "--tally",
        nargs="?",
        const="989,4800",
        metavar="TFLOPS,GBS",
        help="CPU, bf16: count the FLOPs and bytes of the steps after the first by kind, and price "
        "them at this peak and bandwidth (default an H200's; scripts/step_tally.py)",
    )
    parser.add_argument("overrides", nargs="*", help="more config overrides, e.g. model.logprob_chunk_tokens=512")
    args = parser.parse_args()
    gpu = torch.cuda.is_available() and not args.reduced
    seq_length = args.seq_length or (8192 if gpu else 256)
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    if args.suite:
        return suite(out, args.steps, args.only)
    model_dir = Path(args.model_dir) if args.model_dir else out / "model"
    shapes = REDUCED if args.reduced else FULL
    if args.layers:
        shapes = {**shapes, "num_hidden_layers": args.layers}
    config, params = build_model(model_dir, shapes, seq_length)
    if args.checks:
        checks = {
            "varlen against sdpa": varlen_against_sdpa(model_dir, 8192, 16),
            "checkpoint host copies": staging_check(),
            "logprob kernels, 8k tokens": logprob_kernels(out, 8192),
        }
        (out / "gpu_check.json").write_text(json.dumps(checks, indent=1))
        print(json.dumps(checks, indent=1))
        return 0
    sequences_per_row = args.sequences_per_row
    bf16 = gpu or args.tally is not None
    tally = None
    if args.tally:  # imported here: the GPU's runs need none of it
        from step_tally import StepTally, fuse_adamw, tally_compiled_logprobs

        tflops, gbs = (float(x) for x in args.tally.split(","))
        tally = StepTally(tflops * 1e12, gbs * 1e9)
        fuse_adamw()
        tally_compiled_logprobs(tally)
    # Steps 0 and 1 warm up kernels and the allocator: the profile and the timing leave them out.
    profile = StepProfile(gpu) if args.profile else None
    result: dict = {
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "seq_length": seq_length,
        "micro_batches_per_step": args.micro_batches,
        "sequences_per_row": sequences_per_row,
        "parameters": params,
    }
    if args.bare:

        def before_step(step: int) -> None:
            if profile is not None and step >= 2:
                profile.start()
            if tally is not None and step == 1:
                tally.__enter__()

        times = bare_loop(config, seq_length, sequences_per_row, args.micro_batches, args.steps, gpu, bf16, before_step)
        if tally is not None:
            tally.__exit__(None, None, None)
        timed = times[2:] if len(times) > 3 else times
        tokens_per_s = seq_length * args.micro_batches * len(timed) / sum(timed)
        result.update(loop="bare", tokens_per_s=round(tokens_per_s, 1), wall_s=round(sum(times), 1))
        version = args.steps
    else:
        cfg = load_config(
            "base",
            [
                f"run_dir={out / 'run'}",
                f"model.path={model_dir}",
                f"model.dtype={'bfloat16' if bf16 else 'float32'}",
                f"trainer.zero_stage={args.zero_stage}",
                f"shared.max_steps={args.steps}",
                "trainer.checkpoint_every=0",
                f"preprocess.seq_length={seq_length}",
                "metrics.tensorboard=false",
                f"world.gpus_per_node={1 if gpu else 0}",
                *([f"model.lora.rank={args.lora}"] if args.lora else []),
                *args.overrides,
            ],
        )
        save_config(cfg, Path(cfg.run_dir) / "config.yaml")
        rng = random.Random(0)
        streams = open_streams(cfg)
        writer = streams.writer(Topic.TRAINER)
        for step in range(args.steps):
            sequences = sequences_per_row * args.micro_batches
            seqs = random_step(config.vocab_size, seq_length // sequences_per_row * sequences, sequences, step, rng)
            for mb in pack_step(seqs, step, 1, seq_length)[0]:
                writer.write(mb)
        streams.close()

        # One rank: its store binds a free port itself (MASTER_PORT 0); a port found free
        # beforehand can be taken by another process before the store binds it.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        from pipeline_rl.trainer.trainer import run

        start = time.perf_counter()
        host = cProfile.Profile() if args.host_profile else None
        if host is not None:
            host_profile_trainer_steps(2, host)
        sync_sites: Counter = Counter()
        if args.sync_debug and gpu:
            count_trainer_step_syncs(2, sync_sites)
        extra = json.loads(args.deepspeed) if args.deepspeed else {}
        if args.reduced and args.zero_stage == 3:
            # At width 64 every parameter is under DeepSpeed's persistence threshold (1e5
            # elements) and ZeRO-3 would partition none. Here, as at the full shape under the
            # default, the matrices are partitioned and gathered, the vectors (norms, biases) kept.
            zero = {"stage3_param_persistence_threshold": REDUCED_PERSISTENCE, **extra.get("zero_optimization", {})}
            extra = {**extra, "zero_optimization": zero}
        if extra:
            _merge_deepspeed(extra)
            result["deepspeed"] = extra
        partitioned: list[int] = []  # parameters ZeRO-3 partitions (the rest it keeps whole on every rank)

        def count_partitioned(trainer) -> contextlib.AbstractContextManager:
            if not partitioned:  # once: what ZeRO-3 partitions does not change between steps
                partitioned.append(sum(not getattr(p, "ds_persist", True) for p in trainer.model.parameters()))
            return contextlib.nullcontext()

        if args.zero_stage == 3:
            around_trainer_steps(0, count_partitioned)
        if profile is not None:
            profile.trainer_steps(2, args.steps)
        if tally is not None:
            around_trainer_steps(1, lambda _trainer: tally)
        version = run(cfg, 0)
        if host is not None:
            host.dump_stats(out / "host_profile.prof")  # for pstats' callers and callees
            pstats.Stats(host).sort_stats("cumulative").print_stats(r"deepspeed|pipeline_rl", 25)
            pstats.Stats(host).sort_stats("tottime").print_stats(25)
        if args.sync_debug:
            result["synchronizations"] = dict(sync_sites.most_common())
        wall = time.perf_counter() - start
        steps = [r["values"] for r in read_metrics(Path(cfg.run_dir)) if "compute_tokens_per_s" in r["values"]]
        timed = steps[2:] if len(steps) > 3 else steps  # the first steps include allocator and kernel warm-up
        tokens_per_s = sum(s["tokens"] for s in timed) / sum(s["compute_s"] for s in timed)
        result.update(
            loop="trainer",
            version=version,
            zero_stage=args.zero_stage,
            lora_rank=args.lora or None,
            gradient_checkpointing=cfg.trainer.gradient_checkpointing,
            attention=cfg.trainer.attention.value,
            logprob_kernel=logprob_kernel(cfg, gpu).value,
            tokens_per_s=round(tokens_per_s, 1),
            wall_s=round(wall, 1),
            loss_first_last=[steps[0].get("loss"), steps[-1].get("loss")],
            partitioned_parameters=partitioned[0] if partitioned else None,
        )
        if gpu:
            result["plan_gib"] = round(plan_gib(cfg), 2)
    if tally is not None:
        result["tally"] = {
            "by_kind": tally.summary(),
            "least_s": tally.least_seconds(),
            "most_bytes_gb": tally.most_bytes(),
        }
    if profile is not None:
        profile.stop()
        print(profile.table())
        result["profile"] = profile.summary()
    if gpu:
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
        flops = model_flops_per_token(config, seq_length // sequences_per_row) * result["tokens_per_s"]
        free, total = torch.cuda.mem_get_info()
        result.update(
            model_tflops=round(flops / 1e12, 1),
            mfu=round(flops / peak, 3) if peak else None,
            peak_gpu_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
            peak_gpu_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2),
            # What the device holds beyond PyTorch's allocator: CUDA context, cuBLAS and NCCL.
            outside_allocator_gib=round((total - free - torch.cuda.memory_reserved()) / 2**30, 2),
        )
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if version == args.steps else 1


if __name__ == "__main__":
    sys.exit(main())
