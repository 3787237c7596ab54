"""The multi-step arithmetic task and the tiny models built for it: a policy and a teacher, both
fine-tuned from the tiny arithmetic model (pipeline_rl/demo/tiny_model.py), locally and in a
few minutes on 2 cores.

Task: "Q: 12+34+56=" answered in two steps, one per line: "12+34=46\\n46+56=102". Problems
have a + b < 100, so each step is a 2-digit addition, the tiny model's own skill; what the
policy must learn is the format and carrying the first result into the second step. The
domain `multistep` (pipeline_rl/rollouts/domains/multistep.py) rewards a completion whose last
line ends in "=<answer>" and that stops by EOS.

`build(cache_dir)` writes, under cache_dir:
- multistep/{train,test}.jsonl: problems {"id", "prompt", "answer", "solution"}, disjoint;
- multistep_policy: supervised on worked solutions only until about half of the held-out
  problems are solved greedily (room for RL);
- multistep_teacher: the same, until POLICY_TARGETS["teacher"] greedy (for distillation);
each with a report.json of its held-out accuracy.

The task's process reward model and outcome reward model are built in prm.py and
outcome_rm.py.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from pipeline_rl.demo.tiny_model import (
    TINY,
    Batcher,
    greedy_accuracy,
    make_tokenizer,
    save_model,
    teacher_forced_accuracy,
    train_step,
    write_split,
)
from pipeline_rl.demo.tiny_model import build as build_tiny

SEPARATOR = "\n"
TEST_PROBLEMS = 500
TRAIN_PROBLEMS = 20000
POLICY_TARGETS = {"policy": 0.5, "teacher": 0.9}
"""Greedy held-out accuracy (whole solution, teacher-forced) at which SFT stops."""
MAX_STEPS = 3000
BATCH = 64
LR = 1e-3
EVAL_EVERY = 25


def solution(a: int, b: int, c: int) -> str:
    return f"{a}+{b}={a + b}{SEPARATOR}{a + b}+{c}={a + b + c}"


def make_problems(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, test): TRAIN_PROBLEMS and TEST_PROBLEMS disjoint problems a+b+c, a + b < 100."""
    rng = random.Random(seed)
    triples = set()
    while len(triples) < TRAIN_PROBLEMS + TEST_PROBLEMS:
        a = rng.randint(10, 89)
        b = rng.randint(10, 99 - a)
        triples.add((a, b, rng.randint(10, 99)))
    ordered = sorted(triples)
    rng.shuffle(ordered)
    problems = [
        {
            "id": f"add3_{a}_{b}_{c}",
            "prompt": f"Q: {a}+{b}+{c}=",
            "answer": str(a + b + c),
            "solution": solution(a, b, c),
        }
        for a, b, c in ordered
    ]
    return problems[TEST_PROBLEMS:], problems[:TEST_PROBLEMS]


def operands(problem: dict) -> tuple[int, int, int]:
    a, b, c = problem["prompt"][len("Q: ") : -1].split("+")
    return int(a), int(b), int(c)


def _sft(model, tokenizer, train: list[dict], test: list[dict], target: float, seed: int, role: str) -> dict:
    """Supervised fine-tuning on worked solutions until greedy held-out accuracy >= target."""
    as_sft = [{"prompt": p["prompt"], "answer": p["solution"]} for p in train]
    batches = Batcher(tokenizer, as_sft)
    test_ids, test_labels = Batcher(
        tokenizer, [{"prompt": p["prompt"], "answer": p["solution"]} for p in test]
    ).tensors(list(range(len(test))))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    rng = random.Random(seed)
    start, step, greedy = time.time(), 0, 0.0
    model.train()
    while greedy < target:
        if step >= MAX_STEPS:
            raise RuntimeError(f"multi-step SFT reached greedy {greedy:.3f} < {target} in {MAX_STEPS} steps")
        train_step(model, opt, batches, rng, BATCH)
        step += 1
        if step % EVAL_EVERY == 0:
            greedy = greedy_accuracy(model, test_ids, test_labels)
            print(f"multistep_{role}: step {step}, held-out greedy {greedy:.3f} (target {target})", flush=True)
    model.eval()
    exact, greedy = teacher_forced_accuracy(model, test_ids, test_labels)
    return {"steps": step, "seconds": round(time.time() - start, 1), "greedy": greedy, "exact_t1": exact}


def build(cache_dir: Path, seed: int = 0) -> dict[str, Path]:
    """Build the data set and the models under `cache_dir` (the tiny arithmetic model first, if
    missing); returns their directories by role."""
    from transformers import AutoModelForCausalLM

    cache_dir = Path(cache_dir)
    base = cache_dir / TINY.name
    if not (base / "config.json").exists():
        build_tiny(cache_dir, seed)
    train, test = make_problems(seed)
    write_split(cache_dir / "multistep", train, test)
    tokenizer = make_tokenizer()
    out = {}
    for i, (role, target) in enumerate(POLICY_TARGETS.items()):
        torch.manual_seed(seed + i)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        report = _sft(model, tokenizer, train, test, target, seed + i, role)
        out[role] = cache_dir / f"multistep_{role}"
        save_model(model, tokenizer, report, out[role])
    return out
