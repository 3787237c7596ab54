"""Reward checks under a hard time limit, in worker processes that can be killed.

A check that parses model output (sympy, LaTeX grammars) can run for minutes or forever on a
pathological answer, often inside C code that no Python signal interrupts (10^{10^{10}} is a
big-integer power). So checks run in `RewardPool` workers: plain subprocesses
(`python -m pipeline_rl.rollouts.rewards MODULE...`) that read one orjson request per line on stdin
and write one orjson reply per line. Nothing is pickled. A check that runs past the limit gets
its worker killed (SIGKILL) and replaced; one that raises is answered with the error text. In
both cases the caller gets a `RewardResult` with `error` set and goes on.

Before a worker reports ready it imports each `preload` entry, a module or `module:function`
(a warm-up function, called once with no arguments), so imports and first-call costs do not
count against a check's time limit. A worker's stdout is its reply channel: anything the check
prints goes to stderr instead. A worker dies with its parent (PR_SET_PDEATHSIG on Linux, and
EOF on stdin) and has an address-space limit of WORKER_MEMORY_BYTES.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import os
import queue
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson

WORKER_MEMORY_BYTES = 4 << 30
"""Address-space limit of a worker: a check that tries to build a huge object fails with MemoryError."""
START_TIMEOUT_S = 120.0
"""Longest a new worker may take to import its preload modules."""
ERROR_CHARS = 500


@dataclass
class RewardResult:
    value: Any
    """What the check returned (None on error)."""
    error: str | None = None
    """Why there is no value: the exception text, a timeout, or a dead worker."""
    seconds: float = 0.0


class RewardWorker:
    """One worker process; not thread-safe (the pool hands it to one caller at a time)."""

    def __init__(self, preload: tuple[str, ...] = ()):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        # The worker imports the same modules as this process, including ones found via sys.path edits.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline_rl.rollouts.rewards", *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both are PIPE
        self._stdin, self._stdout = self.proc.stdin, self.proc.stdout
        self._buffer = b""
        self._ready = False

    def _read_line(self, deadline: float) -> bytes | None:
        """One reply line, None at the deadline; raises EOFError when the worker has exited."""
        fd = self._stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            readable, _, _ = select.select([fd], [], [], left)
            if readable:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise EOFError(f"reward worker exited with code {self.proc.wait()}")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, function: str, args: list, timeout_s: float) -> RewardResult:
        """Run `function` ("module:function") on `args` (JSON values) within `timeout_s`."""
        try:
            if not self._ready:
                line = self._read_line(time.monotonic() + START_TIMEOUT_S)
                if line is None:
                    self.kill()
                    return RewardResult(None, f"reward worker did not start within {START_TIMEOUT_S:g} s")
                self._ready = True
            start = time.monotonic()
            self._stdin.write(orjson.dumps({"function": function, "args": args}) + b"\n")
            self._stdin.flush()
            line = self._read_line(start + timeout_s)
        except (EOFError, BrokenPipeError) as e:
            self.kill()
            return RewardResult(None, f"reward worker died: {e}")
        elapsed = time.monotonic() - start
        if line is None:
            self.kill()
            return RewardResult(None, f"{function} timed out after {timeout_s:g} s", elapsed)
        reply = orjson.loads(line)
        return RewardResult(reply.get("value"), reply.get("error"), elapsed)

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self._stdin, self._stdout):
            try:
                pipe.close()
            except OSError:
                pass


class RewardPool:
    """`workers` worker processes; calls wait for a free one, then get `timeout_s` each."""

    def __init__(self, workers: int, timeout_s: float, preload: tuple[str, ...] = ()):
        if workers < 1:
            raise ValueError(f"a reward pool needs at least 1 worker, got {workers}")
        self.timeout_s = timeout_s
        self.preload = tuple(preload)
        self.restarts = 0
        self._idle: queue.Queue[RewardWorker] = queue.Queue()
        self._all = [RewardWorker(self.preload) for _ in range(workers)]
        for worker in self._all:
            self._idle.put(worker)
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="reward")

    def call(self, function: str, *args: Any) -> RewardResult:
        worker = self._idle.get()
        try:
            return worker.call(function, list(args), self.timeout_s)
        finally:
            if not worker.alive:
                self.restarts += 1
                fresh = RewardWorker(self.preload)
                self._all[self._all.index(worker)] = fresh
                worker = fresh
            self._idle.put(worker)

    async def acall(self, function: str, *args: Any) -> RewardResult:
        """`call` without blocking the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(self.call, function, *args))

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        for worker in self._all:
            worker.kill()


def call_checked(fn: Callable[..., Any], *args: Any) -> RewardResult:
    """Run a cheap in-process check (one that cannot hang, e.g. a string comparison) and turn
    an exception into an error result, like the pool does."""
    start = time.monotonic()
    try:
        return RewardResult(fn(*args), None, time.monotonic() - start)
    except Exception as e:
        return RewardResult(None, _error_text(e), time.monotonic() - start)


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:ERROR_CHARS]


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _serve(preload: list[str]) -> None:
    import resource

    _die_with_parent()
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    for entry in preload:
        module, _, warm_up = entry.partition(":")
        loaded = importlib.import_module(module)
        if warm_up:
            getattr(loaded, warm_up)()
    replies.write(b'{"ready":true}\n')
    replies.flush()
    functions: dict[str, Callable] = {}
    for line in sys.stdin.buffer:
        try:
            request = orjson.loads(line)
            name = request["function"]
            if name not in functions:
                module, _, attr = name.partition(":")
                functions[name] = getattr(importlib.import_module(module), attr)
            reply = orjson.dumps({"value": functions[name](*request["args"])})
        except Exception as e:
            reply = orjson.dumps({"error": _error_text(e)})
        replies.write(reply + b"\n")
        replies.flush()


if __name__ == "__main__":
    _serve(sys.argv[1:])
