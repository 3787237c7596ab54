"""The --dry-run memory plan: parameter counts against real models, and the 32B facts the
cluster configs rest on (one 80 GB GPU cannot hold a 32B actor with its staging; math_32b fits)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import pytest
from fixtures.helpers import ROOT, random_qwen2

from pipeline_rl.config import ConfigError, load_config
from pipeline_rl.launch.memory_plan import ModelShape, plan_lines

# Qwen2.5-32B's published shape (config.json values).
QWEN32B = {
    "model_type": "qwen2",
    "hidden_size": 5120,
    "intermediate_size": 27648,
    "num_attention_heads": 40,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_matches_a_real_model(tmp_path, tied):
    model = random_qwen2()
    model.config.tie_word_embeddings = tied
    model.config.save_pretrained(tmp_path)
    if tied:
        model.tie_weights()
    real = sum(p.numel() for p in model.parameters())  # shared tensors counted once
    assert ModelShape.read(tmp_path).params == real


QWEN7B = {
    **QWEN32B,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
}


def plan(tmp_path, *overrides, conf="math_32b", shape=QWEN32B):
    (tmp_path / "config.json").write_text(json.dumps(shape))
    cfg = load_config(conf, [f"model.path={tmp_path}", *overrides])
    return plan_lines(cfg, ModelShape.read(tmp_path))


def test_math_7b_fits_and_needs_its_lower_vllm_share(tmp_path):
    lines = plan(tmp_path, conf="math_7b", shape=QWEN7B)
    weighing = [line for line in lines[1:] if "weight updates by delta" not in line]  # the others weigh a GPU
    assert lines[0].startswith("memory: model 7.6") and all(line.endswith("fits") for line in weighing), lines
    # At vLLM's usual 0.9 the 14 GiB staging buffer has only 8 GiB outside vLLM's share.
    lines = plan(tmp_path, "actor.llm.gpu_memory_utilization=0.9", conf="math_7b", shape=QWEN7B)
    assert next(line for line in lines if "actor GPU" in line).endswith("DOES NOT FIT")


def test_math_32b_fits_80_gb_gpus(tmp_path):
    lines = plan(tmp_path)
    assert lines[0].startswith("memory: model 32.")
    assert all(not line.endswith("DOES NOT FIT") for line in lines), lines
    actor = next(line for line in lines if "actor GPU" in line)
    assert "tensor_parallel_size=2" in actor and actor.endswith("fits")


def test_a_32b_actor_on_one_80_gb_gpu_does_not_fit(tmp_path):
    """61 GiB of bf16 weights leave ~9 GiB of KV cache (3 sequences of 9216 tokens), and a
    model-sized staging buffer cannot fit in the 8 GiB outside vLLM's share."""
    lines = plan(tmp_path, "shared.tensor_parallel_size=1", "actor.llm.stage_weights_on_host=false")
    actor = next(line for line in lines if "actor GPU" in line)
    assert actor.endswith("DOES NOT FIT") and "3 sequences" in actor


def test_dry_run_prints_the_plan_and_refuses_one_that_does_not_fit(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN32B))

    def dry_run(*overrides):
        argv = [sys.executable, "launch.py", "conf=math_32b", f"model.path={tmp_path}", *overrides, "--dry-run"]
        return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)

    ok = dry_run()
    assert ok.returncode == 0, ok.stderr
    assert sum(line.startswith("memory: ") for line in ok.stdout.splitlines()) == 5
    assert "memory: weight updates by delta: at lr 5e-07" in ok.stdout  # the expected delta and its staging
    bad = dry_run("world.gpu_memory_gib=40")
    assert bad.returncode == 2 and "memory plan does not fit" in bad.stderr


def test_optimizer_offload_moves_the_12_optimizer_bytes_to_the_host(tmp_path):
    """math_32b: 16 ZeRO-3 ranks, 32.76 B parameters; the fp32 master weights and two moments are
    12 bytes a parameter, 12 x 32.76e9 / 16 / 2**30 = 22.9 GiB a rank."""

    def trainer_state(lines: list[str]) -> float:
        line = next(line for line in lines if "trainer GPU" in line)
        return float(line.split("model and optimizer state ")[1].split(" GiB")[0])

    on_gpu, offloaded = plan(tmp_path), plan(tmp_path, "trainer.optimizer.offload=true")
    params = float(on_gpu[0].split("memory: model ")[1].split(" B")[0]) * 1e9
    expected = params * 12 / 16 / 2**30
    assert trainer_state(on_gpu) - trainer_state(offloaded) == pytest.approx(expected, abs=0.1)
    assert offloaded[-1] == f"memory: trainer host optimizer state {expected:.1f} GiB per rank"
    with pytest.raises(ConfigError, match=r"'trainer\.optimizer\.offload' needs 'trainer\.zero_stage' >= 1"):
        load_config("tiny", ["trainer.optimizer.offload=true", "trainer.zero_stage=0"])


@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj", "down_proj", "lm_head"]])
def test_lora_parameter_count_matches_peft(tmp_path, targets):
    from pipeline_rl.config import LoraConfig
    from pipeline_rl.lora import trained_parameters, wrap

    model = random_qwen2()
    model.config.save_pretrained(tmp_path)
    lora = LoraConfig(rank=3) if targets is None else LoraConfig(rank=3, target_modules=targets)
    real = sum(p.numel() for _, p in trained_parameters(wrap(model, lora)))
    assert ModelShape.read(tmp_path).lora_params(lora) == real


def test_math_32b_lora_fits_the_trainer_on_two_gpus_of_one_node(tmp_path):
    """The frozen bf16 base (61 GiB) over 2 ZeRO-3 ranks, plus 16 bytes per adapter parameter
    (67.1 M at rank 8) over 2 ranks; one rank would hold the whole base beside the activations."""
    lines = plan(tmp_path, conf="math_32b_lora")
    assert all(not line.endswith("DOES NOT FIT") for line in lines), lines
    adapter = 64 * 8 * (2 * 10240 + 2 * 6144 + 3 * 32768)
    assert f"{adapter / 1e6:.1f} M parameters; an update is {adapter * 2 / 2**20:.0f} MiB" in lines[1]
    trainer = next(line for line in lines if "trainer GPU" in line)
    state = float(trainer.split("model and optimizer state ")[1].split(" GiB")[0])
    params = float(lines[0].split("memory: model ")[1].split(" B")[0]) * 1e9
    assert state == pytest.approx((params * 2 / 2 + adapter * 16 / 2) / 2**30, abs=0.1)
    one = plan(tmp_path, "world.trainers=1", conf="math_32b_lora")
    assert next(line for line in one if "trainer GPU" in line).endswith("DOES NOT FIT")
    cfg = load_config("math_32b_lora", [f"model.path={tmp_path}"])
    used = cfg.world.trainers + cfg.world.actors * cfg.shared.tensor_parallel_size + cfg.world.preprocessor_gpus
    assert cfg.world.nodes == 1 and used <= cfg.world.gpus_per_node


def _saved_bytes_per_layer(tokens: int, dtype, packed: bool, lora=None, adapter_dtype=None) -> float:
    """Bytes autograd saves for one decoder layer of a tiny Qwen2 over `tokens` tokens (the
    difference between 4 and 2 layers), storages counted once, parameters left out; with `lora`
    the model is the trainer's peft model with adapters of `adapter_dtype`."""
    import torch
    from transformers import Qwen2ForCausalLM

    from pipeline_rl.demo.tiny_model import qwen2_config
    from pipeline_rl.lora import wrap

    def saved(layers: int) -> int:
        torch.manual_seed(0)
        config = qwen2_config(512, hidden=64, layers=layers, intermediate=128, max_len=tokens)
        config._attn_implementation = "sdpa"
        model = Qwen2ForCausalLM(config).to(dtype)
        if lora is not None:
            model = wrap(model, lora, adapter_dtype).base_model.model
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages: dict[int, int] = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        positions = torch.arange(tokens // 2).repeat(2)[None] if packed else torch.arange(tokens)[None]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model(input_ids=torch.randint(0, 512, (1, tokens)), position_ids=positions, use_cache=False)
        return sum(n for ptr, n in storages.items() if ptr not in params)

    return (saved(4) - saved(2)) / 2


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_activation_bytes_are_what_autograd_saves(dtype_name):
    """The plan's per-token activation bytes (without the CUDA kernels' copies) are exactly what
    transformers' Qwen2 layer saves for backward on CPU; a packed row adds sdpa's [T, T] mask in
    the model's dtype per layer (and at most one hidden vector per token of index bookkeeping)."""
    import torch

    from pipeline_rl.launch.memory_plan import activation_bytes_per_token

    dtype = getattr(torch, dtype_name)
    size = torch.finfo(dtype).bits // 8
    shape = ModelShape(hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128, vocab=512, tied=True, qkv_bias=True)
    per_token = activation_bytes_per_token(shape, size, cuda=False)
    for tokens in (64, 128):
        assert _saved_bytes_per_layer(tokens, dtype, packed=False) == per_token * tokens
        mask = size * tokens**2
        extra = _saved_bytes_per_layer(tokens, dtype, packed=True) - per_token * tokens - mask
        assert 0 <= extra <= size * shape.hidden * tokens, extra


def test_lora_adapters_in_the_model_dtype_save_no_more_than_full_fine_tuning():
    """The plan gives a LoRA trainer the full model's activation bytes. That holds only with the
    adapters in the model's dtype (lora.wrap's dtype, as the trainer makes them): peft's default
    float32 adapters in a bfloat16 model keep a float32 copy of every adapter's input."""
    import torch

    from pipeline_rl.config import LoraConfig
    from pipeline_rl.launch.memory_plan import activation_bytes_per_token

    shape = ModelShape(hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128, vocab=512, tied=True, qkv_bias=True)
    per_token = activation_bytes_per_token(shape, 2, cuda=False)
    lora = LoraConfig(rank=4)
    tokens = 64
    assert _saved_bytes_per_layer(tokens, torch.bfloat16, False, lora, torch.bfloat16) <= per_token * tokens
    # The float32 copies: q/k/v, o, gate and up read hidden-sized inputs, down an intermediate one.
    copies = 4 * (6 * shape.hidden + shape.intermediate) * tokens
    assert _saved_bytes_per_layer(tokens, torch.bfloat16, False, lora, None) >= per_token * tokens + copies / 2


# Qwen3-30B-A3B's published shape (config.json values): 30.5 B parameters, 3.3 B active.
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}


def _moe_model(kind: str, layers: int = 3, dtype=None):
    """A small real MoE causal LM: Qwen3-MoE with one dense layer (mlp_only_layers) and a head_dim
    apart from hidden / heads, or Qwen2-MoE with a shared expert and MoE on every other layer."""
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(**common, head_dim=24, mlp_only_layers=[0])
        model = Qwen3MoeForCausalLM(config)
    else:
        config = Qwen2MoeConfig(**common, shared_expert_intermediate_size=48, decoder_sparse_step=2)
        model = Qwen2MoeForCausalLM(config)
    config._attn_implementation = "sdpa"
    return model if dtype is None else model.to(dtype)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_moe_parameter_count_matches_a_real_model(tmp_path, kind):
    """Every expert, the routers, a shared expert and its gate, Qwen3's q/k norms and head_dim,
    dense layers among the MoE ones: counted exactly; active parameters leave out the experts a
    token does not go to."""
    model = _moe_model(kind)
    model.config.save_pretrained(tmp_path)
    shape = ModelShape.read(tmp_path)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.experts == 8 and shape.top_k == 2
    assert shape.moe_layers == (2 if kind == "qwen3_moe" else 1)
    idle = shape.moe_layers * (8 - 2) * 3 * 64 * 32
    assert shape.active_params == shape.params - idle


def test_the_plan_counts_every_expert_and_the_routes_on_the_stream(tmp_path):
    """Qwen3-30B-A3B: 30.5 B parameters held (3.35 B active per token); with routing replay a
    generated token carries 48 layers x 8 experts = 384 bytes, 512 in base64."""
    cfg_lines = plan(
        tmp_path,
        "shared.routing_replay=true",
        "actor.llm.enforce_eager=true",  # the route recorder needs the eager engine on GPUs
        "shared.tensor_parallel_size=1",
        conf="math_32b",
        shape=QWEN3_30B_A3B,
    )
    assert cfg_lines[0].startswith("memory: model 30.53 B parameters"), cfg_lines
    experts = next(line for line in cfg_lines if "mixture of experts" in line)
    assert "128 experts of width 768 in 48 of 48 layers, 8 per token: 3.35 B parameters active" in experts
    routes = next(line for line in cfg_lines if line.startswith("streams: routing replay"))
    assert "adds 512 B per generated token" in routes
    dense = plan(tmp_path, conf="math_32b", shape=QWEN3_30B_A3B)
    assert not any("routing replay" in line for line in dense)
    # The trainer holds all 30.5 B: 16 bytes each over its ranks under ZeRO-3.
    cfg = load_config("math_32b", [f"model.path={tmp_path}"])
    from pipeline_rl.launch.memory_plan import trainer_bytes

    state = trainer_bytes(cfg, ModelShape.read(tmp_path))["model and optimizer state"]
    assert state == int(ModelShape.read(tmp_path).params * 16 / cfg.world.trainers)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_moe_activation_bytes_are_a_floor_of_what_autograd_saves(dtype_name):
    """For transformers' Qwen3-MoE on CPU the plan's per-token bytes (mean over dense and MoE
    layers) are all saved for backward; what it leaves out is the routing's index bookkeeping
    (the expert each routed row goes to, the sort that groups rows by expert): 352 bytes per
    token and layer in float32 and 476 in bfloat16 on this model (byte counts of tensors, the
    same on every CPU), under two float32 hidden vectors here and a small share at real widths,
    where one layer keeps tens of kilobytes per token."""
    import torch

    from pipeline_rl.launch.memory_plan import activation_bytes_per_token

    dtype = getattr(torch, dtype_name)
    size = torch.finfo(dtype).bits // 8
    tokens = 128

    def saved(layers: int) -> int:
        model = _moe_model("qwen3_moe", layers, dtype)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages: dict[int, int] = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model(
                input_ids=torch.randint(0, 512, (1, tokens)), position_ids=torch.arange(tokens)[None], use_cache=False
            )
        return sum(n for ptr, n in storages.items() if ptr not in params)

    # Layers 1 and 2 of 3 are MoE (layer 0 dense): the difference of 3 and 1 layers is two MoE layers.
    measured = (saved(3) - saved(1)) / 2 / tokens
    with tempfile.TemporaryDirectory() as d:
        config = _moe_model("qwen3_moe", 2).config
        config.mlp_only_layers = []
        config.save_pretrained(d)
        per_token = activation_bytes_per_token(ModelShape.read(d), size, cuda=False)
    assert per_token <= measured < per_token + 2 * 4 * 64, (per_token, measured)


# A Qwen2.5-32B decoder layer: q and o 5120 x 5120, k and v 5120 x 1024 with the q/k/v biases,
# two RMSNorms; the MLP's three 5120 x 27648 matrices.
LAYER_32B = 2 * 5120 * 5120 + 2 * 5120 * 1024 + (5120 + 2 * 1024) + 2 * 5120 + 3 * 5120 * 27648
EMBEDDING_32B = 152064 * 5120


@pytest.mark.parametrize("conf, shape", [("math_7b", QWEN7B), ("math_32b", QWEN32B), ("math_32b_lora", QWEN32B)])
def test_each_gpu_config_runs_the_lowest_zero_stage_that_fits(tmp_path, conf, shape):
    """ZeRO-2 ran at 0.71 of a bare loop on an H200 where ZeRO-3 ran at 0.25 (docs/gpu.md): a
    shipped config takes ZeRO-3 only where ZeRO-2's plan does not fit, and --dry-run says why."""
    from pipeline_rl.launch.memory_plan import lowest_stage, trainer_fits, zero_lines

    (tmp_path / "config.json").write_text(json.dumps(shape))
    cfg = load_config(conf, [f"model.path={tmp_path}"])
    model = ModelShape.read(tmp_path)
    assert cfg.trainer.zero_stage == lowest_stage(cfg, model)
    assert trainer_fits(cfg, model, cfg.trainer.zero_stage)[0]
    assert zero_lines(cfg, model)[0].startswith(
        f"trainer: ZeRO-{cfg.trainer.zero_stage} (trainer.zero_stage), the lowest"
    )
    if cfg.trainer.zero_stage == 2:  # the check can fail: the same config on ZeRO-3 is told so
        slower = load_config(conf, [f"model.path={tmp_path}", "trainer.zero_stage=3"])
        assert "ZeRO-2 fits and runs faster" in zero_lines(slower, model)[0]


def test_zero3_sizes_come_from_a_decoder_layer(tmp_path):
    from pipeline_rl.trainer.zero_sizes import zero3_sizes

    (tmp_path / "config.json").write_text(json.dumps(QWEN32B))
    cfg = load_config("math_32b", [f"model.path={tmp_path}"])
    z = zero3_sizes(cfg, ModelShape.read(tmp_path))
    assert z.layer == LAYER_32B == 487_605_248
    assert z.prefetch == z.reduce_bucket == z.max_reuse == LAYER_32B
    assert z.max_live == 2 * LAYER_32B + EMBEDDING_32B
    assert z.persistence == 5120 * 1024  # the k/v projections: every bias and norm (<= 5120) persists
    assert z.hpz == 8  # 16 ranks on 2 nodes of 8


@pytest.mark.parametrize(
    "overrides, hpz, why",
    [
        ((), 8, "the ranks span 2 nodes of 8"),
        (("trainer.zero3_hierarchical=false",), 1, "off (trainer.zero3_hierarchical)"),
        (("world.trainers=12", "world.actors=6"), 1, "unequally (8+4)"),
        (("world.trainers=8",), 1, "share one node"),
    ],
)
def test_hierarchical_partitioning_only_across_nodes_of_equal_ranks(tmp_path, overrides, hpz, why):
    from pipeline_rl.trainer.zero_sizes import hierarchical_partition

    (tmp_path / "config.json").write_text(json.dumps(QWEN32B))
    cfg = load_config("math_32b", [f"model.path={tmp_path}", *overrides])
    size, reason = hierarchical_partition(cfg)
    assert size == hpz and why in reason


def test_the_plan_counts_zero3_buffers_as_the_sizes_allow(tmp_path):
    """math_32b (bf16, 16 ranks on 2 nodes): the gathered parameters DeepSpeed may hold, its
    reduce bucket and the secondary partition among a node's 8 ranks, in bytes."""
    from pipeline_rl.launch.memory_plan import trainer_bytes

    (tmp_path / "config.json").write_text(json.dumps(QWEN32B))
    cfg = load_config("math_32b", [f"model.path={tmp_path}"])
    shape = ModelShape.read(tmp_path)
    terms = trainer_bytes(cfg, shape)
    assert terms["gathered parameters"] == 2 * (2 * LAYER_32B + EMBEDDING_32B)
    assert terms["reduce bucket"] == 2 * LAYER_32B
    assert terms["secondary partition"] == int(2 * shape.params / 8)
    flat = trainer_bytes(load_config("math_32b", [f"model.path={tmp_path}", "trainer.zero3_hierarchical=false"]), shape)
    assert flat["secondary partition"] == 0 and sum(terms.values()) - sum(flat.values()) == int(2 * shape.params / 8)


def test_the_trainer_hands_deepspeed_the_planned_sizes(tmp_path):
    """DeepSpeed 0.19.8's own config model accepts every key (it refuses unknown ones) and reads
    the derived values; ZeRO-2 keeps DeepSpeed's defaults."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from pipeline_rl.trainer.model import deepspeed_config

    (tmp_path / "config.json").write_text(json.dumps(QWEN32B))
    zero = deepspeed_config(load_config("math_32b", [f"model.path={tmp_path}"]))["zero_optimization"]
    parsed = DeepSpeedZeroConfig(**zero)
    assert parsed.prefetch_bucket_size == parsed.reduce_bucket_size == LAYER_32B
    assert parsed.max_live_parameters == 2 * LAYER_32B + EMBEDDING_32B and parsed.zero_hpz_partition_size == 8
    assert parsed.param_persistence_threshold == 5120 * 1024 and parsed.max_reuse_distance == LAYER_32B
    zero2 = deepspeed_config(load_config("math_32b", [f"model.path={tmp_path}", "trainer.zero_stage=2"]))
    assert set(zero2["zero_optimization"]) == {"stage", "contiguous_gradients"}


def test_max_num_seqs_is_bounded_by_the_kv_cache(tmp_path):
    """math_32b's KV cache holds 35 sequences of max_model_len: 256 scheduled would preempt."""
    actor = next(line for line in plan(tmp_path) if "actor GPU" in line)
    assert "35 sequences of max_model_len for max_num_seqs=32" in actor and actor.endswith("fits")
    actor = next(line for line in plan(tmp_path, "actor.llm.max_num_seqs=36") if "actor GPU" in line)
    assert actor.endswith("DOES NOT FIT")


@pytest.mark.parametrize("conf, shape", [("math_7b", QWEN7B), ("math_32b", QWEN32B)])
def test_dry_run_prints_the_zero_stage_its_sizes_the_driver_and_the_sockets(tmp_path, capsys, conf, shape):
    from pipeline_rl.launch.launcher import main

    (tmp_path / "config.json").write_text(json.dumps(shape))
    assert main([f"conf={conf}", f"model.path={tmp_path}", "--dry-run"]) == 0
    out = capsys.readouterr().out
    stage = 2 if conf == "math_7b" else 3
    assert f"trainer: ZeRO-{stage} (trainer.zero_stage), the lowest stage whose plan fits" in out
    assert "driver: CUDA 13.0 needs an NVIDIA driver >= 580.65.06" in out
    assert "network: gloo and NCCL sockets (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)" in out
    if stage == 3:
        assert "trainer: ZeRO-3 stage3_prefetch_bucket_size 487.6 M" in out
        assert "trainer: ZeRO-3 reduce_bucket_size 487.6 M" in out
        assert "trainer: ZeRO-3 zero_hpz_partition_size 8" in out
    else:
        assert "reduce_bucket_size and allgather_bucket_size (5e8 elements)" in out
    assert main([f"conf={conf}", f"model.path={tmp_path}", "world.socket_ifname=nosuch0", "--dry-run"]) == 2
    assert "world.socket_ifname=nosuch0 is not a network interface" in capsys.readouterr().out


def test_the_dry_run_gives_the_expected_size_of_a_delta_update(tmp_path):
    """math_32b's lr moves few bf16 elements: the line gives the expected fraction and its wire
    size (of the smallest form), well under the full update; ten times the lr moves more; an fp32
    model goes dense; without trainer.weight_delta there is no line."""
    import re

    def delta_line(*overrides):
        lines = [line for line in plan(tmp_path, *overrides) if "weight updates by delta" in line]
        return lines[0] if lines else None

    def figures(line):
        found = re.search(
            r"up to ([\d.]+)% .* about ([\d.]+) GiB on the wire \(([\d.]+)% of the full ([\d.]+) GiB\)", line
        )
        assert found, line
        return [float(x) for x in found.groups()]

    fraction, wire, share, full = figures(delta_line())
    assert 0 < fraction < 10 and 0 < share < 25 and full > 60
    assert wire == pytest.approx(full * share / 100, rel=0.02)
    faster = figures(delta_line("trainer.optimizer.lr=5e-6"))
    assert faster[0] > fraction and faster[1] > wire
    assert figures(delta_line("model.dtype=float32"))[2] == 100.0
    assert delta_line("trainer.weight_delta=false") is None
    assert delta_line().endswith("published weights, 3.8 GiB")  # 61 GiB over 16 trainer ranks
