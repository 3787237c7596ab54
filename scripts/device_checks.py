"""The checks `gpu_check.py --checks` runs on a GPU, beside the throughput runs: the varlen
attention's and the compiled logprob kernel's logprobs against the reference paths, the logprob
kernels' cost (bench_logprobs.py), and the checkpoint's pinned host copies."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch


def varlen_against_sdpa(model_dir: Path, seq_length: int, rows: int) -> dict:
    """On the GPU in bf16: logprobs of one packed row under the varlen attention and under sdpa
    with the block-diagonal mask, and the gradient through varlen."""
    from transformers import AutoModelForCausalLM

    from pipeline_rl.core.logprobs import packed_logprobs

    g = torch.Generator().manual_seed(0)
    length = seq_length // rows
    ids = torch.randint(0, 1000, (1, seq_length), generator=g).cuda()
    pos = torch.arange(length).repeat(rows)[None].cuda()
    out = {}
    for attn, kernels in (("sdpa", (False,)), ("varlen", (False, True))):
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation=attn)
        model.to("cuda")
        for compiled in kernels:  # one model, both logprob kernels
            model.zero_grad()
            lp, _ = packed_logprobs(model, ids, pos, 1.0, [length] * rows, chunk_tokens=2048, compiled=compiled)
            lp.sum().backward()
            out[attn, compiled] = (lp.detach().float(), model.model.layers[0].self_attn.q_proj.weight.grad.float())
        del model
    d = (out["varlen", False][0] - out["sdpa", False][0]).abs()
    g_rel = (out["varlen", False][1] - out["sdpa", False][1]).norm() / out["sdpa", False][1].norm()
    # The logprob kernels on the same forward: only the float32 arithmetic's order differs.
    k = (out["varlen", True][0] - out["varlen", False][0]).abs()
    k_rel = (out["varlen", True][1] - out["varlen", False][1]).norm() / out["varlen", False][1].norm()
    return {
        "logprob_max_abs_diff": round(d.max().item(), 4),
        "logprob_mean_abs_diff": round(d.mean().item(), 5),
        "grad_rel_diff_layer0_q": round(g_rel.item(), 4),
        "compiled_kernel_logprob_max_abs_diff": k.max().item(),
        "compiled_kernel_grad_rel_diff_layer0_q": k_rel.item(),
    }


def logprob_kernels(out: Path, tokens: int) -> dict:
    """scripts/bench_logprobs.py at `tokens` in bf16: the output layer's head and its arithmetic,
    eager and compiled, against the bare loop's."""
    path = out / "bench_logprobs.json"
    bench = Path(__file__).with_name("bench_logprobs.py")
    cmd = [sys.executable, str(bench), "--tokens", str(tokens), "--dtype", "bfloat16", "--json", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr).strip().splitlines()[-1][:200]}
    return json.loads(path.read_text())


def staging_check(gib: float = 4.0, chunk_mib: int = 256) -> dict:
    """The checkpoint's host copies (trainer/host_staging.py) on the GPU: `gib` of bf16 tensors in
    chunks of `chunk_mib`, each host chunk compared with a plain copy of its device tensors; the
    device's copy rate, the whole pass's rate (the comparison is the overlapped host work), and a
    plain pageable `.cpu()` of the same tensors for scale."""
    from pipeline_rl.trainer.host_staging import host_chunks

    per_chunk = chunk_mib * 2**20 // 2 // 4  # four tensors a chunk
    count = int(gib * 2**30 // (chunk_mib * 2**20))
    g = torch.Generator(device="cuda").manual_seed(0)
    chunks = [
        [(f"c{c}.t{i}", torch.randn(per_chunk, device="cuda", generator=g, dtype=torch.bfloat16)) for i in range(4)]
        for c in range(count)
    ]
    torch.cuda.synchronize()
    result = {}
    for attempt in ("first (allocates the pinned buffers)", "second"):
        stats: dict[str, float] = {}
        mismatches = 0
        start = time.perf_counter()
        for c, host in enumerate(host_chunks(iter(chunks), stats)):
            mismatches += sum(not torch.equal(host[n], t.cpu()) for n, t in chunks[c])
        wall = time.perf_counter() - start
        result[attempt] = {
            "gb": round(stats["bytes"] / 1e9, 2),
            "device_copy_gb_per_s": round(stats["bytes"] / stats["copy_s"] / 1e9, 1),
            "pass_gb_per_s_with_check": round(stats["bytes"] / wall / 1e9, 1),
            "mismatched_tensors": mismatches,
        }
    start = time.perf_counter()
    for chunk in chunks:
        for _, t in chunk:
            t.cpu()
    result["pageable .cpu() gb_per_s"] = round(count * chunk_mib * 2**20 / (time.perf_counter() - start) / 1e9, 1)
    return result
