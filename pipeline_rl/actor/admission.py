"""Admission control: an actor starts a rollout group only if it will not be too stale to train.

A trainer step takes exactly `groups_per_step` groups (pipeline_rl/preprocess/preprocessor.py), so with
n actors each actor contributes a share of groups_per_step / n groups per step, and the g-th
group an actor starts (0-based, counted over the whole run) lands in trainer step about
floor(g / share). Its tokens come from a policy version >= the actor's version v when it
starts, so it is trained at most floor(g / share) - v versions behind. An actor therefore
starts group g only while

    floor(g / share) - v <= max_lag

and otherwise waits for newer weights. That bounds what an actor has generated ahead of the
trainer by (max_lag + 1) * share groups, the trainer's lag gate rarely has to drop anything,
and a stalled trainer stalls its actors instead of letting them fill the streams.
`actor.admission_lag`, when set, takes max_lag's place in this rule: a larger value keeps
actors generating while the trainer is slow, and the trainer's gate drops or masks what then
lands too stale.

The landing step is a prediction: it assumes the actors produce at similar rates (the
preprocessor takes groups as they arrive) and a share that divides groups_per_step (an
uneven share can land one step later). A much slower actor's groups land later than
predicted; the trainer's own lag gate drops whatever ends up beyond max_lag.

`max_lag = 0` is conventional synchronous RL: generate one step's groups with the current
policy, wait for the update, repeat. Versions advance only when the trainer publishes weights
(every `weight_update_interval` steps), so the bound used is at least interval - 1; anything
less would wait for a version that is never sent.

Resume: the count goes on from what the actor had started before (saved in its position
file), and at least from checkpoint version x share, the first group the resumed trainer needs.

A job scaled to another number of actors (pipeline_rl/core/actor_count.py) changes every
actor's share. The count is rebased so that the next group still lands in the step predicted
for it, and later ones follow at the new share: its number becomes the first that lands in that
step at the new share; but never past the bound of the actor's version, so that it may start
a share at once. An actor that made more than its share (another was slower, or started late)
predicts its groups later than they land, which is harmless while the others fill the steps it
waits for; once they are drained it would wait for versions that wait for its groups. Each
actor starting a share at once makes a step, and each step opens the next share.

An actor that made less than its share (the others were faster) predicts its groups earlier
than they land, and that lasts: once it is the only one, every group it starts at the bound
lands a step late and the trainer's gate drops it. So when the job has fewer actors (scaled
down, or one absent), the next group's step is the bound of the trainer's latest version V:
V + max_lag. No group lands before the groups already written and in flight, which fill steps
from V on: at most (max_lag + 1) shares of each actor that stays, which is less than max_lag
steps' worth when at most max_lag / (max_lag + 1) of the actors stay (a group landing earlier
than predicted is harmless); and it lands no earlier than step V, so the actor still starts a
share at once when its policy is V. `offset`
keeps the sum of those moves, so that a resumed actor can tell its count from the groups it
wrote.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline_rl.config import RunConfig


def effective_max_lag(max_lag: int, weight_update_interval: int, sync: bool) -> int:
    """The bound an actor admits by: 0 in sync mode, never below interval - 1."""
    return max(0 if sync else max_lag, weight_update_interval - 1)


def admission_lag(cfg: RunConfig) -> int:
    """The bound an actor of run `cfg` admits by: actor.admission_lag, by default shared.max_lag."""
    lag = cfg.shared.max_lag if cfg.actor.admission_lag is None else cfg.actor.admission_lag
    return effective_max_lag(lag, cfg.shared.weight_update_interval, cfg.actor.mode == "sync")


class Admission:
    def __init__(self, groups_per_step: int, actors: int, max_lag: int, started: int = 0):
        if groups_per_step < 1 or actors < 1 or max_lag < 0 or started < 0:
            raise ValueError(
                f"bad admission settings: groups_per_step={groups_per_step}, actors={actors}, "
                f"max_lag={max_lag}, started={started}"
            )
        self.groups_per_step = groups_per_step
        self.actors = actors
        self.max_lag = max_lag
        self.started = started
        """Groups this actor has started over the run (rebased: `offset`): the next one is group `started`."""
        self.offset = 0
        """What rebases added to `started` (negative when the share grew)."""

    def step_of(self, group: int) -> int:
        """Trainer step that group number `group` of this actor lands in: floor(g / share)."""
        return group * self.actors // self.groups_per_step

    def may_start(self, version: int) -> bool:
        """Whether the next group may start while the actor's policy is `version`."""
        return self.step_of(self.started) - version <= self.max_lag

    def start(self) -> int:
        """Count a started group; returns its number."""
        group = self.started
        self.started += 1
        return group

    def abandon(self) -> None:
        """A started group will not land in any step (its rollout failed): it no longer counts."""
        self.started -= 1

    def rebase(self, actors: int, version: int, trainer_version: int | None = None) -> None:
        """The job now has `actors` actors and this actor's policy is `version`: keep the next
        group's step, but within the bound of `version` (see the module's docstring), and take
        the new share after it. With fewer actors and the trainer's latest `trainer_version`
        known, the next group's step is that version's bound instead (see the docstring)."""
        if actors < 1:
            raise ValueError(f"bad actor count {actors}")
        step = min(self.step_of(self.started), version + self.max_lag)
        if trainer_version is not None and actors < self.actors:
            step = trainer_version + self.max_lag
        self.actors = actors
        moved = self.first_group_of(step) - self.started
        self.started += moved
        self.offset += moved

    def first_group_of(self, step: int) -> int:
        """The smallest group number that lands in `step` or later."""
        return -(-step * self.groups_per_step // self.actors)

    def ahead_limit(self, version: int) -> int:
        """Total groups this actor may have started while its policy is `version`."""
        return self.first_group_of(version + self.max_lag + 1)
