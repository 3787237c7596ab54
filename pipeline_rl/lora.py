"""LoRA: the contract between the trainer, which trains low-rank adapters on a frozen base
with peft, and the actors' engines, which serve them (engine/adapter_slot.py).

What crosses between them is an adapter in PEFT's saved form: tensors named as in
`adapter_model.safetensors` (`base_model.model.<module>.lora_A.weight`, [rank, in], and
`...lora_B.weight`, [out, rank], unscaled) and an `adapter_config.json` (rank, alpha, target
modules). The weight broadcast carries those tensors under those names; a checkpoint holds them
as a PEFT adapter directory; an engine starts from one (a zero adapter, `write_zero_adapter`,
before the first update: its output is the base model's, as is a freshly initialised peft
adapter's, whose B is zero).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from pipeline_rl.config import LoraConfig

ADAPTER_NAME = "default"
"""peft's name of the one adapter; its parameter names carry it (`lora_A.default.weight`),
PEFT's saved form does not."""
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def peft_config(lora: LoraConfig, base_path: str | None = None) -> Any:
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_path,
    )


def wrap(model: torch.nn.Module, lora: LoraConfig, dtype: torch.dtype | None = None) -> Any:
    """The model with peft adapters on `lora.target_modules`; only they require grad. Raises
    ValueError naming a target module the model has no linear layer of.

    With `dtype` the adapters are made of it. peft makes them float32 whatever the base; in a
    bfloat16 model each adapter then casts its input to float32 and autograd keeps that copy
    (two thirds of the layers' own activations on the GPU check's shape: docs/gpu.md), and the
    adapter's matmuls run in float32."""
    from peft import get_peft_model

    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = sorted(set(lora.target_modules) - linear)
    if missing:
        raise ValueError(
            f"bad value for 'model.lora.target_modules': {missing} name no linear layer of the model "
            f"(its linear layers: {sorted(linear)})"
        )
    wrapped = get_peft_model(model, peft_config(lora))  # pyright: ignore[reportArgumentType]
    if dtype is not None:
        for p in wrapped.parameters():
            if p.requires_grad:
                p.data = p.data.to(dtype)
    return wrapped


def saved_name(parameter_name: str) -> str:
    """PEFT's saved name of an adapter parameter (without the adapter's name)."""
    return parameter_name.replace(f".{ADAPTER_NAME}.", ".")


def trained_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters an update carries, with the names they travel under: all of a plain
    model's, by their Hugging Face names; of a peft model, the adapter's, by PEFT's saved names."""
    named = list(model.named_parameters())
    if not is_peft(model):
        return named
    return [(saved_name(name), p) for name, p in named if p.requires_grad]


def is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def adapter_shapes(model_path: str | Path, lora: LoraConfig) -> dict[str, list[int]]:
    """Saved name -> shape of every adapter tensor that peft gives the model at `model_path` with
    `lora` (computed on the meta device: nothing is loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        wrapped = wrap(model, lora)
    return {name: list(p.shape) for name, p in trained_parameters(wrapped)}


def write_adapter(out_dir: Path, tensors: Iterable[tuple[str, torch.Tensor]], lora: LoraConfig, base_path: str) -> None:
    """A PEFT adapter directory: adapter_config.json and adapter_model.safetensors."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({name: t.detach().cpu().contiguous() for name, t in tensors}, str(out_dir / WEIGHTS_FILE))
    peft_config(lora, base_path).save_pretrained(str(out_dir))


def write_zero_adapter(out_dir: Path, model_path: str | Path, lora: LoraConfig, dtype: torch.dtype) -> Path:
    """The adapter an engine serves before the first update: all zeros, so the base model's
    output, as a fresh peft adapter gives."""
    shapes = adapter_shapes(model_path, lora)
    write_adapter(out_dir, ((n, torch.zeros(s, dtype=dtype)) for n, s in shapes.items()), lora, str(model_path))
    return out_dir


def merge(adapter_dir: Path, base_path: str | Path, out_dir: Path) -> None:
    """Write the base model with the adapter merged into its weights: a plain Hugging Face model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()  # pyright: ignore[reportArgumentType]
    merged.save_pretrained(str(out_dir))
