"""Per-token logprobs and entropies of packed sequences under a causal LM.

Packing: several sequences share one row, and position_ids restart at 0 for each. With
attention_mask=None and no KV cache, transformers (>= 4.53, masking_utils
`find_packed_sequence_indices`) turns restarting position_ids into a block-diagonal causal
mask for the sdpa/eager/flex kernels, and flash-attention uses them as varlen boundaries.
`use_cache=False` matters: with a cache object present, transformers skips that detection
and the sequences would attend to each other. tests/unit/test_logprobs.py checks the result
against each sequence run alone.

Shared prompts (`shared.share_prompts`): a group's rollouts are laid out as one prompt
followed by their completions. A sequence with prefix p > 0 holds only its completion; it
attends to the first p tokens of the nearest earlier sequence with prefix 0 (its block's head,
which holds the prompt) and to itself, its positions continue from p, and its first token is
predicted by the logits at the prompt's last token. Position ids cannot express that, so this
layout passes an explicit [T, T] mask (sdpa and eager take it; flash-attention varlen does
not): meant for short rows, where it saves recomputing the prompt for every rollout.
The kernel comes from trainer.attention (config/resolve.py `attention_kernel`).

Memory: the model runs up to its output layer only (`final_hidden`: a pre-hook on the output
layer takes the final hidden states and leaves the layer no rows), so full-vocabulary logits
never exist for the whole micro-batch. The output layer, the float32 log-softmax and the entropy
run `chunk_tokens` rows at a time under activation checkpointing: forward and backward hold one
chunk's [chunk, V] rows at a time (backward recomputes them), and the hidden states [T, H]
instead of [T, V] logits. Each row is computed exactly as without chunking. Models whose causal
LM head does more than the output layer (`LOGIT_TRANSFORMS`) take the full logits instead.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from pipeline_rl.core import packed_attention
from pipeline_rl.core.device_copy import to_device


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


LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
"""config.json keys of models whose logits are not just the output layer's (Gemma 2/3, Cohere,
Granite...): for them the logprobs come from the model's own logits."""


def _rows_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    token_logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return token_logp, -(logp_all.exp() * logp_all).sum(-1)


def _chunk_stats(logits: torch.Tensor, targets: torch.Tensor, scale: float):
    """For a chunk of logits [rows, V] (the output layer's dtype, as the engine computes them),
    scaled by `scale` (1 / temperature) in float32: each row's log-sum-exp, its target's logprob
    and the entropy. In place on one float32 copy when eager; compiled, a few passes over the
    logits."""
    z = logits.float().mul_(scale)
    lse = torch.logsumexp(z, -1)
    p = torch.sub(z, lse[:, None]).exp_()
    # H = lse - sum(p * z): one reduction over the rows, no [rows, V] product kept.
    entropy = lse - torch.linalg.vecdot(p, z)
    return lse, z.gather(-1, targets[:, None])[:, 0] - lse, entropy


def _logits_grad_in_place(
    z: torch.Tensor, targets, lse, entropy, grad_logp, grad_entropy, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """The gradient, in `dtype`, of the chunk's logits (_ChunkedHead's formula), built in the
    storage of `z`, the float32 logits times `scale`, which it takes over: what eager needs least
    memory for (the caller frees the logits in the model's dtype once copied)."""
    p = torch.sub(z, lse[:, None]).exp_()
    # grad_z * T = -p * (g_logp + g_H * (log p + H)) + g_logp * onehot(y), built in z's storage.
    if grad_entropy is not None:
        z.sub_((lse - entropy)[:, None]).mul_(grad_entropy[:, None])
        if grad_logp is not None:
            z.add_(grad_logp[:, None])
    else:
        z.copy_(grad_logp[:, None].expand_as(z))
    z.mul_(p).neg_()
    del p
    if grad_logp is not None:
        z.scatter_add_(-1, targets[:, None], grad_logp[:, None])
    return z.mul_(scale).to(dtype)


def _logits_grad_fused(logits, targets, lse, entropy, grad_logp, grad_entropy, scale: float) -> torch.Tensor:
    """The same gradient written out of place, with the target's term as a comparison against
    the vocabulary index instead of a scatter: the compiler fuses it into one pass that reads
    the logits and writes their gradient, both in the model's dtype."""
    logp = logits.float() * scale - lse[:, None]
    grad = -logp.exp() * (grad_logp[:, None] + grad_entropy[:, None] * (logp + entropy[:, None]))
    target = torch.arange(logits.shape[-1], device=logits.device)[None] == targets[:, None]
    return ((grad + torch.where(target, grad_logp[:, None], 0.0)) * scale).to(logits.dtype)


@functools.cache
def _compiled() -> tuple[Callable, Callable]:
    """The compiled chunk statistics and logits gradient, made once per process; `dynamic`: one
    graph for every chunk length."""
    return torch.compile(_chunk_stats, dynamic=True), torch.compile(_logits_grad_fused, dynamic=True)


class _ChunkedHead(torch.autograd.Function):
    """The output layer and the float32 log-softmax, `chunk` rows at a time, with the gradient
    written out: forward keeps the rows' hidden states and two floats per row (log-sum-exp and
    entropy), no [rows, V] tensor; backward recomputes each chunk's logits once and forms their
    gradient,

        d logp[y] / dz = (onehot(y) - p) / T,    d H / dz = -p * (log p + H) / T,

    (z the logits, T the temperature), eagerly in place or by compiled kernels (`compiled`), then
    the layer's two products. The weight gradient is summed over the chunks in the model's dtype
    (each chunk's product added in place), as a loop sums its micro-batches' gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk: int, compiled: bool):
        ctx.set_materialize_grads(False)
        stats = _compiled()[0] if compiled else _chunk_stats
        logp, entropy, lse = [], [], []
        for i in range(0, max(hidden.shape[0], 1), chunk):  # a one-token padding row has none
            rows = slice(i, i + chunk)
            row_lse, row_logp, row_entropy = stats(
                F.linear(hidden[rows], weight, bias), targets[rows], 1.0 / temperature
            )
            logp.append(row_logp)
            entropy.append(row_entropy)
            lse.append(row_lse)
        logp_all, entropy_all = torch.cat(logp), torch.cat(entropy)
        ctx.save_for_backward(hidden, weight, bias, targets, torch.cat(lse), entropy_all)
        ctx.temperature, ctx.chunk, ctx.compiled = temperature, chunk, compiled
        return logp_all, entropy_all

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w: torch.Tensor | None = None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        if grad_logp is None and grad_entropy is None:
            grad_w = torch.zeros_like(weight) if need_w else None
            return (None if grad_h is None else grad_h.zero_(), grad_w, grad_b, None, None, None, None)
        fused = _compiled()[1] if ctx.compiled else None
        if fused is not None:  # its graph takes both gradients, zeros for the one the loss left out
            grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp
            grad_entropy = torch.zeros_like(lse) if grad_entropy is None else grad_entropy
        scale = 1.0 / ctx.temperature
        for i in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(i, i + ctx.chunk)
            h = hidden[rows]
            g_logp = None if grad_logp is None else grad_logp[rows]
            g_entropy = None if grad_entropy is None else grad_entropy[rows]
            if fused is not None:
                logits = F.linear(h, weight, bias)
                g = fused(logits, targets[rows], lse[rows], entropy[rows], g_logp, g_entropy, scale)
                del logits
            else:
                z = F.linear(h, weight, bias).float().mul_(scale)
                g = _logits_grad_in_place(z, targets[rows], lse[rows], entropy[rows], g_logp, g_entropy, scale, h.dtype)
                del z
            if grad_h is not None:
                grad_h[rows] = g @ weight
            # Summed in the model's dtype by the products themselves, as a loop accumulates its
            # micro-batches' gradients: no float32 [V, H] buffer, each chunk read and written once.
            if need_w:
                grad_w = g.t() @ h if grad_w is None else grad_w.addmm_(g.t(), h)
            if grad_b is not None:
                grad_b.add_(g.sum(0, dtype=torch.float32))
        if need_w and grad_w is None:  # no rows
            grad_w = torch.zeros_like(weight)
        return (
            grad_h,
            grad_w,
            None if grad_b is None else grad_b.to(weight.dtype),
            None,
            None,
            None,
            None,
        )


def token_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    temperature: float,
    chunk_tokens: int = 0,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(head(hidden[i]) / temperature)[targets[i]] and the entropy of that
    distribution, for rows [N, H] of hidden states, in float32; `chunk_tokens` rows at a time
    (module docstring; 0: all at once), each chunk's arithmetic compiled when `compiled`
    (config.choices.LogprobKernel). `head` is the output layer (an nn.Linear), or nn.Identity()
    when `hidden` already holds logits (always eager).

    The layer is called once, whatever the number of chunks: under ZeRO-3 each call gathers its
    weight with a collective, and ranks whose micro-batches differ in length must make the same
    number of them."""
    chunk = chunk_tokens if chunk_tokens > 0 else max(hidden.shape[0], 1)
    if isinstance(head, torch.nn.Identity):
        if hidden.shape[0] <= chunk:
            return _rows_logprobs(hidden, targets, temperature)
        parts = [
            checkpoint(_rows_logprobs, hidden[i : i + chunk], targets[i : i + chunk], temperature, use_reentrant=False)
            for i in range(0, hidden.shape[0], chunk)
        ]
        return torch.cat([lp for lp, _ in parts]), torch.cat([ent for _, ent in parts])

    def chunked(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _ChunkedHead.apply(rows, head.weight, head.bias, targets, temperature, chunk, compiled)  # pyright: ignore[reportReturnType]

    # Through the module's __call__ (its hooks: ZeRO-3 gathers the weight for this call and
    # again for its backward), with its forward replaced for this one call.
    head.forward = chunked
    try:
        return head(hidden)
    finally:
        del head.forward


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a DeepSpeed engine (its `module`) or a peft wrapper."""
    return getattr(model, "module", model)


def final_hidden(model: torch.nn.Module, **inputs) -> tuple[torch.Tensor, torch.nn.Module, torch.Tensor]:
    """(hidden [T, H], output layer, anchor) for a [1, T] batch: the model runs with `inputs`
    and its output layer gets no rows, so no [T, V] logits are made. `anchor` (a sum over the
    layer's empty output, always 0) must join the result's graph: ZeRO-3 releases the output
    layer's gathered weight in backward only when its outputs take part. For a model in
    LOGIT_TRANSFORMS or whose output layer is not a plain nn.Linear (a LoRA-wrapped one, say),
    (logits [T, V], nn.Identity(), 0)."""
    lm: Any = _causal_lm(model)
    config = getattr(lm, "config", None)
    head = lm.get_output_embeddings()
    if type(head) is not torch.nn.Linear or any(
        getattr(config, key, None) not in (None, 1.0) for key in LOGIT_TRANSFORMS
    ):
        logits = model(**inputs, use_cache=False).logits[0]
        return logits, torch.nn.Identity(), logits.new_zeros(())
    taken: list[torch.Tensor] = []

    def take(_module, args):
        taken.append(args[0])
        return (args[0][..., :0, :],)

    handle = head.register_forward_pre_hook(take)
    try:
        empty = model(**inputs, use_cache=False).logits
    finally:
        handle.remove()
    return taken[0][0], head, empty.sum()


def packed_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    temperature: float,
    seq_lengths: list[int] | None = None,
    prefix_lengths: list[int] | None = None,
    chunk_tokens: int = 0,
    wanted: list[int] | None = None,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logprobs[t] = log p(input_ids[t] | earlier tokens of its sequence) at `temperature`, and
    entropy[t] of the distribution that token was drawn from; both 0 at each sequence's first
    token. Inputs are [1, T]; outputs are float32 [T] and carry gradients. With prefix lengths
    (any > 0), the shared-prompt layout of the module docstring; `chunk_tokens` and `compiled`
    as in `token_logprobs`. `wanted` (token indices, from the host): the output layer runs on the
    rows that predict those tokens only, and every other token's logprob and entropy is 0 (the
    trainer asks for the tokens its loss trains). A model loaded with the `varlen` attention
    needs `seq_lengths` (its sequence boundaries)."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape != position_ids.shape:
        raise ValueError(
            f"expected input_ids and position_ids of shape [1, T], got {tuple(input_ids.shape)} "
            f"and {tuple(position_ids.shape)}"
        )
    inputs: dict[str, Any] = {"input_ids": input_ids, "position_ids": position_ids}
    shared = bool(prefix_lengths and any(prefix_lengths))
    if wanted is not None and not shared:
        starts = set(itertools.accumulate([0, *(seq_lengths or [])[:-1]])) if seq_lengths else {0}
        if starts.intersection(wanted):
            raise ValueError(
                f"wanted tokens {sorted(starts.intersection(wanted))} begin a sequence: nothing predicts them"
            )
    if getattr(getattr(_causal_lm(model), "config", None), "_attn_implementation", None) == packed_attention.NAME:
        if shared or seq_lengths is None:
            raise ValueError("the varlen attention needs seq_lengths and cannot take shared prompts")
        inputs.update(packed_attention.varlen_kwargs(seq_lengths, input_ids.device))
    if shared:
        allowed, source = shared_prefix_layout(seq_lengths or [], prefix_lengths or [], position_ids)
        allowed, source = allowed.to(input_ids.device), source.to(input_ids.device)
        dtype = next(model.parameters()).dtype
        # Additive form: the eager kernel adds the mask to the scores, sdpa accepts it too.
        mask = torch.zeros(allowed.shape, dtype=dtype, device=input_ids.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        inputs["attention_mask"] = mask[None, None]
    hidden, head, anchor = final_hidden(model, **inputs)
    total = input_ids.shape[1]
    if wanted is not None:
        index = to_device(torch.tensor(wanted, dtype=torch.long), input_ids.device)
        # Shared prompts: the trainer asks only for tokens that something predicts.
        rows = source[index] if shared else index - 1
        lp, ent = token_logprobs(hidden[rows], head, input_ids[0, index], temperature, chunk_tokens, compiled)
        zero = torch.zeros(total, dtype=torch.float32, device=input_ids.device)
        return zero.index_add(0, index, lp) + anchor.float(), zero.index_add(0, index, ent)
    if shared:
        has = source >= 0
        token_logp, token_entropy = token_logprobs(
            hidden[source.clamp(min=0)], head, input_ids[0], temperature, chunk_tokens, compiled
        )
        return token_logp * has + anchor.float(), token_entropy * has
    # Hidden states at t-1 predict token t; the last position predicts nothing.
    token_logp, token_entropy = token_logprobs(hidden[:-1], head, input_ids[0, 1:], temperature, chunk_tokens, compiled)
    keep = ~sequence_starts(position_ids)[1:]
    zero = anchor.reshape(1).float()
    return torch.cat([zero, token_logp * keep]), torch.cat([zero, token_entropy * keep])
