"""Math word problems: the last \\boxed{...} of the completion is compared with the reference
answer by math-verify, in a RewardPool worker under actor.reward_timeout_s.

Each completion gets one outcome and its reward from the domain's settings (`MathReward`, under
actor.domain_settings):
truncated (cut off at the token limit; checked first), no_answer (no complete \\boxed{}),
unparsable (math-verify reads nothing in it, or the check raised or timed out: the error text
goes into metadata["reward_error"]), correct or wrong. The outcome is in metadata["outcome"].

The prompt goes through the tokenizer's chat template as one user message when the tokenizer
has one (instruct models), else it is used as plain text.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
from dataclasses import dataclass
from typing import Any

from pipeline_rl.config import RunConfig
from pipeline_rl.config.plugin_settings import takes_settings
from pipeline_rl.rollouts.domains import make_rollout, sample
from pipeline_rl.rollouts.interface import Generator, RolloutContext, continuable
from pipeline_rl.rollouts.rewards import RewardPool
from pipeline_rl.streams.records import RolloutGroup

CHECK = "pipeline_rl.rollouts.domains.math:check"


@dataclass
class MathReward:
    """Reward of a math rollout by what its final \\boxed{} answer is."""

    correct: float = 1.0
    """The last \\boxed{} answer equals the reference answer (checked with math-verify)."""
    wrong: float = 0.0
    """A readable last \\boxed{} answer that differs from the reference."""
    no_answer: float = 0.0
    """The completion finished without any \\boxed{} answer."""
    unparsable: float = 0.0
    """A \\boxed{} answer math-verify cannot read, or a check that failed or ran past actor.reward_timeout_s."""
    truncated: float = 0.0
    """The completion was cut off at actor.max_new_tokens (or the model length), whatever it contains."""


_pool: RewardPool | None = None


def last_boxed(text: str) -> str | None:
    """Content of the last complete \\boxed{...} (nested braces allowed), or None. One pass
    over the text, so an adversarial completion full of unclosed \\boxed{ costs O(length)."""
    closing: dict[int, int] = {}
    opened: list[int] = []
    for i, ch in enumerate(text):
        if ch == "{":
            opened.append(i)
        elif ch == "}" and opened:
            closing[opened.pop()] = i
    start = text.rfind("\\boxed")
    while start != -1:
        i = start + len("\\boxed")
        while i < len(text) and text[i] == " ":
            i += 1
        if i in closing:
            return text[i + 1 : closing[i]]
        start = text.rfind("\\boxed", 0, start)
    return None


_NO_TIMEOUT: Any = None
"""math-verify's parsing_timeout off (its annotation says int, but it takes None): the reward
worker's time limit replaces its signal-based timeout."""


@functools.lru_cache(maxsize=4096)
def _parse_reference(answer: str):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    text = answer if "\\boxed" in answer else f"\\boxed{{{answer}}}"
    parsed = parse(
        text, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=_NO_TIMEOUT
    )
    if not parsed:
        raise ValueError(f"reference answer {answer[:200]!r} cannot be parsed")
    return parsed


def check(boxed: str, answer: str) -> str:
    """correct, wrong or unparsable. Runs in a reward worker: math-verify's own signal-based
    timeouts are off, the worker is killed at the time limit instead."""
    from math_verify import LatexExtractionConfig, parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    predicted = parse(f"\\boxed{{{boxed}}}", extraction_config=[LatexExtractionConfig()], parsing_timeout=_NO_TIMEOUT)
    if not predicted:
        return "unparsable"
    return "correct" if verify(_parse_reference(answer), predicted, timeout_seconds=None) else "wrong"


def warm_up() -> None:
    """Run in each new worker before it takes checks: math-verify's first parse and first
    symbolic comparison load grammars and sympy modules (seconds)."""
    check("\\frac{84}{2}", "42")
    check("x+1", "42")


def pool(cfg: RunConfig) -> RewardPool:
    """The process's pool of math-verify workers (started on first use, stopped at exit)."""
    global _pool
    if _pool is None:
        _pool = RewardPool(cfg.actor.reward_workers, cfg.actor.reward_timeout_s, preload=(f"{__name__}:warm_up",))
        atexit.register(_pool.close)
    return _pool


async def outcome(text: str, finish_reason: str, answer: str, cfg: RunConfig) -> tuple[str, str | None]:
    """(outcome, error text or None) of one completion."""
    if finish_reason == "length":
        return "truncated", None
    boxed = last_boxed(text)
    if boxed is None:
        return "no_answer", None
    result = await pool(cfg).acall(CHECK, boxed, answer)
    if result.error is not None:
        return "unparsable", result.error
    return result.value, None


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


@continuable
@takes_settings(MathReward)
async def rollout(problem: dict, llm: Generator, ctx: RolloutContext) -> RolloutGroup:
    ids = prompt_ids(llm.tokenizer, problem["prompt"])
    completions = await sample(llm, ids, ctx)
    table: MathReward = ctx.settings
    outcomes = await asyncio.gather(
        *(outcome(c.text, c.finish_reason, problem["answer"], ctx.cfg) for c in completions)
    )
    rollouts = [
        make_rollout(ids, c, getattr(table, kind), error, outcome=kind)
        for c, (kind, error) in zip(completions, outcomes)
    ]
    return RolloutGroup(problem_id=problem["id"], group_id="", rollouts=rollouts)
