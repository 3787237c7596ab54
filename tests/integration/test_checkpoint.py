"""Checkpoints: a restart continues exactly where the run stopped (weights, optimizer, LR
schedule, version, stream position), and a trainer killed with SIGKILL while writing a
checkpoint leaves the previous one valid."""

from __future__ import annotations

import functools
import os
import shutil
import signal

import pytest
import torch
from fixtures.trainer_runs import (
    REL_TOL,
    final_weights,
    make_steps,
    start_ranks,
    train,
    trainer_config,
    trainer_metrics,
    update_error,
    wait_all,
    write_steps,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline_rl.config import save_config
from pipeline_rl.trainer import checkpoint

pytestmark = pytest.mark.deepspeed

# Warm-up, then a cosine to the floor at step 3: each step has its own LR (0.5, 1 and 0.1 x lr),
# so a resume that lost the schedule (or the Adam moments) would not reproduce the uninterrupted run.
SETTINGS = (
    "trainer.optimizer.warmup_steps=2",
    "trainer.optimizer.decay=cosine",
    "trainer.optimizer.min_lr_ratio=0.1",
    "trainer.keep_checkpoints=2",
)
LR_FACTORS = [0.5, 1.0, 0.1]


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory):
    """Three steps of data and the weights after training them without interruption."""
    steps = make_steps(tiny_model, steps=3, groups=2, seed=5)
    cfg = trainer_config(tmp_path_factory.mktemp("uninterrupted"), tiny_model, "shared.max_steps=3", *SETTINGS)
    write_steps(cfg, steps, ranks=1)
    train(cfg)
    return steps, final_weights(cfg.run_dir, 3), load_file(tiny_model / "model.safetensors")


def test_restart_continues_exactly(tiny_model, reference, tmp_path):
    steps, expected, initial = reference
    run_dir = tmp_path / "run"
    cfg = trainer_config(run_dir, tiny_model, "shared.max_steps=2", *SETTINGS)
    write_steps(cfg, steps, ranks=1)
    train(cfg)
    hf_v2, version = checkpoint.latest_checkpoint(run_dir)
    assert version == 2
    shutil.copytree(hf_v2, tmp_path / "v2_hf")

    cfg.shared.max_steps = 3
    save_config(cfg, run_dir / "config.yaml")
    train(cfg)
    assert update_error(final_weights(run_dir, 3), expected, initial) < REL_TOL
    metrics = trainer_metrics(run_dir)
    after_resume = metrics[-1]
    assert after_resume["version"] == 3
    lr = cfg.trainer.optimizer.lr
    assert [m["lr"] for m in metrics if "lr" in m] == pytest.approx([f * lr for f in LR_FACTORS], rel=1e-9)
    assert after_resume["skipped_microbatches"] == 0  # resumed at the saved position, not from the start

    # The kept checkpoints, and a Hugging Face dir that transformers loads, with the tokenizer files.
    root = checkpoint.checkpoints_root(run_dir)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000003"]
    hf_dir, _ = checkpoint.latest_checkpoint(run_dir)
    tokenize = AutoTokenizer.from_pretrained(hf_dir)
    assert tokenize("12+34=").input_ids == AutoTokenizer.from_pretrained(tiny_model)("12+34=").input_ids
    loaded = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    assert torch.equal(loaded.model.embed_tokens.weight, expected["model.embed_tokens.weight"])

    # Control: the same step from the same weights without the optimizer state and LR schedule differs.
    fresh = trainer_config(tmp_path / "fresh", tmp_path / "v2_hf", "shared.max_steps=1", *SETTINGS)
    write_steps(fresh, steps[2:], ranks=1, first_step=2)
    train(fresh)
    assert update_error(final_weights(fresh.run_dir, 1), expected, initial) > 100 * REL_TOL

    # A checkpoint of 1 rank cannot be resumed by 2: a clear error, exit 1.
    cfg.world.trainers = 2
    cfg.shared.max_steps = 4
    save_config(cfg, run_dir / "config.yaml")
    procs = start_ranks(run_dir, 2)
    wait_all(procs, run_dir, timeout=120, expect=1)
    assert "was written by 1 trainer ranks, this run has 2" in (run_dir / "trainer0.log").read_text()


def _kill_self_while_saving_tokenizer(version: int):
    """Dies by SIGKILL in the middle of writing checkpoint `version` (its temp dir is half written)."""
    original = checkpoint.copy_tokenizer_files

    def copy(model_path, hf_dir):
        if f"step_{version:06d}" in str(hf_dir):
            os.kill(os.getpid(), signal.SIGKILL)
        original(model_path, hf_dir)

    checkpoint.copy_tokenizer_files = copy


def _kill_self_before_pointer_update(version: int):
    """Dies by SIGKILL after checkpoint `version` is renamed into place, before `latest` names it."""
    original = checkpoint._write_atomic

    def write(path, text):
        if path.name == checkpoint.LATEST and text == f"step_{version:06d}":
            os.kill(os.getpid(), signal.SIGKILL)
        original(path, text)

    checkpoint._write_atomic = write


@pytest.mark.parametrize("kill", [_kill_self_while_saving_tokenizer, _kill_self_before_pointer_update])
def test_kill_during_checkpoint_write_keeps_the_previous_one(tiny_model, reference, tmp_path, kill):
    steps, expected, initial = reference
    run_dir = tmp_path / "run"
    cfg = trainer_config(run_dir, tiny_model, "shared.max_steps=3", "trainer.checkpoint_every=1", *SETTINGS)
    write_steps(cfg, steps, ranks=1)
    wait_all(
        start_ranks(run_dir, 1, before_main=functools.partial(kill, 2)), run_dir, timeout=120, expect=-signal.SIGKILL
    )

    assert checkpoint.latest_checkpoint(run_dir)[1] == 1
    leftovers = [p.name for p in checkpoint.checkpoints_root(run_dir).iterdir() if p.name.endswith("step_000002")]
    assert leftovers == [".tmp-step_000002" if kill is _kill_self_while_saving_tokenizer else "step_000002"]

    train(cfg)  # resumes from version 1 and trains steps 1 and 2 again
    assert update_error(final_weights(run_dir, 3), expected, initial) < REL_TOL
    assert not [p for p in checkpoint.checkpoints_root(run_dir).iterdir() if p.name.startswith(".")]
