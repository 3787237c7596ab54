"""The arithmetic domain with injected faults. `rollout` (the actor test): the first FAILING
training groups raise, and every training group reports a reward error on its first rollout;
evaluation (one attempt per problem) is left alone. `reward_raises_on_odd_answers` (the launch test):
a reward check that raises on half of the problems."""

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


def _score_or_raise(text: str, finish_reason: str, answer: str) -> float:
    if int(answer) % 2:
        raise ArithmeticError(f"injected reward failure on answer {answer}")
    return arithmetic.score(text, finish_reason, answer)


async def reward_raises_on_odd_answers(problem, llm, cfg):
    """Arithmetic whose reward check raises on every problem with an odd answer (half of them):
    those rollouts get reward 0 and the error, which the actor counts."""
    return await arithmetic.sample_and_score(problem, llm, cfg, _score_or_raise)
