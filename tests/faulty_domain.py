"""The arithmetic domain with injected faults. `rollout` (the actor test): the first FAILING
training groups raise, and every training group reports a reward error on its first rollout;
evaluation (one attempt per problem) is left alone. `reward_raises_and_stream_breaks` (the launch
test): a reward check that raises on half of the problems, and malformed lines in the middle of
the actor's stream."""

from __future__ import annotations

from pipeline_rl.rollouts.domains import arithmetic
from pipeline_rl.streams import open_streams
from pipeline_rl.wire import Topic

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


MALFORMED = (b'{"problem_id": "p1", "rollouts": [', b'{"no_such_field": 1}')
"""Lines no reader can decode: truncated JSON, and a record with an unknown field."""
MALFORMED_AFTER = 5
_training_calls = 0


async def reward_raises_and_stream_breaks(problem, llm, cfg):
    """Arithmetic whose reward check raises on every problem with an odd answer (half of them:
    those rollouts get reward 0 and the error, which the actor counts), and whose
    MALFORMED_AFTER-th training rollout first appends MALFORMED to this actor's JSONL
    partition: the bad lines land in the middle of the stream, before every later group."""
    global _training_calls
    if cfg.actor.attempts > 1:
        _training_calls += 1
        if _training_calls == MALFORMED_AFTER:
            streams = open_streams(cfg)
            writer = streams.writer(Topic.ACTOR, partitions=cfg.world.actors)
            for payload in MALFORMED:
                writer.write_raw(payload)
            streams.close()
    return await arithmetic.sample_and_score(problem, llm, cfg, _score_or_raise)
