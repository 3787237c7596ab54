"""Arithmetic (the tiny model's task): reward 1 when the completion, up to its EOS, is exactly
the answer ("85" for "Q: 37+48="), else 0. A completion cut off before EOS gets 0."""

from __future__ import annotations

from collections.abc import Callable

from pipeline_rl.rollouts.domains import make_rollout, sample
from pipeline_rl.rollouts.interface import Generator, RolloutContext, continuable
from pipeline_rl.rollouts.rewards import call_checked
from pipeline_rl.streams.records import RolloutGroup


def score(text: str, finish_reason: str, answer: str) -> float:
    # vLLM's text stops before the EOS token; "stop" means the EOS was sampled.
    return 1.0 if finish_reason == "stop" and text.strip() == answer else 0.0


@continuable
async def rollout(problem: dict, llm: Generator, ctx: RolloutContext) -> RolloutGroup:
    return await sample_and_score(problem, llm, ctx, score)


async def sample_and_score(
    problem: dict, llm, ctx: RolloutContext, score_fn: Callable[[str, str, str], float]
) -> RolloutGroup:
    """ctx.attempts completions of the problem's prompt, each scored by
    score_fn(text, finish_reason, answer) (a failure of it is reported, not raised)."""
    prompt_ids = llm.tokenizer.encode(problem["prompt"])
    completions = await sample(llm, prompt_ids, ctx)
    rollouts = []
    for completion in completions:
        result = call_checked(score_fn, completion.text, completion.finish_reason, problem["answer"])
        rollouts.append(make_rollout(prompt_ids, completion, result.value or 0.0, result.error))
    return RolloutGroup(problem_id=problem["id"], group_id="", rollouts=rollouts)
