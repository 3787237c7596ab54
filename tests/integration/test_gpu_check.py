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


def test_the_tally_counts_the_bare_loops_matrix_products_exactly(tmp_path):
    """`--tally` (scripts/step_tally.py) on the bare loop of the reduced model: the counted
    matrix-product FLOPs of the step after the first are 6 x tokens x the parameters every token
    meets in a product (each decoder layer's projections; the tied output layer, on every
    token), from the arithmetic of a forward and its backward (2 + 4 FLOPs per weight and
    token); attention is counted apart."""
    out = subprocess.run(
        [
            sys.executable,
            "scripts/gpu_check.py",
            "--reduced",
            "--bare",
            "--tally",
            "--steps",
            "2",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    vocab, width, inner, layers, heads, kv_heads = 512, 64, 128, 2, 4, 2  # gpu_check.REDUCED
    kv_width = width // heads * kv_heads
    per_layer = 2 * width * width + 2 * width * kv_width + 3 * width * inner  # q, o; k, v; the MLP's three
    tokens = result["seq_length"] * result["micro_batches_per_step"]
    counted = result["tally"]["by_kind"]
    assert counted["matmul"]["flops"] == 6 * tokens * (layers * per_layer + vocab * width)
    assert counted["attention"]["flops"] > 0 and counted["matmul"]["bytes"] > 0
    assert set(result["tally"]["least_s"]) == set(counted)
