"""Each trainer rank's share of the published weights as last published: what a delta update is
computed from, with no gather of the model (weight_sync/delta.py has the wire form).

Rank r of W owns, of every published parameter of n elements, the flat elements
[r * part, min((r + 1) * part, n)) with part = ceil(n / W): under ZeRO-3 exactly its partition
(`ds_tensor`, which the optimizer step writes), otherwise the same range of the full parameter
every rank holds. A rank keeps a copy of its elements as last published (its `shadow`: 1/W of
the model in the model's dtype), compares the current ones with it bit for bit, and sends rank
0 only the changes (or its whole range of a tensor whose dense form is the smallest); rank 0
assembles each tensor's wire pieces one broadcast bucket at a time, so no rank ever holds more
than its own share plus a bucket of changes. The per-tensor checksums are the sum of the
ranks' parts (one all-reduce); after a full update each rank computes its part anew, after a
delta from the changes alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

from pipeline_rl.trainer.full_weights import Named, parameter_specs
from pipeline_rl.weight_layout import plan_buckets
from pipeline_rl.weight_sync import delta
from pipeline_rl.weight_sync.delta import DENSE


class PublishedShards:
    """This rank's elements of every published parameter, as last published."""

    def __init__(self, named: Named, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.specs = parameter_specs(named)
        self.params = [p for _, p in named]
        self.numels = [math.prod(shape) for _, shape, _ in self.specs]
        parts = [-(-n // world_size) for n in self.numels]
        self.starts = [min(rank * part, n) for part, n in zip(parts, self.numels)]
        self.lengths = [min(part, n - start) for part, n, start in zip(parts, self.numels, self.starts)]
        self.shadow: list[torch.Tensor] | None = None
        """Per parameter, this rank's elements as last published; None before the first."""
        self.checksums: list[int] = []
        """Per parameter, the whole tensor's checksum as last published (every rank's parts)."""
        self._changes: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Per parameter, the global flat indices and values of this rank's changed elements."""

    def current(self, i: int) -> torch.Tensor:
        """This rank's elements of parameter i as they are now (a flat view, not a copy)."""
        p = self.params[i]
        length = self.lengths[i]
        partition = getattr(p, "ds_tensor", None)
        if partition is not None:  # ZeRO-3: the partition is this rank's range, padded at the end
            return partition.detach().reshape(-1)[:length]
        return p.detach().reshape(-1)[self.starts[i] : self.starts[i] + length]

    def refresh(self) -> list[int]:
        """Take the current elements as published (a full update): the shadow copies them and
        the checksums are computed anew; every rank calls it (one all-reduce)."""
        self.shadow = [self.current(i).clone() for i in range(len(self.params))]
        parts = [delta.checksum(s, start=start) for s, start in zip(self.shadow, self.starts)]
        self.checksums = self._summed(parts)
        return self.checksums

    def changes(self) -> list[int]:
        """Find this rank's changed elements since the last publication and take them as
        published; returns every parameter's changed count over all ranks (an all-gather, so
        every rank knows them: per rank, `counts_by_rank`). Every rank calls it."""
        assert self.shadow is not None, "changes() before the first refresh()"
        self._changes = []
        moved = []
        for i, shadow in enumerate(self.shadow):
            now = self.current(i)
            where = (~delta.same_bits(now, shadow)).nonzero().reshape(-1)
            values = now[where]
            index = where + self.starts[i]
            moved.append(delta.checksum(values, index) - delta.checksum(shadow[where], index))
            shadow[where] = values
            self._changes.append((index, values))
        self.checksums = [delta.combine([c, m]) for c, m in zip(self.checksums, self._summed(moved))]
        local = torch.tensor([len(index) for index, _ in self._changes], dtype=torch.int64, device=self._device())
        self.counts_by_rank = self._all_gather(local)
        return [int(c) for c in self.counts_by_rank.sum(0)]

    def pieces(self, forms: str, bucket_mb: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The wire pieces of the delta `changes()` found, in `forms`, one bucket of parameters
        at a time (rank 0 gathers each bucket's changes from every rank); other ranks get empty
        lists and must iterate to the end too (each bucket's gather is collective)."""
        sizes = [n * dtype.itemsize for n, (_, _, dtype) in zip(self.numels, self.specs)]
        first = 0
        for count in plan_buckets(sizes, bucket_mb):
            bucket = range(first, first + count)
            first += count
            parts = self._gather_bucket(bucket, forms)
            if self.rank != 0:
                yield []
                continue
            chunk = []
            for i in bucket:
                name, shape, dtype = self.specs[i]
                index = torch.cat([p[i][0] for p in parts])
                values = torch.cat([p[i][1] for p in parts])
                encoded = delta.encode(forms[i], self.numels[i], index, values)
                if forms[i] == DENSE:
                    encoded = [values.view(shape)]
                specs = delta.piece_specs(name, shape, dtype, forms[i], len(values))
                chunk.extend((spec[0], piece) for spec, piece in zip(specs, encoded))
            yield chunk

    def _gather_bucket(self, bucket: range, forms: str) -> list[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
        """Per rank (on rank 0; [] elsewhere), per parameter of the bucket, the (global flat
        indices, values) it sends: its changes, or its whole range for a DENSE one (indices
        then unused)."""
        mine = {}
        for i in bucket:
            if forms[i] == DENSE:
                mine[i] = (self._changes[i][0][:0], self.current(i))
            else:
                mine[i] = self._changes[i]
        if self.world_size == 1:
            return [mine]
        blob = torch.cat([_padded(part.contiguous().reshape(-1).view(torch.uint8)) for i in bucket for part in mine[i]])
        nbytes = [self._rank_bytes(r, bucket, forms) for r in range(self.world_size)]
        padded = torch.zeros(max(8, *nbytes), dtype=torch.uint8, device=blob.device)
        padded[: blob.numel()] = blob
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(padded, gathered, dst=0)
        if gathered is None:
            return []
        return [self._split(gathered[r], r, bucket, forms) for r in range(self.world_size)]

    def _rank_counts(self, r: int, i: int, forms: str) -> tuple[int, int]:
        """Indices and values rank r sends for parameter i."""
        if forms[i] == DENSE:
            part = -(-self.numels[i] // self.world_size)
            return 0, max(0, min(part, self.numels[i] - r * part))
        changed = int(self.counts_by_rank[r, i])
        return changed, changed

    def _rank_bytes(self, r: int, bucket: range, forms: str) -> int:
        total = 0
        for i in bucket:
            indices, values = self._rank_counts(r, i, forms)
            total += indices * 8 + _aligned(values * self.specs[i][2].itemsize)
        return total

    def _split(
        self, blob: torch.Tensor, r: int, bucket: range, forms: str
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        at = 0
        for i in bucket:
            indices, values = self._rank_counts(r, i, forms)
            dtype = self.specs[i][2]
            index = blob[at : at + indices * 8].view(torch.int64)
            at += indices * 8
            vals = blob[at : at + values * dtype.itemsize].view(dtype)
            at += _aligned(values * dtype.itemsize)
            out[i] = (index, vals)
        return out

    def _device(self) -> torch.device:
        return self.current(0).device if self.params else torch.device("cpu")

    def _summed(self, parts: list[int]) -> list[int]:
        """Per parameter, the sum of every rank's checksum part (mod the checksum's modulus)."""
        if self.world_size == 1:
            return [delta.combine([p]) for p in parts]
        # In 31-bit halves: a sum of W parts below 2**62 each would not fit in int64.
        parts = [p % delta.MODULUS for p in parts]
        local = torch.tensor([[p >> 31, p & (2**31 - 1)] for p in parts], dtype=torch.int64, device=self._device())
        dist.all_reduce(local)
        return [delta.combine([(int(high) << 31) + int(low)]) for high, low in local.tolist()]

    def _all_gather(self, local: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return local.unsqueeze(0)
        out = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(out, local)
        return torch.stack(out)


def _aligned(nbytes: int) -> int:
    """Each part of a gathered bucket starts at a multiple of 8 bytes (an int64 view needs it)."""
    return -(-nbytes // 8) * 8


def _padded(part: torch.Tensor) -> torch.Tensor:
    pad = _aligned(part.numel()) - part.numel()
    return torch.cat([part, part.new_zeros(pad)]) if pad else part
