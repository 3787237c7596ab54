"""A family of small arithmetic models that differ the way users' models differ, for choosing
RL defaults that do not depend on one model (scripts/bench_learning.py --family).

Every member learns the tiny model's task (2-digit additions, the same train/test split in
cache_dir/arithmetic) from scratch, with its own tokenizer (byte-level: one token per byte, or
char-level: one token per character of the task's alphabet), width and depth, initialisation
seed, and one of two pretraining recipes:
- targeted: warm-up, then training stops at the evaluation closest to the member's
  `start_accuracy`, the probability of sampling exactly the answer at temperature 1 on the
  held-out problems (the start accuracies span 0.1 to 0.5);
- brief: `steps` steps at a constant learning rate, stopped wherever that leaves the model, as
  a user's briefly trained model is.
Nothing is softened: a member's mistakes are those of a model caught half-way through learning
to add. `fresh(member, seed)` is the same recipe from another initialisation and batch order
(named NAME_sSEED, built on demand like the others), so that a default can be judged on models
made after it was chosen.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pipeline_rl.demo import tiny_model

EOS_TOKEN, PAD_TOKEN, UNK_TOKEN = "<|endoftext|>", "<|pad|>", "<|unk|>"
ALPHABET = "Q: 0123456789+="
"""The characters of the task's prompts and answers: the char-level vocabulary."""
EVAL_EVERY = 5
MAX_STEPS = 4000
LR = 2e-3
WARMUP_STEPS = 100


@dataclass(frozen=True)
class Member:
    """One model of the family."""

    name: str
    """Directory under the cache."""
    tokenizer: str
    """"byte" (256 byte tokens, as tiny_model) or "char" (ALPHABET plus an unknown token)."""
    hidden: int
    layers: int
    heads: int
    """Attention heads: hidden / heads must be a head size vLLM's CPU attention supports (32, 64...)."""
    start_accuracy: float
    """Held-out exact T=1 accuracy at which pretraining stops (the targeted recipe)."""
    seed_offset: int
    """Added to the build seed for initialisation and batch order."""
    kv_heads: int = 2
    lr: float = LR
    """Pretraining learning rate (the wider model learns slowly at the others' 2e-3)."""
    steps: int | None = None
    """The brief recipe: this many steps at the constant `lr`, start_accuracy ignored."""


FAMILY = (
    Member("family_byte_small", "byte", hidden=64, layers=2, heads=2, start_accuracy=0.1, seed_offset=11),
    Member("family_char_base", "char", hidden=128, layers=4, heads=4, start_accuracy=0.25, seed_offset=12),
    Member("family_char_deep", "char", hidden=96, layers=6, heads=3, start_accuracy=0.4, seed_offset=13, kv_heads=1),
    Member("family_byte_wide", "byte", hidden=192, layers=3, heads=6, start_accuracy=0.5, seed_offset=14, lr=1e-3),
    Member("family_char_brief", "char", hidden=128, layers=4, heads=4, start_accuracy=0.0, seed_offset=15, steps=520),
    Member(
        "family_byte_brief",
        "byte",
        hidden=96,
        layers=3,
        heads=3,
        start_accuracy=0.0,
        seed_offset=16,
        kv_heads=1,
        steps=850,
    ),
)
BY_NAME = {m.name: m for m in FAMILY}


def fresh(member: Member, seed: int) -> Member:
    """`member`'s recipe from another initialisation and batch order."""
    return replace(member, name=f"{member.name}_s{seed}", seed_offset=member.seed_offset + 1000 * seed)


def member(name: str) -> Member | None:
    """The member called `name`: one of FAMILY, or a fresh one of them (NAME_sSEED); else None."""
    if name in BY_NAME:
        return BY_NAME[name]
    base, _, seed = name.rpartition("_s")
    return fresh(BY_NAME[base], int(seed)) if base in BY_NAME and seed.isdigit() and int(seed) > 0 else None


def char_tokenizer():
    """One token per character of ALPHABET (ids 3..), after EOS, pad and unknown (0, 1, 2): a BPE
    model without merges splits text into characters. The vocabulary holds each character's
    byte-level stand-in (space is "Ġ") behind a byte-level pre-tokenizer and decoder: for a qwen2
    model directory transformers (so vLLM and TRL) loads the tokenizer as Qwen2's class, which
    applies its own byte-level pre-tokenizer to the saved vocabulary, and a plain " " entry was
    then never matched (prompts lost their spaces)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    stand_in = tiny_model.byte_stand_ins()
    specials = [EOS_TOKEN, PAD_TOKEN, UNK_TOKEN]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({stand_in[ord(ch)]: len(specials) + i for i, ch in enumerate(sorted(set(ALPHABET)))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=UNK_TOKEN)


def pretrain(model, tokenizer, train: list[dict], test: list[dict], seed: int, member: Member) -> dict:
    """The targeted recipe: train until the held-out exact T=1 accuracy passes the member's start
    accuracy and keep the weights of the evaluation closest to it (the rise from the plateau is
    steep: evaluate often). The brief recipe: `member.steps` steps at a constant lr."""
    start = time.time()
    rng = random.Random(seed)
    batches = tiny_model.Batcher(tokenizer, train)
    test_ids, test_labels = tiny_model.Batcher(tokenizer, test).tensors(list(range(len(test))))
    opt = torch.optim.AdamW(model.parameters(), lr=member.lr, betas=(0.9, 0.98), weight_decay=0.0)
    if member.steps is not None:
        model.train()
        for _ in range(member.steps):
            tiny_model.train_step(model, opt, batches, rng, tiny_model.BATCH)
        model.eval()
        return _report(model, tokenizer, test, test_ids, test_labels, seed, member.steps, start)
    target = member.start_accuracy
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / WARMUP_STEPS))
    closest: tuple[float, int, dict] | None = None
    exact, step = 0.0, 0
    model.train()
    while exact < target:
        if step >= MAX_STEPS:
            raise RuntimeError(
                f"the model (seed {seed}) reached only {exact:.3f} exact T=1 accuracy in {MAX_STEPS} "
                f"steps, short of {target}; try another --seed"
            )
        tiny_model.train_step(model, opt, batches, rng, tiny_model.BATCH)
        sched.step()
        step += 1
        if step % EVAL_EVERY == 0:
            model.eval()
            exact, _ = tiny_model.teacher_forced_accuracy(model, test_ids, test_labels)
            model.train()
            gap = abs(exact - target)
            if closest is None or gap < closest[0]:
                closest = (gap, step, {k: v.clone() for k, v in model.state_dict().items()})
    assert closest is not None
    model.load_state_dict(closest[2])
    model.eval()
    return _report(model, tokenizer, test, test_ids, test_labels, seed, closest[1], start)


def _report(model, tokenizer, test: list[dict], test_ids, test_labels, seed: int, steps: int, start: float) -> dict:
    exact, greedy = tiny_model.teacher_forced_accuracy(model, test_ids, test_labels)
    return {
        "steps": steps,
        "train_seconds": round(time.time() - start, 1),
        "test_accuracy_exact_t1": round(exact, 4),
        "test_accuracy_greedy": round(greedy, 4),
        "test_accuracy_sampled_t1": tiny_model.sampled_accuracy(model, tokenizer, test, seed),
        "test_problems": len(test),
    }


def build(cache_dir: Path, seed: int, member: Member) -> Path:
    """Build `member` (and the shared data set) under `cache_dir`; returns the model directory."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    init_seed = seed + member.seed_offset
    torch.manual_seed(init_seed)
    train, test = tiny_model.write_problems(cache_dir, seed)
    tokenizer = tiny_model.make_tokenizer() if member.tokenizer == "byte" else char_tokenizer()
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert isinstance(eos_id, int) and isinstance(pad_id, int)
    model = tiny_model.make_model(
        len(tokenizer),
        eos_id,
        pad_id,
        hidden=member.hidden,
        layers=member.layers,
        heads=member.heads,
        kv_heads=member.kv_heads,
    )
    report = pretrain(model, tokenizer, train, test, init_seed, member)
    report.update(
        member=member.name,
        tokenizer=member.tokenizer,
        vocab=len(tokenizer),
        parameters=sum(p.numel() for p in model.parameters()),
        seed=init_seed,
    )
    dest = cache_dir / member.name
    tiny_model.save_model(model, tokenizer, report, dest, "pretrain_report.json")
    return dest
