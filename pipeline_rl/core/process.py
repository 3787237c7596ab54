"""What every pool process shares: its command line, logging, stop signals, and the one-line
failure report the launcher shows.

`python -m pipeline_rl.<pool> --run-dir RUN_DIR --index I` checks that RUN_DIR is the directory
its launcher prepared (pipeline_rl/launch/run_dir.py), reads RUN_DIR/config.yaml and runs the
pool's body on its view of it (pipeline_rl/config/pool_view.py: the other pools' sections
withheld) until it returns or SIGTERM/SIGINT asks it to stop (then it exits 0). It then ends
through `exit_process`, without the interpreter's teardown.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from pipeline_rl.config import RunConfig, load_saved_config
from pipeline_rl.config.pool_view import for_pool
from pipeline_rl.weight_sync.group import PeerGone
from pipeline_rl.wire import LAUNCHED_AT_ENV, RUN_NONCE_ENV, RUN_NONCE_FILE, ExitCode

log = logging.getLogger(__name__)

Body = Callable[[RunConfig, int, Callable[[], bool]], str]
"""(config, index, stop) -> a summary line logged on a clean exit."""


def launched_at() -> float | None:
    """When the launcher started the run (wire.LAUNCHED_AT_ENV), or None when started by hand."""
    value = os.environ.get(LAUNCHED_AT_ENV)
    return float(value) if value else None


class RunDirNotShared(RuntimeError):
    """A process does not see the run directory its launcher prepared."""


def check_run_dir(run_dir: Path, process: str, env: dict[str, str] | None = None) -> None:
    """Raise RunDirNotShared unless `run_dir` holds the nonce the launcher put in RUN_NONCE_ENV.
    A process started by hand (no RUN_NONCE_ENV) is not checked."""
    expected = (os.environ if env is None else env).get(RUN_NONCE_ENV)
    if expected is None:
        return
    try:
        found = (run_dir / RUN_NONCE_FILE).read_text().strip()
    except OSError as e:
        seen = f"it cannot read {run_dir / RUN_NONCE_FILE} ({type(e).__name__})"
    else:
        if found == expected:
            return
        seen = f"{run_dir / RUN_NONCE_FILE} holds another run's nonce"
    raise RunDirNotShared(
        f"{process} on {socket.gethostname()} does not see the run directory the launcher prepared: {seen}. "
        f"run_dir ({run_dir}) must be on a file system every node shares, at the same path"
    )


def run_pool_process(pool: str, body: Body, argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=f"One {pool} process of a pipeline_rl run (launch.py starts it).")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--index", required=True, type=int, help=f"index of this {pool} in its pool")
    args = parser.parse_args(argv)
    name = f"{pool}{args.index}"
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        check_run_dir(args.run_dir, name)
        cfg = load_saved_config(args.run_dir / "config.yaml")
        cfg.run_dir = str(args.run_dir)
        summary = body(for_pool(cfg, pool), args.index, stopping.is_set)
    except Exception as e:
        log.exception("%s failed", name)
        print(f"{name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return ExitCode.PEER_GONE if isinstance(e, PeerGone) else ExitCode.FAILED
    log.info("%s", summary)
    return ExitCode.OK


def exit_process(code: int) -> NoReturn:
    """End a process of the run (a pool process, or the launcher once the run has stopped) with
    `code`, skipping the interpreter's teardown. Streams and logs are closed by then; the exit
    handlers (reward worker pools, MCP servers, the engine's own, Ray's) still run here. What is
    skipped is freeing every module and tensor one by one, which takes seconds after a vLLM
    engine or a DeepSpeed trainer, and the launcher waits for a process to end before it stops
    the run or restarts a pool."""
    atexit._run_exitfuncs()  # what the interpreter runs first at exit
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
