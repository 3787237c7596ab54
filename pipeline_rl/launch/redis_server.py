"""The redis-server a run starts (`streams.redis.start_server`), beside trainer rank 0.

It listens on `streams.redis.host` with the run's random password (streams/redis_secret.py),
which reaches it in a 0600 config file, never on its command line, and keeps an append-only
file under RUN_DIR/redis so that a resumed run finds its streams.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path

from pipeline_rl.config import ConfigError, RunConfig
from pipeline_rl.launch.supervisor import Child, Supervisor
from pipeline_rl.streams.redis_secret import ensure_password, write_server_config


def cannot_start(host: str, port: int) -> str | None:
    """Why the run's redis-server cannot start on this machine, or None: run where it is to
    listen (on Ray, trainer rank 0's node, as a task there)."""
    if shutil.which("redis-server") is None:
        return "redis-server is not on PATH (streams.redis.start_server)"
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return f"port {port} on {host} is taken or not this node's ({e.strerror}; streams.redis.port, streams.redis.host)"
    return None


def start_redis(cfg: RunConfig, services: Supervisor) -> Child:
    """Start the run's redis-server under `services` and wait until it accepts connections."""
    problem = cannot_start(cfg.streams.redis.host, cfg.streams.redis.port)
    if problem is not None:
        raise ConfigError(f"the run's redis-server cannot start: {problem}")
    child = services.spawn("redis", redis_command(cfg), dict(os.environ))
    wait_port(cfg.streams.redis.host, cfg.streams.redis.port, what="redis-server")
    return child


def redis_command(cfg: RunConfig) -> list[str]:
    """The run's redis-server command line (the one-node launcher's child or a Ray actor on
    trainer rank 0's node: `redis-server` is looked up on the PATH of the node it runs on)."""
    r = cfg.streams.redis
    redis_dir = Path(cfg.run_dir).resolve() / "redis"
    redis_dir.mkdir(parents=True, exist_ok=True)
    secret = write_server_config(redis_dir, ensure_password(cfg.run_dir))
    return [
        "redis-server",
        str(secret),  # a config file must be the first argument; the options below add to it
        "--port",
        str(r.port),
        "--bind",
        r.host,
        # An append-only file under the run directory, so that a resumed run finds its streams:
        # every acknowledged XADD is written to the file before the reply (a killed redis-server
        # loses nothing; a machine crash at most the last second, fsynced every second).
        "--save",
        "",
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
        "--dir",
        str(redis_dir),
    ]


def wait_port(host: str, port: int, what: str, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{what} at {host}:{port} is not reachable after {timeout:.0f} s")
