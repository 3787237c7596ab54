"""The verifiers domain (`actor.domain: verifiers`): an environment of the verifiers library
(`vf.SingleTurnEnv`, `MultiTurnEnv`, `ToolEnv` or any `vf.Environment`; the `verifiers` extra)
named by its settings' `environment` runs its own rollout logic for each of a group's attempts
(episodes), its model calls going to the actor's engine through a ChatSession each
(pipeline_rl/rollouts/agent/vf_client.py), and its rubric scores the group (`score_group`, so group
reward functions see the whole group) into the rollouts' rewards.

A problem becomes the environment's input: `prompt` (a string becomes a user message after the
environment's system prompt and few-shot messages, as verifiers formats its own data sets; a list
is taken as the messages), `answer`, `info` (a dict, default empty) and `example_id` (the
problem's id).

The sample's tokens, logprobs, versions and mask are the session's transcript (the engine's
output tokens, environment messages rendered once with mask 0), never verifiers' view of the
conversation. An episode that ends with an error (one verifiers records in its state, such as
an empty reply or a failed tool with `stop_errors`; a session error such as
the settings' max_turns or a full context; or an exception out of the environment's own code)
keeps its tokens, gets the settings' error_reward and the error text in metadata["agent_error"],
and is counted with the agent metrics. An episode that raised before its first model turn, or a
rubric that raises, fails the group (a counted lost group).

verifiers runs a ToolEnv's tools in the actor's event loop: a slow synchronous tool holds up the
actor's other rollouts (the agent domain's tools run in time-limited workers instead).
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field
from typing import Any

from pipeline_rl.config import ConfigError
from pipeline_rl.config.plugin_settings import takes_settings
from pipeline_rl.core.plugins import load_plugin
from pipeline_rl.rollouts.agent.session import ChatSession
from pipeline_rl.rollouts.agent.settings import ChatSettings
from pipeline_rl.rollouts.interface import DOMAIN_SETTINGS, Generator, RolloutContext
from pipeline_rl.streams.records import Rollout, RolloutGroup

KEY = f"{DOMAIN_SETTINGS}.environment"


@dataclass
class VerifiersSettings(ChatSettings):
    """Environments of the verifiers library (the `verifiers` extra): runs `environment`'s own
    rollout and rubric on the actor's engine through the agent domain's chat client, whose
    settings (chat_template, max_turns, error_reward) apply here too."""

    environment: str = ""
    """`module:function` returning a verifiers Environment, called with `args`; or the id of an
    installed verifiers environment package, loaded with `verifiers.load_environment(id, **args)`."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of that function: the environment's own settings."""

    def check(self, key: str) -> None:
        """The environment builds (at launch too)."""
        load_environment(self)


def load_environment(config: VerifiersSettings) -> Any:
    """The environment the settings name, built; raises ConfigError naming the key."""
    try:
        import verifiers as vf  # pyright: ignore[reportMissingImports]  (the optional `verifiers` extra)
    except ImportError as e:
        raise ConfigError(
            f"bad value for 'actor.domain': verifiers needs the verifiers package ({e}); "
            "install it with `bash scripts/setup_cpu.sh --verifiers`"
        ) from None
    if not config.environment:
        raise ConfigError(f"'actor.domain' verifiers needs '{KEY}' (module:function or an id)")
    spec, args = config.environment, dict(config.args)
    if ":" in spec:
        make = load_plugin(spec, KEY, "a function returning a verifiers Environment", check=callable)
    else:
        make = functools.partial(vf.load_environment, spec)
    try:
        env = make(**args)
    except Exception as e:  # an environment's constructor may raise anything
        raise ConfigError(f"bad value for '{KEY}': {spec!r}({args}) raised {type(e).__name__}: {e}") from None
    if not isinstance(env, vf.Environment):
        raise ConfigError(f"bad value for '{KEY}': {spec!r} returned {type(env).__name__}, not a verifiers Environment")
    return env


_environments: dict[str, tuple[Any, str | None]] = {}


def runtime(settings: VerifiersSettings) -> tuple[Any, str | None]:
    """The environment and the chat template text, built once per settings in this process."""
    key = repr(settings)
    if key not in _environments:
        _environments[key] = (load_environment(settings), settings.template_text())
    return _environments[key]


def rollout_input(env: Any, problem: dict) -> dict:
    prompt = problem["prompt"]
    if isinstance(prompt, str):
        system = [{"role": "system", "content": env.system_prompt}] if env.system_prompt else []
        prompt = [*system, *(env.few_shot or []), {"role": "user", "content": prompt}]
    return {
        "prompt": prompt,
        "answer": problem.get("answer", ""),
        "info": problem.get("info", {}),
        "example_id": problem["id"],
    }


def describe(error: BaseException) -> str:
    """An error and its causes, outermost first (verifiers wraps a client's errors in ModelError)."""
    parts, seen = [], set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        parts.append(f"{type(current).__name__}: {current}" if str(current) else type(current).__name__)
        current = current.__cause__ or current.__context__
    return " <- ".join(parts)


async def episode(env: Any, session: ChatSession, problem: dict) -> Any:
    """verifiers' state of one rollout, or None when the environment raised (recorded in the session)."""
    from pipeline_rl.rollouts.agent.vf_client import SessionClient

    try:
        # The environment's sampling_args reach the session, which applies the run's own sampling.
        return await env.rollout(rollout_input(env, problem), SessionClient(session), "policy", dict(env.sampling_args))
    except Exception as e:  # the environment's own code failed: this rollout ends, the group goes on
        session.error = session.error or describe(e)
        return None


def sample(session: ChatSession, state: Any, error_reward: float) -> Rollout:
    if state is not None and state.get("error") is not None and session.error is None:
        session.error = describe(state["error"])
    if session.transcript is None:  # nothing to train on: the actor counts the group as lost
        raise RuntimeError(f"the verifiers environment ended before its first model turn: {session.error}")
    metrics = dict(state.get("metrics") or {}) if state is not None else {}
    session.tool_calls = int(metrics.get("total_tool_calls", 0))  # verifiers ran them, not the session
    reward = state.get("reward") if state is not None and session.error is None else None
    rollout = session.rollout(reward, error_reward)
    rollout.metadata["verifiers_metrics"] = {k: float(v) for k, v in metrics.items()}
    if state is not None and state.get("stop_condition"):
        rollout.metadata["stop_condition"] = state["stop_condition"]
    return rollout


@takes_settings(VerifiersSettings)
async def rollout(problem: dict, llm: Generator, ctx: RolloutContext) -> RolloutGroup:
    settings: VerifiersSettings = ctx.settings
    env, template = runtime(settings)
    cfg = ctx.cfg
    sessions = [
        ChatSession(llm, cfg.actor, cfg.shared.temperature, settings.max_turns, template, None)
        for _ in range(ctx.attempts)
    ]
    states = await asyncio.gather(*(episode(env, s, problem) for s in sessions))
    scored = [s for s in states if s is not None]
    if scored:
        await env.rubric.score_group(scored)
        for state in scored:
            await env.rubric.cleanup(state)
    rollouts = [sample(s, state, settings.error_reward) for s, state in zip(sessions, states)]
    return RolloutGroup(problem_id=problem["id"], group_id="", rollouts=rollouts)
