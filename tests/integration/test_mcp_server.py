"""McpServer (pipeline_rl/rollouts/agent/mcp_server.py) against a real stdio MCP server process
(tests/fixtures/mcp_tools_server.py): its tools' schemas, a call, a failing, an unknown and a timed-out
call, calls from two event loops, and a server that cannot start."""

from __future__ import annotations

import asyncio
import sys

import pytest
from fixtures.helpers import TESTS

from pipeline_rl.rollouts.agent.mcp_server import McpServer, McpToolError

SERVER = [str(TESTS / "fixtures" / "mcp_tools_server.py")]


@pytest.fixture(scope="module")
def server():
    # Generous: under a loaded 2-core CI machine a failing call once took over 2 s to come back.
    s = McpServer(sys.executable, SERVER, timeout_s=10)
    yield s
    s.close()


def test_schemas_and_calls(server):
    schemas = {s["function"]["name"]: s["function"] for s in server.schemas()}
    assert set(schemas) == {"add", "fails", "sleeps"}
    assert schemas["add"]["description"] == "Add two integers."
    assert set(schemas["add"]["parameters"]["properties"]) == {"a", "b"}
    assert asyncio.run(server.call("add", {"a": 2, "b": 40})) == "42"
    assert asyncio.run(server.call("add", {"a": 1, "b": 1})) == "2"  # a second loop: the session is the server's own


def test_failures_raise_naming_the_tool(server):
    # mcp 2 sends a generic message for an exception in a tool, not its text.
    with pytest.raises(McpToolError, match="'fails' failed: Error executing tool fails"):
        asyncio.run(server.call("fails", {"a": 7}))
    with pytest.raises(McpToolError, match="'sleeps' timed out after 10 s"):
        asyncio.run(server.call("sleeps", {"seconds": 30}))
    with pytest.raises(McpToolError, match="'nope' failed"):
        asyncio.run(server.call("nope", {}))
    assert asyncio.run(server.call("add", {"a": 3, "b": 4})) == "7"  # the server goes on


def test_a_server_that_cannot_start_is_refused():
    with pytest.raises(RuntimeError, match="did not start"):
        McpServer(sys.executable, ["-c", "raise SystemExit(3)"], timeout_s=10)
