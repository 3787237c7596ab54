"""Options that depend on the model's architecture, checked against its config.json: a
mixture-of-experts option on a dense model, or a dense-only one on an MoE model, fails at launch
naming the key, not in a pool minutes later."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline_rl.config.schema import RunConfig
from pipeline_rl.config.validate import ConfigError

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""config.json keys that give a model's routed experts (Qwen-MoE, Mixtral, DeepSeek)."""
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


def experts(model_dir: str | Path) -> int:
    """Routed experts per MoE layer of the model at `model_dir` (0: dense)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return max(int(config.get(key) or 0) for key in EXPERT_KEYS)


def check_model_fit(cfg: RunConfig) -> None:
    """Raise ConfigError when an option does not fit cfg.model.path's architecture (nothing to
    check while the model is not there yet)."""
    if not (Path(cfg.model.path) / "config.json").exists():
        return
    moe = experts(cfg.model.path) > 0
    if cfg.shared.routing_replay and not moe:
        raise ConfigError(
            f"'shared.routing_replay' is set, but model.path={cfg.model.path} is a dense model "
            f"(its config.json has none of {', '.join(EXPERT_KEYS)})"
        )
    if moe and cfg.model.lora is not None:
        fused = sorted(set(cfg.model.lora.target_modules) & set(MLP_MODULES))
        if fused:
            raise ConfigError(
                f"bad value for 'model.lora.target_modules': {fused} are the experts' MLPs on the "
                f"mixture-of-experts model {cfg.model.path}, whose experts are fused tensors LoRA cannot "
                "target; keep the attention projections"
            )
