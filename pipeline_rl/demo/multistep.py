"""The multi-step arithmetic task and the tiny models built for it: a policy, a process reward
model (PRM), an outcome reward model (RM) and a teacher, all fine-tuned from the tiny
arithmetic model (pipeline_rl/demo/tiny_model.py), locally and in a few minutes on 2 cores.

Task: "Q: 12+34+56=" answered in two steps, one per line: "12+34=46\\n46+56=102". Problems
have a + b < 100, so each step is a 2-digit addition, the tiny model's own skill; what the
policy must learn is the format and carrying the first result into the second step. The
domain `multistep` (pipeline_rl/actor/domains/multistep.py) rewards a completion whose last
line ends in "=<answer>" and that stops by EOS.

`build(cache_dir)` writes, under cache_dir:
- multistep/{train,test}.jsonl: problems {"id", "prompt", "answer", "solution"}, disjoint;
- multistep_policy: supervised on worked solutions only until about half of the held-out
  problems are solved greedily (room for RL);
- multistep_teacher: the same, until POLICY_TARGETS["teacher"] greedy (for distillation);
- multistep_prm: a 2-label Qwen2ForTokenClassification, trained on right and corrupted
  steps: input "prompt step1 # step2 #" (MARKER after each step), label 1 at a marker whose
  step is right (correct sum of the right operands), 0 otherwise. This is the input layout
  of `ProcessRewardScorer(kind=token_classification, marker="#", separator="\\n")`;
- multistep_rm: a 1-label Qwen2ForSequenceClassification, trained (logistic loss on its
  score) on right and wrong final answers of prompt + completion;
each with a report.json of its held-out accuracy. Corrupted steps cost nothing to make: a
sum off by a small amount, or a first result not carried into the second step.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import torch

from pipeline_rl.demo.tiny_model import (
    TINY,
    _Batcher,
    _replace_dir,
    _teacher_forced_accuracy,
    _write_jsonl,
    make_tokenizer,
)
from pipeline_rl.demo.tiny_model import (
    build as build_tiny,
)

MARKER = "#"
SEPARATOR = "\n"
TEST_PROBLEMS = 500
TRAIN_PROBLEMS = 20000
POLICY_TARGETS = {"policy": 0.5, "teacher": 0.9}
"""Greedy held-out accuracy (whole solution, teacher-forced) at which SFT stops."""
MAX_STEPS = 3000
BATCH = 64
LR = 1e-3
EVAL_EVERY = 25
SCORER_STEPS = 600
"""Training steps of the PRM and the RM."""


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


def corrupted_steps(problem: dict, rng: random.Random) -> tuple[list[str], list[int]]:
    """Two steps of a solution, each right or wrong, and their labels (1 right, 0 wrong)."""
    a, b, c = operands(problem)
    first = a + b
    if rng.random() < 0.5:
        first += rng.choice([-10, -2, -1, 1, 2, 10])
    carried = first if rng.random() < 0.8 else first + rng.choice([-1, 1, 10])
    second = carried + c
    if rng.random() < 0.5:
        second += rng.choice([-10, -2, -1, 1, 2, 10])
    steps = [f"{a}+{b}={first}", f"{carried}+{c}={second}"]
    return steps, [int(first == a + b), int(carried == first and second == carried + c)]


def _sft(model, tokenizer, train: list[dict], test: list[dict], target: float, seed: int, role: str) -> dict:
    """Supervised fine-tuning on worked solutions until greedy held-out accuracy >= target."""
    as_sft = [{"prompt": p["prompt"], "answer": p["solution"]} for p in train]
    batches = _Batcher(tokenizer, as_sft)
    test_ids, test_labels = _Batcher(
        tokenizer, [{"prompt": p["prompt"], "answer": p["solution"]} for p in test]
    ).tensors(list(range(len(test))))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    rng = random.Random(seed)
    start, step, greedy = time.time(), 0, 0.0
    model.train()
    while greedy < target:
        if step >= MAX_STEPS:
            raise RuntimeError(f"multi-step SFT reached greedy {greedy:.3f} < {target} in {MAX_STEPS} steps")
        ids, labels = batches.tensors([rng.randrange(len(as_sft)) for _ in range(BATCH)])
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step % EVAL_EVERY == 0:
            model.eval()
            _, greedy = _teacher_forced_accuracy(model, test_ids, test_labels)
            model.train()
            print(f"multistep_{role}: step {step}, held-out greedy {greedy:.3f} (target {target})", flush=True)
    model.eval()
    exact, greedy = _teacher_forced_accuracy(model, test_ids, test_labels)
    return {"steps": step, "seconds": round(time.time() - start, 1), "greedy": greedy, "exact_t1": exact}


def _prm_example(tokenizer, problem: dict, rng: random.Random) -> tuple[list[int], list[int], list[int]]:
    """(input ids, marker positions, labels) of one PRM training example."""
    steps, labels = corrupted_steps(problem, rng)
    ids = tokenizer.encode(problem["prompt"], add_special_tokens=False)
    positions = []
    for step in steps:
        ids += tokenizer.encode(step + MARKER, add_special_tokens=False)
        positions.append(len(ids) - 1)
    return ids, positions, labels


def _rm_example(tokenizer, problem: dict, rng: random.Random) -> tuple[list[int], int]:
    """(input ids, label): half right solutions, half corrupted ones (of which a few still end right)."""
    steps = problem["solution"].split(SEPARATOR) if rng.random() < 0.5 else corrupted_steps(problem, rng)[0]
    a, b, c = operands(problem)
    text = problem["prompt"] + SEPARATOR.join(steps)
    return tokenizer.encode(text, add_special_tokens=False), int(steps[-1].endswith(f"={a + b + c}"))


def _padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


def _train_prm(model, tokenizer, train: list[dict], test: list[dict], seed: int) -> dict:
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    start = time.time()
    model.train()

    def batch(problems):
        examples = [_prm_example(tokenizer, p, rng) for p in problems]
        ids, mask = _padded([e[0] for e in examples], tokenizer.pad_token_id)
        labels = torch.full(ids.shape, -100, dtype=torch.long)
        for i, (_, positions, ys) in enumerate(examples):
            labels[i, positions] = torch.tensor(ys)
        return ids, mask, labels

    for _ in range(SCORER_STEPS):
        ids, mask, labels = batch([rng.choice(train) for _ in range(BATCH)])
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    ids, mask, labels = batch(test)
    with torch.no_grad():
        predicted = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
    scored = labels != -100
    accuracy = (predicted[scored] == labels[scored]).float().mean().item()
    return {"steps": SCORER_STEPS, "seconds": round(time.time() - start, 1), "step_accuracy": accuracy}


def _train_rm(model, tokenizer, train: list[dict], test: list[dict], seed: int) -> dict:
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    start = time.time()
    model.train()

    def batch(problems):
        examples = [_rm_example(tokenizer, p, rng) for p in problems]
        ids, mask = _padded([e[0] for e in examples], tokenizer.pad_token_id)
        return ids, mask, torch.tensor([float(e[1]) for e in examples])

    for _ in range(SCORER_STEPS):
        ids, mask, y = batch([rng.choice(train) for _ in range(BATCH)])
        score = model(input_ids=ids, attention_mask=mask).logits[:, 0]
        torch.nn.functional.binary_cross_entropy_with_logits(score, y).backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    ids, mask, y = batch(test)
    with torch.no_grad():
        score = model(input_ids=ids, attention_mask=mask).logits[:, 0]
    return {
        "steps": SCORER_STEPS,
        "seconds": round(time.time() - start, 1),
        "accuracy": ((score > 0) == (y > 0.5)).float().mean().item(),
    }


def _save(model, tokenizer, report: dict, dest: Path) -> None:
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    _replace_dir(tmp, dest)


def build(cache_dir: Path, seed: int = 0) -> dict[str, Path]:
    """Build the data set and the four models under `cache_dir` (the tiny arithmetic model first,
    if missing); returns their directories by role."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification

    cache_dir = Path(cache_dir)
    base = cache_dir / TINY.name
    if not (base / "config.json").exists():
        build_tiny(cache_dir, seed)
    train, test = make_problems(seed)
    data = cache_dir / f"multistep.tmp-{os.getpid()}"
    data.mkdir(parents=True)
    _write_jsonl(data / "train.jsonl", train)
    _write_jsonl(data / "test.jsonl", test)
    _replace_dir(data, cache_dir / "multistep")
    tokenizer = make_tokenizer()
    out = {}
    for i, (role, target) in enumerate(POLICY_TARGETS.items()):
        torch.manual_seed(seed + i)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        report = _sft(model, tokenizer, train, test, target, seed + i, role)
        out[role] = cache_dir / f"multistep_{role}"
        _save(model, tokenizer, report, out[role])
    torch.manual_seed(seed)
    prm = AutoModelForTokenClassification.from_pretrained(base, num_labels=2, dtype=torch.float32)
    out["prm"] = cache_dir / "multistep_prm"
    _save(prm, tokenizer, _train_prm(prm, tokenizer, train, test, seed), out["prm"])
    rm = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype=torch.float32)
    rm.config.pad_token_id = tokenizer.pad_token_id
    out["rm"] = cache_dir / "multistep_rm"
    _save(rm, tokenizer, _train_rm(rm, tokenizer, train, test, seed), out["rm"])
    return out
