"""The tiny process reward model (PRM) of the multi-step task (pipeline_rl/demo/multistep.py),
in the Qwen2.5-Math-PRM form that `ProcessRewardScorer(kind=token_classification)` reads: a
token classifier whose label 1 at the marker after a step is "every step so far is right".

Training data are free: worked solutions of the training problems, each result corrupted with
probability CORRUPT_P (one digit changed) and the copied first result with CORRUPT_P / 3. The
PRM reads "Q: a+b+c=" + "a+b=s1" + MARKER + "s1+c=s2" + MARKER, as the scorer builds it with
separator and marker both "\\n".

Labels come at two places:
- at the marker after each step: 1 when this step and all before it are right;
- at each digit of each step's result: 1 when that digit is the right one for the step as
  written ("local" labels: they do not depend on earlier steps).
The step labels alone never taught a classifier here to check a sum: held-out step accuracy
stayed at 0.53-0.70 (half the steps wrong) whether the teacher or the tiny model was fine-tuned
whole, new layers were put on a frozen teacher, a classifier was trained from scratch, or
"the prefix up to here is right" was labelled on every token, for 1,000-3,000 steps each. A
prefix label is 0 from the first error on, whatever follows; a local label asks for the check
itself at every digit of every solution, and the step labels then only have to gather it.

`build(cache_dir, seed, recipe)` fine-tunes the tiny arithmetic model (which adds two 2-digit
numbers) as a 2-label `Qwen2ForTokenClassification` until, on held-out problems, its step
accuracy reaches the recipe's `target` and the shares of wrong steps scored below 0.5 and of
right steps at or above it reach its `class_target`, and writes cache_dir/<recipe.name> with a
report.json of those figures and the targets. FULL is the demo's PRM (2,500-4,000 steps, by CPU);
QUICK, the tests' (multistep_prm_quick), is a fixed recipe: a set number of steps, so that its
build costs the same work on every CPU (a target reached at step 900 on one CPU was not reached
by step 1,700 on another); the tests hold its report to lower floors, enough to separate right
from wrong steps, which is what the scorer tests need.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline_rl.demo.multistep import make_problems, operands
from pipeline_rl.demo.tiny_model import TINY, make_tokenizer, save_model
from pipeline_rl.demo.tiny_model import build as build_tiny

MARKER = "\n"
CORRUPT_P = 0.35
"""Probability that a step's result has one wrong digit (the copied result: a third of it)."""
MAX_STEPS = 6000
"""Where a target-based build gives up."""
QUICK_STEPS = 1200
BATCH = 64
WARMUP_STEPS = 100
EVAL_COPIES = 2
"""Corrupted variants of each held-out problem in the evaluation set."""


@dataclass(frozen=True)
class Recipe:
    """When a classifier build (the PRM here, the outcome RM in outcome_rm.py) stops, and how
    fast it learns."""

    name: str
    """Directory under the cache."""
    target: float
    """Held-out accuracy at which training stops..."""
    class_target: float
    """...once the shares of wrong items caught and of right items kept have both reached this too."""
    lr: float
    """AdamW learning rate (after WARMUP_STEPS of linear warm-up)."""
    eval_every: int
    """Steps between held-out evaluations."""
    steps: int | None = None
    """A fixed recipe: exactly this many steps, whatever the evaluations say, so the build takes
    the same work on every CPU. It keeps the weights of its best evaluation (see `Best`), and
    `target` and `class_target` are then the floors its report is held to (by the tests), not
    where it stops."""


FULL = Recipe("multistep_prm", target=0.9, class_target=0.8, lr=3e-4, eval_every=250)
"""The demo's PRM (conf=tiny_multistep_prm)."""
QUICK = Recipe("multistep_prm_quick", target=0.65, class_target=0.6, lr=3e-4, eval_every=100, steps=QUICK_STEPS)
"""The tests' PRM, a fixed recipe: separates right from wrong steps, in a fraction of FULL's time."""
IGNORE = -100


def corrupt(value: int, rng: random.Random, p: float) -> str:
    """`value` as text, with probability p with one digit replaced by another (no leading 0)."""
    text = str(value)
    if rng.random() >= p:
        return text
    i = rng.randrange(len(text))
    digits = [d for d in "0123456789" if d != text[i] and not (i == 0 and d == "0" and len(text) > 1)]
    return text[:i] + rng.choice(digits) + text[i + 1 :]


def example(problem: dict, rng: random.Random, tokenizer) -> tuple[list[int], list[int], list[int]]:
    """(token ids, labels, marker positions) of one solution of `problem`, possibly corrupted."""
    a, b, c = operands(problem)
    s1 = corrupt(a + b, rng, CORRUPT_P)
    copied = corrupt(int(s1), rng, CORRUPT_P / 3)
    s2 = corrupt(int(copied) + c, rng, CORRUPT_P)
    steps = [(f"{a}+{b}=", s1, str(a + b), True), (f"{copied}+{c}=", s2, str(int(copied) + c), copied == s1)]
    ids = tokenizer.encode(problem["prompt"], add_special_tokens=False)
    labels = [IGNORE] * len(ids)
    marks, chain = [], True
    for head, result, right, copied_right in steps:
        ids += tokenizer.encode(head, add_special_tokens=False)
        labels += [IGNORE] * (len(ids) - len(labels))
        for k, digit in enumerate(result):
            ids += tokenizer.encode(digit, add_special_tokens=False)
            labels.append(int(k < len(right) and digit == right[k]))
        chain = chain and copied_right and result == right
        ids += tokenizer.encode(MARKER, add_special_tokens=False)
        labels.append(int(chain))
        marks.append(len(ids) - 1)
    return ids, labels, marks


def padded(rows: list[list[int]], fill: int) -> torch.Tensor:
    """Rows right-padded with `fill` to the longest."""
    out = torch.full((len(rows), max(len(r) for r in rows)), fill, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out


def batch(items: list[tuple[list[int], list[int], Any]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (padded with pad_id) and labels (padded with IGNORE) of (ids, labels, ...) items."""
    return padded([x for x, _, _ in items], pad_id), padded([y for _, y, _ in items], IGNORE)


def rates(judged: list[tuple[int, bool]]) -> dict:
    """From (label, said right) pairs: accuracy, the shares of wrong items said wrong (caught)
    and of right items said right (kept), and the counts of each."""
    wrong = [said for label, said in judged if not label]
    right = [said for label, said in judged if label]
    return {
        "accuracy": (wrong.count(False) + right.count(True)) / len(judged),
        "wrong_caught": wrong.count(False) / max(len(wrong), 1),
        "right_kept": right.count(True) / max(len(right), 1),
        "held_out_wrong": len(wrong),
        "held_out_right": len(right),
    }


@torch.no_grad()
def step_accuracy(model, items, pad_id: int) -> dict:
    """`rates` of the steps at the markers, a step said right when scored at or above 0.5."""
    model.eval()
    ids, _ = batch(items, pad_id)
    correct = model(input_ids=ids).logits.softmax(-1)[..., 1]
    model.train()
    return rates([(y[m], correct[row, m].item() >= 0.5) for row, (_, y, marks) in enumerate(items) for m in marks])


def reached(report: dict, recipe: Recipe) -> bool:
    return (
        bool(report)
        and report["accuracy"] >= recipe.target
        and min(report["wrong_caught"], report["right_kept"]) >= recipe.class_target
    )


def finished(step: int, report: dict, recipe: Recipe, max_steps: int, what: str) -> bool:
    """Whether a build of `recipe` stops after `step` steps (raises when a target-based build
    ran out of max_steps)."""
    if recipe.steps is not None:
        return step >= recipe.steps
    if reached(report, recipe):
        return True
    if step >= max_steps:
        raise RuntimeError(f"{what} reached {report} in {step} steps, short of {recipe.target} / {recipe.class_target}")
    return False


class Best:
    """A fixed recipe's best evaluation so far, by the smaller of the two class rates, then
    accuracy: at a threshold of 0.5 the two rates trade off from one evaluation to the next, so
    where training happens to end would otherwise decide the report."""

    def __init__(self) -> None:
        self.key: tuple[float, float] | None = None
        self.report: dict = {}
        self.state: dict[str, torch.Tensor] = {}

    def offer(self, step: int, report: dict, model: torch.nn.Module) -> None:
        key = (min(report["wrong_caught"], report["right_kept"]), report["accuracy"])
        if self.key is None or key > self.key:
            self.key, self.report = key, dict(report, kept_step=step)
            self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def restore(self, model: torch.nn.Module) -> dict:
        """Load the best weights into `model` and return their report."""
        model.load_state_dict(self.state)
        return self.report


def evaluates_after(step: int, recipe: Recipe) -> bool:
    """Whether the build evaluates after `step`: every eval_every steps, and a fixed recipe's last."""
    return step % recipe.eval_every == 0 or step == recipe.steps


def fit(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter],
    recipe: Recipe,
    loss: Callable[[], torch.Tensor],
    evaluate: Callable[[], dict],
    what: str,
    decay: bool = False,
    max_steps: int = MAX_STEPS,
) -> tuple[dict, int]:
    """The classifier builds' training loop (this PRM, the outcome RM, the long task's PRM): AdamW
    on `params` at recipe.lr after WARMUP_STEPS of linear warm-up (with `decay`, falling to 0
    over a fixed recipe's last third), one `loss()` of a fresh batch per step and `evaluate()` on
    the held-out set at `evaluates_after`, until `finished` (a target-based build gives up after
    `max_steps`); a fixed recipe ends on its best evaluation's weights. Returns the report of the
    weights it ends on and the steps taken."""
    opt = torch.optim.AdamW(params, lr=recipe.lr)
    steps = recipe.steps
    if decay and steps is None:
        raise ValueError(f"{recipe.name}: a decaying learning rate needs a fixed recipe (steps)")

    def factor(s: int) -> float:
        warm = (s + 1) / WARMUP_STEPS
        return min(warm, (steps - s) / (steps / 3), 1.0) if decay and steps else min(warm, 1.0)

    schedule = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    start, step, report, best = time.time(), 0, {}, Best()
    model.train()
    while not finished(step, report, recipe, max_steps, what):
        loss().backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
        step += 1
        if evaluates_after(step, recipe):
            report = evaluate()
            best.offer(step, report, model)
            shown = ", ".join(f"{k} {v:.3f}" for k, v in report.items() if isinstance(v, float))
            print(f"{recipe.name}: step {step}, held-out {shown} ({time.time() - start:.0f} s)", flush=True)
    if steps is not None:
        report = best.restore(model)
    model.eval()
    return report, step


def build(cache_dir: Path, seed: int = 0, recipe: Recipe = FULL) -> Path:
    """Train the PRM from cache_dir/tiny_model (built first if missing) and write
    cache_dir/<recipe.name>; raises if the targets are not reached within MAX_STEPS."""
    from transformers import AutoModelForTokenClassification

    cache_dir = Path(cache_dir)
    base = cache_dir / TINY.name
    if not (base / "config.json").exists():
        build_tiny(cache_dir, seed)
    tokenizer = make_tokenizer()
    pad_id = tokenizer.pad_token_id
    assert isinstance(pad_id, int)
    train, test = make_problems(seed)
    held_out = random.Random(seed + 1)
    evalset = [example(p, held_out, tokenizer) for p in test for _ in range(EVAL_COPIES)]
    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_pretrained(base, num_labels=2, dtype=torch.float32)
    rng = random.Random(seed)

    def loss() -> torch.Tensor:
        ids, labels = batch([example(rng.choice(train), rng, tokenizer) for _ in range(BATCH)], pad_id)
        return model(input_ids=ids, labels=labels).loss

    start = time.time()
    report, step = fit(
        model, list(model.parameters()), recipe, loss, lambda: step_accuracy(model, evalset, pad_id), "the PRM"
    )
    report.update(steps=step, seconds=round(time.time() - start, 1), marker=MARKER, seed=seed)
    report.update(target=recipe.target, class_target=recipe.class_target)
    dest = cache_dir / recipe.name
    save_model(model, tokenizer, report, dest)
    return dest
