"""The swap's copy plan (engine/engine_weights.py) on small modules with vLLM-style loaders:
a plan replays exactly what the model's own load_weights does, and refuses what it cannot.
The real engine's plan is checked in tests/integration/test_vllm_hook.py and test_tp_swap.py."""

from __future__ import annotations

import pytest
import torch

from pipeline_rl.engine.load_plan import LoadPlan, PlanRefused


class FusedShard(torch.nn.Module):
    """q/k/v fused into one parameter, holding tensor-parallel rank `rank` of `world` (rows of
    each projection), plus an o_proj split by columns and a norm loaded whole: the loaders narrow
    both the parameter and the incoming tensor, as vLLM's do."""

    def __init__(self, hidden: int, rank: int, world: int, transform: str | None = None):
        super().__init__()
        self.hidden, self.rank, self.world, self.transform = hidden, rank, world, transform
        shard = hidden // world
        self.qkv = torch.nn.Parameter(torch.zeros(3 * shard, hidden), requires_grad=False)
        self.o = torch.nn.Parameter(torch.zeros(hidden, shard), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(hidden), requires_grad=False)

    def names(self) -> list[str]:
        return ["q.weight", "k.weight", "v.weight", "o.weight", "norm.weight"]

    def load_weights(self, weights) -> set[str]:
        shard = self.hidden // self.world
        for name, w in weights:
            if name[0] in "qkv":
                i = "qkv".index(name[0])
                src = w.narrow(0, self.rank * shard, shard)
                if self.transform == "scale":
                    src = src * 2
                if self.transform == "setitem":
                    self.qkv.data[i * shard : (i + 1) * shard] = src
                    continue
                self.qkv.data.narrow(0, i * shard, shard).copy_(src)
            elif name == "o.weight":
                self.o.data.copy_(w.narrow(1, self.rank * shard, shard))
            elif name == "norm.weight":
                self.norm.data.copy_(w)
        return set()


def tensors(hidden: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (hidden, hidden), "k": (hidden, hidden), "v": (hidden, hidden), "o": (hidden, hidden)}
    named = [(f"{n}.weight", torch.randn(*s, generator=g)) for n, s in shapes.items()]
    return named + [("norm.weight", torch.randn(hidden, generator=g))]


@pytest.mark.parametrize(("rank", "world"), [(0, 1), (1, 2)])
def test_plan_replays_the_loader_exactly(rank, world):
    hidden = 8
    planned, loaded = FusedShard(hidden, rank, world), FusedShard(hidden, rank, world)
    plan = LoadPlan.capture(planned, tensors(hidden, 0), planned.names())
    storage = [p.data_ptr() for p in planned.parameters()]
    update = tensors(hidden, 1)
    # The update arrives as views into one flat receive buffer, as weight_sync delivers it.
    flat = torch.zeros(3 + sum(t.numel() for _, t in update))
    views, at = [], 3  # not at the buffer's start: offsets are relative to each view
    for name, t in update:
        views.append((name, flat[at : at + t.numel()].view(t.shape)))
        views[-1][1].copy_(t)
        at += t.numel()
    plan.copy(plan.bind(views))
    loaded.load_weights(update)
    for (name, p), q in zip(planned.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), name
    assert [p.data_ptr() for p in planned.parameters()] == storage  # copied in place, nothing reallocated


@pytest.mark.parametrize(("transform", "message"), [("scale", "transformed tensor"), ("setitem", "__setitem__")])
def test_plan_refuses_what_it_cannot_replay(transform, message):
    model = FusedShard(8, 0, 1, transform)
    with pytest.raises(PlanRefused, match=message):
        LoadPlan.capture(model, tensors(8, 0), model.names())


def test_plan_refuses_a_required_name_no_copy_came_from():
    model = FusedShard(8, 0, 1)
    with pytest.raises(PlanRefused, match=r"1 parameter\(s\), e.g. \['extra.weight'\]"):
        LoadPlan.capture(model, tensors(8, 0), [*model.names(), "extra.weight"])


def test_plan_refuses_a_loader_that_fails():
    model = FusedShard(8, 0, 1)
    model.qkv = torch.nn.Parameter(torch.zeros(0), requires_grad=False)  # a CPU linear whose weight was freed
    with pytest.raises(PlanRefused, match="load_weights failed"):
        LoadPlan.capture(model, tensors(8, 0), model.names())


def test_a_gpu_plan_synchronizes_once_after_its_copies(monkeypatch):
    """A caller that does not order the copies itself (a TP worker's load): on CUDA the next
    forward pass may run on another stream, so LoadPlan.copy ends with one device synchronize,
    issued after every copy (scripts/gpu_swap_check.py shows stale reads without any ordering).
    A CPU plan does not synchronize, nor one asked not to (the TP = 1 swap queues its copies on
    the engine's stream: tests/unit/test_swap_streams.py)."""
    dst = torch.zeros(2, 3)
    plan = LoadPlan({"w": [(dst, (2, 3), (3, 1), 0)]})
    calls: list[tuple[object, torch.Tensor]] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append((device, dst.clone())))
    plan.copy(plan.bind([("w", torch.ones(2, 3))]))
    assert calls == []
    plan.device = torch.device("cuda", 0)
    plan.copy(plan.bind([("w", torch.full((2, 3), 2.0))]))
    assert len(calls) == 1 and calls[0][0] == torch.device("cuda", 0)
    assert torch.equal(calls[0][1], torch.full((2, 3), 2.0))  # every copy was issued before it
    plan.copy(plan.bind([("w", torch.full((2, 3), 3.0))]), synchronize=False)
    assert len(calls) == 1 and torch.equal(dst, torch.full((2, 3), 3.0))


@pytest.mark.parametrize(("rank", "world"), [(0, 1), (1, 2)])
def test_a_plan_from_the_checkpoints_headers_alone_copies_the_same(tmp_path, rank, world):
    """`checkpoint_placeholders` gives each tensor's name, shape and dtype from the safetensors
    headers, unfilled; a plan captured from them without performing its copies leaves the
    parameters as they were and then loads an update exactly as the loader does."""
    from safetensors.torch import save_file

    from pipeline_rl.engine.engine_weights import checkpoint_placeholders

    hidden = 8
    save_file(dict(tensors(hidden, 0)), str(tmp_path / "model.safetensors"))
    placeholders = list(checkpoint_placeholders(tmp_path))
    assert [(n, tuple(t.shape), t.dtype) for n, t in placeholders] == sorted(
        (n, tuple(t.shape), t.dtype) for n, t in tensors(hidden, 0)
    )
    planned, loaded = FusedShard(hidden, rank, world), FusedShard(hidden, rank, world)
    for p in planned.parameters():
        p.data.fill_(5.0)  # what the engine serves: left alone by the capture
    plan = LoadPlan.capture(planned, placeholders, planned.names(), perform=False)
    assert all(bool((p == 5.0).all()) for p in planned.parameters())
    update = tensors(hidden, 1)
    plan.copy(plan.bind(update))
    loaded.load_weights(update)
    for (name, p), q in zip(planned.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), name
