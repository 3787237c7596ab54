"""The experts the engine's routers chose for each generated token (routing replay).

vLLM's own capture (`enable_return_routed_experts`) needs its GPU model runner (V2); the CPU
runner has none. Every vLLM MoE layer's router takes a capture function that receives the
expert ids it picked for the rows of the forward pass (`set_capture_fn`, before any expert
placement mapping): `RouteRecorder` sets one on each MoE layer and, after each forward pass,
files the rows under their requests by sequence position (the runner's batch order, query
start offsets and positions of that pass). A generated token's routes are those of the forward
pass that read it, the step after it was sampled, so the last token of a completion has none
(`NO_ROUTE`): nothing the trainer scores depends on them. Prompt positions are dropped: the
trainer routes the prompt itself.

Routes are uint8, one (layers, top_k) block per token (their wire form: core/routes.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pipeline_rl.core.routes import NO_ROUTE


@dataclass(frozen=True)
class RouteShape:
    """What one token's routes hold."""

    layers: int
    """MoE layers of the model, in order."""
    top_k: int
    """Experts each router picks per token."""


def vllm_routers(model: torch.nn.Module) -> list[Any]:
    """The routers of a vLLM model's MoE layers, in layer order (empty for a dense model)."""
    return [m.router for m in model.modules() if hasattr(getattr(m, "router", None), "set_capture_fn")]


class RouteRecorder:
    """Records, per engine request, the routes of each sequence position its forward passes read.
    Installed on the model runner of an in-process engine (one worker); `routes` hands a finished
    request's completion routes over and forgets the request."""

    def __init__(self, runner: Any, top_k: int) -> None:
        routers = vllm_routers(runner.model)
        if not routers:
            raise ValueError("routing replay needs a mixture-of-experts model; the engine's model has no MoE layer")
        self.shape = RouteShape(len(routers), top_k)
        self._runner = runner
        self._pass: list[torch.Tensor | None] = [None] * len(routers)
        self._by_request: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        for layer, router in enumerate(routers):
            router.set_capture_fn(lambda ids, layer=layer: self._capture(layer, ids))
        self._call = runner.execute_model
        runner.execute_model = self._execute_model

    def _capture(self, layer: int, ids: torch.Tensor) -> None:
        # the router's output buffer can be reused by the next layer: keep a copy
        self._pass[layer] = ids.to(torch.uint8, copy=True)

    def _execute_model(self, *args, **kwargs):
        self._pass = [None] * self.shape.layers
        result = self._call(*args, **kwargs)
        if self._pass[0] is not None:
            self._file_pass()
        return result

    def _file_pass(self) -> None:
        runner = self._runner
        num_reqs = runner.input_batch.num_reqs
        starts = runner.query_start_loc.cpu[: num_reqs + 1].tolist()
        positions = runner.positions[: starts[-1]].numpy()
        missing = [layer for layer, ids in enumerate(self._pass) if ids is None]
        if missing:
            raise RuntimeError(f"routing replay: MoE layers {missing} recorded no routes in a forward pass")
        routes = torch.stack([ids[: starts[-1]] for ids in self._pass if ids is not None], dim=1).numpy()
        for i, req_id in enumerate(runner.input_batch.req_ids[:num_reqs]):
            rows = slice(starts[i], starts[i + 1])
            self._by_request.setdefault(req_id, []).append((positions[rows].copy(), routes[rows]))

    def routes(self, engine_id: str, prompt_len: int, tokens: int) -> np.ndarray:
        """The routes of a finished request's `tokens` completion tokens: uint8 (tokens, layers,
        top_k), NO_ROUTE where none was recorded. A position read twice (recomputed after a
        preemption) keeps its latest routes."""
        out = np.full((tokens, self.shape.layers, self.shape.top_k), NO_ROUTE, dtype=np.uint8)
        for positions, routes in self._by_request.pop(engine_id, []):
            index = positions - prompt_len
            keep = (index >= 0) & (index < tokens)
            out[index[keep]] = routes[keep]
        return out

    def forget(self, engine_id: str) -> None:
        """Drop an aborted request's routes."""
        self._by_request.pop(engine_id, None)
