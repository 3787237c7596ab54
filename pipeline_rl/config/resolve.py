"""Config choices that depend on where the run goes: `auto` values made concrete, and whether
the run is the Ray driver's."""

from __future__ import annotations

import importlib.util

from pipeline_rl.config.choices import Attention, LogprobKernel
from pipeline_rl.config.schema import RunConfig

MASK_FREE_ATTENTION = (Attention.varlen, Attention.flash_attention_2, Attention.flex_attention)
"""Kernels that find the packed sequences' boundaries without a [T, T] mask."""


def attention_kernel(cfg: RunConfig, cuda: bool) -> Attention:
    """The trainer's attention kernel (transformers' attn_implementation) for
    trainer.attention (see config.choices.Attention)."""
    if cfg.trainer.attention != Attention.auto:
        return cfg.trainer.attention
    if cfg.shared.share_prompts:
        return Attention.sdpa
    if not cuda:
        return Attention.varlen
    flash = importlib.util.find_spec("flash_attn") is not None
    return Attention.flash_attention_2 if flash else Attention.varlen


def logprob_kernel(cfg: RunConfig, cuda: bool) -> LogprobKernel:
    """model.logprob_kernel made concrete (see config.choices.LogprobKernel)."""
    if cfg.model.logprob_kernel != LogprobKernel.auto:
        return cfg.model.logprob_kernel
    triton = importlib.util.find_spec("triton") is not None
    return LogprobKernel.compiled if cuda and triton else LogprobKernel.eager


def on_ray(cfg: RunConfig) -> bool:
    """Several nodes, or a Ray cluster named: the run is the Ray driver's."""
    return cfg.world.nodes > 1 or cfg.world.ray_address is not None
