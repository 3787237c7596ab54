"""A delta update (weight_sync/delta.py) applied through an engine's copy plan, and the checksums
of the weights an engine holds.

The copy plan (engine/engine_weights.py) records, per checkpoint tensor, which view of it lands in
which parameter view: (dst, shape, stride, offset) with the source view read as
`incoming.as_strided(shape, stride, offset)`. The loaders take those views by slicing the
contiguous incoming tensor, so each is a mixed-radix window on its flat indices: a changed
element's flat index i lies in the view when i - offset splits, by the view's strides from the
largest down, into coordinates within its shape with nothing left over. The changed elements of a
view are thus written into their parameter with one `index_put_` at those coordinates (a
tensor-parallel worker's views select its own shard, so it writes exactly its part); a tensor
sent dense is copied as a full update's is.

The checksum of what an engine holds is computed from the same views: each parameter view's
elements, at the source indices its view reads. A tensor whose views cover each of its elements
once (every tensor of a TP = 1 engine, a replicated one on a TP worker) is checked alone; a
worker's slices of a sharded tensor are parts whose sum the actor checks (`combine_parts`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

import torch

from pipeline_rl.weight_sync import delta
from pipeline_rl.weight_sync.delta import DENSE, TensorDelta

Scatter = tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]
"""(parameter view, coordinates in it, values): one `index_put_` of a delta."""

_ROWS = 1 << 20
"""Elements per step of a view's checksum (bounds its index temporaries)."""


def locate(
    indices: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...], offset: int
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Which flat `indices` (int64) lie in the view (shape, stride, offset) of a contiguous
    tensor, and their coordinates in it (one int64 tensor per dimension, for those that do)."""
    rest = indices - offset
    inside = rest >= 0
    rest = rest.clamp(min=0)
    coords: list[torch.Tensor | None] = [None] * len(shape)
    for d in sorted(range(len(shape)), key=lambda d: -stride[d]):
        if shape[d] == 1:
            coords[d] = torch.zeros_like(rest)
            continue
        if stride[d] <= 0:
            raise ValueError(f"a view with stride {stride} cannot take a delta")
        coord = rest // stride[d]
        rest = rest - coord * stride[d]
        inside &= coord < shape[d]
        coords[d] = coord
    inside &= rest == 0
    return inside, tuple(c[inside] for c in coords if c is not None)


Views = dict[Any, list[tuple[torch.Tensor, tuple[int, ...], tuple[int, ...], int]]]
"""A copy plan's views (LoadPlan.copies): per checkpoint tensor, (dst, shape, stride, offset)."""


def bind_delta(
    copies: Views, deltas: Iterable[TensorDelta], sources: list[tuple[str, torch.Tensor]] | None = None
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[Scatter]]:
    """The copy pairs of the tensors sent dense and the scatters of the others (the per-update
    work done before the lock is taken); `sources`, when given, gets each scatter's tensor name
    and its elements' flat indices in that tensor."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    scatters: list[Scatter] = []
    for change in deltas:
        views = copies.get(change.name, ())
        if change.form == DENSE:
            for dst, shape, stride, offset in views:
                src = change.values.as_strided(shape, stride, change.values.storage_offset() + offset)
                pairs.append((dst, src))
            continue
        assert change.indices is not None
        if change.indices.numel() == 0:
            continue
        for dst, shape, stride, offset in views:
            inside, coords = locate(change.indices, shape, stride, offset)
            if not coords or coords[0].numel() == 0:
                continue
            values = change.values[inside].to(device=dst.device, dtype=dst.dtype, non_blocking=True)
            if sources is not None:
                sources.append((change.name, change.indices[inside]))
            coords = tuple(c.to(dst.device, non_blocking=True) for c in coords)
            scatters.append((dst, coords, values))
    return pairs, scatters


def checksum_moves(
    scatters: list[Scatter],
    sources: list[tuple[str, torch.Tensor]],
    dtypes: dict[str, torch.dtype],
    blocks: dict[str, list[tuple[str, int, int]]],
) -> dict[str, int]:
    """Per tensor of `dtypes`, what the scatters will add to the checksum of what the engine holds
    of it: each changed element's term with its new value less its term with the value the
    engine holds now (read before the lock is taken: only the swap writes the weights)."""
    within = {name: (fused, start) for fused, parts in blocks.items() for name, start, _ in parts}
    moves: dict[str, int] = {}
    with torch.no_grad():
        for (dst, coords, values), (name, index) in zip(scatters, sources):
            target, shift = within.get(name, (name, 0))
            if target not in dtypes:
                continue
            where = (index + shift).to(dst.device)
            dtype = dtypes[target]
            moved = delta.checksum(values.to(dtype), where) - delta.checksum(dst[coords].to(dtype), where)
            moves[target] = moves.get(target, 0) + moved
    return moves


def scatter(scatters: list[Scatter]) -> None:
    """Write a delta's changed elements into the parameters (under the swap lock)."""
    with torch.no_grad():
        for dst, coords, values in scatters:
            dst.index_put_(coords, values)


def source_index(shape: tuple[int, ...], stride: tuple[int, ...], offset: int, device: torch.device) -> torch.Tensor:
    """The flat source index of every element of a view, in the view's (row-major) order."""
    index = torch.full((), offset, dtype=torch.int64, device=device)
    for d, (size, step) in enumerate(zip(shape, stride)):
        axis = torch.arange(size, dtype=torch.int64, device=device) * step
        index = index.unsqueeze(-1) + axis if d else index + axis
    return index.reshape(-1)


def checksum_parts(
    copies: Views, dtypes: dict[str, torch.dtype], blocks: dict[str, list[tuple[str, int, int]]] | None = None
) -> dict[str, tuple[int, int]]:
    """Per checkpoint tensor of `dtypes` (its published dtype), the checksum of the elements this
    engine holds of it and how many elements that is (counted once per view); with `blocks`
    (fused_blocks), a fused tensor's from its per-expert tensors at their place in it."""
    within = {name: (fused, start) for fused, parts in (blocks or {}).items() for name, start, _ in parts}
    sums: dict[str, list[int]] = {}
    with torch.no_grad():
        for name, views in copies.items():
            target, shift = within.get(name, (name, 0))
            if target not in dtypes:
                continue
            if any(dst.element_size() < dtypes[target].itemsize for dst, *_ in views):
                sums[target] = [-1, -1]  # held at a lower precision than published: no checksum can match
                continue
            total, covered = sums.setdefault(target, [0, 0])
            for dst, shape, stride, offset in views:
                values = dst.reshape(-1) if dst.is_contiguous() else dst.contiguous().reshape(-1)
                if values.dtype != dtypes[target]:
                    values = values.to(dtypes[target])
                index = source_index(shape, stride, offset + shift, values.device)
                for at in range(0, values.numel(), _ROWS):
                    total += delta.checksum(values[at : at + _ROWS], index[at : at + _ROWS])
                covered += math.prod(shape)
            sums[target] = [total, covered]
    return {name: (total % delta.MODULUS, covered) for name, (total, covered) in sums.items() if covered >= 0}


def mismatches(
    parts: list[dict[str, tuple[int, int]]], names: list[str], numels: dict[str, int], checksums: list[int]
) -> list[str]:
    """The tensors whose announced checksum the engine's holdings do not make: per tensor, a
    holder that covers it whole (TP = 1, or replicated) is checked alone; slices held by
    several workers are summed and must cover it exactly."""
    wrong = []
    for name, expected in zip(names, checksums):
        held = [p[name] for p in parts if name in p]
        if not held:
            continue
        whole = [value for value, covered in held if covered == numels[name]]
        if whole:
            ok = all(v == expected for v in whole)
        else:
            ok = sum(c for _, c in held) == numels[name] and delta.combine([v for v, _ in held]) == expected
        if not ok:
            wrong.append(name)
    return wrong


_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)\.weight$")


def fused_blocks(shapes: dict[str, list[int]]) -> dict[str, list[tuple[str, int, int]]]:
    """Per fused expert tensor a trainer may send (engine/fused_experts.py), the checkpoint tensors
    it is made of: (name, first flat element, elements), in its layout (per expert, the gate's
    rows then the up projection's; or the down projection)."""
    experts: dict[tuple[str, str], dict[int, dict[str, str]]] = {}
    for name in shapes:
        found = _EXPERT.match(name)
        if found:
            fused = "gate_up_proj" if found["kind"] != "down_proj" else "down_proj"
            experts.setdefault((found["prefix"], fused), {}).setdefault(int(found["e"]), {})[found["kind"]] = name
    blocks: dict[str, list[tuple[str, int, int]]] = {}
    for (prefix, fused), by_expert in experts.items():
        at, parts = 0, []
        for e in sorted(by_expert):
            kinds = ("gate_proj", "up_proj") if fused == "gate_up_proj" else ("down_proj",)
            for kind in kinds:
                name = by_expert[e][kind]
                parts.append((name, at, math.prod(shapes[name])))
                at += parts[-1][2]
        blocks[f"{prefix}.{fused}"] = parts
    return blocks


def split_fused(deltas: list[TensorDelta], blocks: dict[str, list[tuple[str, int, int]]]) -> list[TensorDelta]:
    """The changes of fused expert tensors as changes of the checkpoint's per-expert tensors."""
    out = []
    for change in deltas:
        if change.name not in blocks:
            out.append(change)
            continue
        for name, start, numel in blocks[change.name]:
            if change.indices is None:
                out.append(TensorDelta(name, change.form, None, change.values[start : start + numel]))
                continue
            inside = (change.indices >= start) & (change.indices < start + numel)
            out.append(TensorDelta(name, change.form, change.indices[inside] - start, change.values[inside]))
    return out
