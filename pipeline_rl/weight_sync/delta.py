"""Weight updates by delta: each tensor as the elements whose published value changed since the
version the receivers hold, and a checksum per tensor that lets a receiver check it holds
exactly the trainer's weights.

The wire form reuses the broadcast as it is: a delta update is a WeightUpdate whose tensors are
the pieces below (names, shapes, dtypes, buckets of the pieces), with `base` the version it
applies to (-1: a full update, whose tensors are the weights themselves), `forms` one letter
per weight tensor, and `checksums` one per weight tensor (full updates carry them too). Per
weight tensor, whichever form is smallest for it:
- UNCHANGED: one empty piece NAME#v;
- INDICES: NAME#i (the changed elements' flat indices, int32, or int64 past 2**31 elements) and
  NAME#v (their new values);
- SEGMENTS: NAME#c (per segment of SEGMENT elements, how many changed: int16), NAME#o (each
  changed element's offset in its segment: one byte) and NAME#v: 3 bytes a bf16 change;
- MASK: NAME#m (one bit per element, little-endian within each byte) and NAME#v;
- DENSE: NAME, the whole tensor (what every element changing makes smallest: fp32 models,
  whose Adam step moves every element's value).

The checksum of a tensor is additive over its elements, the sum of (w(i) * bits(x_i)) mod 2**40
over its elements, mod MODULUS, with w a fixed odd hash of the flat index i and bits the value's
raw bits: integer arithmetic, the same on every machine, and computable in parts (each trainer rank over its own shard, each
tensor-parallel worker over its own slice) whose sum is the whole's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pipeline_rl.streams.records import WeightUpdate

MODULUS = 2**62
"""Checksums are sums of element terms modulo this (parts add up to the whole)."""
_MULTIPLIER = 1_103_515_245
_TERM_BITS = (1 << 40) - 1
"""Each element's term is w(i) * bits(x_i) modulo 2**40: w(i) is odd, so a flip of any of a
value's 32 bits changes the term, and a chunk's sum of terms stays well inside int64."""
_CHUNK = 1 << 22
"""Elements per step of a checksum: bounds its int64 temporaries."""

UNCHANGED, INDICES, SEGMENTS, MASK, DENSE = "=", "i", "s", "m", "d"
FORMS = (UNCHANGED, INDICES, SEGMENTS, MASK, DENSE)
INDEX_SUFFIX, VALUES_SUFFIX, MASK_SUFFIX, COUNTS_SUFFIX, OFFSETS_SUFFIX = "#i", "#v", "#m", "#c", "#o"
_SUFFIXES = (INDEX_SUFFIX, VALUES_SUFFIX, MASK_SUFFIX, COUNTS_SUFFIX, OFFSETS_SUFFIX)
SEGMENT = 256
"""Elements per segment of the SEGMENTS form: an offset in one fits a byte."""

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_UNSIGNED = {1: 0xFF, 2: 0xFFFF, 4: 0xFFFFFFFF}


def raw_bits(values: torch.Tensor) -> torch.Tensor:
    """The values' raw bits as non-negative int64 (a bitwise view: -0.0 and 0.0 differ, NaNs
    compare by payload)."""
    size = values.element_size()
    if size not in _BITS:
        raise ValueError(f"no delta form for {values.dtype} ({size}-byte elements)")
    return values.reshape(-1).view(_BITS[size]).to(torch.int64).bitwise_and_(_UNSIGNED[size])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: whether `a` and `b` (one dtype) hold the same bits."""
    return a.reshape(-1).view(_BITS[a.element_size()]) == b.reshape(-1).view(_BITS[b.element_size()])


def index_weights(index: torch.Tensor) -> torch.Tensor:
    """w(i), odd and below 2**31, for int64 flat indices (below 2**33: the product stays in int64)."""
    return (index * _MULTIPLIER).bitwise_and_(0x7FFFFFFF).bitwise_or_(1)


def checksum(values: torch.Tensor, index: torch.Tensor | None = None, start: int = 0) -> int:
    """The checksum part of `values` (any shape, read flat) at flat indices `index` (int64, as
    many), or at start, start + 1, ... when `index` is None."""
    flat = values.reshape(-1)
    total = 0
    for at in range(0, flat.numel(), _CHUNK):
        part = flat[at : at + _CHUNK]
        if index is None:
            where = torch.arange(start + at, start + at + part.numel(), dtype=torch.int64, device=part.device)
        else:
            where = index[at : at + _CHUNK].to(torch.int64)
        total += int(index_weights(where).mul_(raw_bits(part)).bitwise_and_(_TERM_BITS).sum())
    return total % MODULUS


def combine(parts: list[int]) -> int:
    """The checksum of a tensor from the checksums of disjoint parts of it."""
    return sum(parts) % MODULUS


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def form_bytes(form: str, numel: int, changed: int, itemsize: int) -> int:
    """Bytes on the wire of one tensor in `form`."""
    if form == UNCHANGED:
        return 0
    if form == INDICES:
        return changed * (index_dtype(numel).itemsize + itemsize)
    if form == SEGMENTS:
        return -(-numel // SEGMENT) * 2 + changed * (1 + itemsize)
    if form == MASK:
        return -(-numel // 8) + changed * itemsize
    return numel * itemsize


def choose_form(numel: int, changed: int, itemsize: int) -> str:
    """The smallest form for a tensor of `numel` elements of which `changed` changed."""
    if changed == 0:
        return UNCHANGED
    return min((INDICES, SEGMENTS, MASK, DENSE), key=lambda f: form_bytes(f, numel, changed, itemsize))


def piece_specs(
    name: str, shape: list[int], dtype: torch.dtype, form: str, changed: int
) -> list[tuple[str, list[int], torch.dtype]]:
    """The wire tensors of one weight tensor in `form`."""
    numel = math.prod(shape)
    values = (name + VALUES_SUFFIX, [changed], dtype)
    if form == UNCHANGED:
        return [(name + VALUES_SUFFIX, [0], dtype)]
    if form == INDICES:
        return [(name + INDEX_SUFFIX, [changed], index_dtype(numel)), values]
    if form == SEGMENTS:
        return [
            (name + COUNTS_SUFFIX, [-(-numel // SEGMENT)], torch.int16),
            (name + OFFSETS_SUFFIX, [changed], torch.uint8),
            values,
        ]
    if form == MASK:
        return [(name + MASK_SUFFIX, [-(-numel // 8)], torch.uint8), values]
    return [(name, list(shape), dtype)]


def pack_mask(indices: torch.Tensor, numel: int) -> torch.Tensor:
    """One bit per element (set where `indices` are), bit j of byte b for element 8 b + j."""
    bits = torch.zeros(-(-numel // 8) * 8, dtype=torch.uint8, device=indices.device)
    bits[indices] = 1
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=indices.device)
    return (bits.view(-1, 8) * weights).sum(1, dtype=torch.uint8)


def unpack_mask(mask: torch.Tensor, numel: int) -> torch.Tensor:
    """The flat indices whose bits `mask` sets (int64, ascending)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    bits = (mask.unsqueeze(1) >> shifts) & 1
    return bits.reshape(-1)[:numel].nonzero().reshape(-1)


def encode(form: str, numel: int, indices: torch.Tensor, values: torch.Tensor) -> list[torch.Tensor]:
    """The wire tensors of one weight tensor (piece_specs' order) from its changed elements'
    flat `indices` (int64, ascending) and `values`; DENSE takes every element's value in order."""
    if form == UNCHANGED:
        return [values[:0]]
    if form == INDICES:
        return [indices.to(index_dtype(numel)), values]
    if form == SEGMENTS:
        counts = torch.bincount(indices // SEGMENT, minlength=-(-numel // SEGMENT)).to(torch.int16)
        return [counts, (indices % SEGMENT).to(torch.uint8), values]
    if form == MASK:
        return [pack_mask(indices, numel), values]
    return [values]


@dataclass(frozen=True)
class DeltaHeader:
    """What an announcement carries beside its tensors (WeightUpdate.base, forms, checksums)."""

    base: int
    forms: str
    checksums: list[int]


@dataclass(frozen=True)
class TensorDelta:
    """One weight tensor's change as a receiver decodes it."""

    name: str
    form: str
    indices: torch.Tensor | None
    """Flat int64 indices of the changed elements; None for DENSE (every element, in order)."""
    values: torch.Tensor


def is_delta(update: WeightUpdate) -> bool:
    return update.base >= 0


def weight_names(update: WeightUpdate) -> list[str]:
    """The weight tensors an update carries, in order (a delta's, from its pieces' names)."""
    if not is_delta(update):
        return list(update.names)
    names: list[str] = []
    for piece in update.names:
        name = piece[:-2] if piece[-2:] in _SUFFIXES else piece
        if not names or names[-1] != name:
            names.append(name)
    return names


def weight_dtypes(update: WeightUpdate) -> dict[str, str]:
    """The dtype of each weight tensor an update carries (a delta's, from its values pieces)."""
    if not is_delta(update):
        return dict(zip(update.names, update.dtypes))
    return {
        piece.removesuffix(VALUES_SUFFIX): dtype
        for piece, dtype in zip(update.names, update.dtypes)
        if not piece.endswith((INDEX_SUFFIX, MASK_SUFFIX, COUNTS_SUFFIX, OFFSETS_SUFFIX))
    }


def decode(update: WeightUpdate, pieces: list[tuple[str, torch.Tensor]], numels: dict[str, int]) -> list[TensorDelta]:
    """The per-tensor changes of a delta update from its received pieces; `numels`: the element
    count of every weight tensor the receiver holds. Raises ValueError naming the tensor when
    the pieces do not make the announced forms."""
    names = weight_names(update)
    if len(names) != len(update.forms):
        raise ValueError(f"weight update {update.version}: {len(update.forms)} forms for {len(names)} tensors")
    deltas = []
    at = 0
    for name, form in zip(names, update.forms):
        if name not in numels:
            raise ValueError(f"weight update {update.version} has unknown parameter {name!r}")
        numel = numels[name]
        count = {UNCHANGED: 1, DENSE: 1, SEGMENTS: 3}.get(form, 2)
        part = pieces[at : at + count]
        at += count
        got = [piece for piece, _ in part]
        expected = [spec[0] for spec in piece_specs(name, [numel], torch.float32, form, 0)]
        if got != expected:
            raise ValueError(f"weight update {update.version}: {name} in form {form!r} came as pieces {got}")
        values = part[-1][1].reshape(-1)
        if form == UNCHANGED:
            indices = values.new_empty(0, dtype=torch.int64)
        elif form == DENSE:
            indices = None
            if values.numel() != numel:
                raise ValueError(f"weight update {update.version}: {name} has {values.numel()} of {numel} elements")
        elif form == INDICES:
            indices = part[0][1].to(torch.int64)
        elif form == SEGMENTS:
            counts, offsets = part[0][1].to(torch.int64), part[1][1].to(torch.int64)
            if (
                counts.numel() != -(-numel // SEGMENT)
                or bool((counts < 0).any())
                or int(counts.sum()) != offsets.numel()
            ):
                raise ValueError(f"weight update {update.version}: {name}'s segment counts do not match its offsets")
            segments = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
            indices = segments * SEGMENT + offsets
        elif form == MASK:
            if part[0][1].numel() != -(-numel // 8):
                raise ValueError(f"weight update {update.version}: {name}'s mask does not cover {numel} elements")
            indices = unpack_mask(part[0][1], numel)
        else:
            raise ValueError(f"weight update {update.version}: {name} has unknown form {form!r}")
        if indices is not None:
            if indices.numel() != values.numel():
                raise ValueError(
                    f"weight update {update.version}: {name} has {indices.numel()} indices, {values.numel()} values"
                )
            if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= numel):
                raise ValueError(f"weight update {update.version}: {name} has an index outside its {numel} elements")
        deltas.append(TensorDelta(name, form, indices, values))
    if at != len(pieces):
        raise ValueError(f"weight update {update.version}: {len(pieces) - at} pieces left over")
    return deltas


def apply(weights: dict[str, torch.Tensor], deltas: list[TensorDelta]) -> None:
    """Apply decoded changes to whole tensors held by name (contiguous, in place): a receiver
    that keeps the weights as the trainer publishes them (tests, benchmarks)."""
    for change in deltas:
        flat = weights[change.name].view(-1)
        if change.indices is None:
            flat.copy_(change.values)
        elif change.indices.numel():
            flat[change.indices.to(flat.device)] = change.values.to(flat.device, flat.dtype)


def checksums(named: list[tuple[str, torch.Tensor]]) -> list[int]:
    """The checksum of each whole tensor."""
    return [checksum(t) for _, t in named]


_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def expected_changed_fraction(lr: float, dtype: torch.dtype, scale: float) -> float:
    """The fraction of elements whose published value an Adam update of size about `lr` is
    expected to change, for weights distributed as N(0, scale): an element of magnitude |w| sits
    on a grid of spacing 2**(floor(log2 |w|) - mantissa bits), and a step of lr crosses a
    rounding boundary with probability min(1, lr / spacing). Over 4,096 quantiles of the normal."""
    quantiles = (torch.arange(4096, dtype=torch.float64) + 0.5) / 4096
    magnitude = (torch.special.ndtri(quantiles) * scale).abs().clamp(min=1e-30)
    spacing = torch.exp2(torch.floor(torch.log2(magnitude)) - _MANTISSA_BITS.get(dtype, 52))
    return float((lr / spacing).clamp(max=1.0).mean())


def expected_bytes(numel: int, fraction: float, itemsize: int) -> int:
    """Wire bytes of a tensor of `numel` elements of which `fraction` changed, in its smallest form."""
    changed = round(numel * fraction)
    return 0 if changed == 0 else form_bytes(choose_form(numel, changed, itemsize), numel, changed, itemsize)
