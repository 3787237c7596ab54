"""The arithmetic domain with injected faults. `rollout` (the actor test): the first FAILING
training groups raise, and every training group reports a reward error on its first rollout;
evaluation (one attempt per problem) is left alone. `reward_raises_on_odd_answers` (the launch test):
a reward check that raises on half of the problems."""

from __future__ import annotations

from pipeline_rl.actor.domains import arithmetic
from pipeline_rl.actor.rewards import call_checked

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


def _reward_check_that_raises(answer: str) -> float:
    raise ArithmeticError(f"injected reward failure on answer {answer}")


async def reward_raises_on_odd_answers(problem, llm, cfg):
    """Arithmetic whose reward check raises on every problem with an odd answer (half of them):
    those rollouts get reward 0 and the error, which the actor counts."""
    group = await arithmetic.rollout(problem, llm, cfg)
    if int(problem["answer"]) % 2:
        for r in group.rollouts:
            result = call_checked(_reward_check_that_raises, problem["answer"])
            r.reward = 0.0
            r.metadata["reward_error"] = result.error
    return group
