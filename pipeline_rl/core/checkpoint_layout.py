"""Where a run's checkpoints are and which is the newest: the read side of the layout the
trainer writes (trainer/checkpoint.py), shared with the actors, which start from the newest.

RUN_DIR/checkpoints/step_N/ holds the policy (hf/, or adapter/ with LoRA), the optimizer state
and state.json; the file `latest` names the newest complete one and is written last.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

LATEST = "latest"
STATE = "state.json"
HF_DIR = "hf"
ADAPTER_DIR = "adapter"


def checkpoints_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_dir(run_dir: str | os.PathLike) -> tuple[Path, dict[str, Any]] | None:
    """The newest complete checkpoint directory and its state, or None if there is none."""
    root = checkpoints_root(run_dir)
    try:
        name = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    path = root / name
    try:
        state = json.loads((path / STATE).read_text())
    except (FileNotFoundError, json.JSONDecodeError) as e:
        raise RuntimeError(
            f"checkpoint pointer {root / LATEST} names {name!r}, which is not a complete checkpoint ({e})"
        ) from None
    return path, state


def latest_checkpoint(run_dir: str | os.PathLike) -> tuple[Path, int] | None:
    """(the policy's directory: the Hugging Face model, or with LoRA the PEFT adapter; policy
    version) of the newest checkpoint, or None."""
    found = latest_dir(run_dir)
    if found is None:
        return None
    path, state = found
    policy = path / ADAPTER_DIR if (path / ADAPTER_DIR).is_dir() else path / HF_DIR
    return policy, int(state["version"])
