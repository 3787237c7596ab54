"""scripts/answer_digits.py on the kept tiny model: its kept row holds shares of what it sampled."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fixtures.helpers import ROOT


def test_a_run_on_the_tiny_model_keeps_shares_of_what_it_sampled(tiny_model, tmp_path):
    out = tmp_path / "digits.json"
    cmd = [sys.executable, "scripts/answer_digits.py", str(tiny_model), "--problems", "6", "--samples", "2"]
    cmd += ["--labels", "tiny", "--data", str(tiny_model.parent / "arithmetic"), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    assert row["name"] == "tiny" and row["problems"] == 6 and row["samples"] == 2
    # 12 answers: every share is a count of them over 12 (agreement: of 6 problems).
    for key in ("exact", "length", "first_digit", "last_digit"):
        assert 0 <= row[key] <= 1 and (row[key] * 12) == pytest.approx(round(row[key] * 12)), key
    assert (row["agreement"] * 6) == pytest.approx(round(row["agreement"] * 6))
    assert row["first_digit"] >= row["exact"] and row["last_digit"] >= row["exact"]
