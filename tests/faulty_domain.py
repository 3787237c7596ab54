"""The arithmetic domain with injected faults, for the actor test: the first FAILING training
groups raise, and every training group reports a reward error on its first rollout.
Evaluation (one attempt per problem) is left alone."""

from __future__ import annotations

from pipeline_rl.actor.domains import arithmetic

FAILING = 2
_calls = 0


async def rollout(problem, llm, cfg):
    global _calls
    training = cfg.actor.attempts > 1
    if training:
        _calls += 1
        if _calls <= FAILING:
            raise ValueError(f"injected rollout failure {_calls}")
    group = await arithmetic.rollout(problem, llm, cfg)
    if training:
        group.rollouts[0].metadata["reward_error"] = "injected reward error"
    return group
