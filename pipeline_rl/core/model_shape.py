"""The shape of a decoder-only model, read from its config.json: the parameter counts the GPU
memory plan, the time budgets and the trainer's ZeRO-3 sizes are computed from (Llama / Qwen2 /
Qwen3 shapes: attention with grouped KV heads, a gated MLP, or in MoE layers routed experts with
an optional shared expert)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline_rl.config import LoraConfig
from pipeline_rl.core.routes import encoded_bytes_per_token


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
    initializer_range: float = 0.02
    """The weights' initial standard deviation: their typical magnitude, for the expected size of a
    delta weight update."""

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
            initializer_range=c.get("initializer_range", 0.02),
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
    def attention_params(self) -> int:
        """One decoder layer's attention with its biases and norms (the layer's two RMSNorms)."""
        h = self.hidden
        attention = 2 * h * self.q_dim + 2 * h * self.kv_dim + 2 * h
        if self.qkv_bias:
            attention += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            attention += 2 * self.head_size
        return attention

    @property
    def params(self) -> int:
        dense_mlp = 3 * self.hidden * self.intermediate
        mlps = (self.layers - self.moe_layers) * dense_mlp + self.moe_layers * self.moe_mlp_params
        return (
            self.embedding_params * (1 if self.tied else 2) + self.layers * self.attention_params + mlps + self.hidden
        )

    @property
    def embedding_params(self) -> int:
        """The input embedding, and the output layer (untied: a second matrix of this size)."""
        return self.vocab * self.hidden

    @property
    def largest_layer_params(self) -> int:
        """The largest decoder layer (an MoE layer's, when it has experts): what ZeRO-3 gathers at once."""
        dense = 3 * self.hidden * self.intermediate if self.moe_layers < self.layers else 0
        return self.attention_params + max(dense, self.moe_mlp_params if self.moe_layers else 0)

    @property
    def smallest_matrix(self) -> int:
        """Elements of a decoder layer's smallest weight matrix: a key projection, or an MoE
        router, or one expert's projection; every bias and norm weight is smaller."""
        h = self.hidden
        matrices = [h * self.kv_dim, h * self.intermediate]
        if self.experts:
            matrices += [h * self.experts, h * self.moe_intermediate]
        return min(matrices)

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
