"""The GPU memory plan that `--dry-run` prints: what one actor GPU and one trainer GPU hold,
estimated from the model's config.json and the run config, against world.gpu_memory_gib.

An estimate for decoder-only models of the Llama / Qwen2 / Qwen3 shape (attention with grouped KV
heads, a gated MLP, or in MoE layers routed experts with an optional shared expert); it counts
the large terms and leaves a margin for the rest:
- actor GPU (vLLM, tensor parallel t): vLLM takes gpu_memory_utilization of the GPU for its
  shard of the weights (1/t), activations and the KV cache; the weight receiver's staging
  buffer lies outside it (a whole model, or one message when staged on host, where each TP
  worker keeps only its shard of an update). The KV cache must hold actor.llm.max_num_seqs
  sequences of max_model_len: vLLM schedules that many at once, and a cache too small for
  them preempts sequences as they grow and computes them again.
- trainer GPU (DeepSpeed, r ranks), the terms `trainer_bytes` counts, each checked against
  what the trainer allocates (scripts/gpu_check.py on an H100, tests/unit/test_memory_plan.py on
  CPU): 16 bytes per parameter (bf16 weights and gradients, fp32 master weights and two Adam
  moments), divided by r under ZeRO-3 (only the 12 optimizer bytes under ZeRO-2; with
  trainer.optimizer.offload they are in host memory); under ZeRO-3 the parameters DeepSpeed
  may hold gathered (stage3_max_live_parameters), its reduce bucket, and with hierarchical
  partitioning the secondary partition of the weights (trainer/zero_sizes.py); what autograd
  saves per token and layer
  (`activation_bytes_per_token`), for every layer or, with gradient checkpointing, each layer's
  input plus what the one recomputed layer holds beyond the logits chunk (the two are not live
  together); with sdpa, its [T, T] mask of a packed row, in the model's dtype,
  once per layer (the one term that grows with the square of preprocess.seq_length; the varlen
  and flash kernels make none); the output layer's chunk of logits with its float32 log-softmax
  and their gradients (LOGITS_CHUNK_BYTES_PER_ENTRY per row and vocabulary entry, by
  model.logprob_kernel) and the output layer's weight gradient the chunks sum into; and the CUDA
  context, cuBLAS workspaces and NCCL buffers outside PyTorch's allocator.
- with model.lora: the trainer holds the frozen base in model.dtype (divided by r under ZeRO-3)
  and the 16 bytes per parameter above for the adapter's parameters only; the actor holds the
  adapter's slot (at vLLM's reserved rank) beside the base; an update is the adapter.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

from pipeline_rl.config import (
    MASK_FREE_ATTENTION,
    LogprobKernel,
    RunConfig,
    attention_kernel,
    logprob_kernel,
)
from pipeline_rl.core.model_shape import ModelShape
from pipeline_rl.engine.adapter_slot import engine_max_rank
from pipeline_rl.trainer.zero_sizes import hierarchical_partition, zero3_sizes
from pipeline_rl.weight_layout import dtype_of
from pipeline_rl.weight_sync.delta import expected_bytes, expected_changed_fraction

GIB = 2**30
_BYTES = {"float32": 4, "bfloat16": 2}


def memory_plan(cfg: RunConfig) -> list[str]:
    """The plan for cfg.model.path's shape (its config.json; the weights need not be there)."""
    config = Path(cfg.model.path) / "config.json"
    if not config.exists():
        return [f"memory: no plan, {config} not found (the plan reads the model's shape from it)"]
    shape = ModelShape.read(cfg.model.path)
    return plan_lines(cfg, shape) + zero_lines(cfg, shape)


def plan_lines(cfg: RunConfig, shape: ModelShape) -> list[str]:
    """The plan, one line per item; each line that weighs a GPU ends in 'fits' or 'DOES NOT FIT'."""
    gpu = cfg.world.gpu_memory_gib * GIB
    size = _BYTES[cfg.model.dtype]
    weights = shape.params * size
    lines = [f"memory: model {shape.params / 1e9:.2f} B parameters, {weights / GIB:.1f} GiB in {cfg.model.dtype}"]
    if shape.experts:
        lines.append(
            f"memory: mixture of experts: {shape.experts} experts of width {shape.moe_intermediate} in "
            f"{shape.moe_layers} of {shape.layers} layers, {shape.top_k} per token: {shape.active_params / 1e9:.2f} B "
            "parameters active per token; every expert is held, as the trainer's whole model is"
        )
    if cfg.shared.routing_replay:
        per_token = shape.routes_bytes_per_token()
        tokens = cfg.shared.groups_per_step * cfg.actor.attempts * cfg.actor.max_new_tokens
        lines.append(
            f"streams: routing replay adds {per_token} B per generated token to the rollouts (base64 of "
            f"{shape.moe_layers} MoE layers x top {shape.top_k}), up to {per_token * tokens / 2**20:.1f} MiB per step "
            f"of {cfg.shared.groups_per_step} groups x {cfg.actor.attempts} attempts x {cfg.actor.max_new_tokens} tokens"
        )

    llm = cfg.actor.llm
    tp = cfg.shared.tensor_parallel_size
    budget = llm.gpu_memory_utilization * gpu
    shard = weights / tp
    activations = llm.max_num_seqs * shape.hidden * 4 * size + 2 * GIB  # sampler and graphs: a margin
    kv = budget - shard - activations
    kv_per_token = 2 * shape.layers * shape.kv_dim * size / min(tp, shape.kv_heads)
    tokens = max(0, int(kv / kv_per_token))
    bucket = cfg.trainer.weight_bucket_mb * 2**20
    staging = max(bucket, shape.largest_tensor * size) if llm.stage_weights_on_host else weights
    lora = cfg.model.lora
    adapter = 0
    if lora is not None:
        adapter = shape.lora_params(lora) * size
        slot = shape.lora_params(lora, engine_max_rank(lora.rank)) * size / tp
        kv -= slot
        tokens = max(0, int(kv / kv_per_token))
        staging = adapter  # an update is the adapter
        lines.append(
            f"memory: LoRA rank {lora.rank} on {', '.join(lora.target_modules)}: {adapter / size / 1e6:.1f} M "
            f"parameters; an update is {adapter / 2**20:.0f} MiB (the full model: {weights / GIB:.1f} GiB); "
            f"the actor's adapter slot {slot / GIB:.2f} GiB per GPU"
        )
    outside = gpu - budget
    sequences = tokens // llm.max_model_len
    ok = kv > 0 and sequences >= llm.max_num_seqs and staging <= outside
    lines.append(
        f"memory: actor GPU (tensor_parallel_size={tp}): weights {shard / GIB:.1f} GiB + KV cache "
        f"{max(kv, 0) / GIB:.1f} GiB ({tokens} tokens, {sequences} sequences of max_model_len for "
        f"max_num_seqs={llm.max_num_seqs}) within {llm.gpu_memory_utilization:g} x {cfg.world.gpu_memory_gib:g} GiB; "
        f"weight staging {staging / GIB:.1f} GiB in the {outside / GIB:.1f} GiB outside it: "
        f"{'fits' if ok else 'DOES NOT FIT'}"
    )
    if llm.stage_weights_on_host and lora is None:
        per_node = min(cfg.world.actors * tp, cfg.world.gpus_per_node or 1)
        # Each TP worker keeps only the shard its copy plan reads (WeightReceiver keep); PyTorch's
        # pinned-memory allocator rounds every block up to a power of two.
        shard = weights / tp
        pinned = 2 ** math.ceil(math.log2(shard))
        lines.append(
            f"memory: actor host staging {shard / GIB:.1f} GiB (1/{tp} of the model) in a {pinned / GIB:.0f} GiB "
            f"pinned block per TP worker, {per_node * pinned / GIB:.0f} GiB on a node of {per_node} workers"
        )

    if cfg.trainer.weight_delta and lora is None:
        lines.append(delta_line(cfg, shape, weights))

    ranks = cfg.world.trainers
    t = cfg.trainer
    trained = shape.params if lora is None else shape.lora_params(lora)
    parts = trainer_bytes(cfg, shape)
    total = sum(parts.values())
    lines.append(
        f"memory: trainer GPU (ZeRO-{t.zero_stage}, {ranks} ranks): "
        + " + ".join(f"{name} {value / GIB:.1f} GiB" for name, value in parts.items())
        + f" = {total / GIB:.1f} GiB of {cfg.world.gpu_memory_gib:g} GiB: {'fits' if total <= gpu else 'DOES NOT FIT'}"
    )
    if t.optimizer.offload:
        lines.append(f"memory: trainer host optimizer state {trained * 12 / ranks / GIB:.1f} GiB per rank")
    return lines


CUDA_OUTSIDE_ALLOCATOR = int(1.7 * GIB)
"""CUDA context, cuBLAS workspaces and NCCL buffers of one trainer process: memory the device
holds beyond PyTorch's allocator (gpu_check.py on an H100, torch 2.11, CUDA 13: 1.3 GiB at
ZeRO-3, 1.68 GiB at ZeRO-2)."""
LOGITS_CHUNK_BYTES_PER_ENTRY = {LogprobKernel.eager: 10, LogprobKernel.compiled: 4}
"""Bytes per row and vocabulary entry while a chunk of logits is live (core/logprobs.py
_ChunkedHead, in a bf16 model), by logprob kernel. Eager: in forward the output layer's bf16
logits, their float32 copy and the float32 probabilities; in backward the float32 logits turned
in place into their gradient, the probabilities, and the gradient in bf16. Compiled: the bf16
logits, and in backward their bf16 gradient beside them."""


def delta_line(cfg: RunConfig, shape: ModelShape, weights: int) -> str:
    """The expected size of a delta weight update (weight_sync/delta.py: expected_changed_fraction,
    an upper bound: Adam's steps are at most about lr) and what it costs each trainer rank."""
    dtype = dtype_of(cfg.model.dtype)
    lr = cfg.trainer.optimizer.lr
    fraction = expected_changed_fraction(lr, dtype, shape.initializer_range)
    update = expected_bytes(shape.params, fraction, dtype.itemsize)
    shadow = weights / cfg.world.trainers
    every = cfg.trainer.full_update_every
    return (
        f"memory: weight updates by delta: at lr {lr:g} up to {fraction:.1%} of the {cfg.model.dtype} elements change "
        f"per update (weights ~N(0, {shape.initializer_range:g})), about {update / GIB:.2f} GiB on the wire "
        f"({update / weights:.1%} of the full {weights / GIB:.1f} GiB), staged whole by each receiver "
        f"(each TP worker: {update / GIB:.2f} GiB); full updates first, to a changed group and "
        + (f"every {every} updates" if every else "on request")
        + f"; each trainer rank keeps its share of the published weights, {shadow / GIB:.1f} GiB"
    )


def activation_bytes_per_token(shape: ModelShape, size: int, cuda: bool = True) -> int:
    """Bytes autograd saves per token in one decoder layer (Qwen2/Llama shape, sdpa): the inputs
    of every matmul and norm (4 hidden, 4 query-sized, 2 kv and 4 intermediate vectors in the
    model's dtype; a query is a hidden vector unless head_dim says otherwise),
    RMSNorm's float32 copy of its input in a bf16 model, attention's float32 log-sum-exp per
    head and two float32 norm statistics; on CUDA, sdpa's kernels also keep contiguous copies of
    2 hidden vectors. Exact for transformers' Qwen2 on CPU (tests/unit/test_memory_plan.py); the
    CUDA term as measured on an H100. In an MoE layer the MLP's term is that of the top_k experts
    a token goes to (each with its own copy of the token's hidden vector) and of the shared
    expert, plus the router's float32 logits and probabilities; the figure is the mean over the
    layers, dense and MoE."""
    h = shape.hidden
    upcast = 4 * h if size < 4 else 0
    kernel = 2 * size * h if cuda else 0
    rest = size * (4 * h + 4 * shape.q_dim + 2 * shape.kv_dim) + upcast + kernel + 4 * shape.heads + 8
    if shape.qk_norm:  # each head's query and key norm: its input and a float32 statistic
        rest += size * (shape.q_dim + shape.kv_dim) + 4 * (shape.heads + shape.kv_heads)
    dense_mlp = size * 4 * shape.intermediate
    if not shape.moe_layers:
        return rest + dense_mlp
    # Per routed token: the gathered input, the gate/up output, the activation and product, and
    # the expert's output with its routing weight.
    routed = shape.top_k * (size * (2 * h + 4 * shape.moe_intermediate) + 4)
    moe_mlp = routed + size * 4 * shape.shared_expert_intermediate + 2 * 4 * shape.experts
    mlps = (shape.layers - shape.moe_layers) * dense_mlp + shape.moe_layers * moe_mlp
    return rest + math.ceil(mlps / shape.layers)


def trainer_bytes(cfg: RunConfig, shape: ModelShape, cuda: bool = True) -> dict[str, int]:
    """One trainer GPU's peak, by term (module docstring)."""
    t = cfg.trainer
    ranks = cfg.world.trainers
    size = _BYTES[cfg.model.dtype]
    lora = cfg.model.lora
    optimizer = 0 if t.optimizer.offload else 12 / ranks  # offloaded: in host memory
    trained = shape.params if lora is None else shape.lora_params(lora)
    state = trained * (4 / ranks + optimizer if t.zero_stage == 3 else 4 + optimizer)
    if lora is not None:  # the frozen base: weights only, no gradient or optimizer state
        state += shape.params * size / (ranks if t.zero_stage == 3 else 1)
    gathered = reduce_bucket = secondary = 0
    if t.zero_stage == 3:
        sizes = zero3_sizes(cfg, shape)
        gathered = sizes.max_live * size
        reduce_bucket = sizes.reduce_bucket * size
        secondary = shape.params * size / sizes.hpz if sizes.hpz > 1 else 0
    tokens = cfg.preprocess.seq_length
    per_token = activation_bytes_per_token(shape, size, cuda)
    chunk = min(cfg.model.logprob_chunk_tokens or tokens, tokens)
    logits = LOGITS_CHUNK_BYTES_PER_ENTRY[logprob_kernel(cfg, cuda)] * chunk * shape.vocab
    if t.gradient_checkpointing:
        # Each layer keeps its input. The one layer backward recomputes at a time is live only
        # after the output layer's chunks are gone: the larger of the two sets the peak.
        activations = tokens * shape.layers * shape.hidden * size + max(0, tokens * per_token - logits)
        masks = size * tokens**2
    else:
        activations = tokens * shape.layers * per_token
        masks = shape.layers * size * tokens**2
    if attention_kernel(cfg, cuda) in MASK_FREE_ATTENTION:
        masks = 0
    published = shape.params * size / ranks if t.weight_delta and lora is None else 0
    return {
        "model and optimizer state": int(state),
        "published share": int(published),
        "gathered parameters": int(gathered),
        "reduce bucket": int(reduce_bucket),
        "secondary partition": int(secondary),
        "activations": int(activations),
        "attention masks": int(masks),
        # The output layer's weight gradient, which the chunks' products sum into (full fine-tuning).
        "logits chunk": int(logits) + (size * shape.vocab * shape.hidden if lora is None else 0),
        "CUDA context": CUDA_OUTSIDE_ALLOCATOR if cuda else 0,
    }


PLANNED_STAGES = (2, 3)
"""The ZeRO stages whose trainer terms were checked against a GPU (scripts/gpu_check.py)."""


def trainer_fits(cfg: RunConfig, shape: ModelShape, stage: int) -> tuple[bool, float]:
    """(whether one trainer GPU's plan fits at ZeRO `stage`, its GiB)."""
    at = copy.deepcopy(cfg)
    at.trainer.zero_stage = stage
    total = sum(trainer_bytes(at, shape).values())
    return total <= cfg.world.gpu_memory_gib * GIB, total / GIB


def lowest_stage(cfg: RunConfig, shape: ModelShape) -> int | None:
    """The lowest planned ZeRO stage at which one trainer GPU's plan fits (None: neither)."""
    return next((stage for stage in PLANNED_STAGES if trainer_fits(cfg, shape, stage)[0]), None)


def zero_lines(cfg: RunConfig, shape: ModelShape) -> list[str]:
    """`--dry-run`'s ZeRO stage and sizes, each with why (trainer/zero_sizes.py)."""
    stage, gib = cfg.trainer.zero_stage, cfg.world.gpu_memory_gib
    lowest = lowest_stage(cfg, shape)
    need2 = trainer_fits(cfg, shape, 2)[1]
    if stage == lowest:
        why = "the lowest stage whose plan fits" + (
            f" ({need2:.1f} GiB of {gib:g})" if stage == 2 else f" (ZeRO-2 would need {need2:.1f} GiB of {gib:g})"
        )
    elif lowest is None:
        why = "no planned stage fits"
    else:
        why = f"ZeRO-{lowest} fits and runs faster (docs/gpu.md): trainer.zero_stage={lowest}"
    lines = [f"trainer: ZeRO-{stage} (trainer.zero_stage), {why}"]
    if stage == 2:
        lines.append(
            "trainer: ZeRO-2 buckets: DeepSpeed's reduce_bucket_size and allgather_bucket_size (5e8 elements), "
            "as measured on a GPU (docs/gpu.md)"
        )
    if stage != 3:
        return lines
    z = zero3_sizes(cfg, shape)
    size = _BYTES[cfg.model.dtype]

    def key(name: str, value: int, why: str) -> str:
        return f"trainer: ZeRO-3 {name} {value / 1e6:.1f} M: {why}"

    embedding = shape.embedding_params / 1e6
    secondary = f"; a secondary partition of {shape.params * size / z.hpz / GIB:.1f} GiB per GPU" if z.hpz > 1 else ""
    return lines + [
        f"trainer: ZeRO-3 sizes from the largest decoder layer, {z.layer / 1e6:.1f} M parameters, ZeRO-3's unit of gathering:",
        key("stage3_prefetch_bucket_size", z.prefetch, "the next layer is gathered while one computes"),
        key(
            "stage3_max_live_parameters",
            z.max_live,
            f"two layers and the {embedding:.1f} M-parameter embedding or output layer ({z.max_live * size / GIB:.1f} GiB)",
        ),
        key("stage3_max_reuse_distance", z.max_reuse, "a layer stays gathered only for its own backward"),
        key(
            "reduce_bucket_size",
            z.reduce_bucket,
            f"a layer's gradients at once ({z.reduce_bucket * size / GIB:.1f} GiB)",
        ),
        key(
            "stage3_param_persistence_threshold",
            z.persistence,
            "the smallest matrix: biases and norms stay whole on every rank, every matrix is partitioned",
        ),
        f"trainer: ZeRO-3 zero_hpz_partition_size {z.hpz}: {hierarchical_partition(cfg)[1]}{secondary}",
    ]
