"""Scorers with injected faults, for the lost-group and watchdog tests."""

from __future__ import annotations

import time

from pipeline_rl.scorers import Scorer


class EveryThirdBatchFails(Scorer):
    def __init__(self, cfg, **kwargs):
        super().__init__(cfg)
        self.calls = 0

    def score(self, groups) -> None:
        self.calls += 1
        if self.calls % 3 == 0:
            raise RuntimeError(f"injected scorer failure on batch {self.calls}")


class HangsAfterGroups(Scorer):
    """Scores `after_groups` groups, then hangs forever: a stall after the run has made progress
    (a hang before the first step would be the watchdog's start-up window instead)."""

    def __init__(self, cfg, after_groups: int = 12, **kwargs):
        super().__init__(cfg)
        self.after_groups = after_groups
        self.seen = 0

    def score(self, groups) -> None:
        self.seen += len(groups)
        while self.seen > self.after_groups:
            time.sleep(1)
