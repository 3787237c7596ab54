"""The tiny mixture-of-experts policy: the tiny model's task, tokenizer and recipe, with a
Qwen3-MoE body (every layer's MLP is EXPERTS experts of which the router picks TOP_K).

`build(cache_dir, seed)` writes cache_dir/tiny_moe the way tiny_model.build writes the dense
model: pretrained on the arithmetic training problems for a fixed number of steps, then softened
to the same exact T=1 held-out accuracy. `make_moe_model` gives the tests a random one.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline_rl.demo import tiny_model

NAME = "tiny_moe"
EXPERTS = 8
TOP_K = 2
MOE_RECIPE = tiny_model.Recipe(NAME, tiny_model.TINY_STEPS, None, tiny_model.TARGET_ACCURACY)
"""The dense tiny model's recipe: the same steps, softened to the same accuracy."""


def make_moe_model(tokenizer, hidden: int = 128, layers: int = 4, experts: int = EXPERTS, top_k: int = TOP_K):
    """A fresh Qwen3-MoE causal LM for `tokenizer`, of the dense tiny model's width and depth;
    each expert is half as wide as the dense MLP, so two of them do the dense model's work."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        moe_intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    return Qwen3MoeForCausalLM(config)


def save_random(dest: Path, seed: int = 0, router_scale: float = 1.0) -> Path:
    """A random tiny MoE policy with the byte tokenizer at `dest` (the tests' model), its router
    weights scaled by `router_scale` (initialised small, a router is close to uniform)."""
    tokenizer = tiny_model.make_tokenizer()
    torch.manual_seed(seed)
    model = make_moe_model(tokenizer)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                weight.mul_(router_scale)
    tiny_model.save_model(model, tokenizer, {"recipe": "random", "seed": seed}, Path(dest))
    return Path(dest)


def build(cache_dir: Path, seed: int = 0) -> Path:
    """Build the data set (if missing) and the pretrained, softened tiny MoE policy."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    train, test = tiny_model.write_problems(cache_dir, seed)
    tokenizer = tiny_model.make_tokenizer()
    torch.manual_seed(seed)
    model = make_moe_model(tokenizer)
    report = tiny_model.pretrain(model, tokenizer, train, test, seed, MOE_RECIPE)
    dest = cache_dir / NAME
    tiny_model.save_model(model, tokenizer, report, dest, "pretrain_report.json")
    return dest
