"""Tools in real worker processes (pipeline_rl/rollouts/agent/tools.py): a working tool's result,
its OpenAI schema from the docstring; a tool that raises, hangs past the limit or returns garbage,
an unknown tool and bad arguments each give a ToolError naming the tool, and the pool goes on
serving afterwards; a config that names a bad tool is refused naming its key."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from pipeline_rl.config import ConfigError
from pipeline_rl.rollouts.agent.tools import ToolError, Tools

TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def tools():
    box = Tools(
        [
            "fixtures.agent_tools:add",
            "fixtures.agent_tools:fails",
            "fixtures.agent_tools:hangs",
            "fixtures.agent_tools:garbage",
        ],
        TIMEOUT_S,
        workers=1,
    )
    yield box
    box.close()


def call(tools, name, arguments):
    return asyncio.run(tools.call(name, json.dumps(arguments) if not isinstance(arguments, str) else arguments))


def test_schemas_and_a_working_call(tools):
    add = tools.schemas[0]["function"]
    assert add["name"] == "add" and add["description"] == "Add two integers."
    assert add["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first"}
    assert [s["function"]["name"] for s in tools.schemas] == ["add", "fails", "hangs", "garbage"]
    assert call(tools, "add", {"a": 37, "b": 48}) == "85"


@pytest.mark.parametrize(
    "name, arguments, error",
    [
        (
            "fails",
            {"a": 3, "b": 4},
            "tool 'fails' (fixtures.agent_tools:fails) failed: ValueError: fails was called with 3",
        ),
        ("garbage", {"a": 3, "b": 4}, "returned set, neither a string nor a JSON value"),
        ("add", {"a": 1}, "TypeError"),  # a missing argument
        ("add", "[1, 2]", "arguments are list, expected an object"),
        ("add", "{oops", "arguments are not JSON"),
        ("mul", {"a": 1}, "the model called 'mul', which is not a tool"),
    ],
)
def test_failures_name_the_tool_and_the_pool_goes_on(tools, name, arguments, error):
    with pytest.raises(ToolError, match=r"tool|model called") as raised:
        call(tools, name, arguments)
    assert error in str(raised.value)
    assert call(tools, "add", {"a": 1, "b": 2}) == "3"


def test_a_hanging_tool_is_killed_at_the_limit(tools):
    start = time.monotonic()
    with pytest.raises(ToolError, match=f"timed out after {TIMEOUT_S:g} s"):
        call(tools, "hangs", {"a": 1, "b": 2})
    assert time.monotonic() - start < TIMEOUT_S + 1.0
    restarts = tools._workers().restarts
    assert restarts >= 1 and call(tools, "add", {"a": 2, "b": 2}) == "4"


@pytest.mark.parametrize(
    "spec, error",
    [
        ("fixtures.agent_tools:nothing", "bad value for 'actor.domain_settings.tools.0': cannot import"),
        ("json:dumps", "bad value for 'actor.domain_settings.tools.0': no tool schema"),
    ],
)
def test_bad_tools_are_refused_naming_the_key(spec, error):
    with pytest.raises(ConfigError, match=error):
        Tools([spec], 1.0, 1)


def test_two_tools_of_one_name_are_refused():
    with pytest.raises(ConfigError, match=r"actor\.domain_settings\.tools\.1': a second tool named 'add'"):
        Tools(["fixtures.agent_tools:add", "fixtures.agent_tools:add"], 1.0, 1)
