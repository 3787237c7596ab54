"""Rollout plug-ins ("domains"): how one problem becomes one scored RolloutGroup.

A domain is an async function

    async def rollout(problem: dict, llm: Generator, cfg: RunConfig) -> RolloutGroup

(the types are in pipeline_rl/rollouts/interface.py).

`problem` is one row of the data set (pipeline_rl/rollouts/datasets.py: "id", "prompt", "answer" and
any extra keys). The function samples with `llm.generate(...)` (`sample` below: the group's
cfg.actor.attempts completions with the actor's sampling settings) and returns a RolloutGroup whose rollouts have their rewards filled in.
Each Rollout carries the prompt's token ids and, per completion token, the id, the sampled
logprob and the policy version as returned in the Completion. The actor then sets the group's
`group_id` and `actor` fields, so a domain may leave them at their defaults.

A check that could hang or is expensive (parsing model output) belongs in a
`pipeline_rl.rollouts.rewards.RewardPool`, which enforces actor.reward_timeout_s. A reward that
failed is reported, not raised: the rollout gets the failure reward and the error text goes
into `rollout.metadata["reward_error"]`, which the actor counts and shows in its metrics.

Multi-turn rollouts (tools, environments, dialogues) use the same interface: a rollout is a
list of turns flattened into one `completion_ids` after the prompt. Tokens the policy sampled
have mask 1 and their logprobs and versions; tokens the environment inserted (a tool result,
the next question) have mask 0, logprob 0.0 and version -1, and are not trained on. Each turn's
own reward can go on that turn's last token in `token_rewards` (0.0 elsewhere). The
preprocessor adds token_rewards as an undiscounted, unbaselined reward-to-go on top of the
group-relative advantage of `reward` (pipeline_rl/preprocess/advantages.py): keep `reward` for the
episode's outcome and make per-turn rewards centred (e.g. +0.5 / -0.5).
tests/fixtures/multiturn_domain.py is a small example. The `agent` domain builds such rollouts from an
environment written against an OpenAI-style chat client (pipeline_rl/rollouts/agent/); the
`verifiers` domain from an environment of the verifiers library (domains/verifiers_env.py).

Rollouts in flight at a stop are continued by the next actor (pipeline_rl/actor/in_flight.py)
for domains whose rollout is marked `@continuable` (rollouts/interface.py): the built-in
arithmetic, math and multistep are; the others' are counted lost.

`load_domain(name)` accepts a built-in name ("arithmetic", "math", "multistep", "agent", "verifiers") or "module:function".
"""

from __future__ import annotations

import inspect
from typing import Any, cast

from pipeline_rl.config import RunConfig
from pipeline_rl.core.plugins import load_plugin
from pipeline_rl.core.routes import encode_routes
from pipeline_rl.rollouts.interface import Generator, RolloutFn, Sample
from pipeline_rl.streams.records import Rollout

BUILTIN = {
    "arithmetic": "pipeline_rl.rollouts.domains.arithmetic:rollout",
    "math": "pipeline_rl.rollouts.domains.math:rollout",
    "multistep": "pipeline_rl.rollouts.domains.multistep:rollout",
    "agent": "pipeline_rl.rollouts.domains.agent:rollout",
    "verifiers": "pipeline_rl.rollouts.domains.verifiers_env:rollout",
}


def load_domain(name: str) -> RolloutFn:
    """The rollout function of a built-in domain or of an import path `module:function`."""
    found = load_plugin(
        name,
        "actor.domain",
        "an async function (async def rollout(problem, llm, cfg))",
        builtins=BUILTIN,
        check=inspect.iscoroutinefunction,
    )
    return cast(RolloutFn, found)


async def sample(llm: Generator, prompt_ids: list[int], cfg: RunConfig, ignore_eos: bool = False) -> list[Sample]:
    """The group's completions of one prompt: cfg.actor.attempts samples with the actor's
    max_new_tokens, temperature and top_p (LLMClient Completions); `ignore_eos`: each runs to
    max_new_tokens."""
    completions = await llm.generate(
        prompt_ids,
        n=cfg.actor.attempts,
        max_tokens=cfg.actor.max_new_tokens,
        temperature=cfg.shared.temperature,
        top_p=cfg.actor.top_p,
        ignore_eos=ignore_eos,
    )
    return list(completions)


def _routes(completion: Sample) -> str | None:
    routes = getattr(completion, "routes", None)  # a plug-in's own Sample may predate routes
    return None if routes is None else encode_routes(routes)


def make_rollout(
    prompt_ids: list[int], completion: Sample, reward: float, error: str | None = None, **metadata: Any
) -> Rollout:
    """A single-turn Rollout from an LLMClient Completion; `error` (a failed reward check) is
    kept in metadata["reward_error"]."""
    if error is not None:
        metadata["reward_error"] = error
    return Rollout(
        prompt_ids=list(prompt_ids),
        completion_ids=list(completion.token_ids),
        logprobs=list(completion.logprobs),
        versions=list(completion.versions),
        reward=float(reward),
        finish_reason=completion.finish_reason,
        routes=_routes(completion),
        metadata=metadata,
    )
