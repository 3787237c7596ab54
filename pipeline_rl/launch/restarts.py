"""The restart policy: which lost process the run loop replaces, within what budget, and the
record of each restart.

A lost actor or preprocessor is started again in its slot (it resumes from its position file);
a lost trainer rank takes the whole trainer pool with it, and the pool starts again from the
last checkpoint while the actors and preprocessors go on (the trainers cannot go on with a
rank missing: their process group is fixed). Redis and the run's other services are not
restarted. Each process (the trainer pool counting as one) may be restarted `world.max_restarts`
times within any RESTART_WINDOW_S; one more failure stops the run as it would without restarts,
naming the process and its restarts.

Every restart is printed and appended to RUN_DIR/restarts.jsonl (what died, why, when; again,
with when the replacement was started and how long the recovery took, once it reports) and
counted in the launcher's metrics ("restarts_total", "restarts/<what>_total", "recovery_s").
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

RESTART_WINDOW_S = 3600.0
"""The window `world.max_restarts` counts restarts in."""
TRAINER_POOL = "trainer pool"
"""What a lost trainer rank restarts, and the name its restarts are counted under."""


@dataclass
class Restart:
    what: str
    """The process restarted (actor0, preprocessor1) or TRAINER_POOL."""
    died: str
    """The process that was lost."""
    reason: str
    """How it failed, as the launcher reports a failure."""
    at: float
    """When the loss was found (time.time())."""
    number: int
    """Restarts of `what` within the window, this one included."""
    restarted_at: float | None = None
    """When the replacement was started, the lost process's peers in it stopped before: a report
    written later is the replacement's (one written between the loss and this can still be a
    peer's, finishing the step it was in)."""
    recovered_s: float | None = None
    """Seconds from the loss to the replacement's first report (its first step for the trainer
    pool), once known."""


def restart_target(process: str, restartable: set[str]) -> str | None:
    """What a failure of `process` restarts: the process itself, the trainer pool for a trainer
    rank, or None when it is not restarted (a service, or not one of `restartable`)."""
    if process not in restartable:
        return None
    return TRAINER_POOL if process.startswith("trainer") else process


class RestartPolicy:
    def __init__(self, max_restarts: int, log_path: Path | None, clock: Callable[[], float] = time.time):
        self.max_restarts, self.log_path, self.clock = max_restarts, log_path, clock
        self._recent: dict[str, deque[float]] = defaultdict(deque)
        self.done: list[Restart] = []
        self.pending: list[Restart] = []
        """Restarts whose replacement has not reported yet."""

    def allows(self, what: str) -> bool:
        """Whether `what` may be restarted once more within the window."""
        recent = self._recent[what]
        while recent and recent[0] <= self.clock() - RESTART_WINDOW_S:
            recent.popleft()
        return len(recent) < self.max_restarts

    def spent(self, what: str) -> str:
        """Why `what` is not restarted again, for the failure report."""
        if self.max_restarts == 0:
            return ""
        return (
            f"; {what} was already restarted {len(self._recent[what])} times within "
            f"{RESTART_WINDOW_S / 3600:g} h (world.max_restarts={self.max_restarts})"
        )

    def record(self, what: str, died: str, reason: str) -> Restart:
        now = self.clock()
        self._recent[what].append(now)
        restart = Restart(what, died, reason, now, len(self._recent[what]))
        self.done.append(restart)
        self.pending.append(restart)
        self._append(restart)
        return restart

    def started(self, restart: Restart) -> None:
        """Note that the replacement of `restart` has been started."""
        restart.restarted_at = self.clock()

    def recovered(self, process: str, step: bool, at: float) -> Restart | None:
        """Note a report of `process` written at `at` (`step`: a trainer's step record): the
        pending restart it ends, with its recovery time, or None."""
        for restart in self.pending:
            if restart.restarted_at is None or at <= restart.restarted_at:  # the lost process's or a peer's
                continue
            if restart.what == process or (restart.what == TRAINER_POOL and step):
                restart.recovered_s = round(self.clock() - restart.at, 1)
                self.pending.remove(restart)
                self._append(restart)
                return restart
        return None

    def counts(self) -> dict[str, float]:
        """The launcher's metrics: restarts in all and by what was restarted."""
        values: dict[str, float] = {"restarts_total": len(self.done)}
        for restart in self.done:
            key = f"restarts/{restart.what.replace(' ', '_')}_total"
            values[key] = values.get(key, 0) + 1
        return values

    def describe(self, on_ray: bool) -> str:
        """The policy, as `--dry-run` prints it."""
        if self.max_restarts == 0:
            return "restarts: none (world.max_restarts=0): any lost process stops the run"
        where = (
            "its Ray bundle (where Ray places it again when its node is lost; the actors of a frozen node "
            "that held only actors start on any node with room, and while none has, the other actors "
            "carry the run; a lost node 0 or another frozen node stops the run)"
            if on_ray
            else "its slot"
        )
        return (
            f"restarts: up to {self.max_restarts} per process within {RESTART_WINDOW_S / 3600:g} h "
            f"(world.max_restarts): a lost actor or preprocessor is started again in {where}, a lost "
            "trainer rank restarts the trainer pool from the last checkpoint; Redis is not restarted"
        )

    def _append(self, restart: Restart) -> None:
        if self.log_path is None:
            return
        with open(self.log_path, "ab") as f:
            f.write(orjson.dumps(asdict(restart)) + b"\n")
