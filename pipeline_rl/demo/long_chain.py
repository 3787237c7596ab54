"""The long, uneven task (conf=tiny_long) and its policy, built locally in a few minutes on 2 cores.

Task: "Q: 3+5 to d=" asks for the Fibonacci recurrence modulo 10 from the digits 3 and 5, worked
one lettered line per step up to the letter named, "a3+5=8\nb5+8=3\nc8+3=1\nd3+1=4"; the
answer is the last result. Chains run from 2 to 20 steps, so completions run from 14 to 140
tokens, a 10x spread, and a sample that must get every step right is rarer the longer the chain.
The domain `multistep` (its check: the last line ends in "=<answer>" and the completion stops by
EOS) rewards the final answer only; a wrong step is carried into every later line.

Why this task: each step reads the previous line at a fixed offset (its second operand and its
result become the next line's operands, its letter's successor the next letter), adds two
digits, and stops when the letter is the one the prompt names, so the tiny model learns it by
supervised training in minutes. Chains of two-digit sums with operands read back from the prompt
(an earlier attempt) need the model to find the next operand by content, which it had not learnt
after 20 minutes of CPU: the length of the chain, not the difficulty of a step, is what this
task is about.

`build(cache_dir)` writes, under cache_dir:
- long_chain/{train,test}.jsonl: problems {"id", "prompt", "answer", "solution", "steps"}, every
  start (a, b) and length once, the test set disjoint;
- long_chain_policy: the tiny model's shape and tokenizer, trained from scratch on worked
  solutions for a fixed number of steps, then its logits softened (tiny_model.soften_until) until it
  scores TARGET_REWARD on the held-out problems, one sample each at temperature 1: room
  for RL, most of it on the long chains; report.json holds the exact T=1 accuracy by chain length.
"""

from __future__ import annotations

import random
import re
import string
import time
from pathlib import Path

import torch

from pipeline_rl.config import RunConfig
from pipeline_rl.demo.tiny_model import (
    Batcher,
    make_model,
    make_tokenizer,
    sampled_reward,
    save_model,
    soften_until,
    teacher_forced_accuracy,
    write_split,
)
from pipeline_rl.rollouts.domains.multistep import score
from pipeline_rl.scorers.hf import load_tokenizer
from pipeline_rl.scorers.step_scorer import StepScorer
from pipeline_rl.streams.records import StepRequest

NAME = "long_chain_policy"
DATA = "long_chain"
MIN_STEPS, MAX_STEPS = 2, 20
LETTERS = string.ascii_lowercase[:MAX_STEPS]
TEST_PROBLEMS = 300
SFT_STEPS = 800
"""A fixed recipe: the same work on every CPU; softening then sets the starting accuracy."""
TARGET_REWARD = 0.3
"""Held-out reward at T=1 (one sample per problem) the policy's logits are softened to. A sample
can reach the right answer past a slip that does not carry (a wrong letter, say), so this is
above the probability of sampling the whole solution exactly (also in report.json)."""
SOFTEN_ITERATIONS = 12
FLOOR = 0.5
"""Below this exact T=1 accuracy after SFT_STEPS the build failed (a broken recipe)."""
MAX_NEW_TOKENS = 160
"""conf=tiny_long's actor.max_new_tokens: the evaluation's limit here too."""
BATCH = 32
LR = 2e-3
WARMUP_STEPS = 100
EVAL_EVERY = 200


def chain(a: int, b: int, steps: int) -> tuple[str, str, int]:
    """(prompt, worked solution, answer) of `steps` lines of the Fibonacci recurrence modulo 10
    from the digits a and b; the lines are lettered a, b, c... and the prompt names the last."""
    lines, x, y = [], a, b
    for letter in LETTERS[:steps]:
        lines.append(f"{letter}{x}+{y}={(x + y) % 10}")
        x, y = y, (x + y) % 10
    return f"Q: {a}+{b} to {LETTERS[steps - 1]}=", "\n".join(lines), y


PROMPT = re.compile(r"Q: (\d)\+(\d) to ([a-z])=")


class StepChecker(StepScorer):
    """A rule-based step scorer for this task (step guidance, `conf=tiny_long_cut`): 1.0 while
    every completed line of the attempt is the worked solution's line, else 0.0. Exact, so it
    shows what cutting can gain when the step scores are right; a learned process reward model
    is judged against it. Reads the prompt and completion with the policy's tokenizer."""

    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        self.tokenizer = load_tokenizer(cfg.model.path)

    def score_steps(self, requests: list[StepRequest]) -> list[float]:
        def text(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

        return [self.check(text(r.prompt_ids), text(r.completion_ids)) for r in requests]

    @staticmethod
    def check(prompt: str, completion: str) -> float:
        """1.0 when every line of `completion` that a newline ends is the solution's line."""
        found = PROMPT.search(prompt)
        if found is None or found.group(3) not in LETTERS:
            return 0.0
        a, b, last = int(found.group(1)), int(found.group(2)), found.group(3)
        solution = chain(a, b, LETTERS.index(last) + 1)[1].split("\n")
        lines = completion.split("\n")[:-1]
        return 1.0 if len(lines) <= len(solution) and lines == solution[: len(lines)] else 0.0


def make_problems(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, test): every start (a, b) and chain length, shuffled by `seed`; the first
    TEST_PROBLEMS are the test set."""
    problems = []
    for a in range(10):
        for b in range(10):
            for steps in range(MIN_STEPS, MAX_STEPS + 1):
                prompt, solution, answer = chain(a, b, steps)
                problems.append(
                    {
                        "id": f"fib_{a}{b}_{steps}",
                        "prompt": prompt,
                        "answer": str(answer),
                        "solution": solution,
                        "steps": steps,
                    }
                )
    random.Random(seed).shuffle(problems)
    return problems[TEST_PROBLEMS:], problems[:TEST_PROBLEMS]


def _as_sft(problems: list[dict]) -> list[dict]:
    return [{"prompt": p["prompt"], "answer": p["solution"]} for p in problems]


def build(cache_dir: Path, seed: int = 0) -> Path:
    """Build the data set and the policy under `cache_dir`; returns the policy's directory."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    train, test = make_problems(seed)
    write_split(cache_dir / DATA, train, test)
    tokenizer = make_tokenizer()
    torch.manual_seed(seed)
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert isinstance(eos_id, int) and isinstance(pad_id, int)
    model = make_model(len(tokenizer), eos_id, pad_id)
    batches = Batcher(tokenizer, _as_sft(train))
    test_ids, test_labels = Batcher(tokenizer, _as_sft(test)).tensors(list(range(len(test))))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / WARMUP_STEPS, (SFT_STEPS - s) / (SFT_STEPS / 3), 1.0)
    )
    rng = random.Random(seed)
    start = time.time()
    model.train()
    for step in range(1, SFT_STEPS + 1):
        ids, labels = batches.tensors([rng.randrange(len(train)) for _ in range(BATCH)])
        width = int((labels != -100).nonzero()[:, 1].max()) + 1  # no padding past the longest row
        model(input_ids=ids[:, :width], labels=labels[:, :width]).loss.backward()
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
    scale = soften_until(
        model,
        lambda: sampled_reward(model, tokenizer, test, score, MAX_NEW_TOKENS, seed),
        TARGET_REWARD,
        SOFTEN_ITERATIONS,
    )
    exact, _ = teacher_forced_accuracy(model, test_ids, test_labels)
    report = {
        "steps": SFT_STEPS,
        "seconds": round(time.time() - start, 1),
        "greedy": greedy,
        "exact_t1_before_softening": round(exact_before, 4),
        "softening_scale": round(scale, 4),
        "exact_t1": round(exact, 4),
        "reward_t1": round(sampled_reward(model, tokenizer, test, score, MAX_NEW_TOKENS, seed + 1), 4),
        "exact_t1_by_steps": by_steps(model, tokenizer, test),
        "seed": seed,
    }
    dest = cache_dir / NAME
    save_model(model, tokenizer, report, dest)
    return dest


@torch.no_grad()
def by_steps(model, tokenizer, test: list[dict]) -> dict[str, float]:
    """Held-out exact T=1 accuracy by the number of steps in the chain."""
    out = {}
    for steps in sorted({p["steps"] for p in test}):
        rows = [p for p in test if p["steps"] == steps]
        ids, labels = Batcher(tokenizer, _as_sft(rows)).tensors(list(range(len(rows))))
        out[str(steps)] = round(teacher_forced_accuracy(model, ids, labels)[0], 4)
    return out
