"""model.logprob_kernel: the compiled chunk arithmetic gives the eager one's logprobs, entropies
and gradients, and the config picks it where it pays."""

import importlib.util
import re

import pytest
import torch
from fixtures import helpers

from pipeline_rl.config import load_config, logprob_kernel
from pipeline_rl.core.logprobs import (
    _chunk_stats,
    _compiled,
    _logits_grad_fused,
    _logits_grad_in_place,
    packed_logprobs,
)


@pytest.mark.parametrize("loss", ["both", "logprobs", "entropy"])
def test_compiled_kernel_gives_the_eager_values_and_gradients(loss):
    """Packed sequences through the real model, chunks that do and do not divide the rows, a
    temperature: compiled (torch.compile's CPU backend here) against eager. Float32 throughout,
    so the two differ only by the order of the sums over a 97-entry vocabulary (a few float32
    ulps of values of order 1-10) and of the gradient's products; "logprobs" and "entropy" each
    leave the other output out of the loss (the backward that gets one gradient None)."""
    model = helpers.random_qwen2("sdpa", max_len=64)
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (9, 5, 12, 7)]
    input_ids = torch.tensor([sum(seqs, [])])
    position_ids = torch.tensor([[p for s in seqs for p in range(len(s))]])
    results = []
    for compiled in (False, True):
        model.zero_grad()
        calls = _compiled.cache_info().hits + _compiled.cache_info().misses
        lp, ent = packed_logprobs(model, input_ids, position_ids, 0.8, chunk_tokens=6, compiled=compiled)
        objective = {"both": lp.sum() + 0.3 * ent.sum(), "logprobs": lp.sum(), "entropy": ent.sum()}[loss]
        objective.backward()
        # Forward and backward took the compiled functions, or neither did.
        assert _compiled.cache_info().hits + _compiled.cache_info().misses - calls == (2 if compiled else 0)
        results.append((lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]))
    helpers.assert_same_logprobs_and_gradients(results[1], results[0], value_atol=2e-5)


def test_fused_gradient_matches_the_in_place_one_on_bf16_logits():
    """Both gradient formulas work in float32 and round to the logits' dtype once at the end: on
    bf16 logits they agree to a bf16 rounding (a relative 2^-8), the target's entry included
    (where the two terms nearly cancel when the model is sure of it)."""
    g = torch.Generator().manual_seed(2)
    rows, vocab, width = 8, 300, 16
    h = torch.randn(rows, width, generator=g).bfloat16()
    weight = torch.randn(vocab, width, generator=g).bfloat16()
    targets = torch.randint(0, vocab, (rows,), generator=g)
    weight[targets[0]] = h[0] * 2  # p(target) ~ 1 in row 0: the target's gradient is a small difference
    logits = torch.nn.functional.linear(h, weight)
    assert torch.softmax(logits[0].float(), -1)[targets[0]] > 0.99
    z = logits.float() * 1.25
    lse = torch.logsumexp(z, -1)
    p = (z - lse[:, None]).exp()
    entropy = lse - (p * z).sum(-1)
    grad_logp, grad_entropy = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    for gl, ge in ((grad_logp, grad_entropy), (grad_logp, None), (None, grad_entropy)):
        eager = _logits_grad_in_place(logits.float() * 1.25, targets, lse, entropy, gl, ge, 1.25, logits.dtype)
        zeros = torch.zeros(rows)
        fused = _logits_grad_fused(
            logits, targets, lse, entropy, zeros if gl is None else gl, zeros if ge is None else ge, 1.25
        )
        assert fused.dtype == eager.dtype == torch.bfloat16
        torch.testing.assert_close(fused.float(), eager.float(), rtol=2**-8, atol=1e-6)


def test_auto_compiles_on_a_gpu_with_triton_only(monkeypatch):
    cfg = load_config("tiny")
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "triton" else found(name))
    assert logprob_kernel(cfg, cuda=True) == "compiled"
    assert logprob_kernel(cfg, cuda=False) == "eager"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "triton" else found(name))
    assert logprob_kernel(cfg, cuda=True) == "eager"
    assert logprob_kernel(load_config("tiny", ["model.logprob_kernel=compiled"]), cuda=False) == "compiled"
    assert logprob_kernel(load_config("tiny", ["model.logprob_kernel=eager"]), cuda=True) == "eager"


def test_compiled_kernels_keep_no_float32_rows_of_the_vocabulary():
    """What the memory plan counts for the compiled kernel (LOGITS_CHUNK_BYTES_PER_ENTRY: 4 in a
    bf16 model): the code the compiler generates for a chunk's statistics allocates only per-row
    buffers, and for its gradient one [rows, V] buffer, the gradient itself in the logits' dtype.
    Read from the generated code (torch.compile's CPU backend; the GPU's schedules the same
    fusions)."""
    from torch._inductor.utils import run_and_get_code

    stats, logits_grad = _compiled()
    rows, vocab = 64, 1000
    logits = torch.randn(rows, vocab).bfloat16()
    targets = torch.randint(0, vocab, (rows,))
    (lse, _, entropy), stats_code = run_and_get_code(stats, logits, targets, 1.0)
    _, grad_code = run_and_get_code(
        logits_grad, logits, targets, lse, entropy, torch.randn(rows), torch.zeros(rows), 1.0
    )
    allocation = re.compile(r"empty_strided\w*\(\(([^)]*)\), \([^)]*\), (torch\.\w+)\)")

    def wide_buffers(code: list[str]) -> list[str]:
        """The dtypes of the [rows, V] buffers the generated code allocates ([rows] and [rows, 1]
        are per-row)."""
        found = [
            (shape.replace(" ", "").rstrip(",").split(","), dtype)
            for c in code
            for shape, dtype in allocation.findall(c)
        ]
        assert found, code  # the pattern still reads this torch's generated code
        return [dtype for dims, dtype in found if len(dims) > 1 and dims[1] != "1"]

    assert wide_buffers(stats_code) == []
    assert wide_buffers(grad_code) == ["torch.bfloat16"]


def test_compiled_kernel_compiles_once_per_case_not_per_micro_batch():
    """Each micro-batch trains a different number of rows. With the rows a dynamic dimension the
    compiler makes a few graphs per function at first (rows 0 and 1 are special cases; a chunk
    and a remainder; a backward with or without the entropy's gradient) and then reuses them:
    new row counts make no new graph. Were it to compile per size, a GPU run would recompile at
    every micro-batch until torch's recompile limit, then run eager from there on."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model = helpers.random_qwen2("sdpa", max_len=64)
    g = torch.Generator().manual_seed(5)

    def micro_batch(tokens: int, with_entropy: bool) -> None:
        ids = torch.randint(0, 97, (1, tokens), generator=g)
        lp, ent = packed_logprobs(model, ids, torch.arange(tokens)[None], 1.0, chunk_tokens=8, compiled=True)
        (lp.sum() + (0.1 * ent.sum() if with_entropy else 0)).backward()

    def graphs() -> list[int]:
        return [len(_debug_get_cache_entry_list(f)) for f in (_chunk_stats, _logits_grad_fused)]

    for tokens in (1, 2, 3, 9, 13, 20):
        micro_batch(tokens, with_entropy=True)
        micro_batch(tokens, with_entropy=False)
    first = graphs()
    assert all(0 < n < torch._dynamo.config.recompile_limit for n in first), first
    for tokens in (5, 11, 17, 31, 40, 26):
        micro_batch(tokens, with_entropy=tokens % 2 == 0)
    assert graphs() == first
