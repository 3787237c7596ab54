"""What every pool process shares: its command line, logging, stop signals, and the one-line
failure report the launcher shows.

`python -m pipeline_rl.<pool> --run-dir RUN_DIR --index I` checks that RUN_DIR is the directory
its launcher prepared (pipeline_rl/launch/run_dir.py), reads RUN_DIR/config.yaml and runs the
pool's body until it returns or SIGTERM/SIGINT asks it to stop (then it exits 0).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from pipeline_rl.config import RunConfig, load_saved_config
from pipeline_rl.launch.run_dir import check_run_dir
from pipeline_rl.launch.supervisor import PEER_GONE_EXIT
from pipeline_rl.weight_sync.group import PeerGone

log = logging.getLogger(__name__)

Body = Callable[[RunConfig, int, Callable[[], bool]], str]
"""(config, index, stop) -> a summary line logged on a clean exit."""


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
        summary = body(cfg, args.index, stopping.is_set)
    except Exception as e:
        log.exception("%s failed", name)
        print(f"{name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return PEER_GONE_EXIT if isinstance(e, PeerGone) else 1
    log.info("%s", summary)
    return 0
