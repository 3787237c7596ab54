"""The progress watchdog: a run either makes progress or stops and says why.

Progress is the trainer's policy version. Every process publishes metrics, and while it
waits it publishes a heartbeat with `waiting_on` (MetricsLogger.heartbeat). When the version
has not advanced for longer than the limit (`watchdog_startup_s` before the first version,
then max(`watchdog_s`, 5 x the longest interval between versions so far)), `stalled()`
returns a report of each process's last progress and what it waits on; the launcher prints
it, stops the run on every node and exits non-zero.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeline_rl.streams.records import Metrics

SLOWEST_STEP_FACTOR = 5.0
"""A stall is this many times the longest interval between two versions seen so far (or more)."""


@dataclass
class _Seen:
    at: float
    """When its last record arrived (the watchdog's clock)."""
    waiting_on: str = ""


class Watchdog:
    def __init__(self, stall_s: float, startup_s: float, clock: Callable[[], float] = time.monotonic):
        self.stall_s, self.startup_s, self.clock = stall_s, startup_s, clock
        self.version = 0
        self.version_at = clock()
        self.first_version_seen = False
        self.longest_interval = 0.0
        self.processes: dict[str, _Seen] = {}

    def observe(self, record: Metrics) -> None:
        now = self.clock()
        seen = self.processes.setdefault(record.process, _Seen(now))
        seen.at = now
        if "waiting_on" in record.values:
            seen.waiting_on = str(record.values["waiting_on"])
        version = record.values.get("version")
        if record.process.startswith("trainer") and isinstance(version, int) and version > self.version:
            if self.first_version_seen:
                self.longest_interval = max(self.longest_interval, now - self.version_at)
            self.version, self.version_at, self.first_version_seen = version, now, True

    def restarted(self) -> None:
        """The trainer pool restarted: its versions come again from its checkpoint, after a
        start-up (held to the start-up limit)."""
        self.version, self.version_at, self.first_version_seen = 0, self.clock(), False

    def limit_s(self) -> float:
        if not self.first_version_seen:
            return self.startup_s
        return max(self.stall_s, SLOWEST_STEP_FACTOR * self.longest_interval)

    def stalled(self) -> str | None:
        """None while the run progresses; else the report of who last did what."""
        if self.stall_s <= 0:
            return None
        now = self.clock()
        since = now - self.version_at
        if since <= self.limit_s():
            return None
        lines = [
            f"no progress: the policy version has stayed at {self.version} for {since:.0f} s "
            f"(limit {self.limit_s():.0f} s; watchdog_s / watchdog_startup_s)"
        ]
        for name in sorted(self.processes):
            seen = self.processes[name]
            waiting = f", waiting on: {seen.waiting_on}" if seen.waiting_on else ""
            lines.append(f"  {name}: last report {now - seen.at:.0f} s ago{waiting}")
        if not self.processes:
            lines.append("  no process has reported any metrics")
        return "\n".join(lines)
