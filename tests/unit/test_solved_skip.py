"""actor.skip_solved: which problems an actor passes over (pipeline_rl/actor/problems.py), and the
config's refusal of it beside scorers that may change the actor's rewards."""

from __future__ import annotations

import pytest

from pipeline_rl.actor.problems import ProblemOrder, SolvedSkip, next_problem
from pipeline_rl.config import ConfigError, load_config
from pipeline_rl.streams.records import Rollout, RolloutGroup


def group(problem_id: str, *rewards: float, token_rewards: list[float] | None = None) -> RolloutGroup:
    rollouts = [Rollout([1], [2], [-0.1], [0], r, "stop", token_rewards=token_rewards) for r in rewards]
    return RolloutGroup(problem_id=problem_id, group_id="", rollouts=rollouts)


def test_only_a_problem_whose_attempts_all_got_the_best_reward_is_passed_over():
    skip = SolvedSkip(0.999999, "seed")
    skip.record(group("solved", 1.0, 1.0))
    skip.record(group("failed", 0.0, 0.0))  # uniform, but below the best seen: it has something to learn
    skip.record(group("mixed", 0.0, 1.0))
    skip.record(group("dense", 1.0, 1.0, token_rewards=[1.0]))  # per-token rewards carry advantages
    assert [skip.skip(p) for p in ("solved", "failed", "mixed", "dense", "unseen")] == [True] + [False] * 4
    assert skip.skipped == 1


def test_the_best_reward_is_the_runs_so_a_higher_one_clears_what_was_solved_below_it():
    skip = SolvedSkip(0.999999, "seed")
    skip.record(group("a", 0.5, 0.5))
    assert skip.skip("a")  # the best so far
    skip.record(group("b", 1.0, 0.0))
    skip.record(group("a", 0.5, 0.5))  # no longer the best: learnable
    assert not skip.skip("a")
    skip.record(group("a", 1.0, 0.5))  # a spread clears it as well
    assert not skip.skip("a")


def test_a_problem_is_passed_over_with_probability_p():
    p, draws = 0.75, 4000
    skip = SolvedSkip(p, "seed")
    skip.record(group("solved", 1.0, 1.0))
    skipped = sum(skip.skip("solved") for _ in range(draws))
    # Binomial(4000, 0.75): sd 27.4; 5 sd either side
    assert abs(skipped - p * draws) < 5 * (draws * p * (1 - p)) ** 0.5
    assert not SolvedSkip(0.0, "seed").skip("solved")


def test_skip_solved_is_refused_beside_scorers_and_outside_its_range():
    scorer = "preprocess.scorers=[{cls: 'fixtures.faulty_scorer:EveryThirdBatchFails'}]"
    with pytest.raises(ConfigError, match=r"'actor\.skip_solved'.*'preprocess\.scorers'"):
        load_config("tiny", ["actor.skip_solved=0.5", scorer])
    with pytest.raises(ConfigError, match=r"actor\.skip_solved.*< 1"):
        load_config("tiny", ["actor.skip_solved=1.0"])
    assert load_config("tiny", ["actor.skip_solved=0.5"]).actor.skip_solved == 0.5


def test_the_draws_pass_over_the_solved_problems_and_number_every_draw():
    problems = [{"id": f"p{i}"} for i in range(6)]
    order = ProblemOrder(problems, seed=3, index=0, actors=1)
    skip = SolvedSkip(0.999999, "seed")
    solved = {order[1]["id"], order[2]["id"]}
    for problem_id in solved:
        skip.record(group(problem_id, 1.0, 1.0))
    draws, drawn = [], 0
    while drawn < 6:
        number, problem = next_problem(order, drawn, skip)
        draws.append((number, problem["id"]))
        drawn = number + 1
    # draws 1 and 2 were passed over; the numbers are the order's positions
    assert draws == [(0, order[0]["id"]), (3, order[3]["id"]), (4, order[4]["id"]), (5, order[5]["id"])]
    assert skip.skipped == 2
