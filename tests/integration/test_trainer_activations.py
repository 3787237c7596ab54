"""What the trainer's own step keeps for backward: gradient checkpointing takes effect (the model
trains in train mode), and dropout acts in training only."""

import pytest
import torch
from fixtures.trainer_runs import (
    make_steps,
    probe_first_step,
    probe_trainer,
    repeated_logprobs,
    saved_for_backward,
    trainer_config,
    write_steps,
)

from pipeline_rl.launch.memory_plan import ModelShape, activation_bytes_per_token


def _model(path, layers: int) -> None:
    from transformers import Qwen2ForCausalLM

    from pipeline_rl.demo.tiny_model import qwen2_config

    torch.manual_seed(0)
    Qwen2ForCausalLM(qwen2_config(97, hidden=64, layers=layers, intermediate=128, max_len=512)).save_pretrained(path)


def _saved(tmp_path, layers: int, checkpointing: bool) -> dict[str, int]:
    model = tmp_path / f"model{layers}"
    if not model.exists():
        _model(model, layers)
    overrides = (f"trainer.gradient_checkpointing={checkpointing}", "preprocess.seq_length=256")
    return probe_first_step(tmp_path / f"run{layers}_{checkpointing}", model, saved_for_backward, 8, *overrides)


def test_gradient_checkpointing_keeps_one_hidden_state_per_layer(tmp_path):
    """Bytes autograd keeps from the trainer's forward of a micro-batch, for models of 2 and 4
    layers (same widths, same data): the difference is what two more layers keep. Checkpointed,
    a layer keeps only its input, T x hidden floats, exactly; without checkpointing it keeps at
    least the memory plan's activations per token (every matmul's and norm's inputs). Under the
    old code (model left in eval mode) checkpointing did nothing and the first check fails."""
    runs = {(layers, ckpt): _saved(tmp_path, layers, ckpt) for layers in (2, 4) for ckpt in (True, False)}
    assert all(r["training"] == 1 for r in runs.values())
    tokens = runs[2, True]["tokens"]
    assert all(r["tokens"] == tokens for r in runs.values())
    hidden, size = 64, 4
    assert runs[4, True]["saved_bytes"] - runs[2, True]["saved_bytes"] == 2 * tokens * hidden * size
    per_token = activation_bytes_per_token(ModelShape.read(tmp_path / "model4"), size, cuda=False)
    assert runs[4, False]["saved_bytes"] - runs[2, False]["saved_bytes"] >= 2 * tokens * per_token
    # per_token is 17x a hidden state here: the whole step keeps several times less.
    assert runs[4, True]["saved_bytes"] * 3 < runs[4, False]["saved_bytes"]


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_lora_dropout_acts_in_training_only(tmp_path, dropout):
    """With model.lora.dropout the trainer's training forward is random (two passes over the same
    micro-batch differ) and the same weights in eval mode, as the scorers run them, are not;
    without dropout both are deterministic and agree."""
    model = tmp_path / "model"
    _model(model, 2)
    cfg = trainer_config(
        tmp_path,
        model,
        "model.lora.rank=4",
        f"model.lora.dropout={dropout}",
        "trainer.zero_stage=2",
        "preprocess.seq_length=256",
    )
    write_steps(cfg, make_steps(model, 1, 8, seed=0), 1)
    lp = {k: torch.tensor(v) for k, v in probe_trainer(cfg, repeated_logprobs).items()}
    torch.testing.assert_close(lp["eval_a"], lp["eval_b"], atol=0, rtol=0)
    if dropout:
        # Half the adapter inputs zeroed (the probe gives B values): far beyond float noise.
        assert (lp["train_a"] - lp["train_b"]).abs().max() > 1e-3
    else:
        torch.testing.assert_close(lp["train_a"], lp["train_b"], atol=0, rtol=0)
        torch.testing.assert_close(lp["train_a"], lp["eval_a"], atol=1e-6, rtol=1e-6)
