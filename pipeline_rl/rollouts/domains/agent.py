"""The agent domain (`actor.domain: agent`): each of a group's attempts is an episode of the
environment its settings name, `async def run(client, problem) -> float`, with its own
`ChatSession` (pipeline_rl/rollouts/agent/) and becomes one rollout of the group, its reward the
number the environment returned. An episode that ended with an AgentError (a failed tool, too
many turns, a full context) is kept with the settings' error_reward and its error; anything else
an environment raises fails the whole group. An environment may declare settings of its own
(`@takes_settings`): they are given under `environment_settings` and reach it as `settings=`."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from pipeline_rl.config import ConfigError
from pipeline_rl.config.bounds import bounded
from pipeline_rl.config.plugin_settings import read_settings, settings_type, takes_settings
from pipeline_rl.core.plugins import load_plugin
from pipeline_rl.rollouts.agent.http import ChatServer
from pipeline_rl.rollouts.agent.session import AgentError, ChatSession
from pipeline_rl.rollouts.agent.settings import ChatSettings, McpServerConfig
from pipeline_rl.rollouts.agent.tools import Tools
from pipeline_rl.rollouts.interface import DOMAIN_SETTINGS, Generator, RolloutContext
from pipeline_rl.streams.records import Rollout, RolloutGroup


@dataclass
class AgentSettings(ChatSettings):
    """Agent environments: runs `environment` against an OpenAI-style client of the actor's
    engine (pipeline_rl/rollouts/agent/, docs/agents.md)."""

    environment: str = ""
    """The environment as `module:function`: `async def run(client, problem) -> float`, one
    episode of one problem, returning its reward."""
    environment_settings: dict[str, Any] = field(default_factory=dict)
    """The environment's own settings, read into the type it declares (`@takes_settings`) and
    passed to it as `settings=`; an environment that declares none takes none."""
    tools: list[str] = field(default_factory=list)
    """Tools the model may call, each a documented function `module:function`
    (pipeline_rl/rollouts/agent/tools.py); `client.tools` are their OpenAI schemas."""
    mcp_servers: list[McpServerConfig] = field(default_factory=list)
    """MCP tool servers (stdio) whose tools the model may call too; each actor starts its own
    at its first episode and stops them at exit."""
    tool_timeout_s: float = bounded(10.0, gt=0)
    """Time limit of one tool call; past it the tool's worker is killed (an MCP call is
    abandoned) and the episode ends with an error."""
    tool_workers: int = bounded(2, ge=1)
    """Worker processes per actor that run tool calls."""
    http: bool = False
    """Also serve each episode's client over HTTP (`client.base_url`, OpenAI's
    POST .../v1/chat/completions), for environments in another process."""
    http_host: str = "127.0.0.1"
    """Address the HTTP endpoint listens on (0.0.0.0 for environments on other machines)."""
    http_port: int = bounded(0, ge=0, le=65535)
    """Its port; 0: any free one (a fixed port serves only one actor per node)."""

    def check(self, key: str) -> None:
        """The environment and the tools import and describe themselves (at launch too)."""
        load_agent(self)


def load_agent(agent: AgentSettings) -> tuple[Callable[..., Coroutine[Any, Any, Any]], Tools | None]:
    """The environment function (its own settings bound) and the tools (no worker started yet)
    the settings name; raises ConfigError naming the key."""
    key = f"{DOMAIN_SETTINGS}.environment"
    if not agent.environment:
        raise ConfigError(f"'actor.domain' agent needs '{key}' (module:function)")
    environment = load_plugin(
        agent.environment,
        key,
        "an async function (async def run(client, problem) -> float)",
        check=inspect.iscoroutinefunction,
    )
    own = read_settings(
        environment, agent.environment_settings, f"{key}_settings", f"environment {agent.environment!r}"
    )
    if settings_type(environment) is not None:
        environment = functools.partial(environment, settings=own)
    if not (agent.tools or agent.mcp_servers):
        return environment, None
    return environment, Tools(agent.tools, agent.tool_timeout_s, agent.tool_workers, agent.mcp_servers)


class AgentRuntime:
    """What the episodes of one agent config share in this process: the environment function,
    the tools' worker pool and MCP servers, the chat template's text and the HTTP endpoint."""

    def __init__(self, agent: AgentSettings):
        self.environment, self.tools = load_agent(agent)
        if self.tools:  # once per actor, at its first episode: a second or two of start-up
            self.tools.start_mcp()
        self.template = agent.template_text()
        self.server = ChatServer(agent.http_host, agent.http_port) if agent.http else None


_runtimes: dict[str, AgentRuntime] = {}


def runtime(agent: AgentSettings) -> AgentRuntime:
    key = repr(agent)  # one per settings: the actor's training and evaluation share it
    if key not in _runtimes:
        _runtimes[key] = AgentRuntime(agent)
    return _runtimes[key]


async def episode(rt: AgentRuntime, llm: Any, ctx: RolloutContext, problem: dict) -> Rollout:
    agent: AgentSettings = ctx.settings
    session = ChatSession(llm, ctx.cfg.actor, ctx.cfg.shared.temperature, agent.max_turns, rt.template, rt.tools)
    key = rt.server.open(session) if rt.server else None
    try:
        reward = await rt.environment(session, problem)
    except AgentError:  # recorded in the session
        reward = None
    finally:
        if rt.server and key:
            rt.server.close(key)
    if session.error is None and not isinstance(reward, int | float):
        raise TypeError(f"environment {agent.environment!r} returned {type(reward).__name__}, expected a number")
    return session.rollout(reward, agent.error_reward)


@takes_settings(AgentSettings)
async def rollout(problem: dict, llm: Generator, ctx: RolloutContext) -> RolloutGroup:
    rt = runtime(ctx.settings)
    try:
        async with asyncio.TaskGroup() as group:  # one failed episode cancels its siblings
            tasks = [group.create_task(episode(rt, llm, ctx, problem)) for _ in range(ctx.attempts)]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None  # the actor logs and counts the error itself
    return RolloutGroup(problem_id=problem["id"], group_id="", rollouts=[t.result() for t in tasks])
