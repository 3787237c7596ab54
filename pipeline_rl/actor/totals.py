"""An actor's running totals since its start: groups written, failed rollouts and reward checks,
groups lost by cause, time blocked by admission and idle. They go into every metrics record
beside the window since the last record (actor/window.py)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Totals:
    written: int = 0
    """Groups that landed in the partition (a resumed actor starts from its saved count)."""
    reward_errors: int = 0
    """Rollouts whose reward check failed (they got the failure reward)."""
    last_reward_error: str = ""
    rollout_errors: int = 0
    """Rollouts that raised: their groups are lost."""
    last_rollout_error: str = ""
    consecutive_failures: int = 0
    """Rollouts in a row that raised (a broken domain ends the actor)."""
    lost_reported: int = 0
    """Groups the preprocessors reported lost (scorer, decode), as read from the lost stream."""
    lost_by_cause: Counter[str] = field(default_factory=Counter)
    """The reported ones by cause, since this start."""
    lost_stopped: int = 0
    """Groups in flight when this actor last stopped or was killed, not continued."""
    lost_continuation: int = 0
    """Continued groups whose rollout asked for other generations than the saved ones."""
    blocked_s: float = 0.0
    """Time admission held the next group back."""
    idle_s: float = 0.0
    """Time with no group in flight: the engine had nothing to generate."""

    def rollout_failed(self, error: BaseException) -> str:
        """Count a rollout that raised; returns its error text."""
        self.rollout_errors += 1
        self.consecutive_failures += 1
        self.last_rollout_error = f"{type(error).__name__}: {error}"[:500]
        return self.last_rollout_error

    def group_written(self, reward_errors: list[str]) -> None:
        self.consecutive_failures = 0
        self.written += 1
        if reward_errors:
            self.reward_errors += len(reward_errors)
            self.last_reward_error = reward_errors[-1]

    def values(self) -> dict:
        """The totals' part of a metrics record."""
        return {
            "admission_blocked_total_s": self.blocked_s,
            "idle_total_s": self.idle_s,
            "groups_written_total": self.written,
            "reward_errors_total": self.reward_errors,
            "last_reward_error": self.last_reward_error,
            "rollout_errors_total": self.rollout_errors,
            "last_rollout_error": self.last_rollout_error,
            "groups_lost_total": self.lost_reported + self.rollout_errors + self.lost_stopped + self.lost_continuation,
            "groups_lost/rollout_total": self.rollout_errors,
            "groups_lost/stopped_total": self.lost_stopped,
            "groups_lost/continuation_total": self.lost_continuation,
            **{f"groups_lost/{cause}_total": n for cause, n in sorted(self.lost_by_cause.items())},
        }
