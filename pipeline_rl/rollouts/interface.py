"""The one interface an environment author writes against: a rollout function, and the
generator it samples from (the actor's engine; pipeline_rl/engine/llm_client.py implements it).

    async def rollout(problem: dict, llm: Generator, ctx: RolloutContext) -> RolloutGroup

How rollouts are built (single- and multi-turn, masks, per-turn rewards) is described in
pipeline_rl/rollouts/domains/__init__.py; the agent and verifiers domains build them from an
OpenAI-style client instead (pipeline_rl/rollouts/agent/).
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pipeline_rl.config import RunConfig
from pipeline_rl.streams.records import RolloutGroup


class Sample(Protocol):
    """One completion, token for token as the engine produced it."""

    token_ids: list[int]
    logprobs: list[float]
    """Logprob of each sampled token at the sampling temperature (the behaviour logprob)."""
    versions: list[int]
    """Policy version of the forward pass that produced each token."""
    finish_reason: str
    """stop, length, abort, or cut (step guidance stopped it after a step scored wrong)."""
    text: str
    routes: Any
    """With routing replay, the experts each token was routed to (a uint8 numpy array of
    tokens x MoE layers x top_k); else None."""
    shared: int
    """Leading tokens this sequence took from another of its call (step guidance's branch): they
    are trained as that sequence's (mask 0 here)."""


class Generator(Protocol):
    """What a rollout may use of the actor's engine."""

    tokenizer: Any
    """The policy's tokenizer (Hugging Face interface)."""
    max_model_len: int
    """Prompt plus completion tokens the engine accepts (actor.llm.max_model_len)."""

    async def generate(
        self,
        prompt_ids: list[int],
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        *,
        ignore_eos: bool = False,
    ) -> Sequence[Sample]:
        """Sample `n` completions of `prompt_ids`; each token carries its logprob and version."""
        ...


DOMAIN_SETTINGS = "actor.domain_settings"
"""The config key of a domain's own settings."""


@dataclass(frozen=True)
class RolloutContext:
    """What a rollout gets besides its problem and the engine."""

    cfg: RunConfig
    """The run's configuration (read it, never change it: every rollout of the actor shares it)."""
    attempts: int
    """Completions (or episodes) of this group: actor.attempts when training, 1 when the actor
    evaluates."""
    settings: Any = None
    """The domain's own settings: actor.domain_settings read into the type the domain declares
    with `@takes_settings` (pipeline_rl/config/plugin_settings.py); None when it declares none."""


class RolloutFn(Protocol):
    """A domain: one problem (a row of the data set) to one group of scored rollouts."""

    def __call__(
        self, problem: dict[str, Any], llm: Generator, ctx: RolloutContext
    ) -> Coroutine[Any, Any, RolloutGroup]: ...


def continuable(rollout: RolloutFn) -> RolloutFn:
    """Mark a domain's rollout as one an actor may continue after a stop (actor/in_flight.py):
    run again on the same problem and given the same generations, it makes the same generate
    calls in the same order, and what it does besides (rewards, an environment's steps) can be
    done again. Single-turn rollouts are; a multi-turn rollout is when its environment is a pure
    function of the conversation. Rollouts of other domains in flight at a stop are counted lost."""
    rollout.continuable = True  # pyright: ignore[reportAttributeAccessIssue]
    return rollout


def is_continuable(rollout: RolloutFn) -> bool:
    return bool(getattr(rollout, "continuable", False))
