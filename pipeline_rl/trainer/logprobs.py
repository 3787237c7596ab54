"""Per-token logprobs and entropies of packed sequences under a causal LM.

Packing: several sequences share one row, and position_ids restart at 0 for each. With
attention_mask=None and no KV cache, transformers (>= 4.53, masking_utils
`find_packed_sequence_indices`) turns restarting position_ids into a block-diagonal causal
mask for the sdpa/eager/flex kernels, and flash-attention uses them as varlen boundaries.
`use_cache=False` matters: with a cache object present, transformers skips that detection
and the sequences would attend to each other. tests/unit/test_logprobs.py checks the result
against each sequence run alone.

Shared prompts (`preprocess.share_prompts`): a group's rollouts are laid out as one prompt
followed by their completions. A sequence with prefix p > 0 holds only its completion; it
attends to the first p tokens of the nearest earlier sequence with prefix 0 (its block's head,
which holds the prompt) and to itself, its positions continue from p, and its first token is
predicted by the logits at the prompt's last token. Position ids cannot express that, so this
layout passes an explicit [T, T] mask (sdpa and eager take it; flash-attention varlen does
not): meant for short rows, where it saves recomputing the prompt for every rollout.
`attention_kernel` picks the kernel from trainer.attention.

Memory: the logits stay in the model's dtype; their float32 log-softmax and entropy ([T, V]
each, 12 GB apiece for 20k tokens of a 152k vocabulary) are computed `chunk_tokens` rows at a
time under activation checkpointing, so backward keeps only the logits and recomputes one
chunk's float32 rows at a time. Each row is computed exactly as without chunking.
"""

from __future__ import annotations

import importlib.util

import torch
from torch.utils.checkpoint import checkpoint

from pipeline_rl.config import RunConfig
from pipeline_rl.config.choices import Attention


def attention_kernel(cfg: RunConfig, cuda: bool) -> str:
    """transformers' attn_implementation for trainer.attention (see config.schema.Attention)."""
    if cfg.trainer.attention != Attention.auto:
        return str(cfg.trainer.attention)
    flash = cuda and not cfg.preprocess.share_prompts and importlib.util.find_spec("flash_attn") is not None
    return str(Attention.flash_attention_2 if flash else Attention.sdpa)


def sequence_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Bool[T]: True where a packed sequence begins (position does not continue the previous one)."""
    pos = position_ids.reshape(-1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    return starts


def shared_prefix_layout(
    seq_lengths: list[int], prefix_lengths: list[int], position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the shared-prompt layout (module docstring): allowed[t, u] (bool [T, T]) = token t
    may attend to token u, and source[t] (long [T]) = the position whose logits predict token
    t, -1 where nothing does. Raises ValueError naming the sequence if the layout is not valid."""
    if len(seq_lengths) != len(prefix_lengths):
        raise ValueError(f"{len(prefix_lengths)} prefix lengths for {len(seq_lengths)} sequences")
    lengths = torch.tensor(seq_lengths)
    prefix = torch.tensor(prefix_lengths)
    n, total = len(seq_lengths), int(lengths.sum())
    starts = torch.cumsum(lengths, 0) - lengths
    index = torch.arange(n)
    head = torch.cummax(torch.where(prefix == 0, index, -1), 0).values
    bad = (prefix < 0) | ((prefix > 0) & ((head < 0) | (prefix >= lengths[head.clamp(min=0)])))
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"sequence {i}: prefix length {int(prefix[i])} needs an earlier head sequence (prefix 0) longer than it"
        )
    seq = torch.repeat_interleave(index, lengths)
    offset = torch.arange(total) - starts[seq]
    if not torch.equal(position_ids.reshape(-1).cpu(), prefix[seq] + offset):
        raise ValueError("position_ids do not continue each sequence from its prefix length")
    shared_from = starts[head.clamp(min=0)][seq]
    shared_to = shared_from + prefix[seq]
    t, u = torch.arange(total)[:, None], torch.arange(total)[None]
    allowed = ((seq[:, None] == seq[None]) & (u <= t)) | ((u >= shared_from[:, None]) & (u < shared_to[:, None]))
    source = torch.where(offset > 0, torch.arange(total) - 1, torch.where(prefix[seq] > 0, shared_to - 1, -1))
    return allowed, source


def _rows_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    token_logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return token_logp, -(logp_all.exp() * logp_all).sum(-1)


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, chunk_tokens: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits[i] / temperature)[targets[i]] and the entropy of that distribution, for
    rows [N, V] of logits, in float32; `chunk_tokens` rows at a time (module docstring) when
    there are more rows than that (0: all at once)."""
    if chunk_tokens <= 0 or logits.shape[0] <= chunk_tokens:
        return _rows_logprobs(logits, targets, temperature)
    parts = [
        checkpoint(
            _rows_logprobs,
            logits[i : i + chunk_tokens],
            targets[i : i + chunk_tokens],
            temperature,
            use_reentrant=False,
        )
        for i in range(0, logits.shape[0], chunk_tokens)
    ]
    return torch.cat([lp for lp, _ in parts]), torch.cat([ent for _, ent in parts])


def packed_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    temperature: float,
    seq_lengths: list[int] | None = None,
    prefix_lengths: list[int] | None = None,
    chunk_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logprobs[t] = log p(input_ids[t] | earlier tokens of its sequence) at `temperature`, and
    entropy[t] of the distribution that token was drawn from; both 0 at each sequence's first
    token. Inputs are [1, T]; outputs are float32 [T] and carry gradients. With prefix lengths
    (any > 0), the shared-prompt layout of the module docstring; `chunk_tokens` as in
    `token_logprobs`."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape != position_ids.shape:
        raise ValueError(
            f"expected input_ids and position_ids of shape [1, T], got {tuple(input_ids.shape)} "
            f"and {tuple(position_ids.shape)}"
        )
    if prefix_lengths and any(prefix_lengths):
        return _shared_prefix_logprobs(
            model, input_ids, position_ids, temperature, seq_lengths, prefix_lengths, chunk_tokens
        )
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[0]
    # Logits at t-1 predict token t; the last position predicts nothing.
    token_logp, token_entropy = token_logprobs(logits[:-1], input_ids[0, 1:], temperature, chunk_tokens)
    keep = ~sequence_starts(position_ids)[1:]
    zero = token_logp.new_zeros(1)
    logprobs = torch.cat([zero, token_logp * keep])
    entropy = torch.cat([zero, token_entropy * keep])
    return logprobs, entropy


def _shared_prefix_logprobs(model, input_ids, position_ids, temperature, seq_lengths, prefix_lengths, chunk_tokens):
    allowed, source = shared_prefix_layout(seq_lengths, prefix_lengths, position_ids)
    allowed, source = allowed.to(input_ids.device), source.to(input_ids.device)
    dtype = next(model.parameters()).dtype
    # Additive form: the eager kernel adds the mask to the scores, sdpa accepts it too.
    mask = torch.zeros(allowed.shape, dtype=dtype, device=input_ids.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    logits = model(
        input_ids=input_ids, position_ids=position_ids, attention_mask=mask[None, None], use_cache=False
    ).logits[0]
    has = source >= 0
    token_logp, token_entropy = token_logprobs(logits[source.clamp(min=0)], input_ids[0], temperature, chunk_tokens)
    return token_logp * has, token_entropy * has
