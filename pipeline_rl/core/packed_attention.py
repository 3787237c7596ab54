"""Attention over packed rows, one sequence at a time (`trainer.attention: varlen`).

A packed row holds many sequences; attending over the whole row with a block-diagonal mask
costs the square of the row's length, whatever the sequences. Here each sequence attends only
to itself, so the work grows with the sum of the squared sequence lengths, and no [T, T] mask
exists. The boundaries come from the host (`varlen_kwargs`, from the micro-batch's sequence
lengths): nothing is read back from the device to find them.

- CUDA, bf16/fp16: torch's varlen flash-attention (`torch.nn.attention.varlen.varlen_attn`),
  forward and backward.
- Elsewhere (CPU, float32): sdpa with a causal mask on each sequence, the sequences padded to
  a multiple of PAD_TO tokens and those of one padded length batched together.

Registered with transformers under the name `varlen`, so `attn_implementation="varlen"` selects it on any model whose attention
goes through transformers' attention interface (Llama, Qwen2/3, Mistral...).
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections import defaultdict

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from pipeline_rl.core.device_copy import to_device

NAME = "varlen"


def varlen_kwargs(seq_lengths: list[int], device: torch.device | str) -> dict:
    """The model call's keyword arguments that carry the sequence boundaries of one packed row
    (transformers' flash-attention names: they reach every attention layer). The cumulative
    lengths travel to the device without a synchronization; their host copy stays for the
    CPU kernel."""
    cu = torch.zeros(len(seq_lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seq_lengths, dtype=torch.int32), 0)
    cu = to_device(cu, device)
    longest = max(seq_lengths, default=0)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


PAD_TO = 32
"""On the CPU (sdpa) path, sequences are padded to a multiple of this many tokens and each padded
length goes in one batched call: a row of sequences of many lengths (long, uneven rollouts)
takes a few calls instead of one per length."""


def _per_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], scale: float | None
) -> torch.Tensor:
    """[T, H, D] attention of each sequence over itself with sdpa. Sequences padded to the same
    multiple of PAD_TO go in one batched call; the padding comes after each sequence's tokens, so
    the causal mask already keeps the real queries off it, and its outputs are dropped."""
    spans: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for start, end in itertools.pairwise(cu):
        spans[-(-(end - start) // PAD_TO) * PAD_TO].append((start, end))
    out = torch.empty_like(q)
    for padded, group in spans.items():
        starts = torch.tensor([start for start, _ in group])[:, None]
        ends = torch.tensor([end for _, end in group])[:, None]
        positions = starts + torch.arange(padded)[None]  # [n, P]
        real = positions < ends
        rows = torch.minimum(positions, ends - 1).to(q.device)  # the padding repeats a real token
        # [n, P, H, D] -> [n, H, P, D]
        part = F.scaled_dot_product_attention(
            q[rows].transpose(1, 2),
            k[rows].transpose(1, 2),
            v[rows].transpose(1, 2),
            is_causal=True,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        real = real.to(q.device)
        out[rows[real]] = part.transpose(1, 2)[real]
    return out


@functools.cache
def _varlen_signature() -> tuple[bool, dict]:
    """Whether this torch's `varlen_attn` takes grouped key/value heads, and its causal keyword
    (read once: `inspect.signature` on every layer's call is host time the device waits for)."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return "enable_gqa" in params, causal


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int, scale: float | None):
    from torch.nn.attention.varlen import varlen_attn

    gqa, causal = _varlen_signature()
    kwargs: dict = {"scale": scale, **causal}
    if q.shape[1] != k.shape[1]:
        if gqa:
            kwargs["enable_gqa"] = True
        else:  # older torch: each query head needs its own key/value head
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = varlen_attn(q, k, v, cu, cu, longest, longest, **kwargs)
    assert isinstance(out, torch.Tensor)  # no auxiliary outputs asked for
    return out


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [1, H, T, D], key/value [1, Hkv, T, D];
    returns ([1, T, H, D], None)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        raise ValueError(
            "trainer.attention=varlen needs the packed row's sequence boundaries: call the model with "
            "pipeline_rl.core.packed_attention.varlen_kwargs(seq_lengths, device)"
        )
    if query.shape[0] != 1:
        raise ValueError(f"varlen attention takes one packed row, got a batch of {query.shape[0]}")
    if dropout:
        raise ValueError("varlen attention has no attention dropout (the model config's attention_dropout > 0)")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        out = _flash(q, k, v, cu, int(kwargs["max_length_q"]), scaling)
    else:
        out = _per_sequence(q, k, v, cu.tolist(), scaling)
    return out[None], None


# No mask function is registered for the name: transformers then builds no mask at all and skips
# its search of position_ids for packed sequences (a read of the device per forward pass).
AttentionInterface.register(NAME, varlen_attention)
