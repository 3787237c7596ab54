"""The tiny arithmetic model of the CPU demo, built locally and deterministically from a seed.

`build(cache_dir, seed)` writes
- cache_dir/arithmetic/{train,test}.jsonl: 2-digit + 2-digit additions ("Q: 37+48=" -> "85"),
  every pair once, test and train disjoint;
- cache_dir/tiny_model: a byte-level tokenizer (one token per byte, so every digit is one
  token, plus an EOS and a pad token) and a small Qwen2ForCausalLM in float32 safetensors,
  pretrained on the training problems for a fixed number of steps (`TINY_STEPS`: the same
  work on every CPU, though where a CPU's rounding leaves the plateau before the model starts to
  add varies), then made under-confident: its final norm is scaled down (a uniform softening of the logits) until its
  exact probability of sampling the right answer at temperature 1 is `TARGET_ACCURACY` on the
  test problems. The model knows the task but rarely commits to it when sampling: room for RL,
  which must learn to sharpen its distribution, as RL on larger models mostly does;
- cache_dir/tiny_model/pretrain_report.json: steps, seconds, and held-out accuracy (exact at
  T=1, sampled at T=1, greedy).

`build(cache_dir, seed, LEARNER)` writes a second model, cache_dir/tiny_learner, for judging
learning on a model the demo was not tuned on: the same data set and tokenizer, another
initialisation (seed + LEARNER.init_seed_offset), pretrained only until it answers about half
of the held-out problems greedily (a target, so its length depends on the CPU: the benchmark
builds it, no test does), and not softened. Its mistakes are real mistakes, not an
under-confident distribution: RL has to teach it, not only sharpen it.

Each output is written to a temporary sibling and renamed into place, so a killed build never
leaves a half-written model or data set.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN]
TEST_PROBLEMS = 500
TARGET_ACCURACY = 0.3
"""Exact T=1 accuracy the softened model is set to."""
TINY_STEPS = 2000
"""The tiny model's pretraining steps. The model sits on a plateau before it starts to add, for
a number of steps that differs by seed and by CPU (rounding); this covers the spread measured
(docs/models.md) with the cosine decay after it."""
LEARNED = 0.5
"""Greedy accuracy that shows the model has found how to add (reported as `learned_at_step`; a
target-based recipe's learning rate decays from here)."""
DECAY_STEPS = 300
"""Steps of cosine decay at the end (a constant rate oscillates)."""
MAX_STEPS = 3000
"""A target-based recipe gives up (raises) if the model has not learned by then."""
EVAL_EVERY = 50


@dataclass(frozen=True)
class Recipe:
    """How one of the tiny models is made from the shared data set."""

    name: str
    """Directory under the cache."""
    steps: int | None
    """A fixed recipe: this many steps, the rate decaying over the last DECAY_STEPS. None: train
    until greedy_target (then decay), at most MAX_STEPS."""
    greedy_target: float | None
    """A target-based recipe stops once greedy held-out accuracy reaches this."""
    soften_to: float | None
    """Exact T=1 accuracy the logits are softened to; None: left as pretrained."""
    init_seed_offset: int = 0
    """Added to the build seed for initialisation and batch order (the data split keeps the seed)."""
    eval_every: int = EVAL_EVERY
    """Steps between held-out evaluations."""
    closest: bool = False
    """Keep the weights of the evaluation closest to greedy_target rather than the last ones (the
    jump from a plateau to adding is sharp: the first evaluation past the target can be far past)."""


TINY = Recipe("tiny_model", TINY_STEPS, None, TARGET_ACCURACY)
"""The demo's and the tests' model: adds well greedily, softened to TARGET_ACCURACY."""
LEARNER = Recipe("tiny_learner", None, LEARNED, None, init_seed_offset=1000, eval_every=5, closest=True)
"""The learning benchmark's second model: about half right greedily, not softened."""
BATCH = 64
LR = 2e-3
WARMUP_STEPS = 100


def prompt_text(a: int, b: int) -> str:
    return f"Q: {a}+{b}="


def make_problems(seed: int) -> tuple[list[dict], list[dict]]:
    """All pairs of 2-digit numbers, shuffled by `seed`; the first TEST_PROBLEMS are the test set."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    problems = [{"id": f"add_{a}_{b}", "prompt": prompt_text(a, b), "answer": str(a + b)} for a, b in pairs]
    return problems[TEST_PROBLEMS:], problems[:TEST_PROBLEMS]


def byte_stand_ins() -> list[str]:
    """The printable stand-in character of each byte 0..255, in byte order (the byte-level
    pre-tokenizer's convention: printable Latin-1 bytes stand for themselves, the others are
    shifted to code points from 256 up)."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), 256))
    chars, shifted = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def make_tokenizer():
    """A byte-level tokenizer without merges: token id = 2 + byte value, ids 0/1 are EOS/pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + b for b, ch in enumerate(byte_stand_ins())})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)


def qwen2_config(
    vocab_size: int,
    hidden: int = 128,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_len: int = 512,
    **extra,
):
    """The Qwen2 architecture of every small model the project builds (the demo's, the tests'
    random ones, the benchmarks'): by default the tiny model's shape; `intermediate` defaults to
    4 x hidden; `extra` goes to Qwen2Config as is (token ids, tying, labels...)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=4 * hidden if intermediate is None else intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_len,
        **extra,
    )


def make_model(vocab_size: int, eos_id: int, pad_id: int, **shape):
    """A fresh model for a tokenizer; `shape` overrides qwen2_config's (hidden, layers, heads...)."""
    from transformers import Qwen2ForCausalLM

    config = qwen2_config(
        vocab_size,
        **shape,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    return Qwen2ForCausalLM(config)


class Batcher:
    """Tokenized problems as padded (input_ids, labels) tensors; labels only on answer + EOS."""

    def __init__(self, tokenizer, problems: list[dict]):
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id
        self.items = []
        for p in problems:
            prompt = tokenizer.encode(p["prompt"], add_special_tokens=False)
            answer = tokenizer.encode(p["answer"], add_special_tokens=False) + [self.eos]
            self.items.append((prompt, answer))
        self.length = max(len(p) + len(a) for p, a in self.items)

    def tensors(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.full((len(indices), self.length), self.pad, dtype=torch.long)
        labels = torch.full((len(indices), self.length), -100, dtype=torch.long)
        for row, i in enumerate(indices):
            prompt, answer = self.items[i]
            n = len(prompt) + len(answer)
            ids[row, :n] = torch.tensor(prompt + answer)
            labels[row, len(prompt) : n] = torch.tensor(answer)
        return ids, labels


@torch.no_grad()
def teacher_forced_accuracy(model, ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """(mean probability of sampling exactly the answer + EOS at T=1, greedy accuracy)."""
    logprobs = model(input_ids=ids).logits[:, :-1].float().log_softmax(-1)
    target = labels[:, 1:]
    mask = target != -100
    picked = logprobs.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    exact = (picked * mask).sum(-1).exp().mean().item()
    greedy = ((logprobs.argmax(-1) == target) | ~mask).all(-1).float().mean().item()
    return exact, greedy


def train_step(model, opt, batcher: Batcher, rng: random.Random, size: int) -> None:
    """One optimizer step on `size` random items of `batcher`."""
    ids, labels = batcher.tensors([rng.randrange(len(batcher.items)) for _ in range(size)])
    model(input_ids=ids, labels=labels).loss.backward()
    opt.step()
    opt.zero_grad()


def greedy_accuracy(model, ids: torch.Tensor, labels: torch.Tensor) -> float:
    """Held-out greedy accuracy of a model in training (back in train mode afterwards)."""
    model.eval()
    _, greedy = teacher_forced_accuracy(model, ids, labels)
    model.train()
    return greedy


@torch.no_grad()
def sampled_accuracy(model, tokenizer, problems: list[dict], seed: int, max_new_tokens: int = 8) -> float:
    """Fraction of problems answered exactly by one sample each at temperature 1."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [tokenizer.encode(p["prompt"], add_special_tokens=False) for p in problems]
    correct = 0
    for length in sorted({len(p) for p in prompts}):
        rows = [i for i, p in enumerate(prompts) if len(p) == length]
        ids = torch.tensor([prompts[i] for i in rows])
        done = torch.zeros(len(rows), dtype=torch.bool)
        out = [[] for _ in rows]
        for _ in range(max_new_tokens):
            probs = model(input_ids=ids).logits[:, -1].float().softmax(-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
            for r in range(len(rows)):
                if not done[r]:
                    if nxt[r, 0].item() == tokenizer.eos_token_id:
                        done[r] = True
                    else:
                        out[r].append(nxt[r, 0].item())
            ids = torch.cat([ids, nxt], dim=1)
            if done.all():
                break
        for r, i in enumerate(rows):
            correct += bool(done[r]) and tokenizer.decode(out[r]) == problems[i]["answer"]
    return correct / len(problems)


@torch.no_grad()
def sample_once(model, tokenizer, problems: list[dict], max_new_tokens: int, seed=None) -> list[tuple[str, bool]]:
    """One completion per problem at T=1 (prompts left-padded into one batch): its text up to
    EOS, and whether EOS stopped it. `seed` reseeds torch's generator first (the same draws for
    the same seed); None leaves it."""
    if seed is not None:
        torch.manual_seed(seed)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompts = [tokenizer.encode(p["prompt"], add_special_tokens=False) for p in problems]
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    samples = []
    for generated in out[:, width:].tolist():
        stopped = eos in generated
        text = tokenizer.decode(generated[: generated.index(eos)] if stopped else generated, skip_special_tokens=True)
        samples.append((text, stopped))
    return samples


def sampled_reward(
    model, tokenizer, problems: list[dict], score: Callable[[str, str, str], float], max_new_tokens: int, seed=None
) -> float:
    """Mean reward of one sample per problem at T=1 (`sample_once`), scored as the actor's
    evaluation scores it (`score(text, finish_reason, answer)`, a domain's)."""
    samples = sample_once(model, tokenizer, problems, max_new_tokens, seed)
    total = sum(
        score(text, "stop" if stopped else "length", problem["answer"])
        for problem, (text, stopped) in zip(problems, samples, strict=True)
    )
    return total / len(problems)


class Schedule:
    """Linear warm-up, constant until `decay_from` (a fixed step, or set once the model has
    learned), then cosine decay to zero over DECAY_STEPS."""

    def __init__(self, decay_from: int | None = None) -> None:
        self.decay_from = decay_from

    def __call__(self, step: int) -> float:
        if step < WARMUP_STEPS:
            return (step + 1) / WARMUP_STEPS
        if self.decay_from is None or step < self.decay_from:
            return 1.0
        done = min(1.0, (step - self.decay_from) / DECAY_STEPS)
        return 0.5 * (1 + math.cos(math.pi * done))


def finished(step: int, greedy: float, schedule: Schedule, recipe: Recipe, seed: int) -> bool:
    """Whether pretraining stops after `step` steps (raises when a target-based recipe ran out
    of MAX_STEPS)."""
    if recipe.steps is not None:
        return step >= recipe.steps
    assert recipe.greedy_target is not None
    if greedy >= recipe.greedy_target:
        return True
    if schedule.decay_from is not None and step >= schedule.decay_from + DECAY_STEPS:
        return True
    if step >= MAX_STEPS:
        raise RuntimeError(
            f"the tiny model (seed {seed}) did not learn to add in {MAX_STEPS} steps "
            f"(greedy held-out accuracy {greedy:.3f}); try another --seed"
        )
    return False


def pretrain(model, tokenizer, train: list[dict], test: list[dict], seed: int, recipe: Recipe = TINY) -> dict:
    """Train on train-set text for the recipe's steps (or until its greedy target), then soften
    the logits to the recipe's exact T=1 accuracy."""
    start = time.time()
    rng = random.Random(seed)
    train_batches = Batcher(tokenizer, train)
    test_ids, test_labels = Batcher(tokenizer, test).tensors(list(range(len(test))))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = Schedule(None if recipe.steps is None else recipe.steps - DECAY_STEPS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    model.train()
    greedy = 0.0
    step = 0
    learned_at: int | None = None
    closest: tuple[float, int, dict] | None = None
    goal = f"of {recipe.steps}" if recipe.steps is not None else f"(target {recipe.greedy_target})"
    while not finished(step, greedy, schedule, recipe, seed):
        train_step(model, opt, train_batches, rng, BATCH)
        step += 1
        if step % recipe.eval_every == 0:
            greedy = greedy_accuracy(model, test_ids, test_labels)
            print(f"{recipe.name}: step {step} {goal}, held-out greedy {greedy:.3f}", flush=True)
            if greedy >= LEARNED and learned_at is None:
                learned_at = step
                if recipe.steps is None:
                    schedule.decay_from = step
            gap = abs(greedy - (recipe.greedy_target or 0.0))
            if recipe.closest and (closest is None or gap < closest[0]):
                closest = (gap, step, {k: v.clone() for k, v in model.state_dict().items()})
        sched.step()
    if closest is not None:
        model.load_state_dict(closest[2])
        step = closest[1]
    model.eval()
    exact_before, greedy = teacher_forced_accuracy(model, test_ids, test_labels)
    report = {
        "recipe": recipe.name,
        "steps": step,
        "learned_at_step": learned_at,
        "train_seconds": round(time.time() - start, 1),
        "test_accuracy_greedy": round(greedy, 4),
        "test_accuracy_exact_t1_before_softening": round(exact_before, 4),
    }
    if recipe.soften_to is not None:
        if exact_before < recipe.soften_to:
            raise RuntimeError(
                f"the tiny model (seed {seed}) reached only {exact_before:.3f} exact T=1 accuracy "
                f"(greedy {greedy:.3f}) in {step} steps: it left the plateau late (learned at step "
                f"{learned_at}) on this CPU; try another --seed"
            )
        scale = soften(model, test_ids, test_labels, recipe.soften_to)
        _, greedy_after = teacher_forced_accuracy(model, test_ids, test_labels)
        report.update(
            target_accuracy=recipe.soften_to,
            softening_scale=round(scale, 4),
            test_accuracy_greedy_after_softening=round(greedy_after, 4),
        )
    exact, _ = teacher_forced_accuracy(model, test_ids, test_labels)
    report.update(
        test_accuracy_exact_t1=round(exact, 4),
        test_accuracy_sampled_t1=sampled_accuracy(model, tokenizer, test, seed),
        test_problems=len(test),
        seed=seed,
    )
    return report


@torch.no_grad()
def soften(model, ids: torch.Tensor, labels: torch.Tensor, target: float) -> float:
    """Scale the final norm (so every logit by the same factor) until the exact T=1 accuracy is
    `target`. Returns the scale."""
    return soften_until(model, lambda: teacher_forced_accuracy(model, ids, labels)[0], target)


@torch.no_grad()
def soften_until(model, measure: Callable[[], float], target: float, iterations: int = 20) -> float:
    """Scale the final norm until `measure()` (an accuracy that grows with the scale) is
    `target`; bisection. Returns the scale."""
    norm = model.model.norm.weight
    original = norm.detach().clone()
    lo, hi = 0.0, 1.0
    for _ in range(iterations):
        mid = (lo + hi) / 2
        norm.copy_(original * mid)
        lo, hi = (lo, mid) if measure() > target else (mid, hi)
    norm.copy_(original * hi)
    return hi


def replace_dir(tmp: Path, dest: Path) -> None:
    """Move a finished directory into place; the old one is removed only after the rename.
    If another build put its result there in between, that one stays."""
    old = dest.with_name(f"{dest.name}.old-{os.getpid()}")
    try:
        dest.rename(old)
    except FileNotFoundError:
        old = None
    try:
        tmp.rename(dest)
    except OSError:
        if not dest.exists():
            raise
        shutil.rmtree(tmp)
    if old is not None:
        shutil.rmtree(old)


def save_model(model, tokenizer, report: dict, dest: Path, report_name: str = "report.json") -> None:
    """Write model, tokenizer and report to a temporary sibling of `dest`, then move it into place."""
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / report_name).write_text(json.dumps(report, indent=2) + "\n")
    replace_dir(tmp, dest)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _remove_leftovers(cache_dir: Path) -> None:
    """Temporary directories of builds that were killed (their process is gone)."""
    for path in cache_dir.glob("*.tmp-*"):
        pid = path.name.rsplit("-", 1)[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


def write_split(dest: Path, train: list[dict], test: list[dict]) -> None:
    """Write dest/{train,test}.jsonl through a temporary sibling moved into place."""
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    write_jsonl(tmp / "train.jsonl", train)
    write_jsonl(tmp / "test.jsonl", test)
    replace_dir(tmp, dest)


def write_problems(cache_dir: Path, seed: int) -> tuple[list[dict], list[dict]]:
    """Write cache_dir/arithmetic/{train,test}.jsonl (the split of `seed`); returns them."""
    train, test = make_problems(seed)
    write_split(cache_dir / "arithmetic", train, test)
    return train, test


def build(cache_dir: Path, seed: int = 0, recipe: Recipe = TINY) -> Path:
    """Build the data set and a tiny model under `cache_dir`; returns the model directory."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(cache_dir)
    init_seed = seed + recipe.init_seed_offset
    torch.manual_seed(init_seed)
    train, test = write_problems(cache_dir, seed)

    tokenizer = make_tokenizer()
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert isinstance(eos_id, int) and isinstance(pad_id, int)
    model = make_model(len(tokenizer), eos_id, pad_id)
    report = pretrain(model, tokenizer, train, test, init_seed, recipe)

    dest = cache_dir / recipe.name
    save_model(model, tokenizer, report, dest, "pretrain_report.json")
    return dest
