"""transformers holds a mixture-of-experts layer's experts fused, `...mlp.experts.gate_up_proj`
(experts, 2 x intermediate, hidden) and `...mlp.experts.down_proj` (experts, hidden,
intermediate), while its checkpoints and the engine's loader name one tensor per expert and
projection (`...mlp.experts.E.gate_proj.weight`). The trainer sends what it holds; `per_expert`
gives the engine the checkpoint's names, as views of the fused tensors (nothing copied)."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

FUSED = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def per_expert(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """`named` with every fused expert tensor split into the checkpoint's per-expert tensors."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in named:
        match = FUSED.match(name)
        if match is None or tensor.dim() != 3:
            out.append((name, tensor))
            continue
        prefix = match["prefix"]
        for e in range(tensor.shape[0]):
            if match["kind"] == "gate_up_proj":
                gate, up = tensor[e].chunk(2, dim=0)  # transformers: the gate's rows first
                out += [(f"{prefix}.{e}.gate_proj.weight", gate), (f"{prefix}.{e}.up_proj.weight", up)]
            else:
                out.append((f"{prefix}.{e}.down_proj.weight", tensor[e]))
    return out
