"""Which problems an actor draws: the training set shuffled once per epoch with the run's seed,
actor I of n taking every n-th problem of each epoch's order, so the actors cover it without
overlap. An actor counts its draws over the run (its position file keeps the count), and may
pass over problems its policy already solves (`actor.skip_solved`)."""

from __future__ import annotations

import random

from pipeline_rl.streams.records import RolloutGroup


class ProblemOrder:
    """Actor `index`'s problems: every epoch a fresh shuffle (seeded by seed and epoch) of all
    problems, of which this actor takes every `actors`-th one."""

    def __init__(self, problems: list[dict], seed: int, index: int, actors: int):
        self.problems, self.seed, self.index, self.actors = problems, seed, index, actors
        self.per_epoch = len(range(index, len(problems), actors))
        if self.per_epoch == 0:
            raise ValueError(f"{len(problems)} problems are too few for {actors} actors")
        self._epoch, self._order = -1, []

    def __getitem__(self, n: int) -> dict:
        epoch, i = divmod(n, self.per_epoch)
        if epoch != self._epoch:
            order = list(range(len(self.problems)))
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
            self._epoch, self._order = epoch, order[self.index :: self.actors]
        return self.problems[self._order[i]]

    def rescaled(self, actors: int, drawn: int) -> tuple[ProblemOrder, int]:
        """The order of this actor's share in a job of `actors` actors, and where to go on in it
        after `drawn` draws: at the start of the next epoch (the shares of a half-done epoch
        would overlap)."""
        epoch = -(-drawn // self.per_epoch)
        order = ProblemOrder(self.problems, self.seed, self.index, actors)
        return order, epoch * order.per_epoch


class SolvedSkip:
    """Passes over, with probability `p` at each draw (seeded), a problem whose last group had
    every attempt at the best reward the actor has seen this run: such a group has no advantage,
    so no gradient, and late in a run most groups are like that. A group of the problem with any
    spread in rewards, or all below the best, clears it; it comes back after 1/(1-p) epochs on
    average. Kept in memory: a restarted actor starts with none."""

    def __init__(self, p: float, seed: str):
        self.p = p
        self._rng = random.Random(seed)
        self._solved: set[str] = set()
        self._best: float | None = None
        self.skipped = 0
        """Draws passed over since the actor started."""

    def skip(self, problem_id: str) -> bool:
        if not self.p or problem_id not in self._solved or self._rng.random() >= self.p:
            return False
        self.skipped += 1
        return True

    def record(self, group: RolloutGroup) -> None:
        if not self.p:
            return
        rewards = [r.reward for r in group.rollouts]
        self._best = max(rewards) if self._best is None else max(self._best, *rewards)
        per_token = any(r.token_rewards is not None for r in group.rollouts)
        if len(rewards) > 1 and not per_token and min(rewards) == self._best:
            self._solved.add(group.problem_id)
        else:
            self._solved.discard(group.problem_id)


def next_problem(order: ProblemOrder, drawn: int, solved: SolvedSkip) -> tuple[int, dict]:
    """The number of the next draw at or after `drawn` that `solved` does not pass over, and its
    problem (every draw is numbered, a passed-over one too)."""
    while solved.skip(order[drawn]["id"]):
        drawn += 1
    return drawn, order[drawn]
