"""The tiny outcome reward model of the multi-step task, in the form `RewardModelScorer` reads:
an `AutoModelForSequenceClassification` of one label whose logit at the last token says "the
final answer is right" (> 0) or not (< 0).

It reads prompt + completion as the scorer builds it for a tokenizer without a chat template:
"Q: a+b+c=" + "a+b=s1\\ns1+c=s2", no EOS. The solutions are the PRM's (pipeline_rl/demo/prm.py:
worked solutions with corrupted digits), labelled by their final answer.

`build(cache_dir, seed, recipe)` starts from the recipe's PRM (built first if missing), puts a new
one-logit head on its layers and trains on the logistic loss at the last token. The final
answer alone is a sparse label (trained on it alone, from the quick PRM, every answer was still
scored wrong after 1,000 steps), so a second, auxiliary head is trained beside it on the PRM's own
labels (each digit right for its step, each step right so far), which keeps the layers checking
every digit; it is dropped when the RM is saved. FULL (from the demo's PRM), the demo's RM, trains
until the held-out accuracy and the shares of wrong answers scored below 0 and right ones above 0
reach its targets; QUICK (from the quick PRM), the tests', is a fixed number of steps whose report
the tests hold to lower floors (prm.Recipe.steps). Either writes cache_dir/<recipe.name> with a
report.json.
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
"""Where a target-based build gives up."""
QUICK_STEPS = 600
FULL = prm.Recipe("multistep_rm", target=0.9, class_target=0.8, lr=3e-4, eval_every=250)
"""The demo's outcome RM, from the demo's PRM."""
QUICK = prm.Recipe("multistep_rm_quick", target=0.6, class_target=0.45, lr=3e-4, eval_every=100, steps=QUICK_STEPS)
"""The tests' outcome RM, from the tests' PRM: separates right from wrong answers, in a fraction
of FULL's time. Its fixed steps end at different rates on different CPUs (docs/testing.md);
the targets are what the tests assert, below the lowest rates measured."""
BASE = {FULL.name: prm.FULL, QUICK.name: prm.QUICK}
"""The PRM recipe each RM recipe starts from."""


def labelled(problem: dict, rng: random.Random, tokenizer) -> tuple[list[int], list[int], int]:
    """(token ids, the PRM's labels of those tokens, 1 if the final answer is right else 0) of
    one solution of `problem`."""
    ids, labels, _ = prm.example(problem, rng, tokenizer)
    text = tokenizer.decode(ids).removesuffix(prm.MARKER)
    return ids[:-1], labels[:-1], int(text.rsplit("=", 1)[1] == problem["answer"])


def example(problem: dict, rng: random.Random, tokenizer) -> tuple[list[int], int]:
    """(token ids, 1 if the final answer is right else 0) of one solution of `problem`."""
    ids, _, label = labelled(problem, rng, tokenizer)
    return ids, label


def last_logits(model, items: list[tuple[list[int], int]], pad_id: int) -> torch.Tensor:
    """The model's logit at each item's last token (right padding)."""
    ids = prm.padded([x for x, _ in items], pad_id)
    mask = prm.padded([[1] * len(x) for x, _ in items], 0)
    return model(input_ids=ids, attention_mask=mask).logits[:, 0]


@torch.no_grad()
def accuracy(model, items: list[tuple[list[int], int]], pad_id: int) -> dict:
    """`prm.rates` of the answers, an answer said right when its logit is above 0."""
    model.eval()
    right = last_logits(model, items, pad_id) > 0
    model.train()
    return prm.rates([(label, said) for (_, label), said in zip(items, right.tolist())])


def loss(model, aux_head: torch.nn.Linear, items: list[tuple[list[int], list[int], int]], pad_id: int) -> torch.Tensor:
    """The logistic loss of the final answers at the last token plus the auxiliary head's loss
    on the PRM's labels."""
    ids, aux_labels = prm.batch(items, pad_id)
    mask = prm.padded([[1] * len(x) for x, _, _ in items], 0)
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    final = torch.tensor([label for _, _, label in items], dtype=torch.float32)
    aux = aux_head(out.hidden_states[-1]).flatten(0, 1)
    return torch.nn.functional.binary_cross_entropy_with_logits(
        out.logits[:, 0], final
    ) + torch.nn.functional.cross_entropy(aux, aux_labels.flatten(), ignore_index=prm.IGNORE)


def build(cache_dir: Path, seed: int = 0, recipe: prm.Recipe = FULL) -> Path:
    """Train the outcome RM from its PRM and write cache_dir/<recipe.name>; raises if the
    targets are not reached within MAX_STEPS."""
    from transformers import AutoModelForSequenceClassification

    cache_dir = Path(cache_dir)
    base = cache_dir / BASE[recipe.name].name
    if not (base / "config.json").exists():
        prm.build(cache_dir, seed, BASE[recipe.name])
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
    aux_head = torch.nn.Linear(model.config.hidden_size, 2)
    rng = random.Random(seed)

    def batch_loss() -> torch.Tensor:
        return loss(model, aux_head, [labelled(rng.choice(train), rng, tokenizer) for _ in range(prm.BATCH)], pad_id)

    start = time.time()
    params = [*model.parameters(), *aux_head.parameters()]
    report, step = prm.fit(
        model,
        params,
        recipe,
        batch_loss,
        lambda: accuracy(model, evalset, pad_id),
        "the outcome RM",
        max_steps=MAX_STEPS,
    )
    report.update(steps=step, seconds=round(time.time() - start, 1), seed=seed)
    report.update(target=recipe.target, class_target=recipe.class_target)
    dest = cache_dir / recipe.name
    save_model(model, tokenizer, report, dest)
    return dest
