"""Options that depend on the model's architecture are checked against its config.json at
launch (pipeline_rl/config/model_fit.py), naming the key."""

from __future__ import annotations

import json

import pytest

from pipeline_rl.config import ConfigError, load_config
from pipeline_rl.config.model_fit import check_model_fit, experts


def model_dir(tmp_path, **config):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "x", **config}))
    return path


def test_routing_replay_needs_a_mixture_of_experts_model(tmp_path):
    dense = model_dir(tmp_path, hidden_size=8)
    cfg = load_config("base", [f"model.path={dense}", "shared.routing_replay=true"])
    with pytest.raises(ConfigError, match=r"'shared.routing_replay' is set, but model.path=.* is a dense model"):
        check_model_fit(cfg)
    cfg.shared.routing_replay = False
    check_model_fit(cfg)


def test_an_moe_model_takes_routing_replay_but_not_lora_on_its_experts(tmp_path):
    moe = model_dir(tmp_path, num_experts=8, num_experts_per_tok=2)
    assert experts(moe) == 8
    check_model_fit(load_config("base", [f"model.path={moe}", "shared.routing_replay=true"]))
    cfg = load_config("base", [f"model.path={moe}", "model.lora.rank=4", "model.lora.target_modules=[q_proj,up_proj]"])
    with pytest.raises(ConfigError, match=r"'model.lora.target_modules': \['up_proj'\] are the experts' MLPs"):
        check_model_fit(cfg)


def test_routing_replay_needs_one_engine_worker():
    with pytest.raises(ConfigError, match=r"'shared.tensor_parallel_size' 1, got 2"):
        load_config("base", ["shared.routing_replay=true", "shared.tensor_parallel_size=2"])


def test_routing_replay_is_refused_where_cuda_graphs_replay():
    """The route recorder is Python called inside the forward pass: a replayed CUDA graph skips
    it, so on GPUs routing replay needs the eager engine; on CPU (no graphs) either is taken."""
    with pytest.raises(ConfigError, match=r"CUDA graphs skip when they replay: set 'actor.llm.enforce_eager' true"):
        load_config("base", ["shared.routing_replay=true", "world.gpus_per_node=8", "actor.llm.enforce_eager=false"])
    load_config("base", ["shared.routing_replay=true", "world.gpus_per_node=8", "actor.llm.enforce_eager=true"])
    load_config("base", ["shared.routing_replay=true", "world.gpus_per_node=0", "actor.llm.enforce_eager=false"])


def test_nothing_to_check_before_the_model_is_built(tmp_path):
    check_model_fit(load_config("base", [f"model.path={tmp_path / 'not_built'}", "shared.routing_replay=true"]))
