"""scripts/answer_digits.py: the digit shares from hand-made answers (a run on a real model:
tests/integration/test_answer_digits_run.py)."""

from __future__ import annotations

import sys

import pytest
from fixtures.helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import answer_digits


def test_each_share_counts_what_it_names():
    answers = [["85", "86", "85"], ["151", "151", "151"], ["7", "73", "17"]]
    report = answer_digits.digit_report(answers, ["85", "152", "73"])
    # 9 answers. exact: 85 twice, 73 (3). length: all but "7" (8). first digit: all but "17" (8).
    # last digit: 85 twice, 73 (3; "7" and "17" end in 7). Only the 151s agree: 1 of 3 problems.
    assert report == {"exact": 3 / 9, "length": 8 / 9, "first_digit": 8 / 9, "last_digit": 3 / 9, "agreement": 1 / 3}


def test_answers_and_references_of_other_lengths_are_refused():
    with pytest.raises(ValueError, match="2 problems' answers against 1 references"):
        answer_digits.digit_report([["1"], ["2"]], ["1"])
