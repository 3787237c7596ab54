"""The tiny outcome reward model of the multi-step task, in the form `RewardModelScorer` reads:
an `AutoModelForSequenceClassification` of one label whose logit at the last token says "the
final answer is right" (> 0) or not (< 0).

It reads prompt + completion as the scorer builds it for a tokenizer without a chat template:
"Q: a+b+c=" + "a+b=s1\\ns1+c=s2", no EOS. The solutions are the PRM's (pipeline_rl/demo/prm.py:
worked solutions with corrupted digits), labelled by their final answer alone.

`build(cache_dir, seed)` starts from the demo's PRM (built first if missing), whose layers
already check each digit and gather the checks at the end of a step, puts a new one-logit head
on them, and trains on the logistic loss at the last token until the held-out accuracy and the
shares of wrong answers scored below 0 and right ones above 0 reach FULL's targets. It writes
cache_dir/multistep_rm with a report.json. (Started from the quick PRM, the same head at lr 3e-4
still scored every answer wrong after 450 steps: there is no quick RM recipe yet.)
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from pipeline_rl.demo import prm
from pipeline_rl.demo.multistep import make_problems
from pipeline_rl.demo.tiny_model import make_tokenizer, save_model

MAX_STEPS = 3000
FULL = prm.Recipe("multistep_rm", target=0.9, class_target=0.8, lr=3e-4, eval_every=250)


def example(problem: dict, rng: random.Random, tokenizer) -> tuple[list[int], int]:
    """(token ids, 1 if the final answer is right else 0) of one solution of `problem`."""
    ids, _, _ = prm.example(problem, rng, tokenizer)
    text = tokenizer.decode(ids).removesuffix(prm.MARKER)
    return ids[:-1], int(text.rsplit("=", 1)[1] == problem["answer"])


def last_logits(model, items: list[tuple[list[int], int]], pad_id: int) -> torch.Tensor:
    """The model's logit at each item's last token (right padding)."""
    width = max(len(ids) for ids, _ in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, (x, _) in enumerate(items):
        ids[row, : len(x)] = torch.tensor(x)
        mask[row, : len(x)] = 1
    return model(input_ids=ids, attention_mask=mask).logits[:, 0]


@torch.no_grad()
def accuracy(model, items: list[tuple[list[int], int]], pad_id: int) -> dict:
    """`prm.rates` of the answers, an answer said right when its logit is above 0."""
    model.eval()
    right = last_logits(model, items, pad_id) > 0
    model.train()
    return prm.rates([(label, said) for (_, label), said in zip(items, right.tolist())])


def build(cache_dir: Path, seed: int = 0) -> Path:
    """Train the outcome RM from cache_dir/multistep_prm and write cache_dir/multistep_rm."""
    from transformers import AutoModelForSequenceClassification

    cache_dir = Path(cache_dir)
    recipe = FULL
    base = cache_dir / prm.FULL.name
    if not (base / "config.json").exists():
        prm.build(cache_dir, seed, prm.FULL)
    tokenizer = make_tokenizer()
    pad_id = tokenizer.pad_token_id
    assert isinstance(pad_id, int)
    train, test = make_problems(seed)
    held_out = random.Random(seed + 1)
    evalset = [example(p, held_out, tokenizer) for p in test for _ in range(prm.EVAL_COPIES)]
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(
        base, num_labels=1, dtype=torch.float32, ignore_mismatched_sizes=True
    )
    model.config.pad_token_id = pad_id
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / prm.WARMUP_STEPS))
    rng = random.Random(seed)
    start, step, report = time.time(), 0, {}
    model.train()
    while not prm.reached(report, recipe):
        if step >= MAX_STEPS:
            raise RuntimeError(f"the outcome RM reached {report} in {step} steps")
        items = [example(rng.choice(train), rng, tokenizer) for _ in range(prm.BATCH)]
        target = torch.tensor([label for _, label in items], dtype=torch.float32)
        torch.nn.functional.binary_cross_entropy_with_logits(last_logits(model, items, pad_id), target).backward()
        opt.step()
        opt.zero_grad()
        warmup.step()
        step += 1
        if step % recipe.eval_every == 0:
            report = accuracy(model, evalset, pad_id)
            shown = ", ".join(f"{k} {v:.3f}" for k, v in report.items() if isinstance(v, float))
            print(f"{recipe.name}: step {step}, held-out {shown}", flush=True)
    model.eval()
    report.update(steps=step, seconds=round(time.time() - start, 1), seed=seed)
    report.update(target=recipe.target, class_target=recipe.class_target)
    dest = cache_dir / recipe.name
    save_model(model, tokenizer, report, dest)
    return dest
