"""Per-token logprobs and entropies of packed sequences under a causal LM.

Packing: several sequences share one row, and position_ids restart at 0 for each. With
attention_mask=None and no KV cache, transformers (>= 4.53, masking_utils
`find_packed_sequence_indices`) turns restarting position_ids into a block-diagonal causal
mask for the sdpa/eager/flex kernels, and flash-attention uses them as varlen boundaries.
`use_cache=False` matters: with a cache object present, transformers skips that detection
and the sequences would attend to each other. tests/test_logprobs.py checks the result
against each sequence run alone.
"""

from __future__ import annotations

import torch


def sequence_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Bool[T]: True where a packed sequence begins (position does not continue the previous one)."""
    pos = position_ids.reshape(-1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    return starts


def packed_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logprobs[t] = log p(input_ids[t] | earlier tokens of its sequence) at `temperature`, and
    entropy[t] of the distribution that token was drawn from; both 0 at each sequence's first
    token. Inputs are [1, T]; outputs are float32 [T] and carry gradients."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape != position_ids.shape:
        raise ValueError(f"expected input_ids and position_ids of shape [1, T], got {tuple(input_ids.shape)} "
                         f"and {tuple(position_ids.shape)}")
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[0]
    # Logits at t-1 predict token t; the last position predicts nothing.
    logp_all = torch.log_softmax(logits[:-1].float() / temperature, dim=-1)
    targets = input_ids[0, 1:]
    token_logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    token_entropy = -(logp_all.exp() * logp_all).sum(-1)
    keep = ~sequence_starts(position_ids)[1:]
    zero = token_logp.new_zeros(1)
    logprobs = torch.cat([zero, token_logp * keep])
    entropy = torch.cat([zero, token_entropy * keep])
    return logprobs, entropy
