"""Which training problem an actor generates next: a seeded shuffle per epoch, minus the
problems whose last group taught nothing (`actor.skip_uniform`)."""

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


class UniformSkip:
    """Skips, with probability `p` at each draw (seeded), a problem whose last group gave every
    attempt the same reward and no per-token rewards: every advantage of such a group is zero,
    so it carries no gradient (the preprocessor drops it: `preprocess.advantage.filter_zero`),
    and late in a run most groups are like that (a problem solved 8 times out of 8). Such a
    problem comes back after 1/(1-p) epochs on average; a group with any spread in rewards
    clears it."""

    def __init__(self, p: float, seed: str):
        self.p = p
        self._rng = random.Random(seed)
        self._uniform: set[str] = set()
        self.skipped = 0
        """Draws skipped since the actor started."""

    def skip(self, problem_id: str) -> bool:
        if not self.p or problem_id not in self._uniform or self._rng.random() >= self.p:
            return False
        self.skipped += 1
        return True

    def record(self, problem_id: str, group: RolloutGroup) -> None:
        if not self.p:
            return
        rollouts = group.rollouts
        uniform = (
            len(rollouts) > 1
            and all(r.reward == rollouts[0].reward for r in rollouts)
            and all(r.token_rewards is None for r in rollouts)
        )
        if uniform:
            self._uniform.add(problem_id)
        else:
            self._uniform.discard(problem_id)
