"""Starts a node's processes, watches them, and stops them all together.

Each child runs in its own session (so a stop reaches its own children too) and gets
SIGTERM if the launcher itself dies (PR_SET_PDEATHSIG), so no exit path leaves orphans.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from pipeline_rl.wire import ExitCode

STOP_GRACE_S = 6.0
"""SIGTERM, then SIGKILL after this long: a stop completes well within 10 s."""

PEER_REPORT_WAIT_S = 20.0
"""Long enough for vLLM's worker monitor (up to 9 s) and the actor's exit that follows."""

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to send this process SIGTERM when the thread that forked it dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    expected_exit: bool
    """True for processes whose exit 0 means the run is done (trainers)."""
    argv: list[str]
    env: dict[str, str]


class ChildFailed(Exception):
    def __init__(self, child: Child, code: int):
        self.child, self.code = child, code
        super().__init__(f"{child.name} exited with code {code}")


def last_lines(path: Path, n: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            return b"".join(deque(f, maxlen=n)).decode(errors="replace").rstrip()
    except OSError:
        return "(no log)"


def blame_order(code: int | None) -> tuple[bool, bool]:
    """Sort key of exit codes seen together, the likeliest cause first: a process killed by a
    signal, or whose host is gone (None, on Ray) — its peers' collective errors follow from it,
    and as processes end without the interpreter's teardown they can end within one poll of
    it — then any other exit, an ExitCode.PEER_GONE (a failure the process itself blames on a peer)
    last."""
    killed = code is None or code < 0
    return not killed, code == ExitCode.PEER_GONE


def describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    if code == ExitCode.PEER_GONE:
        return f"exit code {code} (a weight-update peer is gone)"
    return f"exit code {code}"


class Supervisor:
    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.children: list[Child] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def spawn(self, name: str, argv: list[str], env: dict[str, str], expected_exit: bool = False) -> Child:
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                argv,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent if sys.platform == "linux" else None,
            )
        child = Child(name, proc, log_path, expected_exit, argv, env)
        self.children.append(child)
        return child

    def respawn(self, names: set[str]) -> None:
        """Kill the children called `names` (their process groups; at once: a rank whose peer
        died cannot checkpoint anyway) and start each again with its command line."""
        old = [c for c in self.children if c.name in names]
        for child in old:
            try:
                os.killpg(child.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            child.proc.wait()
        self.children = [c for c in self.children if c.name not in names]
        for child in old:
            self.spawn(child.name, child.argv, child.env, child.expected_exit)

    def poll(self) -> tuple[ChildFailed | None, bool]:
        """(the failure to blame first (`blame_order`), or None; whether every expected-exit child
        finished with 0)."""
        done = True
        failures = []
        for child in self.children:
            code = child.proc.poll()
            if code is None:
                done = done and not child.expected_exit
            elif code != 0 or not child.expected_exit:
                failures.append(ChildFailed(child, code))
        if failures:
            return min(failures, key=lambda f: blame_order(f.code)), False
        return None, done and any(c.expected_exit for c in self.children)

    def signal_all(self, sig: int, names: set[str] | None = None) -> None:
        for child in self.children:
            if child.proc.poll() is None and (names is None or child.name in names):
                try:
                    os.killpg(child.proc.pid, sig)
                except ProcessLookupError:
                    pass

    def stop(self, first: set[str] | None = None, first_grace_s: float = 0.0, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to `first` (e.g. trainers, so they checkpoint) with up to first_grace_s to exit,
        then to the rest with grace_s of their own (a process hung in a plug-in never exits on
        SIGTERM: it must not get the trainers' time), then SIGKILL."""
        if first:
            deadline = time.time() + first_grace_s
            self.signal_all(signal.SIGTERM, first)
            while time.time() < deadline and any(c.proc.poll() is None for c in self.children if c.name in first):
                time.sleep(0.1)
        self.signal_all(signal.SIGTERM)
        deadline = time.time() + grace_s
        while time.time() < deadline and any(c.proc.poll() is None for c in self.children):
            time.sleep(0.1)
        self.signal_all(signal.SIGKILL)
        for child in self.children:
            try:
                os.killpg(child.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            child.proc.wait()
