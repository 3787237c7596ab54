"""Delta weight updates: the wire forms and their sizes, the checksum, and a delta applied
through a copy plan into fused, tensor-parallel-sharded parameters, bit for bit."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from pipeline_rl.engine.load_plan import LoadPlan
from pipeline_rl.engine.weight_delta import bind_delta, checksum_parts, locate, mismatches, scatter
from pipeline_rl.streams.records import WeightUpdate
from pipeline_rl.trainer.published_shards import PublishedShards
from pipeline_rl.weight_layout import dtype_name
from pipeline_rl.weight_sync import delta


def changed(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return (~delta.same_bits(new, old)).nonzero().reshape(-1)


def delta_update(named_old: dict, named_new: dict, base: int = 1) -> tuple[WeightUpdate, list]:
    """A delta update from `named_old` to `named_new` as a sender would make it, with its pieces."""
    specs, pieces, forms = [], [], ""
    for name, new in named_new.items():
        where = changed(named_old[name], new)
        form = delta.choose_form(new.numel(), len(where), new.element_size())
        forms += form
        values = new.reshape(-1) if form == delta.DENSE else new.reshape(-1)[where]
        encoded = delta.encode(form, new.numel(), where, values)
        if form == delta.DENSE:
            encoded = [new]
        spec = delta.piece_specs(name, list(new.shape), new.dtype, form, len(where))
        specs += spec
        pieces += [(s[0], t) for s, t in zip(spec, encoded)]
    update = WeightUpdate(
        version=base + 1,
        names=[s[0] for s in specs],
        shapes=[s[1] for s in specs],
        dtypes=[dtype_name(s[2]) for s in specs],
        bucket_sizes=[len(specs)],
        group="g",
        plan="",
        base=base,
        forms=forms,
        checksums=delta.checksums(list(named_new.items())),
    )
    return update, pieces


def test_each_tensor_takes_its_smallest_form():
    # bf16, 8000 elements: indices cost 6 bytes a change; segments 64 bytes of counts (32
    # segments of 256) plus 3 a change; the mask 1000 bytes plus 2 a change; dense 16000.
    n = 8000
    assert delta.choose_form(n, 0, 2) == delta.UNCHANGED
    assert delta.choose_form(n, 21, 2) == delta.INDICES  # 126 < 64 + 63
    assert delta.choose_form(n, 22, 2) == delta.SEGMENTS  # 132 > 64 + 66
    assert delta.choose_form(n, 935, 2) == delta.SEGMENTS  # 64 + 2805 < 1000 + 1870
    assert delta.choose_form(n, 937, 2) == delta.MASK  # 64 + 2811 > 1000 + 1874
    assert delta.choose_form(n, 7499, 2) == delta.MASK  # 1000 + 14998 < 16000
    assert delta.choose_form(n, 7501, 2) == delta.DENSE  # 1000 + 15002 > 16000
    # fp32 with every element changed (an Adam step): dense.
    assert delta.choose_form(n, n, 4) == delta.DENSE
    for k in range(0, n + 1, 97):
        sizes = {f: delta.form_bytes(f, n, k, 2) for f in delta.FORMS[1:]}
        assert k == 0 or delta.form_bytes(delta.choose_form(n, k, 2), n, k, 2) == min(sizes.values())
    assert delta.index_dtype(2**31) == torch.int64 and delta.index_dtype(2**31 - 1) == torch.int32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("fraction", [0.0, 0.0005, 0.02, 0.2, 0.97])
def test_a_delta_rebuilds_the_new_weights_bit_for_bit(dtype, fraction):
    g = torch.Generator().manual_seed(3)
    old = {"a": torch.randn(64, 48, generator=g).to(dtype), "b": torch.randn(333, generator=g).to(dtype)}
    new = {}
    for name, t in old.items():
        moved = t.clone().reshape(-1)
        pick = torch.rand(moved.numel(), generator=g) < fraction
        moved[pick] = (moved[pick].float() * 1.01 + 1e-3).to(dtype)
        new[name] = moved.view(t.shape)
    new["b"][0] = -0.0 if float(old["b"][0]) == 0.0 else new["b"][0]
    update, pieces = delta_update(old, new)
    held = {k: v.clone() for k, v in old.items()}
    delta.apply(held, delta.decode(update, pieces, {k: v.numel() for k, v in old.items()}))
    for name in new:
        assert torch.equal(held[name].view(torch.uint8), new[name].view(torch.uint8)), name
    assert delta.checksums(list(held.items())) == update.checksums
    wire = sum(
        math.prod(s) * torch.empty(0, dtype=getattr(torch, d)).element_size()
        for s, d in zip(update.shapes, update.dtypes)
    )
    dense = sum(t.numel() * t.element_size() for t in new.values())
    assert wire <= dense


def test_the_checksum_adds_over_parts_and_sees_every_bit_and_place():
    g = torch.Generator().manual_seed(5)
    t = torch.randn(5000, generator=g).to(torch.bfloat16)
    whole = delta.checksum(t)
    cut = [0, 17, 2500, 4999, 5000]
    parts = [delta.checksum(t[a:b], start=a) for a, b in itertools.pairwise(cut)]
    assert delta.combine(parts) == whole
    perm = torch.randperm(5000, generator=g)
    assert delta.checksum(t[perm], perm) == whole  # any order, by index
    bits = t.view(torch.int16)
    for i in torch.randint(0, 5000, (20,), generator=g).tolist():
        for bit in (0, 7, 15):
            flipped = bits.clone()
            flipped[i] ^= torch.tensor(1 << bit, dtype=torch.int32).to(torch.int16)
            assert delta.checksum(flipped.view(torch.bfloat16)) != whole
    a = int(torch.nonzero(t != t[0])[0])
    swapped = t.clone()
    swapped[0], swapped[a] = t[a], t[0]
    assert delta.checksum(swapped) != whole  # the same values in other places


def test_locate_finds_exactly_the_elements_of_a_slice():
    full = torch.arange(4 * 6 * 10).view(4, 6, 10)
    views = [full[1:3], full[:, 2:5], full[:, :, 3:7], full[2, 1:4, 5:], full.transpose(1, 2)[:, 2:4], full[:, 3:4]]
    indices = torch.arange(full.numel())
    for view in views:
        inside, coords = locate(indices, tuple(view.shape), tuple(view.stride()), view.storage_offset())
        assert torch.equal(indices[inside].sort().values, view.reshape(-1).sort().values)
        assert torch.equal(view[coords], indices[inside])


class _Shard(torch.nn.Module):
    """Worker `rank` of a tensor-parallel pair: q and k land in its half of the rows of one fused
    parameter (column-parallel), o in its half of the columns (row-parallel), n whole."""

    def __init__(self, rank: int, rows: int, width: int, dtype: torch.dtype):
        super().__init__()
        self.rank = rank
        self.qk = torch.nn.Parameter(torch.zeros(rows, width, dtype=dtype), requires_grad=False)
        self.o = torch.nn.Parameter(torch.zeros(width, rows // 2, dtype=dtype), requires_grad=False)
        self.n = torch.nn.Parameter(torch.zeros(width, dtype=dtype), requires_grad=False)

    def load_weights(self, weights) -> None:
        half = self.qk.shape[0] // 2
        for name, t in weights:
            if name in ("q", "k"):
                at = 0 if name == "q" else half
                rows = t.shape[0] // 2
                self.qk[at : at + half].copy_(t[self.rank * rows : (self.rank + 1) * rows])
            elif name == "o":
                cols = t.shape[1] // 2
                self.o.copy_(t[:, self.rank * cols : (self.rank + 1) * cols])
            else:
                self.n.copy_(t)


def test_a_delta_lands_in_each_workers_shard_and_the_checksums_add_up():
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(9)
    width, rows = 16, 8
    old = {
        "q": torch.randn(rows, width, generator=g).to(dtype),
        "k": torch.randn(rows, width, generator=g).to(dtype),
        "o": torch.randn(width, rows, generator=g).to(dtype),
        "n": torch.randn(width, generator=g).to(dtype),
    }
    workers = [_Shard(r, rows, width, dtype) for r in range(2)]
    plans = [LoadPlan.capture(w, list(old.items()), old) for w in workers]
    new = {k: v.clone() for k, v in old.items()}
    for name in new:
        flat = new[name].view(-1)
        pick = torch.randperm(flat.numel(), generator=g)[:5]
        flat[pick] += 1
    update, pieces = delta_update(old, new)
    numels = {k: v.numel() for k, v in new.items()}
    reference = [_Shard(r, rows, width, dtype) for r in range(2)]
    for worker, ref, plan in zip(workers, reference, plans):
        pairs, scatters = bind_delta(plan.copies, delta.decode(update, pieces, numels))
        assert not pairs and scatters
        scatter(scatters)
        LoadPlan.capture(ref, list(new.items()), new)
        for got, want in zip(worker.parameters(), ref.parameters()):
            assert torch.equal(got, want)
    dtypes = {name: dtype for name in new}
    parts = [checksum_parts(plan.copies, dtypes) for plan in plans]
    assert parts[0]["n"][1] == width and parts[0]["q"][1] == rows * width // 2
    names = list(new)
    assert mismatches(parts, names, numels, update.checksums) == []
    # A byte flipped on the wire (one changed value of q) is caught, on whichever worker holds it.
    values = dict(pieces)["q#v"]
    values.view(torch.uint8)[1] ^= 0x40
    for plan in plans:
        _, scatters = bind_delta(plan.copies, delta.decode(update, pieces, numels))
        scatter(scatters)
    parts = [checksum_parts(plan.copies, dtypes) for plan in plans]
    assert mismatches(parts, names, numels, update.checksums) == ["q"]


def test_a_rank_finds_its_changes_and_keeps_its_checksums_by_arithmetic():
    """One rank (no process group): its range is every element; the incremental checksums equal
    the whole tensors' after each change."""
    g = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(50, 40, generator=g).to(torch.bfloat16)) for _ in range(2)]
    shards = PublishedShards([("w0", params[0]), ("w1", params[1])], rank=0, world_size=1)
    assert shards.refresh() == delta.checksums([("w0", params[0]), ("w1", params[1])])
    with torch.no_grad():
        params[0].view(-1)[[3, 77, 1999]] += 1
    counts = shards.changes()
    assert counts == [3, 0]
    assert shards.checksums == delta.checksums([("w0", params[0]), ("w1", params[1])])
    forms = "".join(delta.choose_form(2000, c, 2) for c in counts)
    assert forms == "i="
    [chunk] = list(shards.pieces(forms, bucket_mb=1))
    assert [name for name, _ in chunk] == ["w0#i", "w0#v", "w1#v"]
    assert chunk[0][1].tolist() == [3, 77, 1999]
    assert shards.changes() == [0, 0]  # taken as published


def test_a_rank_owns_its_zero3_range():
    """Under ZeRO-3 rank r's elements are [r * part, ...) of each parameter, part = ceil(n / W):
    the ranges of every rank tile each parameter exactly."""
    params = [("a", torch.nn.Parameter(torch.zeros(7))), ("b", torch.nn.Parameter(torch.zeros(3, 3)))]
    ranges = [PublishedShards(params, r, 4) for r in range(4)]
    for i, n in enumerate((7, 9)):
        covered = []
        for s in ranges:
            covered += list(range(s.starts[i], s.starts[i] + s.lengths[i]))
        assert covered == list(range(n))


def test_a_delta_of_fused_experts_lands_in_the_engines_per_expert_tensors():
    """A trainer holds a mixture-of-experts layer's experts fused (gate_up_proj: experts x
    2*intermediate x hidden); the engine's plan is by the checkpoint's per-expert tensors. The
    fused tensor's changes land in them, and its checksum is made from them."""
    from pipeline_rl.engine.fused_experts import per_expert
    from pipeline_rl.engine.weight_delta import fused_blocks, split_fused

    g = torch.Generator().manual_seed(4)
    experts, inter, hidden = 3, 4, 8
    fused_old = {
        "m.mlp.experts.gate_up_proj": torch.randn(experts, 2 * inter, hidden, generator=g).to(torch.bfloat16),
        "m.mlp.experts.down_proj": torch.randn(experts, hidden, inter, generator=g).to(torch.bfloat16),
    }
    fused_new = {k: v.clone() for k, v in fused_old.items()}
    for t in fused_new.values():
        t.view(-1)[torch.randperm(t.numel(), generator=g)[:9]] += 1
    engine = {name: t.clone() for name, t in per_expert(fused_old.items())}  # the engine's own tensors
    copies = {name: [(t, tuple(t.shape), tuple(t.stride()), 0)] for name, t in engine.items()}
    shapes = {name: list(t.shape) for name, t in engine.items()}
    blocks = fused_blocks(shapes)
    assert set(blocks) == set(fused_old)
    update, pieces = delta_update(fused_old, fused_new)
    numels = {name: sum(n for _, _, n in parts) for name, parts in blocks.items()}
    _, scatters = bind_delta(copies, split_fused(delta.decode(update, pieces, numels), blocks))
    scatter(scatters)
    for name, want in per_expert(fused_new.items()):
        assert torch.equal(engine[name], want), name
    parts = checksum_parts(copies, {name: torch.bfloat16 for name in fused_new}, blocks)
    assert mismatches([parts], list(fused_new), numels, update.checksums) == []
