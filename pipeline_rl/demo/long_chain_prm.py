"""The process reward model of the long, uneven task (pipeline_rl/demo/long_chain.py), as
`ProcessRewardStepScorer(kind=token_classification)` reads it: a token classifier whose label 1
at the newline after a line is "this line is what the line before it asks for". Step guidance
reads a line's score only while every line before it is right (an attempt is cut at its first
line scored wrong), and there this is "every line so far is the worked solution's".

The scorer's input here is the policy's own text: the prompt, then each line with the marker
"\\n" after it, "Q: 3+5 to d=a3+5=8\\nb5+8=3\\n".

Training data are free: solutions of the training problems written with slips, continued from
what was written (a wrong result is carried into the next line, as the policy carries it). A
slip swaps one character of a line for another of its kind (the letter, an operand, the result,
a sign), or, as the softened policy's own slips mostly do, writes a stray character in a line's
place, inserts one or drops one. Labels:
- at the newline after each line: 1 when every character of the line is right (below); a
  label "every line so far is right" would ask the model to carry an earlier slip along 140
  tokens, which step guidance never needs (held-out wrong steps caught stalled with it);
- at each character of a line ("local" labels, as pipeline_rl/demo/prm.py puts them at each
  digit): 1 when it is what its place asks for given the line before it as written: the line's
  letter (not past the one the prompt names), the previous line's second operand and result,
  the signs, the sum of this line's operands modulo 10; in a malformed line, 0 at a stray
  character, and at an inserted one or where one is missing with nothing checked after it.
  Each check reads a fixed offset back, which a small model learns; the newline's label then
  only has to gather its line's.

`build(cache_dir, seed, recipe)` fine-tunes the long task's policy (built first if missing) as a
2-label `Qwen2ForTokenClassification` for the recipe's steps, keeps the weights of its best
evaluation on held-out solutions (`prm.Best`), then judges it where it is used: on the policy's own attempts (one sample at
temperature 1 per held-out problem), each step up to and including an attempt's first wrong one
labelled by the exact checker (`StepChecker`); the report holds both.
"""

from __future__ import annotations

import random
import string
import time
from pathlib import Path

import torch

from pipeline_rl.demo import ensure_built, long_chain, prm
from pipeline_rl.demo.tiny_model import make_tokenizer, sample_once, save_model

NAME = "long_chain_prm"
MARKER = "\n"
SLIP_P = 0.25
"""Probability that a line slips: about the softened policy's own rate (its exact T=1 accuracy
falls by a factor of about 0.7 a line)."""
PAST_END_P = 0.1
"""Share of training solutions that go on for a line past the letter the prompt names."""
SLIP_KINDS = ("swap", "garbage", "insert", "delete")
SLIP_WEIGHTS = (0.5, 0.2, 0.15, 0.15)
"""How often each kind of slip comes (see `slip`): the softened policy's wrong lines are about
half well-formed, half malformed."""
SIGN_P = 0.1
"""Share of swaps that change a sign ("+" or "=") instead of a letter or digit."""
GARBAGE = [chr(c) for c in range(128) if chr(c) != "\n"] + ["\ufffd"]
"""What a malformed slip writes: any ASCII character but the newline, or the replacement
character that a byte the policy samples outside UTF-8 decodes to (the scorer reads the policy's
text, decoded)."""
FULL = prm.Recipe(NAME, target=0.95, class_target=0.85, lr=1e-3, eval_every=100, steps=900)
"""The demo's PRM (conf=tiny_long_prm), a fixed recipe (the same work on every CPU) whose learning
rate decays linearly over its last third (at a constant rate the held-out rates stalled:
docs/learning.md). The targets are the floors its report is held to."""
POLICY_SAMPLES_SEED = 7
IGNORE = prm.IGNORE


def slip(line: list[str], labels: list[int], rng: random.Random) -> bool:
    """Slip once in `line` (its characters: letter, operand, "+", operand, "=", result) and
    `labels` (their local labels), in place. Returns whether the line keeps that form (a
    character swapped for another of its kind: the next line copies what it says) rather than a
    malformed one (a character replaced by GARBAGE, one inserted or deleted: the next line goes
    on from what this one meant)."""
    kind = rng.choices(SLIP_KINDS, SLIP_WEIGHTS)[0]
    if kind == "swap":
        i = rng.choice((2, 4)) if rng.random() < SIGN_P else rng.choice((0, 1, 3, 5))
        pool = "+=" + string.digits if i in (2, 4) else long_chain.LETTERS if i == 0 else string.digits
        line[i] = rng.choice([c for c in pool if c != line[i]])
        return True
    i = rng.randrange(len(line))
    if kind == "garbage":
        line[i] = rng.choice([c for c in GARBAGE if c != line[i]])
        labels[i] = 0
    elif kind == "insert":
        line.insert(i, rng.choice(GARBAGE))
        labels[i:] = [0] + [IGNORE] * (len(labels) - i)
    else:
        del line[i]
        labels[i:] = [0] * (i < len(line)) + [IGNORE] * (len(line) - i - 1)
    return False


def written(problem: dict, rng: random.Random) -> tuple[list[str], list[list[int]], list[int]]:
    """A solution of `problem` as a slipping writer writes it: its lines, per line the local
    label of each character (IGNORE where nothing is checked), and per line the step's label (1
    when the line is what the line before it, as written, asks for)."""
    a, b, last = _prompt(problem["prompt"])
    lines = problem["steps"] + (rng.random() < PAST_END_P)
    out, labels, exact = [], [], []
    x, y = a, b
    for k in range(lines):
        letter = letter_of(k)
        line = [letter, str(x), "+", str(y), "=", str((x + y) % 10)]
        local = local_labels(line, letter, x, y, last)
        carried = True
        if rng.random() < SLIP_P:
            carried = slip(line, local, rng)
            if carried:
                local = local_labels(line, letter, x, y, last)
        out.append("".join(line))
        labels.append(local)
        exact.append(int(carried and all(local)))
        x, y = (int(line[3]), int(line[5])) if carried else (y, (x + y) % 10)
    return out, labels, exact


def local_labels(line: list[str], letter: str, x: int, y: int, last: str) -> list[int]:
    """Each character's local label in a well-formed line: 1 when it is what its place asks
    for: the line's `letter` (not past the prompt's `last`), the operands `x` and `y` the previous
    line wrote, the signs, the sum of its operands modulo 10 as written here."""
    checks = (
        line[0] == letter and letter <= last,
        line[1] == str(x),
        line[2] == "+",
        line[3] == str(y),
        line[4] == "=",
        line[5] == str((int(line[1]) + int(line[3])) % 10),
    )
    return [int(c) for c in checks]


def example(problem: dict, rng: random.Random, tokenizer) -> tuple[list[int], list[int], list[int]]:
    """(token ids, labels, the positions of the newlines step guidance reads: up to and
    including the first wrong line's) of one written solution of `problem`; a character of
    several tokens (GARBAGE's replacement character) has its label on each."""
    lines, local, exact = written(problem, rng)
    ids = tokenizer.encode(problem["prompt"], add_special_tokens=False)
    labels = [IGNORE] * len(ids)
    marks = []
    for line, line_labels, right in zip(lines, local, exact, strict=True):
        for char, label in zip(line, line_labels, strict=True):
            char_ids = tokenizer.encode(char, add_special_tokens=False)
            ids += char_ids
            labels += [label] * len(char_ids)
        ids += tokenizer.encode(MARKER, add_special_tokens=False)
        labels.append(right)
        if len(marks) == 0 or labels[marks[-1]] == 1:
            marks.append(len(ids) - 1)
    return ids, labels, marks


def _prompt(prompt: str) -> tuple[int, int, str]:
    found = long_chain.PROMPT.search(prompt)
    if found is None:
        raise ValueError(f"not a long-chain prompt: {prompt!r}")
    return int(found.group(1)), int(found.group(2)), found.group(3)


def letter_of(k: int) -> str:
    """Line k's letter (past the last of LETTERS too: a line past a 20-step chain's end)."""
    return chr(ord("a") + k)


def guided_steps(prompt: str, completion: str) -> list[tuple[str, int]]:
    """The prefixes step guidance scores in an attempt (each ending with a line's newline), up
    to and including the first wrong line (a cut ends the attempt there), with the exact label."""
    out, text = [], ""
    for line in completion.split("\n")[:-1]:
        text += line + "\n"
        right = int(long_chain.StepChecker.check(prompt, text))
        out.append((text, right))
        if not right:
            break
    return out


@torch.no_grad()
def on_policy_rates(model, tokenizer, problems: list[dict], attempts: list[str]) -> dict:
    """`prm.rates` of the PRM on the steps step guidance would score in the policy's attempts,
    plus the share of attempts with a wrong line whose first wrong line the PRM scores below 0.5
    and the share of attempts that it cuts while every line so far is right."""
    model.eval()
    judged, caught, wrong_attempts, false_cuts = [], 0, 0, 0
    for problem, completion in zip(problems, attempts, strict=True):
        steps = guided_steps(problem["prompt"], completion)
        if not steps:
            continue
        ids = tokenizer.encode(problem["prompt"] + steps[-1][0], add_special_tokens=False)
        probs = model(input_ids=torch.tensor([ids])).logits[0].softmax(-1)[:, 1]
        marks = [i for i, t in enumerate(ids) if tokenizer.decode([t]) == MARKER]
        said = [probs[m].item() >= 0.5 for m in marks]
        judged += [(label, s) for (_, label), s in zip(steps, said, strict=True)]
        first_wrong = next((k for k, (_, label) in enumerate(steps) if not label), None)
        cut = next((k for k, s in enumerate(said) if not s), None)
        if first_wrong is not None:
            wrong_attempts += 1
            caught += cut == first_wrong
        false_cuts += cut is not None and (first_wrong is None or cut < first_wrong)
    report = prm.rates(judged)
    report.update(
        first_wrong_step_caught=caught / max(wrong_attempts, 1),
        attempts_cut_while_right=false_cuts / len(problems),
        attempts_with_a_wrong_step=wrong_attempts,
        attempts=len(problems),
    )
    return report


def build(cache_dir: Path, seed: int = 0, recipe: prm.Recipe = FULL, base: str = long_chain.NAME) -> Path:
    """Train the PRM from cache_dir/<base> (the policy, built first if missing) for the recipe's
    steps and write cache_dir/<recipe.name>."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    cache_dir = Path(cache_dir)
    ensure_built(cache_dir / base, seed)
    tokenizer = make_tokenizer()
    pad_id = tokenizer.pad_token_id
    assert isinstance(pad_id, int)
    train, test = long_chain.make_problems(seed)
    held_out = random.Random(seed + 1)
    evalset = [example(p, held_out, tokenizer) for p in test for _ in range(prm.EVAL_COPIES)]
    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_pretrained(cache_dir / base, num_labels=2, dtype=torch.float32)
    rng = random.Random(seed)

    def loss() -> torch.Tensor:
        ids, labels = prm.batch([example(rng.choice(train), rng, tokenizer) for _ in range(prm.BATCH)], pad_id)
        return model(input_ids=ids, labels=labels).loss

    start = time.time()
    report, step = prm.fit(
        model,
        list(model.parameters()),
        recipe,
        loss,
        lambda: prm.step_accuracy(model, evalset, pad_id),
        "the long task's PRM",
        decay=True,
    )
    policy = AutoModelForCausalLM.from_pretrained(cache_dir / base, dtype=torch.float32).eval()
    attempts = [
        text for text, _ in sample_once(policy, tokenizer, test, long_chain.MAX_NEW_TOKENS, seed + POLICY_SAMPLES_SEED)
    ]
    report.update(steps=step, seconds=round(time.time() - start, 1), marker=MARKER, seed=seed)
    report.update(target=recipe.target, class_target=recipe.class_target)
    report["on_policy_attempts"] = on_policy_rates(model, tokenizer, test, attempts)
    print(f"{recipe.name}: on the policy's own attempts {report['on_policy_attempts']}", flush=True)
    dest = cache_dir / recipe.name
    save_model(model, tokenizer, report, dest)
    return dest
