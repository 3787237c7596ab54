"""tools_policy, the policy of the tool-use demo (pipeline_rl/demo/tool_task.py): fine-tuned from
the tiny arithmetic model on whole conversations in its chat template, locally in a few minutes
on 2 cores.

Each training problem becomes one transcript: worked out in one turn, or (TOOL_SHARE of them)
with two calls of `add` and the final number. The tokens between turns are the ones the agent
domain adds (ChatTemplate.between_turns over the saved template), so the model learns exactly
the conversation an episode shows it; only its own turns carry a loss. The learning rate decays
once half of the held-out tool transcripts are right greedily (tiny_model.Schedule), and
fine-tuning ends with the decay: stopping at a greedy target instead left a policy that wrote
broken calls at T=1 (0.41 of its tool transcripts sampled whole), and RL then broke the format
further. Whether the policy uses the tool is left to RL: at T=1 it starts by calling it on about
TOOL_SHARE of the problems, and its worked answers are those of a tiny model still learning to
carry one sum into the next.

`build(cache_dir)` writes cache_dir/tools/{train,test}.jsonl (the multistep problems) and
cache_dir/tools_policy, a model directory whose tokenizer holds the chat template, with its
report.json.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from pipeline_rl.demo import multistep, tiny_model
from pipeline_rl.demo.tool_task import TEMPLATE, call_text
from pipeline_rl.rollouts.agent.template import ChatTemplate

NAME = "tools_policy"
TOOL_SHARE = 0.5
"""Share of training transcripts that use the tool."""
TOOL_MIN = tiny_model.LEARNED
"""Held-out greedy accuracy of whole tool transcripts (after the first token, which chooses the
tool) below which the build fails: the model has not found the format. Two builds of the same
seed on two machines ended at 0.915 and 0.850 (floating point differs), so this is no target."""
EVAL_PROBLEMS = 200
MAX_STEPS = 2000
BATCH = 32
LR = 1e-3
EVAL_EVERY = 25


def transcript(template: ChatTemplate, eos: int, problem: dict, with_tool: bool) -> tuple[list[int], list[int]]:
    """(token ids, 1 where the model wrote the token) of one problem's conversation."""
    ids = template.prompt_ids([{"role": "user", "content": problem["prompt"]}])
    trained = [0] * len(ids)

    def model_turn(text: str) -> None:
        turn = template.encode(text) + [eos]
        ids.extend(turn)
        trained.extend([1] * len(turn))

    def tool_result(value: int) -> None:
        shown = template.between_turns(
            eos, [{"role": "tool", "tool_call_id": "", "name": "add", "content": str(value)}]
        )
        ids.extend(shown)
        trained.extend([0] * len(shown))

    a, b, c = multistep.operands(problem)
    if with_tool:
        model_turn(call_text(a, b))
        tool_result(a + b)
        model_turn(call_text(a + b, c))
        tool_result(a + b + c)
        model_turn(str(a + b + c))
    else:
        model_turn(problem["solution"])
    return ids, trained


def tensors(rows: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, labels), labels -100 where the model did not write the token."""
    length = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), length), pad, dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    for r, (row, trained) in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
        labels[r, : len(row)] = torch.where(torch.tensor(trained, dtype=torch.bool), torch.tensor(row), -100)
    return ids, labels


def unscore_first(labels: torch.Tensor) -> torch.Tensor:
    """Each row's first trained position, no longer scored in `labels`."""
    first = (labels != -100).int().argmax(-1)
    labels[torch.arange(len(labels)), first] = -100
    return first


@torch.no_grad()
def first_token_share(model, ids: torch.Tensor, first: torch.Tensor) -> float:
    """Mean probability at T=1 of each row's token at position `first` (the way's first token)."""
    probs = model(input_ids=ids).logits.float().softmax(-1)
    rows = torch.arange(len(ids))
    return probs[rows, first - 1, ids[rows, first]].mean().item()


def _finetune(model, template: ChatTemplate, tokenizer, train: list[dict], test: list[dict], seed: int) -> dict:
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rng = random.Random(seed)
    held_out = {
        kind: tensors([transcript(template, eos, p, kind == "tool") for p in test[:EVAL_PROBLEMS]], pad)
        for kind in ("tool", "worked")
    }
    # Held-out accuracy of each way given that it was chosen: the first token, the choice between
    # the two ways (about TOOL_SHARE either way), is left out; its greedy pick flipped whole sets
    # of transcripts from one evaluation to the next.
    first = {kind: unscore_first(labels) for kind, (_, labels) in held_out.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    # As the tiny model's pretraining: constant until the model has found the format, then a
    # decay that sharpens its sampled calls (the build ends with it).
    schedule = tiny_model.Schedule()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    start, step, greedy = time.time(), 0, 0.0
    model.train()
    while schedule.decay_from is None or step < schedule.decay_from + tiny_model.DECAY_STEPS:
        if step >= MAX_STEPS:
            raise RuntimeError(f"{NAME}: held-out tool transcripts {greedy:.3f} greedy in {MAX_STEPS} steps")
        batch = [transcript(template, eos, rng.choice(train), rng.random() < TOOL_SHARE) for _ in range(BATCH)]
        ids, labels = tensors(batch, pad)
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        step += 1
        if step % EVAL_EVERY == 0:
            greedy = tiny_model.greedy_accuracy(model, *held_out["tool"])
            if greedy >= tiny_model.LEARNED and schedule.decay_from is None:
                schedule.decay_from = step
            print(f"{NAME}: step {step}, held-out tool transcripts greedy {greedy:.3f}", flush=True)
    if greedy < TOOL_MIN:
        raise RuntimeError(f"{NAME}: held-out tool transcripts {greedy:.3f} greedy < {TOOL_MIN}; try another --seed")
    model.eval()
    report: dict = {"steps": step, "seconds": round(time.time() - start, 1), "tool_share": TOOL_SHARE}
    for kind, (ids, labels) in held_out.items():
        exact, greedy = tiny_model.teacher_forced_accuracy(model, ids, labels)
        report[f"{kind}_greedy"], report[f"{kind}_exact_t1"] = round(greedy, 4), round(exact, 4)
        report[f"{kind}_chosen_t1"] = round(first_token_share(model, ids, first[kind]), 4)
    return report


def build(cache_dir: Path, seed: int = 0) -> Path:
    """Build the data set and tools_policy under `cache_dir` (the tiny arithmetic model first, if
    missing); returns the model's directory."""
    from transformers import AutoModelForCausalLM

    cache_dir = Path(cache_dir)
    base = cache_dir / tiny_model.TINY.name
    if not (base / "config.json").exists():
        tiny_model.build(cache_dir, seed)
    train, test = multistep.make_problems(seed)
    tiny_model.write_split(cache_dir / "tools", train, test)
    tokenizer = tiny_model.make_tokenizer()
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    report = _finetune(model, ChatTemplate(tokenizer, None, None), tokenizer, train, test, seed)
    dest = cache_dir / NAME
    tiny_model.save_model(model, tokenizer, report, dest)
    return dest
