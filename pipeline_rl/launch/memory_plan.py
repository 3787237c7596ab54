"""The GPU memory plan that `--dry-run` prints: what one actor GPU and one trainer GPU hold,
estimated from the model's config.json and the run config, against world.gpu_memory_gib.

An estimate for decoder-only models of the Llama / Qwen2 shape (attention with grouped KV
heads, a gated MLP); it counts the large terms and leaves a margin for the rest:
- actor GPU (vLLM, tensor parallel t): vLLM takes gpu_memory_utilization of the GPU for its
  shard of the weights (1/t), activations and the KV cache; the weight receiver's staging
  buffer lies outside it (a whole model, or one message when staged on host).
- trainer GPU (DeepSpeed, r ranks): 16 bytes per parameter (bf16 weights and gradients, fp32
  master weights and two Adam moments), divided by r under ZeRO-3 (only the 12 optimizer bytes
  are divided under ZeRO-2; with trainer.optimizer.offload they are in host memory); checkpointed activations (one hidden vector per layer per token);
  one layer's activations being recomputed; the fp32 logits chunk, its log-softmax and gradient.
- with model.lora: the trainer holds the frozen base in model.dtype (divided by r under ZeRO-3)
  and the 16 bytes per parameter above for the adapter's parameters only; the actor holds the
  adapter's slot (at vLLM's reserved rank) beside the base; an update is the adapter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline_rl.actor.adapter_slot import engine_max_rank
from pipeline_rl.config import LoraConfig, RunConfig

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

    @classmethod
    def read(cls, model_dir: str | Path) -> ModelShape:
        c = json.loads((Path(model_dir) / "config.json").read_text())
        return cls(
            c["hidden_size"],
            c["num_hidden_layers"],
            c["num_attention_heads"],
            c.get("num_key_value_heads", c["num_attention_heads"]),
            c["intermediate_size"],
            c["vocab_size"],
            bool(c.get("tie_word_embeddings", False)),
            bool(c.get("attention_bias", c.get("model_type") == "qwen2")),  # Qwen2 has q/k/v biases
        )

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    @property
    def params(self) -> int:
        h = self.hidden
        layer = 2 * h * h + 2 * h * self.kv_dim + 3 * h * self.intermediate + 2 * h
        if self.qkv_bias:
            layer += h + 2 * self.kv_dim
        return self.vocab * h * (1 if self.tied else 2) + self.layers * layer + h

    def lora_params(self, lora: LoraConfig, rank: int | None = None) -> int:
        """Elements of the LoRA adapter (A: rank x in, B: out x rank per target layer)."""
        h, kv, inter = self.hidden, self.kv_dim, self.intermediate
        per_layer = {
            "q_proj": (h, h),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (h, h),
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
        """Elements of the largest single tensor (the embedding, or an MLP matrix)."""
        return max(self.vocab * self.hidden, self.hidden * self.intermediate)


def memory_plan(cfg: RunConfig) -> list[str]:
    """The plan for cfg.model.path's shape (its config.json; the weights need not be there)."""
    config = Path(cfg.model.path) / "config.json"
    if not config.exists():
        return [f"memory: no plan, {config} not found (the plan reads the model's shape from it)"]
    return plan_lines(cfg, ModelShape.read(cfg.model.path))


def plan_lines(cfg: RunConfig, shape: ModelShape) -> list[str]:
    """The plan, one line per item, each ending in 'fits' or 'DOES NOT FIT'."""
    gpu = cfg.world.gpu_memory_gib * GIB
    size = _BYTES[cfg.model.dtype]
    weights = shape.params * size
    lines = [f"memory: model {shape.params / 1e9:.2f} B parameters, {weights / GIB:.1f} GiB in {cfg.model.dtype}"]

    llm = cfg.actor.llm
    tp = llm.tensor_parallel_size
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
        lines.append(
            f"memory: actor host staging {weights / GIB:.1f} GiB pinned per TP worker, "
            f"{per_node * weights / GIB:.0f} GiB on a node of {per_node} workers"
        )

    ranks = cfg.world.trainers
    t = cfg.trainer
    optimizer = 0 if t.optimizer.offload else 12 / ranks  # offloaded: in host memory
    trained = shape.params if lora is None else shape.lora_params(lora)
    state = trained * (4 / ranks + optimizer if t.zero_stage == 3 else 4 + optimizer)
    if lora is not None:  # the frozen base: weights only, no gradient or optimizer state
        state += shape.params * size / (ranks if t.zero_stage == 3 else 1)
    tokens_step = cfg.preprocess.seq_length
    checkpoints = tokens_step * shape.hidden * shape.layers * size if t.gradient_checkpointing else 0
    per_layer = tokens_step * (6 * shape.hidden + 3 * shape.intermediate) * size
    recompute = per_layer * (1 if t.gradient_checkpointing else shape.layers)
    logits = 3 * min(cfg.model.logprob_chunk_tokens, tokens_step) * shape.vocab * 4
    total = state + checkpoints + recompute + logits
    lines.append(
        f"memory: trainer GPU (ZeRO-{t.zero_stage}, {ranks} ranks): model and optimizer state "
        f"{state / GIB:.1f} GiB + activations {(checkpoints + recompute) / GIB:.1f} GiB + logits chunk "
        f"{logits / GIB:.1f} GiB = {total / GIB:.1f} GiB of {cfg.world.gpu_memory_gib:g} GiB: "
        f"{'fits' if total <= gpu else 'DOES NOT FIT'}"
    )
    if t.optimizer.offload:
        lines.append(f"memory: trainer host optimizer state {trained * 12 / ranks / GIB:.1f} GiB per rank")
    return lines
