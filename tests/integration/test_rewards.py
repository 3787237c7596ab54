"""Rewards: the arithmetic and math checks on good, wrong, malformed and adversarial answers,
and the worker pool's time limit (a pathological check returns within the limit + slack)."""

from __future__ import annotations

import asyncio
import time

import pytest

from pipeline_rl.config import load_config
from pipeline_rl.rollouts.domains import arithmetic, load_domain
from pipeline_rl.rollouts.domains import math as math_domain
from pipeline_rl.rollouts.domains.math import last_boxed
from pipeline_rl.rollouts.rewards import RewardPool

# Generous: a legitimate check must finish within the limit on a slow, loaded CI machine too.
LIMIT_S = 3.0
SLACK_S = 1.5


@pytest.mark.parametrize(
    "text, finish, reward",
    [
        ("85", "stop", 1.0),
        (" 85 ", "stop", 1.0),
        ("84", "stop", 0.0),
        ("85", "length", 0.0),  # no EOS: cut off
        ("8 5", "stop", 0.0),
        ("085", "stop", 0.0),
        ("85+0", "stop", 0.0),
        ("", "stop", 0.0),
        ("\x00\ufffd", "stop", 0.0),
        ("9" * 100_000, "stop", 0.0),
    ],
)
def test_arithmetic_exact_match(text, finish, reward):
    assert arithmetic.score(text, finish, "85") == reward


@pytest.mark.parametrize(
    "text, boxed",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed {x^{2}}", "x^{2}"),
        ("\\boxed{7} and an unclosed \\boxed{8", "7"),
        ("no box here", None),
        ("\\boxed{", None),
        ("\\boxed{}", ""),
    ],
)
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


def test_last_boxed_adversarial_is_linear():
    start = time.perf_counter()
    assert last_boxed("\\boxed{" * 20_000) is None
    assert last_boxed("{" * 50_000 + "\\boxed{1}" + "}" * 50_000) == "1"
    assert time.perf_counter() - start < 1.0


@pytest.fixture(scope="module")
def pool():
    pool = RewardPool(workers=1, timeout_s=LIMIT_S)
    yield pool
    pool.close()


def test_pool_value_error_and_recovery(pool):
    assert pool.call("math:hypot", 3, 4).value == 5.0
    failed = pool.call("math:sqrt", -1)
    assert failed.value is None and "ValueError" in failed.error and "math domain error" in failed.error
    unencodable = pool.call("builtins:object")
    assert unencodable.value is None and "TypeError" in unencodable.error
    printed = pool.call("builtins:print", "noise on stdout must not break the reply channel")
    assert printed.error is None
    assert pool.call("math:hypot", 6, 8).value == 10.0


def test_pool_timeout_kills_and_replaces_the_worker(pool):
    pool.call("math:hypot", 1, 1)  # worker ready: its start-up does not count against the limit
    restarts = pool.restarts
    start = time.monotonic()
    result = pool.call("time:sleep", 60)
    assert time.monotonic() - start < LIMIT_S + SLACK_S
    assert result.value is None and "timed out" in result.error
    assert pool.restarts == restarts + 1
    assert pool.call("math:hypot", 3, 4).value == 5.0


def test_pool_worker_death_is_an_error(pool):
    result = pool.call("os:_exit", 3)
    assert result.value is None and "exited with code 3" in result.error
    assert pool.call("math:hypot", 3, 4).value == 5.0


@pytest.fixture(scope="module")
def math_cfg():
    cfg = load_config(
        "base",
        [
            f"actor.reward_timeout_s={LIMIT_S}",
            "actor.reward_workers=2",
            "actor.domain=math",
            "actor.domain_settings.wrong=-0.5",
            "actor.domain_settings.no_answer=-1",
            "actor.domain_settings.unparsable=-0.75",
            "actor.domain_settings.truncated=-0.25",
        ],
    )
    math_domain.pool(cfg)
    yield cfg
    math_domain._pool.close()
    math_domain._pool = None


def outcome(text, answer, cfg, finish="stop"):
    return asyncio.run(math_domain.outcome(text, finish, answer, cfg))


@pytest.mark.parametrize(
    "text, answer, expected",
    [
        ("The sum is \\boxed{42}.", "42", "correct"),
        ("\\boxed{\\frac{84}{2}}", "42", "correct"),
        ("\\boxed{0.5}", "\\frac{1}{2}", "correct"),
        ("first \\boxed{41}, no wait: \\boxed{42}", "42", "correct"),
        ("\\boxed{41}", "42", "wrong"),
        ("\\boxed{x+1}", "42", "wrong"),
        ("The answer is 42.", "42", "no_answer"),
        ("\\boxed{42", "42", "no_answer"),
        ("\\boxed{}", "42", "unparsable"),
        ("\\boxed{" + "9" * 5000 + "}", "42", "wrong"),
    ],
)
def test_math_outcomes(math_cfg, text, answer, expected):
    kind, error = outcome(text, answer, math_cfg)
    assert (kind, error) == (expected, None)
    assert (
        getattr(load_domain(math_cfg.actor).settings, kind)
        == {"correct": 1.0, "wrong": -0.5, "no_answer": -1.0, "unparsable": -0.75}[kind]
    )


def test_math_truncated_is_not_checked(math_cfg):
    assert outcome("\\boxed{42}", "42", math_cfg, finish="length") == ("truncated", None)


PATHOLOGICAL = [
    "\\boxed{2^{2^{2^{2^{2^{2^{2}}}}}}}",  # a power tower: big-integer work in C
    "\\boxed{(x+1)^{3000}}",  # symbolic expansion in Python (sympy): over 20 s on this kind of machine
]


def test_math_pathological_answers_return_within_limit(math_cfg):
    # Both workers ready (start-up does not count against the limit); each answer kills one.
    assert outcome("\\boxed{42}", "42", math_cfg)[0] == "correct"
    assert outcome("\\boxed{42}", "42", math_cfg)[0] == "correct"
    for text in PATHOLOGICAL:
        start = time.monotonic()
        kind, error = outcome(text, "42", math_cfg)
        assert time.monotonic() - start < LIMIT_S + SLACK_S
        assert kind == "unparsable" and "timed out" in error
