"""Delta weight updates from real DeepSpeed trainer ranks (gloo, two ranks, ZeRO-2 and ZeRO-3,
bf16): each rank sends only the changes in its own range of every parameter, rank 0 broadcasts
them, and the actor's receiver (tests/fixtures/trainer_runs.receive_weights: deltas applied to
the weights it holds, every update's checksums checked) ends bit-identical to the trainer's
final checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures.trainer_runs import (
    final_weights,
    make_steps,
    start_ranks_with_receiver,
    trainer_config,
    trainer_metrics,
    wait_all,
    write_steps,
)

pytestmark = pytest.mark.deepspeed

STEPS = 4


@pytest.mark.parametrize("stage", [2, 3])
def test_deltas_from_each_ranks_shard_leave_the_actor_bit_identical(tiny_model, tmp_path, stage):
    cfg = trainer_config(
        tmp_path,
        tiny_model,
        f"shared.max_steps={STEPS}",
        f"trainer.zero_stage={stage}",
        "model.dtype=bfloat16",
        "trainer.optimizer.lr=1e-5",
        "trainer.optimizer.warmup_steps=0",
        "trainer.weight_bucket_mb=1",
    )
    write_steps(cfg, make_steps(tiny_model, steps=STEPS, groups=4, seed=1), ranks=2)
    procs, receiver, received, errors = start_ranks_with_receiver(cfg, 2, STEPS)
    run_dir = Path(cfg.run_dir)
    wait_all(procs, run_dir, timeout=240)  # they stop at max_steps, with a final checkpoint
    receiver.join(30)
    assert not errors, errors  # every update's checksums matched the weights held
    final = final_weights(run_dir, STEPS)
    assert received[STEPS].keys() == final.keys()
    for name, tensor in final.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(received[STEPS][name].view(torch.int16), tensor.view(torch.int16)), name
    metrics = [m for m in trainer_metrics(run_dir) if "weight_update_bytes" in m]
    dense = sum(t.numel() * t.element_size() for t in final.values())
    assert [m["weight_full_updates_total"] for m in metrics] == [1] * STEPS  # the first only
    assert metrics[0]["weight_update_bytes"] == dense
    for m in metrics[1:]:
        # Each bf16 element's value moved at some steps only: the deltas are a fraction.
        assert 0 < m["weight_update_changed_fraction"] < 1
        assert m["weight_update_bytes"] < dense
        assert m["weight_update_bytes_ratio"] == pytest.approx(m["weight_update_bytes"] / dense)


@pytest.mark.parametrize(
    ("setting", "full"),
    [("trainer.full_update_every=2", [1, 1, 2, 2, 3]), ("trainer.weight_delta=false", None)],
)
def test_the_delta_settings_take_effect(tiny_model, tmp_path, setting, full):
    """full_update_every=2: every second update is full (1, 3, 5); weight_delta=false: every
    update is the dense model, with no checksums kept."""
    steps = 5
    cfg = trainer_config(
        tmp_path, tiny_model, f"shared.max_steps={steps}", "model.dtype=bfloat16", "trainer.optimizer.lr=1e-5", setting
    )
    write_steps(cfg, make_steps(tiny_model, steps=steps, groups=2, seed=2), ranks=1)
    procs, receiver, received, errors = start_ranks_with_receiver(cfg, 1, steps)
    run_dir = Path(cfg.run_dir)
    wait_all(procs, run_dir, timeout=240)
    receiver.join(30)
    assert not errors, errors
    final = final_weights(run_dir, steps)
    assert all(torch.equal(received[steps][k].view(torch.int16), v.view(torch.int16)) for k, v in final.items())
    metrics = [m for m in trainer_metrics(run_dir) if "weight_update_bytes" in m]
    dense = sum(t.numel() * t.element_size() for t in final.values())
    if full is None:
        assert all("weight_full_updates_total" not in m and m["weight_update_bytes"] == dense for m in metrics)
    else:
        assert [m["weight_full_updates_total"] for m in metrics] == full
        assert [m["weight_update_bytes"] == dense for m in metrics] == [True, False, True, False, True]
