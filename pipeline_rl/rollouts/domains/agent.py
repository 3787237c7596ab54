"""The agent domain (`actor.domain: agent`): each of a problem's actor.attempts episodes runs the
environment actor.agent.environment, `async def run(client, problem) -> float`, with its own
`ChatSession` (pipeline_rl/rollouts/agent/) and becomes one rollout of the group, its reward the
number the environment returned. An episode that ended with an AgentError (a failed tool, too
many turns, a full context) is kept with actor.agent.error_reward and its error; anything else
an environment raises fails the whole group."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from pipeline_rl.config import ConfigError, RunConfig
from pipeline_rl.config.pool_sections import AgentConfig
from pipeline_rl.core.plugins import load_plugin
from pipeline_rl.rollouts.agent.http import ChatServer
from pipeline_rl.rollouts.agent.session import AgentError, ChatSession
from pipeline_rl.rollouts.agent.tools import Tools
from pipeline_rl.rollouts.interface import Generator
from pipeline_rl.streams.records import Rollout, RolloutGroup


def load_agent(agent: AgentConfig) -> tuple[Callable[..., Coroutine[Any, Any, Any]], Tools | None]:
    """The environment function and the tools (no worker started yet) the config names; raises
    ConfigError naming the key. The launcher calls it too, so a bad one fails at launch."""
    environment = load_plugin(
        agent.environment,
        "actor.agent.environment",
        "an async function (async def run(client, problem) -> float)",
        check=inspect.iscoroutinefunction,
    )
    if not (agent.tools or agent.mcp_servers):
        return environment, None
    return environment, Tools(agent.tools, agent.tool_timeout_s, agent.tool_workers, agent.mcp_servers)


def chat_template(agent: AgentConfig) -> str | None:
    """The text of actor.agent.chat_template (None: the tokenizer's own)."""
    if agent.chat_template is None:
        return None
    path = Path(agent.chat_template)
    if not path.is_file():
        raise ConfigError(f"bad value for 'actor.agent.chat_template': {path} is not a file")
    return path.read_text()


class AgentRuntime:
    """What the episodes of one agent config share in this process: the environment function,
    the tools' worker pool and MCP servers, the chat template's text and the HTTP endpoint."""

    def __init__(self, agent: AgentConfig):
        self.environment, self.tools = load_agent(agent)
        if self.tools:  # once per actor, at its first episode: a second or two of start-up
            self.tools.start_mcp()
        self.template = chat_template(agent)
        self.server = ChatServer(agent.http_host, agent.http_port) if agent.http else None


_runtimes: dict[str, AgentRuntime] = {}


def runtime(cfg: RunConfig) -> AgentRuntime:
    key = repr(cfg.actor.agent)  # one per config: the actor's training and evaluation share it
    if key not in _runtimes:
        _runtimes[key] = AgentRuntime(cfg.actor.agent)
    return _runtimes[key]


async def episode(rt: AgentRuntime, llm: Any, cfg: RunConfig, problem: dict) -> Rollout:
    session = ChatSession(llm, cfg.actor, cfg.shared.temperature, rt.template, rt.tools)
    key = rt.server.open(session) if rt.server else None
    try:
        reward = await rt.environment(session, problem)
    except AgentError:  # recorded in the session
        reward = None
    finally:
        if rt.server and key:
            rt.server.close(key)
    if session.error is None and not isinstance(reward, int | float):
        raise TypeError(
            f"actor.agent.environment {cfg.actor.agent.environment!r} returned {type(reward).__name__}, expected a number"
        )
    return session.rollout(reward, cfg.actor.agent.error_reward)


async def rollout(problem: dict, llm: Generator, cfg: RunConfig) -> RolloutGroup:
    try:
        async with asyncio.TaskGroup() as group:  # one failed episode cancels its siblings
            tasks = [group.create_task(episode(runtime(cfg), llm, cfg, problem)) for _ in range(cfg.actor.attempts)]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None  # the actor logs and counts the error itself
    return RolloutGroup(problem_id=problem["id"], group_id="", rollouts=[t.result() for t in tasks])
