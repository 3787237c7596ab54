"""Trainer rank 0's end of the weight broadcast: every published version goes to the actors in
the weight-update group (pipeline_rl/weight_sync/), announced on the "weights" stream.

An update that fails (an actor died or hangs) is logged and counted and training goes on: the
next update forms a group of the receivers registered then, so a dead actor is left out and its
replacement taken in. MAX_FAILED_UPDATES failures in a row stop the trainer (a group that cannot
form). A receiver that joins while the trainer waits for data gets the current weights at once
(`has_joiners`): the replacement of the only actor would otherwise wait for a version that its
own groups must make. Where every rank takes part in a publication (the gathers of ZeRO-3, the
changes of a delta over several ranks) that waits for the next step's update.

With trainer.weight_delta an update is full when it must be (the first, a group that changed, an
actor's request, every full_update_every) and otherwise a delta from every rank's own shard
(trainer/published_shards.py; the wire form in weight_sync/delta.py). Full updates carry the
per-tensor checksums too.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from pipeline_rl.config import RunConfig
from pipeline_rl.core.actor_count import ActorCountWatch
from pipeline_rl.streams.api import Streams
from pipeline_rl.streams.records import WeightUpdate
from pipeline_rl.trainer.full_weights import Named, gathered_chunks, parameter_specs
from pipeline_rl.trainer.published_shards import PublishedShards
from pipeline_rl.weight_sync import (
    WeightGroupFailed,
    WeightSender,
    backend_for,
    group_ranks,
    member_names,
    transfer_timeout_s,
)
from pipeline_rl.weight_sync.delta import DENSE, DeltaHeader, choose_form, piece_specs
from pipeline_rl.wire import WEIGHT_SYNC_ADDR_ENV, Topic

log = logging.getLogger(__name__)

MAX_FAILED_UPDATES = 3
"""Weight updates failed in a row after which the trainer stops (raises the last failure): one
failure is a member lost; several in a row, a group that cannot form."""


class WeightPublisher:
    def __init__(self, cfg: RunConfig, rank: int, streams: Streams, world_size: int = 1):
        self.rank = rank
        self.bucket_mb = cfg.trainer.weight_bucket_mb
        addr = os.environ.get(WEIGHT_SYNC_ADDR_ENV)
        self.broadcast = bool(addr)  # unset: no actors to update (tests, benchmarks)
        self.zero3 = cfg.trainer.zero_stage == 3
        self.failed = 0
        """Updates failed in a row."""
        self.failed_total = 0
        self.sender: WeightSender | None = None
        self.tp = cfg.shared.tensor_parallel_size
        self.world_size = world_size
        self.delta = self.broadcast and cfg.trainer.weight_delta and cfg.model.lora is None
        self.shards: PublishedShards | None = None
        """With trainer.weight_delta, this rank's share of the weights as last published."""
        self.full_every = cfg.trainer.full_update_every
        self.since_full = 0
        """Delta updates since the last full one."""
        self.full_total = 0
        if rank == 0 and addr:
            # The group takes the actors of a job scaled up since the launch too.
            self.actor_count = ActorCountWatch(streams, cfg.world.actors)
            actors = self.actor_count.largest
            self.sender = WeightSender(
                addr,
                group_ranks(0, actors, self.tp)[1],
                backend_for(cfg.world.gpus_per_node),
                transfer_timeout_s(cfg.world.collective_timeout_s),
                member_names(actors, self.tp),
            )
            # A trainer started again after the job shrank (actors scaled away, or absent on
            # Ray) waits for the actors there, not for every rank the job ever had.
            there = [i for i in range(self.actor_count.count) if i not in self.actor_count.absent]
            self.sender.expect([r for i in there for r in group_ranks(i, actors, self.tp)[0]])
            self.writer = streams.writer(Topic.WEIGHTS)

    def _follow_actor_count(self) -> None:
        assert self.sender is not None
        before = self.actor_count.largest
        self.actor_count.poll()
        if self.actor_count.largest > before:
            actors = self.actor_count.largest
            self.sender.resize(group_ranks(0, actors, self.tp)[1], member_names(actors, self.tp))

    def has_joiners(self) -> bool:
        """Whether a receiver joined that the current group lacks, and this rank can send alone."""
        if self.sender is None or self.zero3 or (self.delta and self.world_size > 1):
            return False  # every rank takes part in a publication
        self._follow_actor_count()
        return self.sender.has_joiners()

    def publish(self, version: int, published: Named) -> dict:
        """Send `published` (name, parameter) as `version`: rank 0 broadcasts, the others take
        part in the gathers under ZeRO-3 (a full update) or send rank 0 their changes (a delta).
        Returns rank 0's metrics of the update."""
        if not self.broadcast:
            return {}
        started = time.perf_counter()
        if self.delta and self.shards is None:
            self.shards = PublishedShards(published, self.rank, self.world_size)
        if self.shards is None:
            metrics = self._send(version, self._full(published), parameter_specs(published), None)
        elif (base := self._agree_base()) < 0:
            header = DeltaHeader(-1, "", self.shards.refresh())
            metrics = self._send(version, self._full(published), parameter_specs(published), header)
            self.since_full = 0
            self.full_total += 1
        else:
            metrics = self._send_delta(version, base)
            self.since_full += 1
        if self.sender is not None and self.shards is not None:
            metrics["weight_full_updates_total"] = self.full_total
        if self.sender is not None:
            metrics["weight_publish_s"] = time.perf_counter() - started
        return metrics

    def _full(self, published: Named) -> Iterator[list[tuple[str, torch.Tensor]]]:
        return gathered_chunks(published, self.rank, self.bucket_mb)

    def _agree_base(self) -> int:
        """The version the next update is a delta against, or -1 for a full one: rank 0 decides
        (weight_sync WeightSender.delta_base, every full_update_every, the first) and every rank
        takes its word (one broadcast), since both forms are collective."""
        assert self.shards is not None
        base = -1
        if self.sender is not None and self.shards.shadow is not None:
            periodic = self.full_every > 0 and self.since_full >= self.full_every - 1
            found = None if periodic else self.sender.delta_base()
            base = -1 if found is None else found
        if self.world_size > 1:
            word = torch.tensor([base], dtype=torch.int64, device=self.shards.current(0).device)
            dist.broadcast(word, src=0)
            base = int(word)
        return base

    def _send_delta(self, version: int, base: int) -> dict:
        """The changes since `base` from every rank's shard: counts (an all-gather), then each
        tensor's form, then each bucket's pieces gathered on rank 0 as the broadcast takes them."""
        shards = self.shards
        assert shards is not None
        counts = shards.changes()
        forms = "".join(
            choose_form(n, c, dtype.itemsize) for n, c, (_, _, dtype) in zip(shards.numels, counts, shards.specs)
        )
        specs = [
            piece
            for (name, shape, dtype), form, c in zip(shards.specs, forms, counts)
            for piece in piece_specs(name, shape, dtype, form, math.prod(shape) if form == DENSE else c)
        ]
        metrics = self._send(
            version, shards.pieces(forms, self.bucket_mb), specs, DeltaHeader(base, forms, shards.checksums)
        )
        if self.sender is not None:
            total = sum(shards.numels)
            dense = sum(n * dtype.itemsize for n, (_, _, dtype) in zip(shards.numels, shards.specs))
            metrics.update(
                weight_update_changed_fraction=sum(counts) / total if total else 0.0,
                weight_update_bytes_ratio=sum(math.prod(s) * d.itemsize for _, s, d in specs) / dense,
            )
        return metrics

    def _send(
        self,
        version: int,
        chunks: Iterator[list[tuple[str, torch.Tensor]]],
        specs: list[tuple[str, list[int], torch.dtype]],
        header: DeltaHeader | None,
    ) -> dict:
        """Rank 0 broadcasts the tensors of `chunks`; every other rank iterates them (the
        collectives behind each chunk)."""
        if self.sender is None:
            for _ in chunks:
                pass
            return {}
        self._follow_actor_count()
        try:
            seconds = self.sender.send(
                version,
                (pair for chunk in chunks for pair in chunk),
                announce=self._announce,
                bucket_mb=self.bucket_mb,
                specs=specs,
                header=header,
            )
        except WeightGroupFailed as e:
            self.failed += 1
            self.failed_total += 1
            if self.failed >= MAX_FAILED_UPDATES:
                raise
            log.warning("%s; the weight-update group re-forms at the next version", e)
            return {"weight_update_failed_total": self.failed_total}
        finally:
            for _ in chunks:  # leave the last gather, and finish any the other ranks are still in
                pass
        self.failed = 0
        return {
            "weight_update_bytes": sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in specs),
            "weight_broadcast_s": seconds,
            "weight_update_members": len(self.sender.members) - 1,
            "weight_update_failed_total": self.failed_total,
        }

    def _announce(self, update: WeightUpdate) -> None:
        self.writer.write(update)
        self.writer.flush()

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
