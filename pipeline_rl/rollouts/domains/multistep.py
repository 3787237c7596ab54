"""Multi-step arithmetic (pipeline_rl/demo/multistep.py): "Q: 12+34+56=" answered one step per
line, "12+34=46\\n46+56=102". Reward 1 when the completion stops by EOS and its last line ends
in "=<answer>", else 0: only the outcome counts here, the steps are for a PRM to judge."""

from __future__ import annotations

from pipeline_rl.rollouts.domains.arithmetic import sample_and_score
from pipeline_rl.rollouts.interface import Generator, RolloutContext, continuable
from pipeline_rl.streams.records import RolloutGroup


def score(text: str, finish_reason: str, answer: str) -> float:
    lines = text.strip().splitlines()
    return 1.0 if finish_reason == "stop" and lines and lines[-1].endswith(f"={answer}") else 0.0


@continuable
async def rollout(problem: dict, llm: Generator, ctx: RolloutContext) -> RolloutGroup:
    return await sample_and_score(problem, llm, ctx, score)
