"""Tools the model may call (the agent domain's `tools`): Python functions named `module:function`, run
in RewardPool workers (pipeline_rl/rollouts/rewards.py) under its `tool_timeout_s`, so a tool
that hangs, even inside C code, is killed and replaced without stopping the actor; and the tools
of MCP servers (its `mcp_servers`, mcp_server.py), started by `start_mcp` in the actor,
each call under the same limit.

A tool is a plain function of JSON-valued keyword arguments, documented Google-style (a summary
line and an `Args:` entry per argument, with type hints): transformers' `get_json_schema` makes
its OpenAI schema from that, which the chat template shows the model. It returns a string, or a
JSON value that becomes its JSON text. A tool that raises, runs past the limit, or returns
anything else (None, an object JSON cannot hold) fails the call with a `ToolError`.
"""

from __future__ import annotations

import atexit
import json
import shutil
from typing import Any

from pipeline_rl.config import ConfigError
from pipeline_rl.core.plugins import import_attr, load_plugin
from pipeline_rl.rollouts.agent.mcp_server import McpServer, McpToolError
from pipeline_rl.rollouts.agent.settings import McpServerConfig
from pipeline_rl.rollouts.interface import DOMAIN_SETTINGS
from pipeline_rl.rollouts.rewards import RewardPool

INVOKE = f"{__name__}:invoke"


class ToolError(RuntimeError):
    """A tool call that produced no result (the episode ends with it)."""


def invoke(function: str, arguments: dict) -> str:
    """Run in a worker: call `function` ("module:function") with `arguments` as keywords; the
    result as text (checked here, where the value is, not after it crossed the pipe)."""
    value = import_attr(function)(**arguments)
    if isinstance(value, str):
        return value
    if value is None:
        raise TypeError(f"{function} returned None, expected a string or a JSON value")
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{function} returned {type(value).__name__}, neither a string nor a JSON value: {e}") from None


def tool_schema(function: Any, key: str) -> dict:
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as e:  # transformers raises several types for undocumented arguments and hints
        raise ConfigError(f"bad value for '{key}': no tool schema from its signature and docstring: {e}") from None


class Tools:
    """The configured tools: their schemas (`schemas`, for the model), their worker pool and
    MCP servers."""

    def __init__(self, specs: list[str], timeout_s: float, workers: int, mcp: list[McpServerConfig] | None = None):
        self.timeout_s, self.workers = timeout_s, workers
        self.paths: dict[str, str] = {}
        self.schemas: list[dict] = []
        self.mcp_specs = list(mcp or [])
        for i, server in enumerate(self.mcp_specs):
            if not shutil.which(server.command):
                raise ConfigError(
                    f"bad value for '{DOMAIN_SETTINGS}.mcp_servers.{i}.command': {server.command!r} is not a program"
                )
        self.mcp_servers: list[McpServer] = []
        self.mcp_routes: dict[str, McpServer] = {}
        for i, spec in enumerate(specs):
            key = f"{DOMAIN_SETTINGS}.tools.{i}"
            schema = tool_schema(load_plugin(spec, key, "a function", check=callable), key)
            name = schema["function"]["name"]
            if name in self.paths:
                raise ConfigError(f"bad value for '{key}': a second tool named {name!r} ({self.paths[name]})")
            self.paths[name] = spec
            self.schemas.append(schema)
        self._pool: RewardPool | None = None

    def start_mcp(self) -> None:
        """Start the MCP servers (in the actor: the launcher's check starts none) and add their
        tools; a server that does not start, or a tool name given twice, raises naming the key."""
        try:
            for i, spec in enumerate(self.mcp_specs):
                key = f"{DOMAIN_SETTINGS}.mcp_servers.{i}"
                try:
                    server = McpServer(spec.command, spec.args, spec.env, self.timeout_s)
                except RuntimeError as e:
                    raise RuntimeError(f"{key}: {e}") from None
                self.mcp_servers.append(server)
                for schema in server.schemas():
                    name = schema["function"]["name"]
                    if name in self.paths or name in self.mcp_routes:
                        raise ConfigError(f"bad value for '{key}': its tool {name!r} is named by another tool too")
                    self.mcp_routes[name] = server
                    self.schemas.append(schema)
        except BaseException:
            self.close()
            raise

    def _workers(self) -> RewardPool:
        if self._pool is None:  # started on the first call: a run without tool calls starts none
            modules = tuple(sorted({p.partition(":")[0] for p in self.paths.values()}))
            self._pool = RewardPool(self.workers, self.timeout_s, preload=(__name__, *modules))
            atexit.register(self._pool.close)
        return self._pool

    async def call(self, name: str, arguments: str) -> str:
        """The result text of one call; raises ToolError naming the tool."""
        if name not in self.paths and name not in self.mcp_routes:
            known = sorted([*self.paths, *self.mcp_routes])
            raise ToolError(f"the model called {name!r}, which is not a tool (known: {known})")
        try:
            kwargs = json.loads(arguments)
        except ValueError as e:
            raise ToolError(f"tool {name!r}: arguments are not JSON: {e}") from None
        if not isinstance(kwargs, dict):
            raise ToolError(f"tool {name!r}: arguments are {type(kwargs).__name__}, expected an object")
        if name in self.mcp_routes:
            try:
                return await self.mcp_routes[name].call(name, kwargs)
            except McpToolError as e:
                raise ToolError(str(e)) from None
        result = await self._workers().acall(INVOKE, self.paths[name], kwargs)
        if result.error is not None:
            raise ToolError(f"tool {name!r} ({self.paths[name]}) failed: {result.error}")
        if not isinstance(result.value, str):  # invoke returns text; anything else is a broken worker
            raise ToolError(f"tool {name!r} gave {type(result.value).__name__}, expected text")
        return result.value

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
        for server in self.mcp_servers:
            server.close()
        self.mcp_servers, self.mcp_routes = [], {}
