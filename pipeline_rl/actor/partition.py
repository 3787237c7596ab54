"""An actor's partition of the actor stream, and its position file beside it.

The position file's counts (actor/resume.py) are only right together with the partition's end
they were saved at: the groups after that end landed after the save (up to one save interval of
them when the actor was killed), and a restarted actor counts them as written. So one object
writes the groups, knows the partition's end after the last one that landed, reads the groups
that landed after a saved end, and saves the counts with the end they go with.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipeline_rl.actor.resume import SavedCounts
from pipeline_rl.streams import PositionStore, Streams
from pipeline_rl.streams.records import RolloutGroup
from pipeline_rl.wire import Topic


class Partition:
    def __init__(self, streams: Streams, index: int, position_file: Path):
        self.streams, self.index = streams, index
        self.writer = streams.writer(Topic.ACTOR, partitions=index + 1)
        self.store = PositionStore(position_file)
        self.found_end: str | None = None
        """The partition's end as this actor found it (the writer's ends follow once it writes)."""

    def saved(self) -> SavedCounts:
        """The counts of the last save ({} before the first: the first start)."""
        return SavedCounts.from_file(self.store.load(), self.store.path)

    def write(self, group: RolloutGroup) -> None:
        self.writer.write(group, partition=self.index)

    def landed_since(self, stream_end: str | None) -> list[str]:
        """The ids of the groups the partition got after `stream_end` (None: from its start)."""
        position = None if stream_end is None else {str(self.index): stream_end}
        reader = self.streams.reader(Topic.ACTOR, RolloutGroup, partitions=(self.index,), position=position)
        landed: list[str] = []
        while entries := reader.read(timeout=0.0, max_count=4096):
            landed.extend(e.record.group_id for e in entries)
        self.found_end = reader.position().get(self.index, stream_end)
        reader.close()
        return landed

    def trimmed_after(self, stream_end: str | None) -> bool:
        """Whether groups that landed after `stream_end` may be gone from the partition (consumed
        and trimmed), so that `landed_since` may not name them all."""
        return self.streams.trimmed_after(Topic.ACTOR, self.index, stream_end)

    def end(self) -> str | None:
        """The partition's end after this actor's last group that landed."""
        return self.writer.ends.get(self.index, self.found_end)

    def flushed_end(self) -> str | None:
        """The partition's end once every group written so far is in the stream."""
        self.writer.flush()
        return self.end()

    def save(self, counts: SavedCounts) -> None:
        """Save `counts` with the end they go with; every group they count as written is in the
        stream first, never still buffered."""
        self.store.save(dataclasses.replace(counts, stream_end=self.flushed_end()).to_file())
