"""verifiers environments for the verifiers-domain tests (actor.verifiers.environment), on the
tiny arithmetic model (tests/agent_tiny.jinja): the questions of tests/agent_envs.py as a
`vf.MultiTurnEnv` and a `vf.ToolEnv`, each scored by its `vf.Rubric`."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable

import verifiers as vf
from agent_envs import operands, swapped
from agent_tools import add
from helpers import TESTS

from pipeline_rl.rollouts.agent.vf_mcp import McpToolEnv

between_turns: Callable[[], Awaitable[None]] | None = None
"""Awaited by TwoQuestions before its second question (a test sets it to swap weights there)."""


def _never_built():
    raise AssertionError("the environment's own data set is not used: problems come from actor.dataset")


def _question(messages) -> str:
    return next(m.content for m in messages if m.role == "user")


def _replies(completion) -> list[str]:
    return [(m.content or "").strip() for m in completion if m.role == "assistant"]


class TwoQuestions(vf.MultiTurnEnv):
    """The sum, then the same sum swapped."""

    async def env_response(self, messages, state, **kwargs):
        if between_turns is not None:
            await between_turns()
        return [{"role": "user", "content": swapped(_question(messages))}]


def both_right(completion, answer) -> float:
    replies = _replies(completion)
    return float(len(replies) == 2 and all(r == answer for r in replies))


def two_questions() -> vf.Environment:
    return TwoQuestions(dataset=_never_built, max_turns=2, rubric=vf.Rubric(funcs=[both_right]))


class Broken(TwoQuestions):
    async def env_response(self, messages, state, **kwargs):
        raise ZeroDivisionError("the environment's own bug")


def broken() -> vf.Environment:
    return Broken(dataset=_never_built, max_turns=2, rubric=vf.Rubric(funcs=[both_right]))


class BrokenAtSetup(TwoQuestions):
    async def setup_state(self, state):
        raise KeyError("no such resource")


def broken_at_setup() -> vf.Environment:
    return BrokenAtSetup(dataset=_never_built, max_turns=2, rubric=vf.Rubric(funcs=[both_right]))


class OnTheModelsBehalf:
    """For a ToolEnv: the tiny model writes no <tool_call>, so after its first answer the
    environment makes the call the model would make, with the ToolEnv's own call_tool, and shows
    it the result; the second answer ends the episode."""

    async def env_response(self, messages, state, **kwargs):
        if messages[-1].tool_calls:
            return await super().env_response(messages, state, **kwargs)
        a, b = operands(_question(messages))
        return [await self.call_tool("add", {"a": a, "b": b}, "call_0")]

    @vf.stop
    async def no_tools_called(self, state) -> bool:
        return len(state["trajectory"]) >= 2


class CheckedByTool(OnTheModelsBehalf, vf.ToolEnv):
    """verifiers' ToolEnv with the Python function `add`."""


class CheckedByMcp(OnTheModelsBehalf, McpToolEnv):
    """McpToolEnv with the `add` of the MCP server tests/mcp_tools_server.py."""


def second_right(completion, answer) -> float:
    replies = _replies(completion)
    return float(len(replies) == 2 and replies[1] == answer)


def checked_by_tool() -> vf.Environment:
    return CheckedByTool(tools=[add], dataset=_never_built, max_turns=2, rubric=vf.Rubric(funcs=[second_right]))


def checked_by_mcp() -> vf.Environment:
    servers = [{"command": sys.executable, "args": [str(TESTS / "mcp_tools_server.py")]}]
    return CheckedByMcp(mcp_servers=servers, dataset=_never_built, max_turns=2, rubric=vf.Rubric(funcs=[second_right]))
