"""Which problems an actor draws: the training set shuffled once per epoch with the run's seed,
actor I of n taking every n-th problem of each epoch's order, so the actors cover it without
overlap. An actor counts its draws over the run (its position file keeps the count)."""

from __future__ import annotations

import random


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
