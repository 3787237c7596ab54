"""The policy the trainer optimises: the model as loaded (partitioned from the start under
ZeRO-3), its optimizer (on the device or offloaded) and the DeepSpeed config that wraps both
(ZeRO-3's sizes from the model's shape: trainer/zero_sizes.py)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.integrations import HfDeepSpeedConfig
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from pipeline_rl import lora
from pipeline_rl.config import LrDecay, RunConfig, attention_kernel
from pipeline_rl.core import packed_attention  # noqa: F401  (registers the varlen attention with transformers)
from pipeline_rl.core.model_shape import ModelShape
from pipeline_rl.trainer.zero_sizes import zero3_sizes

log = logging.getLogger(__name__)


def deepspeed_config(cfg: RunConfig) -> dict:
    zero: dict[str, Any] = {"stage": cfg.trainer.zero_stage}
    if cfg.trainer.zero_stage == 2:
        # Copying each gradient into one buffer as backward produces it costs a copy kernel and
        # host time per parameter and micro-batch; the gradients are reduced from where they lie.
        zero["contiguous_gradients"] = False
    if cfg.trainer.zero_stage == 3:
        # By default ZeRO-3 replaces torch.nn.functional.linear, process-wide, with a Python
        # autograd function (host work in every projection's forward and backward). Torch's own
        # linear saves the same tensors, and a layer's weights are gathered again for its backward.
        zero["memory_efficient_linear"] = False
        zero.update(zero3_sizes(cfg, ModelShape.read(cfg.model.path)).keys())
    if cfg.trainer.optimizer.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # A step's micro-batch count varies: backward() only accumulates, step() is the boundary.
        "managed_gradient_accumulation": False,
        # Always explicit: DeepSpeed clips at 1.0 when the key is absent; 0 disables.
        "gradient_clipping": cfg.trainer.optimizer.grad_clip,
        "zero_optimization": zero,
        # DeepSpeed's check of the gradients before each bf16 update reads every gradient tensor
        # and waits on the device; the trainer checks the norm the update computes anyway
        # instead (trainer/grad_norm.py), as it does for float32, which DeepSpeed never checks.
        "bf16": {"enabled": cfg.model.dtype == "bfloat16", "check_grad_overflow": False},
        "steps_per_print": 2**31 - 1,
    }


def load_model(cfg: RunConfig) -> Any:
    """The policy at model.path, in fp32 (DeepSpeed casts it to bf16 when model.dtype asks and
    keeps fp32 master weights in the optimizer, of the trained parameters only). Under ZeRO-3 it
    is built already partitioned (deepspeed.zero.Init, through transformers' DeepSpeed
    integration): no rank ever holds the full model; rank 0 reads the checkpoint one module at a
    time and scatters it. With model.lora, peft adapters wrap it and only they are trained."""
    model = _load_base(cfg)
    if cfg.model.lora is not None:
        # The adapters in the training dtype, like the base (DeepSpeed keeps their float32 master copy).
        model = lora.wrap(model, cfg.model.lora, dtype=getattr(torch, cfg.model.dtype))
    if cfg.trainer.zero_stage == 3:
        gather_whole_layers(model)
    return model


def _load_base(cfg: RunConfig) -> PreTrainedModel:
    kwargs: dict[str, Any] = dict(
        dtype=torch.float32, attn_implementation=str(attention_kernel(cfg, torch.cuda.is_available()))
    )
    if cfg.trainer.zero_stage != 3:
        return AutoModelForCausalLM.from_pretrained(cfg.model.path, **kwargs)
    # Registers itself as the config from_pretrained obeys; transformers keeps only a weak
    # reference, so the local keeps it alive.
    _zero3 = HfDeepSpeedConfig(deepspeed_config(cfg))
    try:
        return AutoModelForCausalLM.from_pretrained(cfg.model.path, **kwargs)
    finally:
        unset_hf_deepspeed_config()  # later loads in this process (tests) are plain again


def gather_whole_layers(model: torch.nn.Module) -> None:
    """Have ZeRO-3 gather each decoder layer's parameters as one unit (a DeepSpeed "leaf
    module"), once for its forward and once for its backward. By default DeepSpeed hooks every
    module that holds parameters and gathers each on its own, in forward and again in backward,
    each gather with host bookkeeping before and after it that the device waits on. The memory
    plan already counts a whole gathered layer and the next one prefetched. The layer classes
    are the ones transformers keeps whole when it splits a model over devices. Call it before
    deepspeed.initialize, which hooks the modules."""
    from deepspeed.utils import set_z3_leaf_modules

    layers: list[str] = [str(name) for name in getattr(model, "_no_split_modules", None) or ()]
    if not layers:
        log.warning(
            "%s names no decoder layer class: ZeRO-3 gathers its parameters module by module", type(model).__name__
        )
        return
    set_z3_leaf_modules(model, layers)


def leave_out_shm_all_reduce() -> None:
    """On CPU, keep DeepSpeed from building and loading its shared-memory all-reduce op when the
    process group is made. Only DeepSpeed's inference all-reduce (tensor-parallel inference
    layers) calls it, never ZeRO training, and its first build compiles two C++ files against
    torch's headers; gloo's all-reduce serves the trainers. DeepSpeed keeps the ops it found
    compatible in one dict, read when the group is made, so this marks the op unavailable there."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator is None or accelerator.device_name() != "cpu":
        return
    builder = accelerator.create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def make_optimizer(params: Iterable[torch.nn.Parameter], cfg: RunConfig) -> torch.optim.Optimizer:
    """AdamW; with trainer.optimizer.offload DeepSpeed's CPU AdamW, which steps the offloaded
    fp32 state on the host (DeepSpeed refuses a torch optimizer there: too slow)."""
    o = cfg.trainer.optimizer
    kwargs: dict[str, Any] = dict(lr=o.lr, betas=(o.betas[0], o.betas[1]), eps=o.eps, weight_decay=o.weight_decay)
    if o.offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **kwargs)
    # Fused: one kernel for every parameter's update, instead of a chain of them per tensor list.
    return torch.optim.AdamW(params, fused=torch.cuda.is_available(), **kwargs)


def lr_factor(
    cfg: RunConfig, clock: Callable[[], float] = time.time, started: float | None = None
) -> Callable[[int], float]:
    """LR multiplier of optimizer update s (0-based): linear up to 1 over `warmup_steps`; then
    constant, or a half cosine down to `min_lr_ratio` whose progress is the larger of the updates
    made of `shared.max_steps` and, when the run is bounded by time, the wall time spent of
    `max_time_s` since `started` (the launch: a trainer restarted mid-run goes on where the run
    is; by default this call)."""
    o = cfg.trainer.optimizer
    started = clock() if started is None else started
    updates = cfg.shared.max_steps * cfg.trainer.updates_per_step * cfg.trainer.epochs

    def factor(s: int) -> float:
        if s < o.warmup_steps:
            return (s + 1) / o.warmup_steps
        if o.decay == LrDecay.constant:
            return 1.0
        done = (s + 1 - o.warmup_steps) / max(1, updates - o.warmup_steps)
        if cfg.max_time_s > 0:
            done = max(done, (clock() - started) / cfg.max_time_s)
        return o.min_lr_ratio + (1.0 - o.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))

    return factor
