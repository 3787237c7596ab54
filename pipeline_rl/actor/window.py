"""What an actor did since its last metrics record: groups, rollouts and tokens written, their
rewards, the lag of their oldest tokens, reward errors, and how long admission held it."""

from __future__ import annotations

import time

from pipeline_rl.streams.records import RolloutGroup


def oldest_version(versions: list[int]) -> int | None:
    policy = [v for v in versions if v >= 0]  # -1 marks environment tokens
    return min(policy) if policy else None


class Window:
    def __init__(self) -> None:
        self.start = time.monotonic()
        self.groups = self.rollouts = self.tokens = self.reward_errors = 0
        self.rewards: list[float] = []
        self.lags: list[int] = []
        self.blocked_s = 0.0

    def add(self, group: RolloutGroup, version: int) -> list[str]:
        """Count a group written while the actor's policy is `version`; returns its reward errors."""
        self.groups += 1
        errors = []
        for rollout in group.rollouts:
            self.rollouts += 1
            self.rewards.append(rollout.reward)
            self.tokens += sum(rollout.mask) if rollout.mask is not None else len(rollout.completion_ids)
            oldest = oldest_version(rollout.versions)
            if oldest is not None:
                self.lags.append(version - oldest)
            error = rollout.metadata.get("reward_error")
            if error:
                errors.append(str(error))
        self.reward_errors += len(errors)
        return errors

    def values(self) -> dict:
        """The window's metrics (None where it saw nothing to average)."""
        elapsed = max(time.monotonic() - self.start, 1e-9)
        return {
            "tokens_per_s": self.tokens / elapsed,
            "rollouts_per_s": self.rollouts / elapsed,
            "groups_per_s": self.groups / elapsed,
            "reward_mean": sum(self.rewards) / len(self.rewards) if self.rewards else None,
            "lag_mean": sum(self.lags) / len(self.lags) if self.lags else None,
            "lag_max": max(self.lags) if self.lags else None,
            "admission_blocked_s": self.blocked_s,
            "admission_blocked_frac": self.blocked_s / elapsed,
            "reward_errors": self.reward_errors,
        }
