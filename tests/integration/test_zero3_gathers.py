"""ZeRO-3 gathers each decoder layer's parameters as one unit, once for its forward and once for
its backward, with or without gradient checkpointing, and two ranks of it make the update one
ZeRO-2 rank makes."""

import pytest
import torch
from fixtures.trainer_runs import (
    LINEAR_ADAM,
    REL_TOL,
    final_weights,
    make_steps,
    parameter_gathers,
    probe_first_step,
    train,
    trainer_config,
    update_error,
    write_steps,
)
from safetensors.torch import load_file

pytestmark = pytest.mark.deepspeed

# Every projection of these layers holds more elements than DeepSpeed's persistence threshold
# (1e5: smaller parameters stay whole on every rank and are never gathered): q/k/v/o 384 x 384,
# the MLP's 384 x 1536.
HIDDEN, HEADS = 384, 6


def _model(path, layers: int) -> None:
    from transformers import Qwen2ForCausalLM

    from pipeline_rl.demo.tiny_model import qwen2_config

    torch.manual_seed(0)
    config = qwen2_config(97, hidden=HIDDEN, layers=layers, heads=HEADS, kv_heads=HEADS, max_len=512)
    Qwen2ForCausalLM(config).save_pretrained(path)


def _gathers(tmp_path, layers: int, checkpointing: bool) -> dict[str, int]:
    model = tmp_path / f"model{layers}"
    if not model.exists():
        _model(model, layers)
    overrides = ("trainer.zero_stage=3", f"trainer.gradient_checkpointing={checkpointing}", "preprocess.seq_length=128")
    return probe_first_step(tmp_path / f"run{layers}_{checkpointing}", model, parameter_gathers, 4, *overrides)


def test_zero3_gathers_a_decoder_layer_at_once(tmp_path):
    """Gathers in the trainer's forward and backward of a micro-batch, for models of 2 and 4
    layers (same widths, same data): the difference is what two more layers cost. Gathered as
    one unit, a layer costs one gather in forward and one in backward; checkpointed too (its
    backward's recomputation gathers it, and it stays until its gradients are made). Gathered
    module by module (DeepSpeed's default, the code before) the two layers cost 18 gathers in
    forward, and no DeepSpeed parameter is ever gathered alone. The projections run through
    torch's own linear: DeepSpeed's replacement (its default under ZeRO-3) would gather a
    weight alone in backward were it not gathered already."""
    runs = {(layers, ckpt): _gathers(tmp_path, layers, ckpt) for layers in (2, 4) for ckpt in (False, True)}
    assert all(r["forward_single"] == r["backward_single"] == 0 for r in runs.values()), runs
    assert all(r["torch_linear"] == 1 for r in runs.values()), runs
    for ckpt in (False, True):
        for phase in ("forward_fetches", "backward_fetches"):
            assert runs[4, ckpt][phase] - runs[2, ckpt][phase] == 2, (ckpt, phase, runs)


def test_zero3_on_two_ranks_with_checkpointing_makes_zero2s_update(tmp_path):
    """The same step trained by two ZeRO-3 ranks with gradient checkpointing (each holds half of
    every projection; layers gathered whole from both, released, gathered again to recompute
    and differentiate) and by one plain ZeRO-2 rank."""
    _model(tmp_path / "model", 2)
    steps = make_steps(tmp_path / "model", 1, 4, seed=1)
    initial = load_file(tmp_path / "model" / "model.safetensors")
    weights = {}
    for name, ranks, overrides in (
        ("zero2", 1, ("trainer.zero_stage=2",)),
        ("zero3", 2, ("trainer.zero_stage=3", "trainer.gradient_checkpointing=true", "world.trainers=2")),
    ):
        cfg = trainer_config(tmp_path / name, tmp_path / "model", "shared.max_steps=1", *overrides, *LINEAR_ADAM)
        write_steps(cfg, steps, ranks)
        train(cfg, ranks)
        weights[name] = final_weights(cfg.run_dir, 1)
    assert update_error(weights["zero3"], weights["zero2"], initial) < REL_TOL
