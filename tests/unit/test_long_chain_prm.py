"""The long task's PRM recipe (pipeline_rl/demo/long_chain_prm.py): its labels agree with the
exact checker at every newline, its local labels mark exactly the slipped characters while the
lines after a slip carry what was written, and its on-policy rates count what step guidance
would do with a scorer's verdicts."""

import random

import torch

from pipeline_rl.demo import long_chain, long_chain_prm
from pipeline_rl.demo.long_chain import StepChecker
from pipeline_rl.demo.tiny_model import make_tokenizer


def test_the_newline_label_is_the_exact_checkers_verdict_on_every_prefix_guidance_reads():
    tok = make_tokenizer()
    train, _ = long_chain.make_problems(seed=0)
    rng = random.Random(1)
    seen = {0: 0, 1: 0}
    for problem in train[:400]:
        ids, labels, marks = long_chain_prm.example(problem, rng, tok)
        prompt = problem["prompt"]
        for m in marks:
            prefix = tok.decode(ids[: m + 1])[len(prompt) :]
            assert labels[m] == StepChecker.check(prompt, prefix), (prompt, prefix)
            seen[labels[m]] += 1
    # Both kinds of step are common enough to learn from.
    assert min(seen.values()) > 0.1 * sum(seen.values()), seen


def test_a_malformed_slip_is_wrong_where_it_happens_and_unchecked_after_it():
    for kind in ("garbage", "insert", "delete"):

        class Kind(random.Random):
            def choices(self, population, weights):
                return [kind]

        for seed in range(50):
            line, labels = list("b5+8=3"), [1] * 6
            assert not long_chain_prm.slip(line, labels, Kind(seed))
            assert "".join(line) != "b5+8=3" and len(labels) == len(line), (kind, line, labels)
            # Right up to where the slip happened, 0 there (unless a deletion took the last
            # character: then the newline's label says it); after a stray character the rest
            # is still in place and checked, after an inserted or dropped one nothing is.
            first = labels.index(0) if 0 in labels else len(line)
            after = {1} if kind == "garbage" else {long_chain_prm.IGNORE}
            assert labels[:first] == [1] * first and set(labels[first + 1 :]) <= after
            assert 0 in labels or (kind == "delete" and line == list("b5+8="))


def test_local_labels_mark_the_slipped_character_and_later_lines_carry_it():
    problem = {"prompt": "Q: 3+5 to d=", "steps": 4}

    class Slips(random.Random):
        """Slips the result of line b into 9 and nothing else; no extra line."""

        calls = 0

        def random(self):
            # No extra line, then line b alone slips (a swap: not a sign).
            self.calls += 1
            return 0.0 if self.calls == 3 else 0.5

        def choices(self, population, weights):
            return ["swap"]

        def choice(self, seq):
            return 5 if seq == (0, 1, 3, 5) else "9"

    lines, local, exact = long_chain_prm.written(problem, Slips())
    assert lines == ["a3+5=8", "b5+8=9", "c8+9=7", "d9+7=6"]
    # A step's label is its own line's: c is what b, as written, asks for.
    assert local == [[1] * 6, [1, 1, 1, 1, 1, 0], [1] * 6, [1] * 6] and exact == [1, 0, 1, 1]
    # A line past the letter the prompt names is wrong at its letter.
    assert long_chain_prm.local_labels(list("e7+6=3"), "e", 7, 6, "d") == [0, 1, 1, 1, 1, 1]
    # A copied operand that is not the previous line's is wrong there, and the result is
    # checked against the operands as written.
    assert long_chain_prm.local_labels(list("c8+4=2"), "c", 8, 3, "d") == [1, 1, 1, 0, 1, 1]


class Rule(torch.nn.Module):
    """A token classifier that scores each newline with a fixed verdict per prefix: the exact
    checker's, unless `flip` names the prefix's line count."""

    def __init__(self, tok, prompt: str, flip: set[int]):
        super().__init__()
        self.tok, self.prompt, self.flip = tok, prompt, flip

    def forward(self, input_ids):
        text = self.tok.decode(input_ids[0].tolist())
        logits = torch.zeros(input_ids.shape[1], 2)
        for i in range(input_ids.shape[1]):
            if self.tok.decode([int(input_ids[0, i])]) == "\n":
                prefix = self.tok.decode(input_ids[0, : i + 1].tolist())[len(self.prompt) :]
                right = StepChecker.check(self.prompt, prefix) == 1.0
                right ^= prefix.count("\n") in self.flip
                logits[i, int(right)] = 1.0
        assert text.startswith(self.prompt)
        return type("Out", (), {"logits": logits[None]})()


def test_on_policy_rates_count_first_wrong_steps_caught_and_right_attempts_cut():
    tok = make_tokenizer()
    problems = [{"prompt": "Q: 3+5 to d="}, {"prompt": "Q: 3+5 to d="}]
    # Attempt 1 is right in all 4 lines, the last ended by EOS (not a step guidance scores);
    # attempt 2 goes wrong at its second line, and its third line (wrong too) is never scored:
    # a cut ends the attempt at the first wrong one.
    attempts = ["a3+5=8\nb5+8=3\nc8+3=1\nd3+1=4", "a3+5=8\nb5+8=4\nc8+4=2\n"]
    exact = long_chain_prm.on_policy_rates(Rule(tok, problems[0]["prompt"], set()), tok, problems, attempts)
    assert exact["accuracy"] == 1.0 and exact["held_out_right"] == 4 and exact["held_out_wrong"] == 1
    assert exact["first_wrong_step_caught"] == 1.0 and exact["attempts_cut_while_right"] == 0.0
    # Said wrong at line 2: attempt 1 is cut while right, attempt 2's first wrong step caught.
    flipped = long_chain_prm.on_policy_rates(Rule(tok, problems[0]["prompt"], {2}), tok, problems, attempts)
    assert flipped["attempts_cut_while_right"] == 0.5 and flipped["first_wrong_step_caught"] == 0.0
    assert flipped["right_kept"] == 3 / 4 and flipped["wrong_caught"] == 0.0
