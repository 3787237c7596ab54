"""The engine an actor starts: the policy of the newest checkpoint (or the model, at version 0),
with LoRA the base model serving the policy's adapter (a zero adapter before any checkpoint)."""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline_rl.config import RunConfig
from pipeline_rl.core.checkpoint_layout import latest_checkpoint
from pipeline_rl.engine.llm_client import LLMClient

log = logging.getLogger("pipeline_rl.actor.actor")

CHECKPOINT_TRIES = 3
"""Engine starts from the newest checkpoint, each after the one before was pruned mid-load."""


def start_engine(cfg: RunConfig, name: str) -> tuple[LLMClient, int]:
    """Actor `name`'s engine and the policy version it serves."""
    run_dir = Path(cfg.run_dir)
    tries_left = CHECKPOINT_TRIES
    while True:
        found = latest_checkpoint(run_dir)
        policy, version = (str(found[0]), found[1]) if found else (cfg.model.path, 0)
        model_path, adapter_dir = policy, None
        if cfg.model.lora is not None:  # the engine serves the base, the policy is its adapter
            model_path, adapter_dir = cfg.model.path, policy if found else str(zero_adapter(cfg, name))
        log.info("starting the engine from %s at version %d", adapter_dir or model_path, version)
        try:
            return LLMClient.create(cfg, model_path, version, adapter_dir), version
        except Exception:
            # The trainer keeps its newest checkpoints only: one can be pruned while an engine
            # loads it (checkpoint_every steps are short). Start from the newest then.
            tries_left -= 1
            if found is None or found[0].exists() or not tries_left:
                raise
            log.warning("checkpoint %s was pruned while the engine loaded it: starting from the newest", found[0])


def zero_adapter(cfg: RunConfig, name: str) -> Path:
    """The adapter of version 0 (zeros: the base model's output, as a fresh peft adapter gives),
    written once per actor into the run directory."""
    import torch

    from pipeline_rl.lora import write_zero_adapter

    assert cfg.model.lora is not None
    out = Path(cfg.run_dir) / "lora" / f"initial_{name}"
    return write_zero_adapter(out, cfg.model.path, cfg.model.lora, getattr(torch, cfg.model.dtype))
