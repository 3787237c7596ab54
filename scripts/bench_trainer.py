"""Trainer benchmark, side by side in one run (CPU, about 3 minutes):

1. Training throughput on packed micro-batches: the real trainer (`python -m
   pipeline_rl.trainer.trainer`, 1 rank, DeepSpeed ZeRO-2 and ZeRO-3 on gloo, micro-batches read
   from the JSONL trainer stream) vs a bare torch loop (same model, same packed forward with
   the trainer's attention kernel and output layer, same loss, AdamW, gradient clipping) on the
   same batches. Goals: ratio >= 0.90 (ZeRO-2), >= 0.80 (ZeRO-3).
2. Weight broadcast, sender + 1 receiver process: WeightSender/WeightReceiver (announcement,
   store round trips, packing, bucketed broadcast; --bucket-mb) vs a raw gloo broadcast of
   the same bytes as one buffer, for the tiny model and a random Qwen2 of ~100M parameters
   (qwen2_config: hidden 768, 8 layers, vocab 32000; fp32). Each is sent twice: from views of
   one flat buffer in parameter order, as the trainer holds its parameters under DeepSpeed
   ZeRO-1/2 (packed runs, and from the second update on whole buckets, go without a copy),
   and from separate tensors (as loaded from a checkpoint: every packed run pays a copy).
   Goal, flat source: <= 1.5x the raw broadcast with a reused buffer on both
   sides for the tiny model, <= 1.2x at 100M. The separate-tensor rows pay the packing copy
   the raw time does not; the fresh-buffer raw time (which pays a packing copy and page
   faults) is shown beside it. Rounds interleave the three (20 for the tiny model, 5 at
   100M); the best of each is kept, and the median of the per-round ratios is printed beside
   it: on a shared machine the raw time alone varies 3x between runs. Announcements go
   through a pipe (no feeder thread).
3. Peak RSS of every process. MFU needs a GPU and is skipped on CPU.

    python scripts/bench_trainer.py [--model DIR] [--steps 12] [--only training|broadcast] [--bucket-mb 256]
        [--json PATH]

--json PATH also keeps the ratios there, a row for each (scripts/bench_tables.py).

--model defaults to the tiny model in $PIPELINE_RL_CACHE (else <repo>/.cache); when it has
not been built, a random Qwen2 of the same shape stands in.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pipeline_rl.config import LogprobKernel, attention_kernel, load_config, logprob_kernel, save_config  # noqa: E402
from pipeline_rl.core.logprobs import packed_logprobs  # noqa: E402
from pipeline_rl.preprocess.packing import pack_step, rollout_sequence  # noqa: E402
from pipeline_rl.streams import open_streams  # noqa: E402
from pipeline_rl.streams.records import Rollout, WeightUpdate, decode, encode  # noqa: E402
from pipeline_rl.trainer.loss import LossInputs, policy_loss  # noqa: E402
from pipeline_rl.wire import WEIGHT_SYNC_ADDR_ENV  # noqa: E402

SEQ_LENGTH = 1024
GROUPS_PER_STEP = 16
ATTEMPTS = 8
TRAINING_GOALS = {2: 0.9, 3: 0.8}
"""Trainer / bare loop tokens per second by ZeRO stage, the stages measured (the goals on a GPU,
watched here on CPU)."""
REPEATS = {"tiny model": 20, "100M Qwen2": 5}
"""Broadcast rounds per model: a millisecond transfer needs more of them to show its best."""


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_dir(arg: str | None, scratch: Path) -> Path:
    path = Path(arg) if arg else Path(os.environ.get("PIPELINE_RL_CACHE", ROOT / ".cache")) / "tiny_model"
    if (path / "config.json").exists():
        return path
    from transformers import Qwen2ForCausalLM

    from pipeline_rl.demo.tiny_model import qwen2_config

    print(f"(no model at {path}: using a random Qwen2 of the tiny model's shape)")
    torch.manual_seed(0)
    config = qwen2_config(512)
    Qwen2ForCausalLM(config).save_pretrained(scratch / "model")
    return scratch / "model"


def random_steps(
    steps: int,
    vocab: int,
    seed: int = 0,
    groups: int = GROUPS_PER_STEP,
    attempts: int = ATTEMPTS,
    prompt: tuple[int, int] = (12, 24),
    completion: tuple[int, int] = (8, 48),
    seq_length: int = SEQ_LENGTH,
    ranks: int = 1,
):
    """Per step, each rank's micro-batches: `groups` groups of `attempts` random rollouts (prompt
    and completion lengths drawn from the ranges), packed into micro-batches of `seq_length`."""
    rng = random.Random(seed)
    out = []
    for s in range(steps):
        seqs = []
        for g in range(groups):
            prompt_ids = [rng.randrange(vocab) for _ in range(rng.randint(*prompt))]
            for _ in range(attempts):
                n = rng.randint(*completion)
                rollout = Rollout(
                    prompt_ids=prompt_ids,
                    completion_ids=[rng.randrange(vocab) for _ in range(n)],
                    logprobs=[-rng.uniform(0.5, 6.0) for _ in range(n)],
                    versions=[s] * n,
                    reward=float(rng.random() < 0.5),
                    finish_reason="stop",
                )
                seqs.append(rollout_sequence(rollout, [rng.gauss(0, 1)] * n, f"{s}-{g}", seq_length))
        out.append(pack_step(seqs, s, ranks, seq_length))
    return out


def make_steps(steps: int, vocab: int, seed: int = 0):
    """Per step: GROUPS_PER_STEP groups of ATTEMPTS rollouts (prompt 12-24, completion 8-48
    tokens), packed into micro-batches of SEQ_LENGTH tokens for 1 rank."""
    return [per_rank[0] for per_rank in random_steps(steps, vocab, seed)]


def bare_loop(model_path: Path, steps, cfg) -> tuple[float, float, int]:
    """Plain torch: forward/backward per micro-batch, clip, AdamW step. The model's work is the
    trainer's (its attention kernel, the output layer on the trained tokens only, the same
    loss), so that the ratio is what DeepSpeed and the trainer's loop add. Returns (wall
    seconds, CPU seconds, tokens) over all steps but the first (warm-up)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation=str(attention_kernel(cfg, cuda=False))
    )
    model.train()
    opt_cfg = cfg.trainer.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt_cfg.lr, betas=tuple(opt_cfg.betas), eps=opt_cfg.eps)
    seconds, cpu_seconds, tokens = 0.0, 0.0, 0
    for s, micro_batches in enumerate(steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        for mb in micro_batches:
            ids = torch.tensor([mb.input_ids])
            logprobs, entropy = packed_logprobs(
                model,
                ids,
                torch.tensor([mb.position_ids]),
                cfg.shared.temperature,
                mb.seq_lengths,
                mb.prefix_lengths,
                cfg.model.logprob_chunk_tokens,
                wanted=[t for t, m in enumerate(mb.loss_mask) if m > 0],
                compiled=logprob_kernel(cfg, cuda=False) == LogprobKernel.compiled,
            )
            seq_index = torch.repeat_interleave(torch.arange(len(mb.seq_lengths)), torch.tensor(mb.seq_lengths))
            inputs = LossInputs(
                logprobs=logprobs,
                entropy=entropy,
                old_logprobs=torch.tensor(mb.old_logprobs),
                advantages=torch.tensor(mb.advantages),
                loss_mask=torch.tensor(mb.loss_mask),
                seq_index=seq_index,
                step_tokens=mb.step_tokens,
                step_samples=mb.step_samples,
            )
            loss, _ = policy_loss(inputs, cfg.trainer.loss)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        if s > 0:
            seconds += time.perf_counter() - start
            cpu_seconds += time.process_time() - cpu_start
            tokens += sum(len(mb.input_ids) for mb in micro_batches)
    return seconds, cpu_seconds, tokens


def real_trainer(cfg, run_dir: Path) -> tuple[float, float, int, float]:
    """The trainer as the launcher runs it; returns (wall seconds, CPU seconds, tokens, peak RSS
    MB) over all steps but the first, from its metrics (reading/decoding data + computing)."""
    env = dict(
        os.environ,
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="0",  # one rank: its store binds a free port itself, which no other process can take first
        OMP_NUM_THREADS="1",
    )
    env.pop(WEIGHT_SYNC_ADDR_ENV, None)
    with open(run_dir / "trainer0.log", "wb") as log:
        code = subprocess.run(
            [sys.executable, "-m", "pipeline_rl.trainer", "--run-dir", str(run_dir), "--index", "0"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=log,
        ).returncode
    if code != 0:
        raise SystemExit(f"trainer failed ({code}); see {run_dir / 'trainer0.log'}")
    records = [json.loads(line)["values"] for line in (run_dir / "metrics" / "trainer0.jsonl").read_text().splitlines()]
    timed = [r for r in records if "compute_s" in r][1:]  # steps, not the heartbeats of a wait
    return (
        sum(r["wait_s"] + r["compute_s"] for r in timed),
        sum(r["step_cpu_s"] for r in timed),
        int(sum(r["tokens"] for r in timed)),
        max(r["peak_rss_mb"] for r in records),
    )


BROADCAST_GOALS = {"tiny model": 1.5, "100M Qwen2": 1.2}
"""Goal ratio WeightSender / raw broadcast (reused buffers) per model, for the flat source."""


def qwen2_100m() -> list[tuple[str, torch.Size]]:
    """Parameter names and shapes, in parameter order, of a Qwen2 of ~100M parameters (99.5M:
    untied embeddings of 32000 x 768, 8 layers, MLP 2048, 12 heads, 4 KV heads), without
    allocating it."""
    from transformers import Qwen2ForCausalLM

    from pipeline_rl.demo.tiny_model import qwen2_config

    config = qwen2_config(32000, hidden=768, layers=8, heads=12, kv_heads=4, intermediate=2048)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    return [(name, p.shape) for name, p in model.named_parameters()]


def flat_views(shapes: list[tuple[str, torch.Size]], seed: int) -> list[tuple[str, torch.Tensor]]:
    """Random fp32 tensors of `shapes` that are views of one flat buffer, back to back in order
    (how DeepSpeed ZeRO-1/2 keeps a model's parameters)."""
    flat = torch.randn(sum(s.numel() for _, s in shapes), generator=torch.Generator().manual_seed(seed))
    out, at = [], 0
    for name, shape in shapes:
        out.append((name, flat[at : at + shape.numel()].view(shape)))
        at += shape.numel()
    return out


def tensor_sets(model_path: Path) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Per model, its tensors as views of one flat buffer (the trainer's parameters under
    ZeRO-1/2), then the same values as separate tensors."""
    from safetensors.torch import load_file

    tiny = sorted(load_file(model_path / "model.safetensors").items())
    sets = {}
    for model, named in [
        ("tiny model", flat_views([(n, t.shape) for n, t in tiny], 0)),
        ("100M Qwen2", flat_views(qwen2_100m(), 0)),
    ]:
        sets[f"{model}, flat source"] = named
        sets[f"{model}, separate tensors"] = [(n, t.clone()) for n, t in named]
    return sets


def _broadcast_worker(rank: int, model_path: str, sync_addr: str, raw_port: int, bucket_mb: int, pipe, results) -> None:
    import torch.distributed as dist

    from pipeline_rl.weight_sync import WeightReceiver, WeightSender

    torch.set_num_threads(1)
    sets = tensor_sets(Path(model_path))
    timeout = timedelta(seconds=300)
    store = dist.TCPStore("127.0.0.1", raw_port, 2, is_master=rank == 0)
    # A c10d backend object; torch's stubs omit its collectives.
    raw_group: Any = dist.ProcessGroupGloo(store, rank, 2, timeout)
    sender = WeightSender(sync_addr, 2, "gloo", timeout_s=300) if rank == 0 else None
    receiver = WeightReceiver(sync_addr, 1, 2, "gloo", timeout_s=300) if rank != 0 else None
    opts = dist.BroadcastOptions()
    opts.rootRank = 0

    def raw_broadcast(buffer: torch.Tensor) -> float:
        raw_group.barrier().wait()
        start = time.perf_counter()
        raw_group.broadcast([buffer], opts).wait()
        return time.perf_counter() - start

    out = {}
    for name, named in sets.items():
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        flat = torch.cat([t.reshape(-1) for _, t in named]) if rank == 0 else torch.empty(nbytes // 4)
        raw, fresh, synced = [], [], []
        for version in range(REPEATS[name.split(",")[0]]):
            raw.append(raw_broadcast(flat))
            # Fresh buffers, as a transfer that hands the receiver new tensors needs: a packed copy
            # on the sender, newly allocated (page-faulting) memory on the receiver.
            raw_group.barrier().wait()
            start = time.perf_counter()
            buffer = torch.cat([t.reshape(-1) for _, t in named]) if rank == 0 else torch.empty(nbytes // 4)
            fresh.append(raw_broadcast(buffer) + (time.perf_counter() - start))
            raw_group.barrier().wait()
            if sender is not None:
                start = time.perf_counter()
                sender.send(
                    version + 100 * len(out),
                    named,
                    announce=lambda u: pipe[1].send_bytes(encode(u)),
                    bucket_mb=bucket_mb,
                )
                synced.append(time.perf_counter() - start)
            else:
                assert receiver is not None
                received = receiver.receive(decode(pipe[0].recv_bytes(), WeightUpdate))
                assert all(torch.equal(t, r) for (_, t), (_, r) in zip(named, received)), "received weights differ"
        out[name] = {
            "bytes": nbytes,
            "raw_s": min(raw),
            "raw_fresh_s": min(fresh),
            "weight_sync_s": min(synced) if synced else None,
            "round_ratio": statistics.median(s / r for s, r in zip(synced, raw)) if synced else None,
            "rounds": len(raw),
        }
    results.put((rank, out, peak_rss_mb()))
    raw_group.barrier().wait()


def broadcast_bench(model_path: Path, bucket_mb: int) -> tuple[dict, dict[int, float]]:
    ctx = multiprocessing.get_context("spawn")
    # Announcements go through a pipe, written by the announcing thread itself (as the trainer
    # writes and flushes its stream): no feeder thread between announce() and the receiver.
    pipe, results = ctx.Pipe(duplex=False), ctx.Queue()
    args = (str(model_path), f"127.0.0.1:{free_port()}", free_port(), bucket_mb, pipe, results)
    procs = [ctx.Process(target=_broadcast_worker, args=(rank, *args)) for rank in (0, 1)]
    for p in procs:
        p.start()
    got = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    timings = next(out for rank, out, _ in got if rank == 0)
    return timings, {rank: rss for rank, _, rss in got}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--only", choices=("training", "broadcast"), default=None, help="run one part of the benchmark")
    parser.add_argument(
        "--bucket-mb",
        type=int,
        default=256,
        help="WeightSender bucket size (trainer.weight_bucket_mb; default as in the config)",
    )
    parser.add_argument("--json", type=Path, help="also keep the ratios in this JSON (its rows of this run replaced)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows: list[dict] = []
    scratch = Path(tempfile.mkdtemp(prefix="bench_trainer_"))
    model_path = model_dir(args.model, scratch)
    if args.only != "broadcast":
        trainer_rss = training_bench(args, model_path, scratch, rows)
    if args.only != "training":
        timings, rss = broadcast_bench(model_path, args.bucket_mb)
        for name, t in timings.items():
            model, source = name.split(", ")
            goal = (
                f"goal ratio <= {BROADCAST_GOALS[model]}"
                if source == "flat source"
                else "no goal: pays the packing copy the reused-buffer raw time does not"
            )
            print(
                f"weight broadcast, {name} ({t['bytes'] / 2**20:.1f} MiB, {args.bucket_mb} MiB buckets), best of {t['rounds']}: "
                f"WeightSender {t['weight_sync_s']:.4f} s; raw gloo {t['raw_s']:.4f} s (reused buffer, ratio "
                f"{t['weight_sync_s'] / t['raw_s']:.2f}), {t['raw_fresh_s']:.4f} s (fresh buffers, ratio "
                f"{t['weight_sync_s'] / t['raw_fresh_s']:.2f}); median over rounds of WeightSender / raw "
                f"(reused) {t['round_ratio']:.2f}; {goal}"
            )
            rows.append(
                {
                    "name": name,
                    "part": "broadcast",
                    "goal": BROADCAST_GOALS[model] if source == "flat source" else None,
                    "rss_mb": rss[0],
                    **{k: t[k] for k in ("bytes", "rounds", "weight_sync_s", "raw_s", "raw_fresh_s", "round_ratio")},
                }
            )
    print("MFU: skipped (no GPU on this machine; it is measured for a ~0.5B model on a GPU)")
    print(
        f"peak RSS MB: bench process {peak_rss_mb():.0f}"
        + ("" if args.only == "broadcast" else "".join(f", trainer ZeRO-{k} {v:.0f}" for k, v in trainer_rss.items()))
        + ("" if args.only == "training" else f", broadcast sender {rss[0]:.0f}, broadcast receiver {rss[1]:.0f}")
    )
    if args.json:
        from bench_tables import keep, machine

        keep(args.json, [r | {"machine": machine()} for r in rows])


def training_bench(args, model_path: Path, scratch: Path, rows: list[dict]) -> dict[int, float]:
    """Part 1: prints the throughput table and adds its ratios to `rows`; returns each trainer's
    peak RSS MB by ZeRO stage."""
    vocab = json.loads((model_path / "config.json").read_text())["vocab_size"]
    steps = make_steps(args.steps, vocab)
    configs = {}
    for stage in TRAINING_GOALS:
        run_dir = scratch / f"run_zero{stage}"
        cfg = load_config(
            "base",
            [
                f"run_dir={run_dir}",
                f"model.path={model_path}",
                f"shared.max_steps={args.steps}",
                f"trainer.zero_stage={stage}",
                "trainer.checkpoint_every=0",
                "metrics.tensorboard=false",
                f"preprocess.seq_length={SEQ_LENGTH}",
                "trainer.optimizer.lr=1e-4",
            ],
        )
        save_config(cfg, run_dir / "config.yaml")
        streams = open_streams(cfg)
        writer = streams.writer("trainer")
        for micro_batches in steps:
            for mb in micro_batches:
                writer.write(mb, partition=0)
        streams.close()
        configs[stage] = cfg
    per_step = sum(len(mb.input_ids) for mb in steps[0])
    print(
        f"model {model_path}; {args.steps} steps of {len(steps[0])} packed micro-batches "
        f"(<= {SEQ_LENGTH} tokens, {per_step} tokens in step 0); first step excluded from timings"
    )

    # The bare loop runs before and after the trainers, and CPU time is reported beside wall
    # time: other processes on a shared machine inflate wall time, not CPU time.
    before = bare_loop(model_path, steps, configs[2])
    trainers = {stage: real_trainer(cfg, Path(cfg.run_dir)) for stage, cfg in configs.items()}
    after = bare_loop(model_path, steps, configs[2])
    bare_s, bare_cpu_s, bare_tokens = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2, before[2]
    bare = (bare_tokens / bare_s, bare_tokens / bare_cpu_s)
    print("                          tokens/s (wall)  tokens/CPU-s  of bare (wall, CPU)")
    print(f"{'bare torch loop':24s}  {bare[0]:15.0f}  {bare[1]:12.0f}")
    for stage, (seconds, cpu_seconds, tokens, _) in trainers.items():
        wall, cpu = tokens / seconds, tokens / cpu_seconds
        print(
            f"{f'trainer, ZeRO-{stage}':24s}  {wall:15.0f}  {cpu:12.0f}  {wall / bare[0]:8.3f} {cpu / bare[1]:8.3f}"
            f"   (goal >= {TRAINING_GOALS[stage]})"
        )
        rows.append(
            {
                "name": f"ZeRO-{stage}",
                "part": "training",
                "model": model_path.name,
                "goal": TRAINING_GOALS[stage],
                "wall_over_bare": wall / bare[0],
                "cpu_over_bare": cpu / bare[1],
                "tokens_s": wall,
                "rss_mb": trainers[stage][3],
            }
        )
    print("trainer: 1 rank, stream reads included; bare: mean of a run before and after the trainers")
    return {stage: t[3] for stage, t in trainers.items()}


if __name__ == "__main__":
    main()
