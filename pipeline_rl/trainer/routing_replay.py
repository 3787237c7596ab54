"""Routing replay in the trainer: each MoE layer sends a token to the experts the engine's
router chose for it (the micro-batch's routes), not to those its own router would choose; the
router's probabilities are still computed, at those experts, so the router is trained as before.
Tokens without a recorded route (NO_ROUTE: prompt, environment and padding tokens) are routed
by the trainer's router.

A forward hook on each router module (transformers' Mixture-of-experts routers return
(logits, top-k weights, top-k indices)) rewrites the weights and indices from the logits. The
routes stay set from one micro-batch's forward through its backward, when gradient
checkpointing runs the forward again.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pipeline_rl.core.routes import NO_ROUTE, decode_routes


def moe_routers(model: torch.nn.Module) -> list[Any]:
    """The router modules of a transformers MoE model, in layer order: each MoE block's `gate`
    with a `top_k` (empty for a dense model)."""
    return [m for name, m in model.named_modules() if name.endswith("mlp.gate") and hasattr(m, "top_k")]


class RoutingReplay:
    """Replays given routes in every router of `model` (hooks registered once)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(
                "shared.routing_replay needs a mixture-of-experts model: the trainer's model has no router"
            )
        self.top_k = int(self.routers[0].top_k)
        self.width = len(self.routers) * self.top_k
        """Bytes of one token's routes."""
        self._routes: torch.Tensor | None = None
        """(tokens, layers, top_k) expert ids (long), NO_ROUTE where the router decides."""
        self._counted: set[int] = set()
        """Layers whose routes of the current micro-batch are counted (checkpointing runs a
        forward twice)."""
        self._counts: list[torch.Tensor] = []
        """Per counted layer forward: (token-layer pairs routed by the engine's routes, those of
        them whose experts differ from the ones the trainer's router picked), kept on the device
        so counting never waits for it."""
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(lambda module, args, output, layer=layer: self._replay(module, layer, output))

    def set(self, routes: str | None, tokens: int, where: str, device: torch.device) -> None:
        """Route the next forward passes' `tokens` tokens by `routes` (a micro-batch's; None:
        every token by the trainer's routers). Raises ValueError naming `where` when they are not
        this model's routes."""
        self._counted.clear()
        if routes is None:
            self._routes = None
            return
        rows = decode_routes(routes, tokens, where)
        if rows.shape[1] != self.width:
            raise ValueError(
                f"{where}: routes of {rows.shape[1]} bytes per token; the trainer's model has "
                f"{len(self.routers)} MoE layers x top-{self.top_k} = {self.width}"
            )
        table = torch.from_numpy(rows.reshape(tokens, len(self.routers), self.top_k).astype(np.int64))
        self._routes = table.to(device)

    def take_counts(self) -> tuple[int, int]:
        """(replayed, moved) token-layer pairs since the last call, and start counting again."""
        if not self._counts:
            return 0, 0
        replayed, moved = torch.stack(self._counts).sum(dim=0).tolist()
        self._counts = []
        return int(replayed), int(moved)

    def _replay(self, module: torch.nn.Module, layer: int, output: Any) -> Any:
        if self._routes is None:
            return output
        logits, weights, indices = output
        given = self._routes[:, layer, :]
        if given.shape[0] != indices.shape[0]:
            raise ValueError(f"routing replay: routes for {given.shape[0]} tokens, the router saw {indices.shape[0]}")
        recorded = given != NO_ROUTE
        chosen = torch.where(recorded, given, indices)
        if layer not in self._counted:
            self._counted.add(layer)
            rows = recorded.all(dim=-1)
            same = (given.sort(dim=-1).values == indices.sort(dim=-1).values).all(dim=-1)
            self._counts.append(torch.stack([rows.sum(), (rows & ~same).sum()]))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        picked = probs.gather(-1, chosen)
        if getattr(module, "norm_topk_prob", False):
            picked = picked / picked.sum(dim=-1, keepdim=True)
        return logits, picked.to(weights.dtype), chosen.to(indices.dtype)
