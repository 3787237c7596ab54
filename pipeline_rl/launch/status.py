"""The launcher's live status line, fed by the metrics stream: a progress bar over the run's
time limit when it has one (the CPU demo), else over trainer steps."""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm import tqdm

from pipeline_rl.streams.records import Metrics


class StatusLine:
    """Keeps the latest value of each metric per pool and shows the ones people watch."""

    def __init__(self, total_steps: int, reader: Any, max_time_s: float = 0.0):
        self.reader = reader
        self.latest: dict[str, dict[str, Any]] = {}
        self.by_time = max_time_s > 0
        self.start = time.monotonic()
        # In a log file (no terminal) one line every 30 s is enough.
        mininterval = 1.0 if sys.stderr.isatty() else 30.0
        if self.by_time:
            self.bar = tqdm(
                total=int(max_time_s),
                desc="time limit",
                dynamic_ncols=True,
                mininterval=mininterval,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}",
            )
        else:
            self.bar = tqdm(total=total_steps, desc="version", unit="step", dynamic_ncols=True, mininterval=mininterval)
        self._last_print = 0.0

    def _value(self, pool: str, key: str, default: Any = None) -> Any:
        values = [v[key] for name, v in self.latest.items() if name.startswith(pool) and key in v]
        if not values:
            return default
        if isinstance(values[0], (int, float)):
            return sum(values) if key.endswith(("_per_s", "_total")) else sum(values) / len(values)
        return values[0]

    def update(self, timeout: float) -> list[Metrics]:
        """Read new metrics, refresh the line; returns the records read."""
        records: list[Metrics] = [entry.record for entry in self.reader.read(timeout=timeout, max_count=1024)]
        for record in records:
            self.latest.setdefault(record.process, {}).update(record.values)
        version = int(self._value("trainer", "version", 0))
        done = min(int(time.monotonic() - self.start), self.bar.total) if self.by_time else version
        if done > self.bar.n:
            self.bar.update(done - self.bar.n)
        if time.time() - self._last_print < 1.0:
            return records
        self._last_print = time.time()
        fields = {
            "version": version if self.by_time else None,
            "samples/s": self._value("trainer", "samples_per_s"),
            "tok/s(actor)": self._value("actor", "tokens_per_s"),
            "reward": self._value("actor", "reward_mean"),
            "eval": self._value("actor", "eval/reward"),
            "lag": self._value("actor", "lag_mean"),
            "dropped": self._value("trainer", "dropped_total"),
            "lost": self._value("actor", "groups_lost_total"),
        }
        self.bar.set_postfix(
            {k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in fields.items() if v is not None}, refresh=False
        )
        return records

    def close(self) -> None:
        self.bar.close()
