"""The long, uneven task (pipeline_rl/demo/long_chain.py): every step a two-digit operation,
solutions that check, and completion lengths spread by 10x."""

from pipeline_rl.demo import long_chain
from pipeline_rl.demo.tiny_model import make_tokenizer
from pipeline_rl.rollouts.domains.multistep import score


def test_every_step_is_a_two_digit_operation_and_the_solution_checks():
    train, test = long_chain.make_problems(seed=3)
    assert len(train) == long_chain.TRAIN_PROBLEMS and len(test) == long_chain.TEST_PROBLEMS
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in test}
    for p in test:
        lines = p["solution"].split("\n")
        assert len(lines) == p["steps"]
        expected = p["prompt"].removeprefix("Q: ").removesuffix("=")
        value = None
        rebuilt = ""
        for line in lines:
            left, result = line.split("=")
            op = "+" if "+" in left else "-"
            a, b = (int(x) for x in left.split(op))
            assert value is None or a == value  # each line starts from the last result
            assert 10 <= a <= 99 and 10 <= b <= 99 and 10 <= int(result) <= 99
            assert int(result) == (a + b if op == "+" else a - b)
            rebuilt += (f"{a}" if value is None else "") + f"{op}{b}"
            value = int(result)
        assert rebuilt == expected and str(value) == p["answer"]
        assert score(p["solution"], "stop", p["answer"]) == 1.0
        assert score(p["solution"], "length", p["answer"]) == 0.0


def test_steps_are_uniform_and_completion_lengths_spread_tenfold():
    train, _ = long_chain.make_problems(seed=0)
    steps = [p["steps"] for p in train]
    counts = [steps.count(s) for s in range(long_chain.MIN_TERMS - 1, long_chain.MAX_TERMS)]
    # Drawn uniformly over 11 step counts; the one-step chains, of which there are only a few
    # thousand distinct ones, lose their repeats, the longer ones stay within 4 binomial
    # standard deviations of their share.
    n = len(train)
    share = (n - counts[0]) / 10
    sd = (share * (1 - 1 / 11)) ** 0.5
    assert all(abs(c - share) < 4 * sd for c in counts[1:]), counts
    assert counts[0] > share / 2, counts
    tok = make_tokenizer()
    lengths = [len(tok.encode(p["solution"], add_special_tokens=False)) + 1 for p in train[:2000]]
    assert max(lengths) >= 10 * min(lengths)
