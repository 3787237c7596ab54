"""The tensor-parallel engine checks (tp_swap_checks.py) in a fresh interpreter.

Run in the suite's own process, after the in-process engines and models of the tests before
them, the TP = 2 engine's tests saw transformers reference outputs of 1e10-1e37 and left the
tests after them (trainer, hook, weight sync) seeing the same; alone, each passes. The cause
is not found yet (issue 13); a process of their own keeps the checks exact and the rest of the
suite unaffected.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.vllm


def test_tensor_parallel_engine_checks_in_a_fresh_process(tiny_model):
    checks = ROOT / "tests" / "integration" / "tp_swap_checks.py"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", str(checks), "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    checks_in_file = checks.read_text().count("\ndef test_")
    assert f"{checks_in_file} passed" in out.stdout, out.stdout[-3000:]
