"""The policy-gradient loss of one packed micro-batch.

Off-policy correction: every trained token carries the behaviour logprob the actor sampled
it with (old_logprobs), so the importance weight of the current policy is
w = exp(logprob - old_logprob), per token, or per sequence with `ratio: sequence` (GSPO: the
geometric mean exp(mean log w) of the sequence's trained tokens, given to each of them). Three
objectives:

- reinforce: -min(w, is_truncation).detach() * A * logprob (truncated importance weights);
- ppo: -min(w * A, clip(w, 1 - eps, 1 + eps_high) * A), eps_high = ppo_clip_high (DAPO's
  clip-higher) or eps;
- cispo: -clip(w, 1 - eps, 1 + eps_high).detach() * A * logprob (CISPO: the weight is clipped,
  the token's gradient is kept, unlike PPO's, which is zero outside the range).

`ratio_mask: c` (IcePop / masked importance sampling) leaves out of the gradient every token
whose token-level ratio lies outside [1/c, c], whatever the objective.

Optional terms: + kl_coef * k3(ref || policy) with k3 = exp(ref - lp) - (ref - lp) - 1, and
- entropy_coef * entropy.

Normalisation uses denominators of the whole optimizer step over all ranks, so that the sum
of the micro-batch losses of all ranks is the step's mean: token (each trained token weighs
1 / step_tokens) or sequence (each sequence's mean over its trained tokens weighs
1 / step_samples). Data-parallel ranks therefore give the same update as one rank. With
`preprocess.advantage.count_filtered` the denominators also hold the tokens and sequences of the
step's groups filtered for zero advantage, as if trained with advantage 0.

`stats` are sums over the micro-batch's trained tokens, to be added up over micro-batches
and ranks and divided at the end (see `summarize`).

The loss is a plug-in (`trainer.loss.function`, default `policy_loss` here): a replacement
takes the same two arguments (a `LossInputs` and the `trainer.loss` section) and returns the
same (loss, stats) pair; see `LossFn`. One that declares settings of its own
(`@takes_settings(Settings)`) also gets them, from `trainer.loss.settings`, as `settings=`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from pipeline_rl.config import LossConfig, RatioLevel
from pipeline_rl.config.plugin_settings import read_settings, settings_type
from pipeline_rl.core.plugins import load_plugin

STAT_KEYS = ("tokens", "loss", "pg_loss", "kl", "entropy", "w", "w_sq", "clipped", "masked", "adv", "adv_sq")


@dataclass
class LossInputs:
    """One micro-batch as the loss sees it. Tensors are [T] over its packed tokens."""

    logprobs: torch.Tensor
    """The current policy's logprob of each token (with grad)."""
    entropy: torch.Tensor
    """The current policy's entropy at each token (with grad)."""
    old_logprobs: torch.Tensor
    """The behaviour logprob: what the actor's engine sampled the token with."""
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    """1 where the token is trained (completion tokens of samples the lag gate kept), else 0."""
    seq_index: torch.Tensor
    """The packed sequence each token belongs to (0, 1, ...)."""
    step_tokens: float
    """Trained tokens of the whole optimizer step over all ranks, and its share of the filtered
    groups' (token normalisation)."""
    step_samples: float
    """Sequences of the whole optimizer step over all ranks, likewise (sequence normalisation)."""
    ref_logprobs: torch.Tensor | None = None
    """The reference model's logprobs, when a scorer produced them (KL term)."""


class LossFn(Protocol):
    """The contract of a loss plug-in: `policy_loss`'s signature. The sum over all micro-batches
    of all ranks of the returned loss is what is minimised, so weigh tokens with
    `token_weights`. `stats` holds detached 0-d sums for STAT_KEYS (extra keys are ignored)."""

    def __call__(self, inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


def load_loss(cfg: LossConfig) -> LossFn:
    """The loss named by `trainer.loss.function`, with its own settings (`trainer.loss.settings`,
    read into the type it declares with `@takes_settings`) bound as `settings=`."""
    loss = load_plugin(cfg.function, "trainer.loss.function", "a function", check=callable)
    own = read_settings(loss, cfg.settings, "trainer.loss.settings", f"loss {cfg.function!r}")
    return functools.partial(loss, settings=own) if settings_type(loss) is not None else loss


def token_weights(
    loss_mask: torch.Tensor, seq_index: torch.Tensor, normalize: str, step_tokens: float, step_samples: float
) -> torch.Tensor:
    """Weight of each token in the step's loss (0 where loss_mask is 0)."""
    mask = loss_mask.float()
    if normalize == "token":
        return mask / max(step_tokens, 1.0)
    if normalize == "sequence":
        per_seq = torch.zeros(int(seq_index.max()) + 1, dtype=mask.dtype, device=mask.device)
        per_seq.scatter_add_(0, seq_index, mask)
        return mask / per_seq[seq_index].clamp(min=1.0) / max(step_samples, 1.0)
    raise ValueError(f"bad value for 'trainer.loss.normalize': {normalize!r}, expected token or sequence")


def per_sequence_mean(values: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
    """Each token's sequence mean of `values` over the sequence's masked tokens ([T] -> [T])."""
    n = int(seq_index.max()) + 1
    sums = torch.zeros(n, dtype=values.dtype, device=values.device).scatter_add(0, seq_index, values * mask)
    counts = torch.zeros(n, dtype=mask.dtype, device=mask.device).scatter_add(0, seq_index, mask)
    return (sums / counts.clamp(min=1.0))[seq_index]


def policy_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch, and its stats as detached 0-d tensors keyed by STAT_KEYS."""
    logprobs, entropy, old_logprobs = inputs.logprobs, inputs.entropy, inputs.old_logprobs
    advantages, loss_mask, seq_index = inputs.advantages, inputs.loss_mask, inputs.seq_index
    step_tokens, step_samples, ref_logprobs = inputs.step_tokens, inputs.step_samples, inputs.ref_logprobs
    mask = loss_mask.float()
    weights = token_weights(loss_mask, seq_index, cfg.normalize, step_tokens, step_samples)
    # Masked tokens (prompts, gated samples) get log-ratio 0 so exp() cannot overflow there.
    token_log_ratio = (logprobs - old_logprobs) * mask
    masked = torch.zeros_like(mask)
    if cfg.ratio_mask is not None:
        bound = math.log(cfg.ratio_mask)
        masked = (token_log_ratio.detach().abs() > bound).float() * mask
    if cfg.ratio == RatioLevel.sequence:
        log_ratio = per_sequence_mean(token_log_ratio, mask, seq_index) * mask
    elif cfg.ratio == RatioLevel.token:
        log_ratio = token_log_ratio
    else:
        raise ValueError(f"bad value for 'trainer.loss.ratio': {cfg.ratio!r}, expected token or sequence")
    ratio = torch.exp(log_ratio)
    r = ratio.detach()
    high = 1.0 + (cfg.ppo_clip if cfg.ppo_clip_high is None else cfg.ppo_clip_high)
    low = 1.0 - cfg.ppo_clip
    if cfg.kind == "reinforce":
        per_token = -r.clamp(max=cfg.is_truncation) * advantages * logprobs
        clipped = (r > cfg.is_truncation).float()
    elif cfg.kind == "ppo":
        per_token = -torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
        clipped = (((advantages > 0) & (r > high)) | ((advantages < 0) & (r < low))).float()
    elif cfg.kind == "cispo":
        per_token = -r.clamp(low, high) * advantages * logprobs
        clipped = ((r > high) | (r < low)).float()
    else:
        raise ValueError(f"bad value for 'trainer.loss.kind': {cfg.kind!r}, expected reinforce, ppo or cispo")
    per_token = per_token * (1.0 - masked)
    pg_loss = (weights * per_token).sum()
    loss = pg_loss
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("'trainer.loss.kl_coef' > 0 but the micro-batch has no ref_logprobs (no reference scorer ran)")
    kl = torch.zeros_like(logprobs)
    if ref_logprobs is not None:
        d = (ref_logprobs - logprobs) * mask
        kl = torch.exp(d) - d - 1.0
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * (weights * kl).sum()
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * (weights * entropy).sum()
    stats = {
        "tokens": mask.sum(),
        "loss": loss.detach(),
        "pg_loss": pg_loss.detach(),
        "kl": (kl.detach() * mask).sum(),
        "entropy": (entropy.detach() * mask).sum(),
        "w": (r * mask).sum(),
        "w_sq": (r * r * mask).sum(),
        "clipped": (clipped * mask).sum(),
        "masked": masked.sum(),
        "adv": (advantages * mask).sum(),
        "adv_sq": (advantages * advantages * mask).sum(),
    }
    return loss, stats


def summarize(sums: dict[str, float]) -> dict[str, float]:
    """Step metrics from stats summed over all micro-batches and ranks."""
    n = max(sums["tokens"], 1.0)
    adv_mean = sums["adv"] / n
    return {
        "loss": sums["loss"],
        "pg_loss": sums["pg_loss"],
        "kl": sums["kl"] / n,
        "entropy": sums["entropy"] / n,
        # Effective sample size of the importance weights, as a fraction of the tokens (1 = on-policy).
        "ess": sums["w"] ** 2 / (n * sums["w_sq"]) if sums["w_sq"] > 0 else 1.0,
        "is_weight_mean": sums["w"] / n,
        "clip_fraction": sums["clipped"] / n,
        "ratio_masked_fraction": sums["masked"] / n,
        "advantage_mean": adv_mean,
        "advantage_std": max(sums["adv_sq"] / n - adv_mean**2, 0.0) ** 0.5,
        "trained_tokens": sums["tokens"],
    }
