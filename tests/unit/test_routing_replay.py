"""The trainer's routing replay (pipeline_rl/trainer/routing_replay.py) on a tiny transformers
Qwen3-MoE: given routes decide the experts, the router's probabilities at them are still
trained, and unrecorded tokens keep the trainer's own routing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline_rl.core.routes import NO_ROUTE, encode_routes
from pipeline_rl.demo.tiny_model import make_tokenizer
from pipeline_rl.demo.tiny_moe import EXPERTS, TOP_K, make_moe_model
from pipeline_rl.trainer.routing_replay import RoutingReplay, moe_routers

T = 12


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return make_moe_model(make_tokenizer(), layers=2).float().eval()


def own_routes(model, ids) -> np.ndarray:
    """(tokens, layers, top_k) experts the model's routers pick."""
    picked = []
    hooks = [r.register_forward_hook(lambda m, a, out: picked.append(out[2].clone())) for r in moe_routers(model)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return torch.stack(picked, 1).numpy().astype(np.uint8)


def test_replayed_routes_decide_the_experts_and_unrecorded_tokens_keep_their_own(model):
    ids = torch.randint(2, 200, (1, T), generator=torch.Generator().manual_seed(1))
    replay = RoutingReplay(model)
    assert replay.width == 2 * TOP_K
    with torch.no_grad():
        plain = model(ids).logits
    own = own_routes(model, ids)
    # the model's own routes, replayed: the same network
    replay.set(encode_routes(own), T, "here", torch.device("cpu"))
    with torch.no_grad():
        same = model(ids).logits
    torch.testing.assert_close(same, plain, rtol=0, atol=1e-6)
    # other experts for the second half of the tokens: those tokens' outputs change, the first
    # half's cannot (causal), and the routers report the given experts
    other = own.copy()
    other[T // 2 :] = (own[T // 2 :] + 1) % EXPERTS
    other[: T // 2] = NO_ROUTE
    replay.set(encode_routes(other), T, "here", torch.device("cpu"))
    with torch.no_grad():
        moved = model(ids).logits
    seen = own_routes(model, ids)
    assert (seen[T // 2 :] == other[T // 2 :]).all() and (seen[: T // 2] == own[: T // 2]).all()
    torch.testing.assert_close(moved[0, : T // 2], plain[0, : T // 2], rtol=0, atol=1e-6)
    assert (moved[0, T // 2 :] - plain[0, T // 2 :]).abs().max() > 1e-3
    replay.set(None, T, "here", torch.device("cpu"))


def test_the_router_is_trained_at_the_replayed_experts(model):
    ids = torch.randint(2, 200, (1, T), generator=torch.Generator().manual_seed(2))
    replay = RoutingReplay(model)
    given = (own_routes(model, ids).astype(np.int64) + 3) % EXPERTS
    replay.set(encode_routes(given.astype(np.uint8)), T, "here", torch.device("cpu"))
    router = moe_routers(model)[0]
    model.zero_grad()
    model(ids).logits.logsumexp(-1).sum().backward()
    # the replayed experts' weights come from the router's softmax: it still learns
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    replay.set(None, T, "here", torch.device("cpu"))
    model.zero_grad()


def test_routes_of_another_shape_are_refused_naming_the_micro_batch(model):
    replay = RoutingReplay(model)
    wrong = np.zeros((T, 3), dtype=np.uint8)
    with pytest.raises(
        ValueError, match=r"step 3, micro-batch 1: routes of 3 bytes per token; .* 2 MoE layers x top-2 = 4"
    ):
        replay.set(encode_routes(wrong), T, "step 3, micro-batch 1", torch.device("cpu"))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        RoutingReplay(torch.nn.Linear(2, 2))


def test_the_counts_say_how_many_routes_the_replay_moved(model):
    """Token-layer pairs the engine's routes decided, and those whose experts differ from the
    router's own pick; a forward run again for the same micro-batch (gradient checkpointing's
    recompute) is not counted twice."""
    ids = torch.randint(2, 200, (1, T), generator=torch.Generator().manual_seed(3))
    replay = RoutingReplay(model)
    own = own_routes(model, ids)
    layers = len(replay.routers)
    replay.set(encode_routes(own), T, "here", torch.device("cpu"))
    with torch.no_grad():
        model(ids)
    assert replay.take_counts() == (T * layers, 0)
    # Every expert moved by one (a different pair of 8) on the second half; the first half unrecorded.
    other = (own + 1) % EXPERTS
    other[: T // 2] = NO_ROUTE
    replay.set(encode_routes(other.astype(np.uint8)), T, "here", torch.device("cpu"))
    with torch.no_grad():
        model(ids)
        model(ids)
    assert replay.take_counts() == (T // 2 * layers, T // 2 * layers)
    assert replay.take_counts() == (0, 0)
    replay.set(None, T, "here", torch.device("cpu"))
