"""An actor's tie to the trainer's weights: its engine's receivers in the weight-update group, the
trainer's latest version as the sender publishes it, and leaving the group when the job is
scaled below the actor.

With env PIPELINE_RL_WEIGHT_SYNC_ADDR set (the launcher sets it) the engine joins the group (one
rank, or one per tensor-parallel worker: weight_sync.group_ranks) and swaps in every version the
trainer announces on the "weights" stream. Without it the actor keeps its starting weights (tests
and generation-only runs) and the trainer's version is the engine's own.
"""

from __future__ import annotations

import logging
import os

from pipeline_rl.config import RunConfig
from pipeline_rl.streams import Streams
from pipeline_rl.streams.records import WeightUpdate
from pipeline_rl.wire import WEIGHT_SYNC_ADDR_ENV, Topic

log = logging.getLogger("pipeline_rl.actor.weight_link")

TRAINER_VERSION_WAIT_S = 5.0
"""Longest wait for the sender's latest version at a rebase (a restarting trainer has none)."""


class WeightLink:
    def __init__(self, cfg: RunConfig, index: int, llm, streams: Streams, largest: int):
        """Join the weight-update group as actor `index` of at most `largest` (when the launcher
        gave an address) and start taking the versions announced on the "weights" stream."""
        self.cfg, self.index, self.llm = cfg, index, llm
        self.addr = os.environ.get(WEIGHT_SYNC_ADDR_ENV)
        self.receiver = None
        if not self.addr:
            log.warning(
                "%s is not set: no weight updates, the actor keeps version %d", WEIGHT_SYNC_ADDR_ENV, llm.version
            )
            return
        from pipeline_rl.weight_sync import backend_for, transfer_timeout_s

        self.receiver = llm.weight_receiver(
            self.addr,
            index,
            largest,
            backend_for(cfg.world.gpus_per_node),
            transfer_timeout_s(cfg.world.collective_timeout_s),
            cfg.actor.llm.stage_weights_on_host,
        )
        llm.start_receiver(self.receiver, streams.reader(Topic.WEIGHTS, WeightUpdate))

    def published_version(self) -> int:
        """The sender's latest version, waiting up to the collective timeout for its store (0
        without a group)."""
        if not self.addr:
            return 0
        from pipeline_rl.weight_sync import published_version

        return published_version(self.addr, self.cfg.world.collective_timeout_s)

    def trainer_version(self) -> int:
        """The trainer's latest version as far as this actor can tell: the sender's, else the
        engine's own (a restarting trainer has no sender to ask)."""
        if not self.addr:
            return self.llm.version
        from pipeline_rl.weight_sync import published_version

        try:
            return max(self.llm.version, published_version(self.addr, TRAINER_VERSION_WAIT_S))
        except (RuntimeError, TimeoutError, OSError) as e:
            log.warning("the trainer's latest version is not known (%s): rebasing on version %d", e, self.llm.version)
            return self.llm.version

    def leave(self, largest: int) -> None:
        """Take this actor's ranks out of the group for good, waiting until the sender has formed
        one without them (so no transfer waits for an actor that is gone)."""
        if not self.addr:
            return
        from pipeline_rl.weight_sync import group_ranks, leave_group

        ranks, _ = group_ranks(self.index, largest, self.cfg.shared.tensor_parallel_size)
        if not leave_group(self.addr, ranks, self.cfg.world.collective_timeout_s):
            log.warning("the weight-update group did not re-form without actor %d in time: leaving anyway", self.index)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
