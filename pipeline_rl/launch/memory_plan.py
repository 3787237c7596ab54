"""The GPU memory plan that `--dry-run` prints: what one actor GPU and one trainer GPU hold,
estimated from the model's config.json and the run config, against world.gpu_memory_gib.

An estimate for decoder-only models of the Llama / Qwen2 / Qwen3 shape (attention with grouped KV
heads, a gated MLP, or in MoE layers routed experts with an optional shared expert); it counts
the large terms and leaves a margin for the rest:
- actor GPU (vLLM, tensor parallel t): vLLM takes gpu_memory_utilization of the GPU for its
  shard of the weights (1/t), activations and the KV cache; the weight receiver's staging
  buffer lies outside it (a whole model, or one message when staged on host, where each TP
  worker keeps only its shard of an update).
- trainer GPU (DeepSpeed, r ranks), the terms `trainer_bytes` counts, each checked against
  what the trainer allocates (scripts/gpu_check.py on an H100, tests/unit/test_memory_plan.py on
  CPU): 16 bytes per parameter (bf16 weights and gradients, fp32 master weights and two Adam
  moments), divided by r under ZeRO-3 (only the 12 optimizer bytes under ZeRO-2; with
  trainer.optimizer.offload they are in host memory); under ZeRO-3 the gathered layers and
  DeepSpeed's prefetch bucket; what autograd saves per token and layer
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

import json
import math
from dataclasses import dataclass
from pathlib import Path

from pipeline_rl.config import (
    MASK_FREE_ATTENTION,
    LogprobKernel,
    LoraConfig,
    RunConfig,
    attention_kernel,
    logprob_kernel,
)
from pipeline_rl.core.routes import encoded_bytes_per_token
from pipeline_rl.engine.adapter_slot import engine_max_rank

GIB = 2**30
_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool
    head_dim: int | None = None
    """Per attention head (Qwen3 sets it apart from hidden / heads); None: hidden / heads."""
    qk_norm: bool = False
    """Qwen3's RMSNorm of each head's queries and keys (head_dim weights each)."""
    experts: int = 0
    """Mixture of experts: routed experts per MoE layer (0: a dense model)."""
    top_k: int = 0
    """Experts the router picks per token."""
    moe_intermediate: int = 0
    """Each expert's MLP width."""
    shared_expert_intermediate: int = 0
    """Qwen2-MoE's shared expert, run for every token beside the routed ones (0: none)."""
    moe_layers: int = 0
    """Layers whose MLP is the experts; the others (decoder_sparse_step, mlp_only_layers) are dense."""

    @classmethod
    def read(cls, model_dir: str | Path) -> ModelShape:
        c = json.loads((Path(model_dir) / "config.json").read_text())
        experts = c.get("num_experts") or c.get("num_local_experts") or 0
        layers = c["num_hidden_layers"]
        moe_layers = 0
        if experts:
            step = c.get("decoder_sparse_step") or 1
            dense = set(c.get("mlp_only_layers") or [])
            moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
        return cls(
            c["hidden_size"],
            layers,
            c["num_attention_heads"],
            c.get("num_key_value_heads", c["num_attention_heads"]),
            c["intermediate_size"],
            c["vocab_size"],
            bool(c.get("tie_word_embeddings", False)),
            # Qwen2 and Qwen2-MoE have q/k/v biases
            bool(c.get("attention_bias", c.get("qkv_bias", c.get("model_type") in ("qwen2", "qwen2_moe")))),
            head_dim=c.get("head_dim"),
            qk_norm=c.get("model_type") in ("qwen3", "qwen3_moe"),
            experts=experts,
            top_k=c.get("num_experts_per_tok", 0) if experts else 0,
            moe_intermediate=c.get("moe_intermediate_size") or (c["intermediate_size"] if experts else 0),
            shared_expert_intermediate=c.get("shared_expert_intermediate_size") or 0,
            moe_layers=moe_layers,
        )

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.head_size * self.heads

    @property
    def kv_dim(self) -> int:
        return self.head_size * self.kv_heads

    @property
    def moe_mlp_params(self) -> int:
        """One MoE layer's MLP: the experts, the router, and the shared expert with its gate."""
        h = self.hidden
        shared = 3 * h * self.shared_expert_intermediate + h if self.shared_expert_intermediate else 0
        return self.experts * 3 * h * self.moe_intermediate + self.experts * h + shared

    @property
    def params(self) -> int:
        h = self.hidden
        attention = 2 * h * self.q_dim + 2 * h * self.kv_dim + 2 * h
        if self.qkv_bias:
            attention += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            attention += 2 * self.head_size
        dense_mlp = 3 * h * self.intermediate
        mlps = (self.layers - self.moe_layers) * dense_mlp + self.moe_layers * self.moe_mlp_params
        return self.vocab * h * (1 if self.tied else 2) + self.layers * attention + mlps + h

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: only the top_k experts of each MoE layer."""
        if not self.experts:
            return self.params
        idle = (self.experts - self.top_k) * 3 * self.hidden * self.moe_intermediate
        return self.params - self.moe_layers * idle

    def lora_params(self, lora: LoraConfig, rank: int | None = None) -> int:
        """Elements of the LoRA adapter (A: rank x in, B: out x rank per target layer)."""
        h, kv, inter = self.hidden, self.kv_dim, self.intermediate
        per_layer = {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, inter),
            "up_proj": (h, inter),
            "down_proj": (inter, h),
        }
        r = lora.rank if rank is None else rank
        total = self.layers * sum(r * (i + o) for name, (i, o) in per_layer.items() if name in lora.target_modules)
        if "lm_head" in lora.target_modules:
            total += r * (h + self.vocab)
        return total

    @property
    def largest_tensor(self) -> int:
        """Elements of the largest single tensor the trainer sends: the embedding, an MLP matrix,
        or (MoE) one layer's experts, which transformers keeps fused in one tensor."""
        return max(
            self.vocab * self.hidden,
            self.hidden * self.intermediate,
            self.experts * 2 * self.moe_intermediate * self.hidden,
        )

    def routes_bytes_per_token(self) -> int:
        """Routing replay's routes of one token on the stream: a byte per MoE layer and pick."""
        return encoded_bytes_per_token(self.moe_layers * self.top_k)


def memory_plan(cfg: RunConfig) -> list[str]:
    """The plan for cfg.model.path's shape (its config.json; the weights need not be there)."""
    config = Path(cfg.model.path) / "config.json"
    if not config.exists():
        return [f"memory: no plan, {config} not found (the plan reads the model's shape from it)"]
    return plan_lines(cfg, ModelShape.read(cfg.model.path))


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
    ok = kv > 0 and tokens >= llm.max_model_len and staging <= outside
    lines.append(
        f"memory: actor GPU (tensor_parallel_size={tp}): weights {shard / GIB:.1f} GiB + KV cache "
        f"{max(kv, 0) / GIB:.1f} GiB ({tokens} tokens, {tokens // llm.max_model_len} sequences of "
        f"max_model_len) within {llm.gpu_memory_utilization:g} x {cfg.world.gpu_memory_gib:g} GiB; weight staging "
        f"{staging / GIB:.1f} GiB in the {outside / GIB:.1f} GiB outside it: {'fits' if ok else 'DOES NOT FIT'}"
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
ZERO3_PREFETCH_ELEMENTS = 50_000_000
"""DeepSpeed's default stage3_prefetch_bucket_size (parameters fetched ahead of use)."""
LOGITS_CHUNK_BYTES_PER_ENTRY = {LogprobKernel.eager: 10, LogprobKernel.compiled: 4}
"""Bytes per row and vocabulary entry while a chunk of logits is live (core/logprobs.py
_ChunkedHead, in a bf16 model), by logprob kernel. Eager: in forward the output layer's bf16
logits, their float32 copy and the float32 probabilities; in backward the float32 logits turned
in place into their gradient, the probabilities, and the gradient in bf16. Compiled: the bf16
logits, and in backward their bf16 gradient beside them."""


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
    gathered = 0
    if t.zero_stage == 3:  # the layer in use, the next one prefetched, and the output layer
        layer = (shape.params - shape.vocab * shape.hidden * (1 if shape.tied else 2)) / shape.layers
        gathered = (2 * layer + ZERO3_PREFETCH_ELEMENTS + shape.vocab * shape.hidden) * size
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
    return {
        "model and optimizer state": int(state),
        "gathered parameters": int(gathered),
        "activations": int(activations),
        "attention masks": int(masks),
        # The output layer's weight gradient, which the chunks' products sum into (full fine-tuning).
        "logits chunk": int(logits) + (size * shape.vocab * shape.hidden if lora is None else 0),
        "CUDA context": CUDA_OUTSIDE_ALLOCATOR if cuda else 0,
    }
