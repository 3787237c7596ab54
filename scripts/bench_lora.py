"""Full-weight updates against LoRA updates on one actor engine, side by side in one run.

Runs scripts/bench_actor.py twice on the same model, one after the other: full weights, then
a LoRA adapter of --rank (alpha 2 x rank) written in place into the engine's slot. Each run
interleaves its own phases (plain vLLM, LLMClient, LLMClient with an update every
--update-every seconds), so its ratios are fair within it. Prints per mode the bytes per
update, the swap's lock hold, decode tokens/s with and without updates, their ratio and the
peak RSS, then the goals: LoRA lock hold <= 1/10 of the full-weight swap's, decode
overhead of LoRA updates <= 3%.

With --random-shape HIDDENxLAYERS the engines serve a model of that shape with random weights
(the tiny model's tokenizer and vocabulary, 4 x hidden MLP, one KV head per 64 dimensions of 4
heads): what a swap costs at a larger size, where the tiny model's fixed costs no longer hide
the copy.

--json PATH keeps both runs' figures there (each row replacing the kept row of the same model and
mode); docs/lora.md's table is generated from docs/bench_lora.json (scripts/bench_tables.py).

    python scripts/bench_lora.py [--model DIR] [--random-shape 512x8] [--rank 8] [--seconds 15]
        [--update-every 2] [--loads-per-round 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run(args: argparse.Namespace, lora: int, out: Path) -> dict:
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "bench_actor.py"),
        "--model",
        args.model,
        "--seconds",
        str(args.seconds),
        "--update-every",
        str(args.update_every),
        "--loads-per-round",
        str(args.loads_per_round),
        "--json",
        str(out),
    ]
    if lora:
        cmd += ["--lora", str(lora)]
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())[0]


def random_model(like: str, shape: str, out: Path) -> str:
    """A model of `like`'s vocabulary and tokenizer with HIDDENxLAYERS and random weights."""
    import torch
    from transformers import AutoConfig, Qwen2ForCausalLM

    from pipeline_rl.demo.tiny_model import qwen2_config
    from pipeline_rl.trainer.checkpoint import copy_tokenizer_files

    hidden, layers = (int(x) for x in shape.split("x"))
    base = AutoConfig.from_pretrained(like)
    config = qwen2_config(
        base.vocab_size,
        hidden=hidden,
        layers=layers,
        heads=hidden // 64,
        kv_heads=max(1, hidden // 256),
        max_len=base.max_position_embeddings,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        tie_word_embeddings=base.tie_word_embeddings,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(str(out))
    copy_tokenizer_files(like, out)
    return str(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default=os.path.join(os.environ.get("PIPELINE_RL_CACHE", ROOT / ".cache"), "tiny_model")
    )
    parser.add_argument("--random-shape", metavar="HIDDENxLAYERS", help="a random model of this shape")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--update-every", type=float, default=2.0)
    parser.add_argument("--loads-per-round", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also keep both runs' figures in this JSON")
    args = parser.parse_args()
    from pipeline_rl.demo import ensure_built

    ensure_built(Path(args.model))  # the tiny model, on a fresh clone
    model_name = f"random {args.random_shape}" if args.random_shape else Path(args.model).name
    with tempfile.TemporaryDirectory() as tmp:
        if args.random_shape:
            args.model = random_model(args.model, args.random_shape, Path(tmp) / "model")
        full = run(args, 0, Path(tmp) / "full.json")
        lora = run(args, args.rank, Path(tmp) / "lora.json")
    rows = [
        ("bytes per update", "update_bytes", "{:,.0f}"),
        ("sender send() p50 (ms)", "send_p50_ms", "{:.2f}"),
        ("swap lock hold p50 (ms)", "lock_hold_p50_ms", "{:.3f}"),
        ("swap lock hold p99 (ms)", "lock_hold_p99_ms", "{:.3f}"),
        ("swap lock wait p50 (ms)", "lock_wait_p50_ms", "{:.2f}"),
        ("engine step p50 (ms)", "step_p50_ms", "{:.2f}"),
        ("plain vLLM (tok/s)", "plain_tok_s", "{:.0f}"),
        ("LLMClient, no updates (tok/s)", "client_tok_s", "{:.0f}"),
        (f"LLMClient, update every {args.update_every:g} s (tok/s)", "updating_tok_s", "{:.0f}"),
        ("with / without updates", "updating_over_client", "{:.3f}"),
        ("  median of rounds", "updating_over_client_median", "{:.3f}"),
        ("swaps (failures)", "swaps", "{:.0f}"),
        ("peak RSS actor (MiB)", "actor_rss_mib", "{:.0f}"),
        ("peak RSS sender (MiB)", "sender_rss_mib", "{:.0f}"),
    ]
    print()
    print(f"model {args.model}; LoRA rank {args.rank}, alpha {2 * args.rank}")
    print(f"| | full weights | LoRA r={args.rank} |")
    print("|---|---|---|")
    for label, key, fmt in rows:
        extra = (f" ({full['failures']:.0f})", f" ({lora['failures']:.0f})") if key == "swaps" else ("", "")
        print(f"| {label} | {fmt.format(full[key])}{extra[0]} | {fmt.format(lora[key])}{extra[1]} |")
    hold = lora["lock_hold_p50_ms"] / full["lock_hold_p50_ms"]
    overhead = 1 - lora["updating_over_client_median"]
    print()
    print(f"LoRA lock hold / full-weight lock hold (p50): {hold:.3f}  (goal <= 0.1)")
    print(f"decode overhead of LoRA updates (1 - median with/without): {overhead:+.3f}  (goal <= 0.03)")
    print(f"bytes per update, LoRA / full: {lora['update_bytes'] / full['update_bytes']:.4f}")
    print(f"decode rate without updates, LoRA / full: {lora['client_tok_s'] / full['client_tok_s']:.3f}")
    if args.json:
        from bench_tables import keep

        keep(
            args.json,
            [{**full, "name": model_name, "lora_rank": 0}, {**lora, "name": model_name, "lora_rank": args.rank}],
        )
        print(f"kept in {args.json}")


if __name__ == "__main__":
    main()
