"""An MCP tool server over stdio for the MCP tests (mcp 2.x's MCPServer): `add`, a tool that
fails and one that sleeps."""

import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("test tools")


@server.tool()
def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


@server.tool()
def fails(a: int) -> str:
    """Always raises."""
    raise ValueError(f"fails was called with {a}")


@server.tool()
def sleeps(seconds: float) -> str:
    """Sleeps, then answers."""
    time.sleep(seconds)
    return "awake"


if __name__ == "__main__":
    server.run()
