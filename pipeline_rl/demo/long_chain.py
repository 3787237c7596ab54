"""The long, uneven task (conf=tiny_long) and its policy, built locally from the tiny arithmetic
model (pipeline_rl/demo/tiny_model.py) in a few minutes on 2 cores.

Task: a chain of 2 to 12 two-digit numbers added and subtracted, "Q: 45+23-17+30=", worked one
step per line, "45+23=68\\n68-17=51\\n51+30=81". Every intermediate result stays within 10..99,
so each step is a two-digit operation; what varies is how many there are: completions run from
about 9 tokens (one step) to about 100 (eleven), a 10x spread, and a sample that must get every
step right is rarer the longer the chain. The domain `multistep` (the same check: the last
line ends in "=<answer>" and the completion stops by EOS) rewards the final answer only.

`build(cache_dir)` writes, under cache_dir:
- long_chain/{train,test}.jsonl: problems {"id", "prompt", "answer", "solution", "steps"};
- long_chain_policy: supervised on worked solutions for a fixed number of steps, each batch
  of one chain length (mixed lengths left the tiny model unable to finish even one-step chains
  in the same time: the long solutions' loss drowned the short ones'), then, if it answers the
  held-out problems exactly at temperature 1 more often than TARGET_ACCURACY, its logits
  softened to that (tiny_model.soften): room for RL, most of it on long chains.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from pathlib import Path

import torch

from pipeline_rl.demo.tiny_model import (
    TINY,
    Batcher,
    make_tokenizer,
    save_model,
    soften,
    teacher_forced_accuracy,
    write_split,
)
from pipeline_rl.demo.tiny_model import build as build_tiny

NAME = "long_chain_policy"
DATA = "long_chain"
MIN_TERMS, MAX_TERMS = 2, 12
TEST_PROBLEMS = 300
TRAIN_PROBLEMS = 30000
SFT_STEPS = 3000
"""A fixed recipe: the same work on every CPU; softening then caps the starting accuracy."""
TARGET_ACCURACY = 0.3
"""Mean probability over held-out problems of sampling the whole worked solution at T=1."""
FLOOR = 0.15
"""Below this after SFT_STEPS the build failed (a broken recipe, not a slow CPU)."""
BATCH = 32
LR = 2e-3
GRAD_CLIP = 1.0
EVAL_EVERY = 500


def chain(rng: random.Random, terms: int) -> tuple[str, str, int]:
    """(prompt, worked solution, answer) of one chain of `terms` numbers whose running result
    stays within 10..99."""
    value = rng.randint(10, 99)
    prompt, lines = f"Q: {value}", []
    for _ in range(terms - 1):
        ops = [op for op in "+-" if (value + 10 <= 99 if op == "+" else value - 10 >= 10)]
        op = rng.choice(ops)
        b = rng.randint(10, 99 - value) if op == "+" else rng.randint(10, value - 10)
        result = value + b if op == "+" else value - b
        prompt += f"{op}{b}"
        lines.append(f"{value}{op}{b}={result}")
        value = result
    return prompt + "=", "\n".join(lines), value


def make_problems(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, test): disjoint problems, the number of terms uniform in MIN_TERMS..MAX_TERMS."""
    rng = random.Random(seed)
    seen: dict[str, dict] = {}
    while len(seen) < TRAIN_PROBLEMS + TEST_PROBLEMS:
        terms = rng.randint(MIN_TERMS, MAX_TERMS)
        prompt, solution, answer = chain(rng, terms)
        seen.setdefault(
            prompt,
            {
                "id": f"chain_{len(seen)}",
                "prompt": prompt,
                "answer": str(answer),
                "solution": solution,
                "steps": terms - 1,
            },
        )
    problems = list(seen.values())
    return problems[TEST_PROBLEMS:], problems[:TEST_PROBLEMS]


def _as_sft(problems: list[dict]) -> list[dict]:
    return [{"prompt": p["prompt"], "answer": p["solution"]} for p in problems]


def build(cache_dir: Path, seed: int = 0) -> Path:
    """Build the data set and the policy under `cache_dir` (the tiny arithmetic model first, if
    missing); returns the policy's directory."""
    from transformers import AutoModelForCausalLM

    cache_dir = Path(cache_dir)
    base = cache_dir / TINY.name
    if not (base / "config.json").exists():
        build_tiny(cache_dir, seed)
    train, test = make_problems(seed)
    write_split(cache_dir / DATA, train, test)
    tokenizer = make_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    batches = Batcher(tokenizer, _as_sft(train))
    by_steps: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(train):
        by_steps[p["steps"]].append(i)
    lengths = sorted(by_steps)
    test_ids, test_labels = Batcher(tokenizer, _as_sft(test)).tensors(list(range(len(test))))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100, (SFT_STEPS - s) / (SFT_STEPS / 3)))
    rng = random.Random(seed)
    start = time.time()
    model.train()
    for step in range(1, SFT_STEPS + 1):
        rows = rng.choices(by_steps[rng.choice(lengths)], k=BATCH)
        ids, labels = batches.tensors(rows)
        width = int((labels != -100).nonzero()[:, 1].max()) + 1  # one length: no padding beyond it
        model(input_ids=ids[:, :width], labels=labels[:, :width]).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        opt.zero_grad()
        sched.step()
        if step % EVAL_EVERY == 0 or step == SFT_STEPS:
            model.eval()
            exact, greedy = teacher_forced_accuracy(model, test_ids, test_labels)
            model.train()
            print(
                f"{NAME}: step {step}/{SFT_STEPS}, held-out exact T=1 {exact:.3f}, greedy {greedy:.3f} "
                f"({time.time() - start:.0f} s)",
                flush=True,
            )
    model.eval()
    exact_before, greedy = teacher_forced_accuracy(model, test_ids, test_labels)
    if exact_before < FLOOR:
        raise RuntimeError(
            f"{NAME} reached only {exact_before:.3f} exact T=1 held-out accuracy in {SFT_STEPS} steps "
            f"(greedy {greedy:.3f}, floor {FLOOR}); try another --seed"
        )
    scale = soften(model, test_ids, test_labels, TARGET_ACCURACY) if exact_before > TARGET_ACCURACY else 1.0
    exact, _ = teacher_forced_accuracy(model, test_ids, test_labels)
    report = {
        "steps": SFT_STEPS,
        "seconds": round(time.time() - start, 1),
        "greedy": greedy,
        "exact_t1_before_softening": round(exact_before, 4),
        "softening_scale": round(scale, 4),
        "exact_t1": round(exact, 4),
        "exact_t1_by_steps": _by_steps(model, tokenizer, test),
        "seed": seed,
    }
    dest = cache_dir / NAME
    save_model(model, tokenizer, report, dest)
    return dest


@torch.no_grad()
def _by_steps(model, tokenizer, test: list[dict]) -> dict[str, float]:
    """Held-out exact T=1 accuracy by the number of steps of the chain."""
    out = {}
    for steps in sorted({p["steps"] for p in test}):
        rows = [p for p in test if p["steps"] == steps]
        ids, labels = Batcher(tokenizer, _as_sft(rows)).tensors(list(range(len(rows))))
        out[str(steps)] = round(teacher_forced_accuracy(model, ids, labels)[0], 4)
    return out
