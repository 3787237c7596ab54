"""MCP tool servers in a verifiers environment (the `verifiers` extra): `McpToolEnv` is a
`vf.ToolEnv` whose tools are those of stdio MCP servers (mcp_server.py), in place of verifiers'
`vf.MCPEnv`, which reads mcp 1's tool objects and fails under the locked mcp 2.

    McpToolEnv(mcp_servers=[{"command": "python", "args": ["my_server.py"]}], dataset=...,
               rubric=..., max_turns=4)

The model sees every server's tools (their own JSON schemas); a call goes to the server that
has the tool, under `tool_timeout_s`; a failed call becomes the tool message verifiers' ToolEnv
shows the model (its `error_formatter`; `stop_errors` ends the episode instead). The servers
start with the environment and stop at its teardown or at exit.
"""

from __future__ import annotations

from typing import Any

import verifiers as vf  # pyright: ignore[reportMissingImports]  (the optional `verifiers` extra)

from pipeline_rl.rollouts.agent.mcp_server import McpServer, McpToolError


class McpToolEnv(vf.ToolEnv):
    def __init__(self, mcp_servers: list[dict], tool_timeout_s: float = 30.0, **kwargs: Any):
        super().__init__(tools=[], **kwargs)
        self.mcp_servers: list[McpServer] = []
        self.mcp_routes: dict[str, McpServer] = {}
        try:
            for spec in mcp_servers:
                server = McpServer(spec["command"], spec.get("args"), spec.get("env"), tool_timeout_s)
                self.mcp_servers.append(server)
                for tool in server.tools:
                    if tool.name in self.mcp_routes:
                        raise ValueError(f"two MCP servers have a tool named {tool.name!r}")
                    self.mcp_routes[tool.name] = server
                    self.tool_monitor_rubric.add_tool_metric(tool.name)
        except BaseException:
            self._close_servers()
            raise
        self.tool_defs = [
            vf.Tool(
                name=s["function"]["name"],
                description=s["function"]["description"],
                parameters=s["function"]["parameters"],
            )
            for server in self.mcp_servers
            for s in server.schemas()
        ]

    async def call_tool(self, tool_name: str, tool_args: dict, tool_call_id: str, **kwargs: Any) -> Any:
        server = self.mcp_routes.get(tool_name)
        if server is None:
            raise McpToolError(f"the model called {tool_name!r}, which no MCP server has ({sorted(self.mcp_routes)})")
        return vf.ToolMessage(role="tool", content=await server.call(tool_name, tool_args), tool_call_id=tool_call_id)

    def _close_servers(self) -> None:
        for server in self.mcp_servers:
            server.close()

    @vf.teardown
    async def close_mcp_servers(self) -> None:
        self._close_servers()
