"""How many actors a running job has: world.actors at the launch, then what the job was scaled
to (`pipeline-rl ... --actors N`, pipeline_rl/launch/scaling.py).

The launcher writes an ActorCount record to the "actor_count" topic at each change; every pool
reads the topic from its start and takes the last record written since the launch (records of
an earlier launch of the same run directory are older than wire.LAUNCHED_AT_ENV: a run started
again runs world.actors of its own config). Actors 0..count-1 generate; an actor of a higher
index drains (finishes its groups in flight, leaves the weight-update group, exits 0). The
preprocessors read every actor partition up to the largest count seen, since a draining actor
still writes; trainer rank 0 widens the weight-update group to the same bound.

An actor of the job that is lost and cannot be started again at once (on Ray, no node has room
for it) is *absent* until it is back: the actors present share each step among themselves
(admission counts `present`), so the run goes on at the rate they support.
"""

from __future__ import annotations

import time

from pipeline_rl.core.process import launched_at
from pipeline_rl.streams.api import Streams
from pipeline_rl.streams.records import ActorCount
from pipeline_rl.wire import Topic

CHECK_EVERY_S = 1.0
"""How often `poll` reads the topic (a Redis round trip each time)."""


class ActorCountWatch:
    def __init__(self, streams: Streams, initial: int):
        self.reader = streams.reader(Topic.ACTOR_COUNT, ActorCount)
        self.since = launched_at()
        """Records written before the launch belong to an earlier one (None: started by hand, all count)."""
        self.count = initial
        """The current count."""
        self.largest = initial
        """The largest count since the launch: actors up to it may still write (draining)."""
        self.scaled = False
        """Whether the launcher wrote a count since the launch (the job was scaled, or an actor
        is or was absent)."""
        self.absent: frozenset[int] = frozenset()
        """Actors of the job not running now (see the module's docstring)."""
        self._checked = 0.0
        self.read()

    def read(self) -> int:
        """Take every record written so far; returns the current count."""
        while entries := self.reader.read(timeout=0.0, max_count=256):
            for entry in entries:
                record: ActorCount = entry.record
                if self.since is None or record.time >= self.since:
                    self.count, self.absent, self.scaled = record.count, frozenset(record.absent), True
                    self.largest = max(self.largest, record.count)
        return self.count

    @property
    def present(self) -> int:
        """The job's actors that are running (at least 1: an actor that asks is one)."""
        return max(1, self.count - sum(1 for i in self.absent if i < self.count))

    def poll(self) -> int:
        """`read`, at most every CHECK_EVERY_S; returns the current count."""
        now = time.monotonic()
        if now - self._checked >= CHECK_EVERY_S:
            self._checked = now
            self.read()
        return self.count
