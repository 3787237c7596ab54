"""How the trainer cuts its stream into steps (StepCollector) and a step into optimizer
updates (update_slices)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from pipeline_rl.streams.api import Entry
from pipeline_rl.streams.records import MicroBatch

log = logging.getLogger(__name__)


def update_slices(micro_batches: int, updates: int) -> list[slice]:
    """Consecutive, near-equal slices of a step's micro-batches, one per optimizer update
    (fewer when there are fewer micro-batches than updates)."""
    n = min(updates, micro_batches)
    return [slice(i * micro_batches // n, (i + 1) * micro_batches // n) for i in range(n)]


class MicroBatchSource(Protocol):
    """A trainer partition's reader (streams.api.Reader, or trainer.replay.ReplayingReader)."""

    def read(self, timeout: float = 1.0, max_count: int = 256) -> list[Entry]: ...


class StepCollector:
    """Assembles the micro-batches of one step from this rank's partition, reading only as
    many entries as the step still needs so that the stream position falls on step boundaries."""

    def __init__(self, reader: MicroBatchSource, rank: int):
        self.reader = reader
        self.rank = rank
        self.skipped = 0
        """Micro-batches of steps already trained (a preprocessor rewrote them after a restart)."""
        self.restarted = 0
        """Partial steps dropped because the step began again."""

    def next_step(
        self, version: int, stop: Callable[[], bool], waiting: Callable[[str], None] = lambda _: None
    ) -> list[MicroBatch] | None:
        """The micro-batches of the next untrained step, or None once `stop()` is true.
        `waiting` is told, while it waits, what it waits for."""
        batch: list[MicroBatch] = []
        while not stop():
            need = batch[0].count - len(batch) if batch else 1
            have = f"{len(batch)} of {batch[0].count}" if batch else "none yet"
            waiting(f"micro-batches of step {version} on trainer stream partition {self.rank} ({have})")
            for entry in self.reader.read(timeout=0.2, max_count=need):
                mb: MicroBatch = entry.record
                if mb.step < version:
                    self.skipped += 1
                    continue
                if batch and (mb.step != batch[0].step or mb.index == 0):
                    log.warning(
                        "dropping partial step %d (%d of %d micro-batches): step %d index %d follows at offset %s",
                        batch[0].step,
                        len(batch),
                        batch[0].count,
                        mb.step,
                        mb.index,
                        entry.offset,
                    )
                    self.restarted += 1
                    batch = []
                if mb.index != len(batch) or mb.count < 1 or (batch and mb.count != batch[0].count):
                    raise ValueError(
                        f"trainer stream partition {self.rank} offset {entry.offset}: micro-batch "
                        f"{mb.index} of {mb.count} of step {mb.step}, expected index {len(batch)}"
                    )
                batch.append(mb)
                if len(batch) == mb.count:
                    return batch
        return None
