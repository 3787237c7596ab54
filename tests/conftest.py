"""Shared fixtures: a real redis-server on a free loopback port, and the tiny model."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("PIPELINE_RL_CACHE", ROOT / ".cache"))

# One compute thread per process: two OpenMP threads on these VMs are much slower than one.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server process of the test's own; `restart()` keeps the port."""

    def __init__(self, workdir: Path):
        self.port = free_port()
        self.workdir = workdir
        self.proc = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not on PATH (.ci/run installs it with apt)")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The pretrained tiny arithmetic model (built once, cached under .cache/tiny_model, with
    its data set under .cache/arithmetic)."""
    path = CACHE / "tiny_model"
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), "--cache", str(CACHE)], check=True)
    return path


# Tests that fork trainer ranks from the test process (test_trainer, test_checkpoint) or load
# models with transformers next to an engine run first: once an in-process vLLM engine has run in
# this process, forked children and later loads were seen to get unloaded (meta) weights.
FIRST = ("test_trainer.py", "test_checkpoint.py", "test_vllm_hook.py", "test_weight_sync.py")


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return FIRST.index(name) if name in FIRST else len(FIRST)

    items.sort(key=rank)
