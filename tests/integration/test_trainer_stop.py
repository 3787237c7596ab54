"""A stop request reaches real DeepSpeed trainer ranks (gloo) between micro-batches, and a stop
during a checkpoint write leaves a complete checkpoint behind (the SIGKILL cases are in
test_checkpoint.py)."""

from __future__ import annotations

import functools
import os
import signal

import pytest
from fixtures.trainer_runs import make_steps, start_ranks, trainer_config, wait_all, write_steps

from pipeline_rl.streams import open_streams
from pipeline_rl.streams.records import MicroBatch
from pipeline_rl.trainer import checkpoint

pytestmark = pytest.mark.deepspeed


def _log_micro_batches_and_stop_at(step: int, index: int):
    """Logs every micro-batch computed ("computed step S micro-batch I"), and rank 0 asks itself
    to stop (SIGTERM, as the launcher does) while computing micro-batch `index` of `step`."""
    from pipeline_rl.trainer.trainer import Trainer

    original = Trainer._micro_batch_loss

    def loss(self, mb, *args):
        print(f"computed step {mb.step} micro-batch {mb.index}", flush=True)
        if self.rank == 0 and (mb.step, mb.index) == (step, index):
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, mb, *args)

    Trainer._micro_batch_loss = loss  # pyright: ignore[reportAttributeAccessIssue]


def test_a_stop_mid_step_is_honoured_after_the_current_micro_batch(tiny_model, tmp_path):
    """Rank 0 is stopped during micro-batch 0 of step 2: both ranks leave the step after that
    micro-batch (rank 1 was not signalled: they agree), and the final checkpoint is version 2,
    the last whole step; its stream position is step 2's start, so a resume trains step 2 whole."""
    run_dir = tmp_path / "run"
    cfg = trainer_config(run_dir, tiny_model, "shared.max_steps=4", "preprocess.seq_length=32")
    write_steps(cfg, make_steps(tiny_model, 4, 4, seed=0), ranks=2)
    procs = start_ranks(run_dir, 2, before_main=functools.partial(_log_micro_batches_and_stop_at, 2, 0))
    wait_all(procs, run_dir, timeout=180)
    for rank in (0, 1):
        log = (run_dir / f"trainer{rank}.log").read_text()
        computed = [line for line in log.splitlines() if line.startswith("computed step 2 ")]
        assert computed == ["computed step 2 micro-batch 0"], log[-3000:]
        # Step 2 had more micro-batches than the one computed: the stop cut it short.
        assert "stop requested: leaving step 2 after 1 of " in log and "after 1 of 1 " not in log, log[-3000:]
        assert "computed step 3" not in log
    found = checkpoint.latest_dir(run_dir)
    assert found is not None and found[1]["version"] == 2
    for rank in (0, 1):
        position = checkpoint.PositionStore(found[0] / f"position_rank{rank}.json").load()
        streams = open_streams(cfg)
        [first] = streams.reader("trainer", MicroBatch, partitions=(rank,), position=position).read(1.0, max_count=1)
        streams.close()
        assert (first.record.step, first.record.index) == (2, 0)


def _sigterm_while_saving(version: int):
    """SIGTERM arrives while checkpoint `version` is half written (as a stop during a save)."""
    original = checkpoint.copy_tokenizer_files

    def copy(model_path, hf_dir):
        if f"step_{version:06d}" in str(hf_dir):
            os.kill(os.getpid(), signal.SIGTERM)
        original(model_path, hf_dir)

    checkpoint.copy_tokenizer_files = copy


def test_a_stop_during_a_checkpoint_lets_it_finish(tiny_model, tmp_path):
    """The stop is seen after the save: `latest` names the checkpoint that was being written,
    complete, and the trainer exits 0 without starting another step."""
    run_dir = tmp_path / "run"
    cfg = trainer_config(run_dir, tiny_model, "shared.max_steps=4", "trainer.checkpoint_every=1")
    write_steps(cfg, make_steps(tiny_model, 4, 2, seed=0), ranks=1)
    wait_all(start_ranks(run_dir, 1, before_main=functools.partial(_sigterm_while_saving, 2)), run_dir, timeout=120)
    found = checkpoint.latest_dir(run_dir)
    assert found is not None and found[1]["version"] == 2
    assert (found[0] / "hf" / "config.json").exists() and (found[0] / "deepspeed").is_dir()
    assert not [p for p in checkpoint.checkpoints_root(run_dir).iterdir() if p.name.startswith(".")]
