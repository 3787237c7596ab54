"""The HTTP endpoint of the sessions (actor.domain_settings.http): OpenAI's chat-completions route for
environments in another process, e.g. `openai.AsyncOpenAI(base_url=client.base_url, api_key="-")`.

`POST /sessions/ID/v1/chat/completions` takes OpenAI's request body and answers with a
`chat.completion` object; the session id in the path (unguessable) says which episode's
conversation the request continues, so each base URL serves one episode. A request the session
refuses is answered 400 with OpenAI's error shape, an ended or unknown session 404.

The server runs in its own daemon threads for the life of the actor process (stdlib
ThreadingHTTPServer: no dependency) and hands each request to its session's event loop, where the
engine requests are made.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)
_ROUTE = re.compile(r"/sessions/([A-Za-z0-9_-]+)/v1/chat/completions")


class ChatServer:
    def __init__(self, host: str, port: int):
        self.sessions: dict[str, Any] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as OpenAI's client expects

            def do_POST(self) -> None:
                status, body = server.handle(self.path, self.rfile.read(int(self.headers.get("Content-Length", 0))))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug(format, *args)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.host, self.port = host, self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="agent-http", daemon=True)
        self._thread.start()

    def open(self, session: Any) -> str:
        """Serve `session` until `close(key)`; returns its key (part of its base URL)."""
        key = secrets.token_urlsafe(16)
        self.sessions[key] = session
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        session.served_at = f"http://{host}:{self.port}/sessions/{key}/v1"
        return key

    def close(self, key: str) -> None:
        self.sessions.pop(key, None)

    def handle(self, path: str, raw: bytes) -> tuple[int, dict]:
        match = _ROUTE.fullmatch(path)
        if match is None:
            return 404, _error(f"no route {path}: POST /sessions/ID/v1/chat/completions", "not_found")
        session = self.sessions.get(match.group(1))
        if session is None:
            return 404, _error("no such session (its episode has ended)", "not_found")
        try:
            request = json.loads(raw)
            if not isinstance(request, dict) or "messages" not in request:
                raise ValueError("the body must be a JSON object with 'messages'")
        except ValueError as e:
            return 400, _error(f"bad request body: {e}", "invalid_request_error")
        future = asyncio.run_coroutine_threadsafe(session.create(**request), session.loop)
        try:
            return 200, future.result().model_dump()
        except (ValueError, TypeError, RuntimeError) as e:  # AgentError is a RuntimeError
            return 400, _error(f"{type(e).__name__}: {e}", "invalid_request_error")
        except BaseException as e:  # the episode was cancelled (the actor is stopping)
            return 503, _error(f"{type(e).__name__}: {e}", "unavailable")


def _error(message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind}}
