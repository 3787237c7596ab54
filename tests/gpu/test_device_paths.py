"""The GPU tier: what only a CUDA device can show about the paths the library takes on one.
Every test is marked `gpu` and skipped where no device is (tests/conftest.py); on a lent GPU,
`python -m pytest -m gpu tests/gpu` runs them (scripts/gpu_device_run.sh does, first). The CPU
tests hold the same invariants against the code path a GPU takes (docs/gpu.md lists them)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from fixtures.helpers import ROOT

pytestmark = pytest.mark.gpu


def swap_check(*args: str) -> dict:
    """scripts/gpu_swap_check.py's JSON result; it exits non-zero when a check failed."""
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_swap_check.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_the_swap_copy_is_seen_whole_by_the_next_read():
    """LoadPlan.copy, then a read of every parameter on another stream: never the old weights."""
    result = swap_check("--gib", "0.25", "--rounds", "10")
    assert result["stale_reads_ordered"] == 0, result


def test_the_tp1_swap_is_ordered_between_two_forward_passes_without_stopping_them():
    """engine/swap_streams.py on the device: forward passes go on during each transfer, none
    sees two versions at once or an older version after a newer one."""
    result = swap_check("--concurrent", "--gib", "0.25", "--rounds", "5")
    assert result["torn_reads"] == 0 and result["stale_reads"] == 0, result
    assert result["passes_on_device_during_transfers"] > 0, result


def test_checkpoint_weights_reach_the_host_exactly_through_the_pinned_buffers():
    sys.path.insert(0, str(ROOT / "scripts"))
    from device_checks import staging_check

    result = staging_check(gib=0.5, chunk_mib=64)
    assert all(result[k]["mismatched_tensors"] == 0 for k in result if isinstance(result[k], dict)), result


def test_the_compiled_logprob_kernel_matches_eager_on_the_device():
    """core/logprobs.py's two kernels on CUDA in bf16: the same logprobs and weight gradient up
    to the float32 arithmetic's order (bf16 logits, float32 statistics)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipeline_rl.core.logprobs import packed_logprobs

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    config.num_attention_heads, config.num_key_value_heads = 4, 2
    model = Qwen2ForCausalLM(config).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 4096, (1, 1024), device="cuda")
    pos = torch.arange(256, device="cuda").repeat(4)[None]
    got = {}
    for compiled in (False, True):
        model.zero_grad()
        lp, _ = packed_logprobs(model, ids, pos, 1.0, [256] * 4, chunk_tokens=512, compiled=compiled)
        lp.sum().backward()
        got[compiled] = (lp.detach().float(), model.lm_head.weight.grad.float())
    (lp_e, g_e), (lp_c, g_c) = got[False], got[True]
    # float32 statistics of bf16 logits: the two orders of summation differ by float32 rounding
    # of values of order log(V) ~ 8, far below bf16's own spacing there (0.03).
    assert (lp_e - lp_c).abs().max() < 1e-3
    assert (g_e - g_c).norm() / g_e.norm() < 1e-2
