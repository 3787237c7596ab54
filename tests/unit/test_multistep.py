"""The multi-step task's data and its reward."""

from __future__ import annotations

from pipeline_rl.demo.multistep import (
    SEPARATOR,
    TEST_PROBLEMS,
    TRAIN_PROBLEMS,
    make_problems,
    operands,
)
from pipeline_rl.rollouts.domains.multistep import score


def test_problems_are_deterministic_disjoint_and_two_digit_steps():
    train, test = make_problems(0)
    assert (train, test) == make_problems(0) and make_problems(1) != (train, test)
    assert len(train) == TRAIN_PROBLEMS and len(test) == TEST_PROBLEMS
    assert not {p["id"] for p in train} & {p["id"] for p in test}
    for p in train[:200] + test[:200]:
        a, b, c = operands(p)
        assert a >= 10 and b >= 10 and a + b < 100 and 10 <= c <= 99
        assert p["prompt"] == f"Q: {a}+{b}+{c}=" and p["answer"] == str(a + b + c)
        assert p["solution"] == f"{a}+{b}={a + b}{SEPARATOR}{a + b}+{c}={a + b + c}"


def test_reward_needs_the_answer_on_the_last_line_and_a_stop():
    assert score("12+34=46\n46+56=102", "stop", "102") == 1.0
    assert score("12+34=46\n46+56=102\n", "stop", "102") == 1.0
    assert score("12+34=46\n46+56=103", "stop", "102") == 0.0
    assert score("12+34=46\n46+56=102", "length", "102") == 0.0
    assert score("46+56=102\n1", "stop", "102") == 0.0
    assert score("", "stop", "102") == 0.0
    assert score("=1102", "stop", "102") == 0.0
