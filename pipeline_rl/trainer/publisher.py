"""Trainer rank 0's end of the weight broadcast: every published version goes to the actors in
the weight-update group (pipeline_rl/weight_sync/), announced on the "weights" stream.

An update that fails (an actor died or hangs) is logged and counted and training goes on: the
next update forms a group of the receivers registered then, so a dead actor is left out and its
replacement taken in. MAX_FAILED_UPDATES failures in a row stop the trainer (a group that cannot
form). A receiver that joins while the trainer waits for data gets the current weights at once
(`has_joiners`): the replacement of the only actor would otherwise wait for a version that its
own groups must make. Under ZeRO-3 every rank takes part in the gathers, so that waits for the
next step's update.
"""

from __future__ import annotations

import logging
import os

from pipeline_rl.config import RunConfig
from pipeline_rl.core.actor_count import ActorCountWatch
from pipeline_rl.streams.api import Streams
from pipeline_rl.streams.records import WeightUpdate
from pipeline_rl.trainer.full_weights import Named, gathered_chunks, parameter_specs
from pipeline_rl.weight_sync import (
    WeightGroupFailed,
    WeightSender,
    backend_for,
    group_ranks,
    member_names,
    transfer_timeout_s,
)
from pipeline_rl.wire import WEIGHT_SYNC_ADDR_ENV, Topic

log = logging.getLogger(__name__)

MAX_FAILED_UPDATES = 3
"""Weight updates failed in a row after which the trainer stops (raises the last failure): one
failure is a member lost; several in a row, a group that cannot form."""


class WeightPublisher:
    def __init__(self, cfg: RunConfig, rank: int, streams: Streams):
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
        if self.sender is None or self.zero3:
            return False
        self._follow_actor_count()
        return self.sender.has_joiners()

    def publish(self, version: int, published: Named) -> dict:
        """Send `published` (name, parameter) as `version`: rank 0 broadcasts, the others take
        part in the gathers under ZeRO-3. Returns rank 0's metrics of the update."""
        if not self.broadcast:
            return {}
        chunks = gathered_chunks(published, self.rank, self.bucket_mb)
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
                specs=parameter_specs(published),
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
