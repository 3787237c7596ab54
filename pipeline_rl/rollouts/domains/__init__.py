"""Rollout plug-ins ("domains"): how one problem becomes one scored RolloutGroup.

A domain is an async function

    async def rollout(problem: dict, llm: Generator, ctx: RolloutContext) -> RolloutGroup

(the types are in pipeline_rl/rollouts/interface.py). `ctx` holds the run's config, the group's
number of attempts (1 when the actor evaluates) and the domain's own settings: a domain declares
their type with `@takes_settings(Settings)` (a dataclass; pipeline_rl/config/plugin_settings.py)
and the config gives them under `actor.domain_settings`, checked when the domain is loaded.

`problem` is one row of the data set (pipeline_rl/rollouts/datasets.py: "id", "prompt", "answer" and
any extra keys). The function samples with `llm.generate(...)` (`sample` below: the group's
ctx.attempts completions with the actor's sampling settings) and returns a RolloutGroup whose rollouts have their rewards filled in.
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

`load_domain(actor)` loads `actor.domain`, a built-in name ("arithmetic", "math", "multistep",
"agent", "verifiers") or "module:function", with its settings.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, cast

from pipeline_rl.config import ActorConfig, RunConfig
from pipeline_rl.config.plugin_settings import read_settings
from pipeline_rl.core.plugins import load_plugin
from pipeline_rl.core.routes import encode_routes
from pipeline_rl.rollouts.interface import DOMAIN_SETTINGS, Generator, RolloutContext, RolloutFn, Sample
from pipeline_rl.streams.records import Rollout

BUILTIN = {
    "arithmetic": "pipeline_rl.rollouts.domains.arithmetic:rollout",
    "math": "pipeline_rl.rollouts.domains.math:rollout",
    "multistep": "pipeline_rl.rollouts.domains.multistep:rollout",
    "agent": "pipeline_rl.rollouts.domains.agent:rollout",
    "verifiers": "pipeline_rl.rollouts.domains.verifiers_env:rollout",
}


@dataclass(frozen=True)
class Domain:
    """A loaded domain: its rollout function and its own settings (read and checked)."""

    rollout: RolloutFn
    settings: Any

    def context(self, cfg: RunConfig, attempts: int) -> RolloutContext:
        return RolloutContext(cfg, attempts, self.settings)


def load_domain(actor: ActorConfig) -> Domain:
    """The domain `actor.domain` names (built-in or `module:function`) with
    `actor.domain_settings` read into its settings type; raises ConfigError naming the key."""
    found = load_plugin(
        actor.domain,
        "actor.domain",
        "an async function (async def rollout(problem, llm, ctx))",
        builtins=BUILTIN,
        check=inspect.iscoroutinefunction,
    )
    settings = read_settings(found, actor.domain_settings, DOMAIN_SETTINGS, f"domain {actor.domain!r}")
    return Domain(cast(RolloutFn, found), settings)


async def sample(llm: Generator, prompt_ids: list[int], ctx: RolloutContext, ignore_eos: bool = False) -> list[Sample]:
    """The group's completions of one prompt: ctx.attempts samples with the actor's
    max_new_tokens, temperature and top_p (LLMClient Completions); `ignore_eos`: each runs to
    max_new_tokens."""
    cfg = ctx.cfg
    completions = await llm.generate(
        prompt_ids,
        n=ctx.attempts,
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
    kept in metadata["reward_error"]. The tokens a branch shares with another sequence of its
    call (`Completion.shared`, step guidance) get mask 0: they are trained once, in that sequence."""
    if error is not None:
        metadata["reward_error"] = error
    shared = getattr(completion, "shared", 0)  # a plug-in's own Sample may predate branches
    n = len(completion.token_ids)
    return Rollout(
        prompt_ids=list(prompt_ids),
        completion_ids=list(completion.token_ids),
        logprobs=[0.0] * shared + list(completion.logprobs[shared:]),
        versions=[-1] * shared + list(completion.versions[shared:]),
        reward=float(reward),
        finish_reason=completion.finish_reason,
        mask=[0] * shared + [1] * (n - shared) if shared else None,
        routes=_routes(completion),
        metadata=metadata,
    )
