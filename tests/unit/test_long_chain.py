"""The long, uneven task (pipeline_rl/demo/long_chain.py): solutions that follow the recurrence
and check, every start and length once, and completion lengths spread by 10x."""

from pipeline_rl.config import load_config
from pipeline_rl.demo import long_chain
from pipeline_rl.demo.tiny_model import make_tokenizer
from pipeline_rl.rollouts.domains.multistep import score


def test_each_line_follows_the_recurrence_and_the_solution_checks():
    train, test = long_chain.make_problems(seed=3)
    for p in train + test:
        a, b = int(p["prompt"][3]), int(p["prompt"][5])
        lines = p["solution"].split("\n")
        assert len(lines) == p["steps"] and p["prompt"].endswith(f" to {long_chain.LETTERS[p['steps'] - 1]}=")
        for letter, line in zip(long_chain.LETTERS, lines, strict=False):
            assert line == f"{letter}{a}+{b}={(a + b) % 10}"
            a, b = b, (a + b) % 10
        assert p["answer"] == str(b)
        assert score(p["solution"], "stop", p["answer"]) == 1.0
        assert score(p["solution"], "length", p["answer"]) == 0.0
        # One wrong step changes the answer the check sees (the next line carries it on).
        broken = p["solution"][:-1] + str((int(p["solution"][-1]) + 1) % 10)
        assert score(broken, "stop", p["answer"]) == 0.0


def test_every_start_and_length_once_disjoint_and_lengths_spread_tenfold():
    train, test = long_chain.make_problems(seed=0)
    lengths_range = long_chain.MAX_STEPS - long_chain.MIN_STEPS + 1
    assert len(train) + len(test) == 100 * lengths_range and len(test) == long_chain.TEST_PROBLEMS
    assert len({p["prompt"] for p in train + test}) == len(train) + len(test)
    assert {p["steps"] for p in test} == set(range(long_chain.MIN_STEPS, long_chain.MAX_STEPS + 1))
    tok = make_tokenizer()
    completion = [len(tok.encode(p["solution"], add_special_tokens=False)) + 1 for p in train + test]
    assert max(completion) >= 10 * min(completion)
    # conf=tiny_long's completions have room for the longest solution and then some: a policy
    # that does not stop is cut off (and scored 0) past it, not before.
    assert max(completion) < load_config("tiny_long").actor.max_new_tokens == long_chain.MAX_NEW_TOKENS


def test_softening_bisects_the_norm_scale_to_the_target_of_any_measure():
    """long_chain softens on the sampled reward through tiny_model.soften_until: a bisection on
    the final norm's scale for any measure that grows with it. With a measure equal to the
    scale itself, the scale found is the target to within the bisection's 2^-iterations, and the
    norm is left at that scale."""
    from pipeline_rl.demo.tiny_model import make_model, soften_until

    tok = make_tokenizer()
    model = make_model(len(tok), tok.eos_token_id, tok.pad_token_id, hidden=32, layers=1, heads=2, kv_heads=1)
    norm = model.model.norm.weight
    original = norm.detach().clone() + 1.0  # a norm that is not all ones, so the scale is read off it
    norm.data.copy_(original)
    scale = soften_until(model, lambda: float((norm / original).mean()), 0.37, iterations=12)
    assert abs(scale - 0.37) <= 2**-12
    assert (norm.detach() - original * scale).abs().max() < 1e-6
