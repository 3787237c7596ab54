"""The multi-step task's data, its corrupted steps (the PRM's training labels) and its reward."""

from __future__ import annotations

import random

from pipeline_rl.actor.domains.multistep import score
from pipeline_rl.demo.multistep import (
    SEPARATOR,
    TEST_PROBLEMS,
    TRAIN_PROBLEMS,
    corrupted_steps,
    make_problems,
    operands,
)


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


def test_corrupted_step_labels_say_whether_each_step_is_right():
    rng = random.Random(0)
    (p,) = make_problems(0)[1][:1]
    a, b, c = operands(p)
    kinds = set()
    for _ in range(500):
        (s1, s2), labels = corrupted_steps(p, rng)
        x, y = s1.split("=")[0].split("+"), s2.split("=")[0].split("+")
        first, second = int(s1.split("=")[1]), int(s2.split("=")[1])
        assert (int(x[0]), int(x[1])) == (a, b) and int(y[1]) == c
        right1 = first == a + b
        right2 = int(y[0]) == first and second == int(y[0]) + c
        assert labels == [int(right1), int(right2)]
        kinds.add(tuple(labels))
    assert kinds == {(0, 0), (0, 1), (1, 0), (1, 1)}, "every combination of right and wrong steps occurs"


def test_reward_needs_the_answer_on_the_last_line_and_a_stop():
    assert score("12+34=46\n46+56=102", "stop", "102") == 1.0
    assert score("12+34=46\n46+56=102\n", "stop", "102") == 1.0
    assert score("12+34=46\n46+56=103", "stop", "102") == 0.0
    assert score("12+34=46\n46+56=102", "length", "102") == 0.0
    assert score("46+56=102\n1", "stop", "102") == 0.0
    assert score("", "stop", "102") == 0.0
    assert score("=1102", "stop", "102") == 0.0
