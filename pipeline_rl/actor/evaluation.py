"""Actor 0's held-out evaluation: one sample of each held-out problem at the sampling
temperature, its mean reward logged as "eval/reward" with the version it started at (and the
version it ended at: weights may change under it). Evaluation groups never reach the stream."""

from __future__ import annotations

import asyncio
import logging
import time

from pipeline_rl.metrics import MetricsLogger
from pipeline_rl.streams.records import RolloutGroup

log = logging.getLogger("pipeline_rl.actor.evaluation")


async def evaluate(rollout, llm, ctx, problems: list[dict], metrics: MetricsLogger) -> None:
    """Run `rollout` once on each of `problems` with `ctx` (one attempt each) and log the result."""
    version, start = llm.version, time.monotonic()
    results = await asyncio.gather(*(rollout(p, llm, ctx) for p in problems), return_exceptions=True)
    rewards = [r.reward for g in results if isinstance(g, RolloutGroup) for r in g.rollouts]
    errors = [g for g in results if not isinstance(g, RolloutGroup)]
    if errors:
        log.error("evaluation: %d of %d problems failed, e.g. %r", len(errors), len(results), errors[0])
    if not rewards:
        return
    metrics.log(
        {
            "eval/reward": sum(rewards) / len(rewards),
            "eval/version": version,
            "eval/version_end": llm.version,
            "eval/problems": len(rewards),
            "eval/errors": len(errors),
            "eval/seconds": time.monotonic() - start,
        },
        step=version,
    )
    log.info("eval at version %d: reward %.3f on %d problems", version, sum(rewards) / len(rewards), len(rewards))
