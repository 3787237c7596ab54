"""scripts/gpu_check.py in its reduced CPU mode: the same code path that measures MFU on a GPU
(model build, packed micro-batches through the trainer stream, ZeRO-3 steps) runs to the end,
with full fine-tuning (profiled) and with LoRA."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.deepspeed]


VOCAB, WIDTH, INNER, LAYERS, HEADS, KV_HEADS = 512, 64, 128, 2, 4, 2  # gpu_check.REDUCED
PER_LAYER = 2 * WIDTH * WIDTH + 2 * WIDTH * (WIDTH // HEADS * KV_HEADS) + 3 * WIDTH * INNER
"""Weights a token meets in a decoder layer's products: q and o; k and v; the MLP's three."""


def reduced_gpu_check(out: Path, *args: str) -> dict:
    """`gpu_check.py --reduced ARGS`'s result (OUT/gpu_check.json), after it exits cleanly."""
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--reduced", "--out", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text())


@pytest.mark.parametrize("lora", [[], ["--lora", "4"]], ids=["full", "lora"])
def test_gpu_check_runs_in_reduced_mode(tmp_path, lora):
    profile = [] if lora else ["--profile"]
    result = reduced_gpu_check(tmp_path, "--steps", "3", *lora, *profile)
    assert result["device"] == "cpu" and result["version"] == 3
    assert result["lora_rank"] == (int(lora[1]) if lora else None)
    assert result["tokens_per_s"] > 0 and all(math.isfinite(x) for x in result["loss_first_last"])
    # ZeRO-3 (the script's default) partitions every matrix of the base model as at the full
    # shape (the tied embedding, seven projections a layer) and keeps the vectors (norms, biases)
    # and LoRA's rank-4 adapters whole.
    assert result["zero_stage"] == 3 and result["partitioned_parameters"] == 1 + 7 * LAYERS
    if profile:  # the third step's operators (the first two warm up), matrix products among them
        assert 0 < result["profile"]["by_kind_s"]["matmul"] < result["profile"]["kernel_s"]
        assert result["profile"]["kernel_s"] < result["profile"]["profiled_span_s"]


def test_the_tally_counts_the_bare_loops_matrix_products_exactly(tmp_path):
    """`--tally` (scripts/step_tally.py) on the bare loop of the reduced model: the counted
    matrix-product FLOPs of the step after the first are 6 x tokens x the parameters every token
    meets in a product (each decoder layer's projections; the tied output layer, on every
    token), from the arithmetic of a forward and its backward (2 + 4 FLOPs per weight and
    token); attention is counted apart."""
    result = reduced_gpu_check(tmp_path, "--bare", "--tally", "--steps", "2")
    tokens = result["seq_length"] * result["micro_batches_per_step"]
    counted = result["tally"]["by_kind"]
    assert counted["matmul"]["flops"] == 6 * tokens * (LAYERS * PER_LAYER + VOCAB * WIDTH)
    assert counted["attention"]["flops"] > 0 and counted["matmul"]["bytes"] > 0
    assert set(result["tally"]["least_s"]) == set(counted)


def test_the_tally_counts_the_trainers_output_layer_on_the_trained_tokens_only(tmp_path):
    """The trainer's step under `--tally`, with the compiled logprob kernel: the decoder layers'
    products as in the bare loop, the output layer's on the trained half of the tokens only, 8
    FLOPs per weight and row (forward, its recomputation in backward, the two gradients), and
    the compiled kernel counted once per micro-batch in forward and once in backward (one chunk
    each), in the counted step only."""
    result = reduced_gpu_check(
        tmp_path, "--tally", "--steps", "2", "--zero-stage", "2", "model.logprob_kernel=compiled"
    )
    tokens = result["seq_length"] * result["micro_batches_per_step"]
    counted = result["tally"]["by_kind"]
    assert counted["matmul"]["flops"] == 6 * tokens * LAYERS * PER_LAYER + 8 * (tokens // 2) * VOCAB * WIDTH
    assert counted["compiled"]["ops"] == 2 * result["micro_batches_per_step"]
