"""The run directory: prepared by the launcher (one node) or the Ray driver alone, and checked by
every pool process (core/process.py checks it).

Only one process ever prepares it (the `--fresh` wipe, `config.yaml`), so a node that starts
late cannot delete or rewrite what another node's processes already use. `config.yaml` is
written to a temporary file and renamed, so a reader sees the old file or the new one, never a
half-written one. A fresh random nonce is written for every start; the launcher hands it to
each process (`wire.RUN_NONCE_ENV`), which refuses to start unless it reads the same nonce from
the run directory it was given: on several nodes that catches a `run_dir` that is not on a file
system every node shares (each node would otherwise write its own checkpoints, logs and
streams, and a resume would find none of them).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path

from pipeline_rl.config import ConfigError, RunConfig, save_config
from pipeline_rl.wire import RUN_NONCE_FILE


def prepare_run_dir(cfg: RunConfig, fresh: bool) -> tuple[bool, str]:
    """Create or reuse the run directory and write its config and a new nonce.
    Returns (whether this is a resume, the nonce)."""
    run_dir = Path(cfg.run_dir)
    saved = run_dir / "config.yaml"
    if fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    elif run_dir.exists() and not saved.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"run_dir {run_dir} exists and is not a pipeline_rl run; choose another run_dir")
    resumed = saved.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".config.", suffix=".yaml", delete=False) as tmp:
        pass
    try:
        save_config(cfg, Path(tmp.name))
        os.replace(tmp.name, saved)
    finally:
        Path(tmp.name).unlink(missing_ok=True)
    nonce = secrets.token_hex(16)
    (run_dir / RUN_NONCE_FILE).write_text(nonce)
    return resumed, nonce
