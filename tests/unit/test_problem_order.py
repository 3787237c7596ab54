"""Which problems an actor draws (actor/problems.py): the actors' shares of an epoch cover the
training set once; after the job is rescaled mid-epoch, each actor goes on at the next epoch of
its new share, and the new shares again cover it once."""

from __future__ import annotations

import pytest

from pipeline_rl.actor.problems import ProblemOrder

PROBLEMS = [{"id": str(i)} for i in range(50)]


def epoch_of(orders: list[ProblemOrder], starts: list[int]) -> list[str]:
    return [o[s + i]["id"] for o, s in zip(orders, starts) for i in range(o.per_epoch)]


@pytest.mark.parametrize("before, after", [(2, 3), (3, 1), (4, 4)])
def test_the_shares_of_an_epoch_cover_the_problems_once_before_and_after_a_rescale(before, after):
    orders = [ProblemOrder(PROBLEMS, seed=7, index=i, actors=before) for i in range(before)]
    drawn = epoch_of(orders, [o.per_epoch for o in orders])  # epoch 1
    assert sorted(drawn) == sorted(p["id"] for p in PROBLEMS)
    # Rescaled after a part of epoch 2 (actors that stay; an added one starts at draw 0).
    went_on = [orders[i].rescaled(after, 2 * orders[i].per_epoch + 5) for i in range(min(before, after))]
    went_on += [(ProblemOrder(PROBLEMS, 7, i, after), None) for i in range(before, after)]
    for (order, start), i in zip(went_on, range(after)):
        assert order.actors == after and order.index == i
        assert start is None or start == 3 * order.per_epoch  # the start of epoch 3
    new = [order for order, _ in went_on]
    assert sorted(epoch_of(new, [3 * o.per_epoch for o in new])) == sorted(p["id"] for p in PROBLEMS)
