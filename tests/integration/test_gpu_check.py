"""scripts/gpu_check.py in its reduced CPU mode: the same code path that measures MFU on a GPU
(model build, packed micro-batches through the trainer stream, ZeRO-3 steps) runs to the end,
with full fine-tuning (profiled) and with LoRA."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from fixtures.helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.deepspeed]


@pytest.mark.parametrize("lora", [[], ["--lora", "4"]], ids=["full", "lora"])
def test_gpu_check_runs_in_reduced_mode(tmp_path, lora):
    profile = [] if lora else ["--profile"]
    out = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--reduced", "--steps", "3", "--out", str(tmp_path), *lora, *profile],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["device"] == "cpu" and result["version"] == 3
    assert result["lora_rank"] == (int(lora[1]) if lora else None)
    assert result["tokens_per_s"] > 0 and all(math.isfinite(x) for x in result["loss_first_last"])
    if profile:  # the third step's operators (the first two warm up), matrix products among them
        assert 0 < result["profile"]["by_kind_s"]["matmul"] < result["profile"]["kernel_s"]
        assert result["profile"]["kernel_s"] < result["profile"]["profiled_span_s"]
