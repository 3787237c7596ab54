"""Weight swaps into vLLM's CPU mixture-of-experts layers.

The CPU MoE kernel computes from expert weights that vLLM repacks after loading, in a layout
chosen by the instruction set (`prepack_moe_weight`): a copy of new weights into them would be
read in the wrong layout. `ExpertRepack` gives each such layer unpacked staging tensors of the
packed ones' shapes; the copy plan writes the staging tensors (the views its loaders chose, on
the unpacked layout they assume) and, after each update, the staging tensors are repacked into
the layer's weights in place, so the kernel sees the new experts at its next forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class _Packed:
    layer: torch.nn.Module
    isa: str
    staging: dict[str, torch.Tensor]
    """Per packed parameter name (w13_weight, w2_weight), its unpacked staging tensor."""


PACKED = ("w13_weight", "w2_weight")


def _cpu_experts(layer: torch.nn.Module) -> Any:
    """The layer's CPU unquantized experts kernel when it repacked the weights, else None."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    experts = getattr(getattr(kernel, "impl", None), "fused_experts", None)
    if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
        return None  # zentorch computes from the weights as loaded
    return experts


class ExpertRepack:
    """The CPU MoE layers of an engine's model whose weights the kernel repacked."""

    def __init__(self, layers: list[_Packed]) -> None:
        self.layers = layers

    @classmethod
    def of(cls, model: torch.nn.Module) -> ExpertRepack:
        """Find the repacked layers (none on GPU, or for a dense model). Raises ValueError when
        vLLM padded a layer's intermediate size (the loaders' views then do not fit the
        packed shape)."""
        if next(model.parameters()).device.type != "cpu":
            return cls([])
        layers = []
        for name, layer in model.named_modules():
            if not all(p in layer._parameters for p in PACKED):
                continue
            experts = _cpu_experts(layer)
            if experts is None:
                continue
            config = experts.moe_config
            if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
                raise ValueError(f"{name}: vLLM padded the experts' intermediate size; swaps cannot copy into it")
            staging = {p: torch.empty_like(getattr(layer, p)) for p in PACKED}
            layers.append(_Packed(layer, experts.isa, staging))
        return cls(layers)

    def redirect(self, dst: torch.Tensor) -> torch.Tensor:
        """The staging view standing for `dst` when `dst` is a view of a packed weight, else `dst`."""
        for packed in self.layers:
            for name, staging in packed.staging.items():
                weight = packed.layer._parameters[name]
                assert weight is not None
                if dst.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr():
                    offset = dst.storage_offset() - weight.storage_offset()
                    return staging.as_strided(dst.shape, dst.stride(), staging.storage_offset() + offset)
        return dst

    def repack(self) -> None:
        """Repack every staging tensor into its layer's weight, in place (after an update's copies)."""
        for packed in self.layers:
            for name, staging in packed.staging.items():
                torch.ops._C.prepack_moe_weight(staging, packed.layer._parameters[name], packed.isa)
