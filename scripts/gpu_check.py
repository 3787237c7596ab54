"""The trainer on one device: DeepSpeed ZeRO-3 steps of real packed RL micro-batches through the
real loss, on a locally built Qwen2-shaped model with random weights.

    python scripts/gpu_check.py                 # GPU: ~0.5 B parameters, bf16, NCCL
    python scripts/gpu_check.py --reduced       # CPU: a tiny model, fp32, gloo (the test suite runs this)
    python scripts/gpu_check.py --lora 16       # the same with LoRA adapters of rank 16 on the frozen base
    python scripts/gpu_check.py model.logprob_chunk_tokens=512   # any config override

Prints throughput, MFU (GPU only: model FLOPs over the device's dense bf16 peak) and peak
device memory, and writes them as JSON to OUT/gpu_check.json. The micro-batches go through
the trainer stream (JSONL) and `pipeline_rl.trainer.trainer.run`, exactly as in a run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline_rl.config import load_config, save_config
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
# Dense bf16 peak FLOP/s by device name (vendor data sheets).
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}


def build_model(path: Path, shapes: dict, max_len: int) -> tuple[Qwen2Config, int]:
    torch.manual_seed(0)
    config = Qwen2Config(**shapes, max_position_embeddings=max_len)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    return config, sum(p.numel() for p in model.parameters())


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reduced", action="store_true", help="tiny model, fp32, CPU")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-length", type=int, default=None, help="tokens per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--sequences-per-row", type=int, default=16, help="packed sequences per micro-batch")
    parser.add_argument("--out", default=None, help="directory for the run and gpu_check.json")
    parser.add_argument("--zero-stage", type=int, default=3, choices=(2, 3))
    parser.add_argument("--lora", type=int, default=0, metavar="RANK", help="train LoRA adapters of this rank")
    parser.add_argument("--profile", action="store_true", help="print the operators that take the most device time")
    parser.add_argument("overrides", nargs="*", help="more config overrides, e.g. model.logprob_chunk_tokens=512")
    args = parser.parse_args()
    gpu = torch.cuda.is_available() and not args.reduced
    seq_length = args.seq_length or (8192 if gpu else 256)
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    config, params = build_model(out / "model", REDUCED if args.reduced else FULL, seq_length)

    cfg = load_config(
        "base",
        [
            f"run_dir={out / 'run'}",
            f"model.path={out / 'model'}",
            f"model.dtype={'bfloat16' if gpu else 'float32'}",
            f"trainer.zero_stage={args.zero_stage}",
            f"trainer.max_steps={args.steps}",
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
    sequences_per_row = args.sequences_per_row
    for step in range(args.steps):
        sequences = sequences_per_row * args.micro_batches
        seqs = random_step(config.vocab_size, seq_length // sequences_per_row * sequences, sequences, step, rng)
        for mb in pack_step(seqs, step, 1, seq_length)[0]:
            writer.write(mb)
    streams.close()

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    from pipeline_rl.trainer.trainer import run

    start = time.perf_counter()
    if args.profile:
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])
        with torch.profiler.profile(activities=activities) as prof:
            version = run(cfg, 0)
        sort = "cuda_time_total" if gpu else "cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60))
    else:
        version = run(cfg, 0)
    wall = time.perf_counter() - start
    steps = [r["values"] for r in read_metrics(Path(cfg.run_dir)) if "compute_tokens_per_s" in r["values"]]
    timed = steps[2:] if len(steps) > 3 else steps  # the first steps include allocator and kernel warm-up
    tokens_per_s = sum(s["tokens"] for s in timed) / sum(s["compute_s"] for s in timed)
    result: dict = {
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "version": version,
        "seq_length": seq_length,
        "zero_stage": args.zero_stage,
        "lora_rank": args.lora or None,
        "micro_batches_per_step": args.micro_batches,
        "sequences_per_row": sequences_per_row,
        "parameters": params,
        "tokens_per_s": round(tokens_per_s, 1),
        "wall_s": round(wall, 1),
        "loss_first_last": [steps[0].get("loss"), steps[-1].get("loss")],
    }
    if gpu:
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
        flops = model_flops_per_token(config, seq_length // sequences_per_row) * tokens_per_s
        result.update(
            model_tflops=round(flops / 1e12, 1),
            mfu=round(flops / peak, 3) if peak else None,
            peak_gpu_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
            peak_gpu_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2),
            # What the device holds beyond PyTorch's allocator: CUDA context, cuBLAS and NCCL.
            outside_allocator_gib=round(
                (torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0] - torch.cuda.memory_reserved()) / 2**30, 2
            ),
        )
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if version == args.steps else 1


if __name__ == "__main__":
    sys.exit(main())
