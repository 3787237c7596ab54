"""One process of a run on a Ray node: the Ray driver makes each pool process (and the Redis
server) an actor of this class, which runs the same command line the one-node launcher runs.

The child gets SIGTERM when the Ray worker that started it dies (PR_SET_PDEATHSIG; the worker
dies with its node's raylet, or when the driver goes), and runs in its own session so that a
stop reaches its own children (vLLM workers, reward workers). The class imports no Ray: the
driver wraps it with `ray.remote`. Its methods are async so that `signal` runs while `run`
waits, on the one event-loop thread that also started the child (the death signal follows the
thread that forked, which must outlive the child).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from pipeline_rl.launch.supervisor import die_with_parent, last_lines

POLL_S = 0.2
"""How often `run` looks at the child."""


class ProcessHost:
    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], cwd: str, log_path: str, unset: tuple[str, ...] = ()
    ):
        self.name, self.argv, self.env, self.cwd, self.unset = name, argv, env, cwd, unset
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None

    async def run(self) -> tuple[int, str]:
        """Start the child, wait for it; (its exit code, the last lines of its log as this node
        sees them: the driver's node may not see them when run_dir is not shared)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in self.unset} | self.env
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                env=env,
                # The driver's working directory when this node has it (a shared checkout), so
                # relative paths of the config mean the same on every node.
                cwd=self.cwd if os.path.isdir(self.cwd) else None,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent if sys.platform == "linux" else None,
            )
        while (code := self.proc.poll()) is None:
            await asyncio.sleep(POLL_S)
        return code, last_lines(self.log_path)

    async def signal(self, sig: int) -> None:
        """Send `sig` to the child's process group (a no-op once it has exited)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
