"""A two-turn arithmetic domain: the example of a multi-turn rollout (see pipeline_rl/rollouts/domains).

Turn 1: the policy answers the problem ("Q: 37+48=" -> "85"). The environment then asks the
same sum with the operands swapped ("\\nQ: 48+37=", mask 0), and turn 2 answers that. The
rollout's `reward` is the episode's outcome (1 when both turns are right); each turn also gets
a centred reward (+0.5 right, -0.5 wrong) on its last token in `token_rewards`.
"""

from __future__ import annotations

import asyncio
import re

from pipeline_rl.rollouts.domains.arithmetic import score
from pipeline_rl.streams.records import Rollout, RolloutGroup


def follow_up(prompt: str) -> str:
    a, b = re.fullmatch(r"Q: (\d+)\+(\d+)=", prompt).groups()
    return f"\nQ: {b}+{a}="


async def _second_turn(llm, cfg, prompt_ids, first, env_ids, answer) -> Rollout:
    context = prompt_ids + first.token_ids + env_ids
    (second,) = await llm.generate(
        context, n=1, max_tokens=cfg.actor.max_new_tokens, temperature=cfg.actor.temperature, top_p=cfg.actor.top_p
    )
    r1 = score(first.text, first.finish_reason, answer)
    r2 = score(second.text, second.finish_reason, answer)
    turn_rewards = [0.0] * len(first.token_ids) + [0.0] * len(env_ids) + [0.0] * len(second.token_ids)
    if first.token_ids:
        turn_rewards[len(first.token_ids) - 1] = r1 - 0.5
    if second.token_ids:
        turn_rewards[-1] = r2 - 0.5
    return Rollout(
        prompt_ids=prompt_ids,
        completion_ids=first.token_ids + env_ids + second.token_ids,
        logprobs=first.logprobs + [0.0] * len(env_ids) + second.logprobs,
        versions=first.versions + [-1] * len(env_ids) + second.versions,
        reward=r1 * r2,
        finish_reason=second.finish_reason,
        mask=[1] * len(first.token_ids) + [0] * len(env_ids) + [1] * len(second.token_ids),
        token_rewards=turn_rewards,
        metadata={"turns": 2, "turn_rewards": [r1, r2]},
    )


async def rollout(problem: dict, llm, cfg) -> RolloutGroup:
    prompt_ids = llm.tokenizer.encode(problem["prompt"])
    env_ids = llm.tokenizer.encode(follow_up(problem["prompt"]), add_special_tokens=False)
    firsts = await llm.generate(
        prompt_ids,
        n=cfg.actor.attempts,
        max_tokens=cfg.actor.max_new_tokens,
        temperature=cfg.actor.temperature,
        top_p=cfg.actor.top_p,
    )
    rollouts = await asyncio.gather(
        *(_second_turn(llm, cfg, prompt_ids, f, env_ids, problem["answer"]) for f in firsts)
    )
    return RolloutGroup(problem_id=problem["id"], group_id="", rollouts=list(rollouts))
