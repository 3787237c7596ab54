"""Real DeepSpeed trainer ranks on gloo: data parallelism gives the same update as one rank,
several optimizer updates per step equal as many steps, and the max_lag gate keeps stale
samples out of the update (the ZeRO-3 pair is stopped with
SIGTERM, as the launcher does)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from fixtures.helpers import hf_model
from fixtures.trainer_runs import (
    LINEAR_ADAM,
    REL_TOL,
    final_weights,
    make_steps,
    start_ranks,
    start_ranks_with_receiver,
    train,
    trainer_config,
    trainer_metrics,
    update_error,
    wait_all,
    write_steps,
)
from safetensors.torch import load_file

from pipeline_rl.core.checkpoint_layout import latest_checkpoint
from pipeline_rl.core.logprobs import packed_logprobs
from pipeline_rl.preprocess.packing import pack_step
from pipeline_rl.streams import open_streams
from pipeline_rl.trainer.model import leave_out_shm_all_reduce

pytestmark = pytest.mark.deepspeed


def test_two_ranks_give_the_same_update_as_one(tiny_model, tmp_path):
    steps = make_steps(tiny_model, steps=2, groups=4, seed=1)
    initial = load_file(tiny_model / "model.safetensors")
    results = {}
    cases = [
        ("zero2", "trainer.zero_stage=2", "trainer.loss.normalize=token", *LINEAR_ADAM),
        # Chunks of 8 tokens: the output layer runs chunk by chunk under ZeRO-3 too (and its
        # 1-rank reference), with backward recomputing each chunk.
        (
            "zero3",
            "trainer.zero_stage=3",
            "trainer.loss.normalize=sequence",
            "model.logprob_chunk_tokens=8",
            *LINEAR_ADAM,
        ),
    ]
    for name, *overrides in cases:
        ref = trainer_config(
            tmp_path / f"{name}_1rank", tiny_model, "shared.max_steps=2", "trainer.zero_stage=2", *overrides[1:]
        )
        write_steps(ref, steps, ranks=1)
        train(ref)
        results[name] = final_weights(ref.run_dir, 2)

    # ZeRO-2: two ranks that stop at max_steps.
    two = trainer_config(tmp_path / "zero2_2ranks", tiny_model, "shared.max_steps=2", "world.trainers=2", *cases[0][1:])
    write_steps(two, steps, ranks=2)
    train(two, ranks=2)
    assert update_error(final_weights(two.run_dir, 2), results["zero2"], initial) < REL_TOL

    # ZeRO-3: two ranks stopped by SIGTERM (as the launcher does) once both steps are trained;
    # they save the final checkpoint and exit 0. An actor's weight receiver runs in a thread
    # here: rank 0 broadcasts the gathered weights after each step. 1 MiB buckets: the ~3 MB
    # model is gathered, broadcast and written to the checkpoint in several chunks.
    three = trainer_config(
        tmp_path / "zero3_2ranks",
        tiny_model,
        "shared.max_steps=50",
        "world.trainers=2",
        "trainer.weight_bucket_mb=1",
        *cases[1][1:],
    )
    write_steps(three, steps, ranks=2)
    procs, receiver, received, errors = start_ranks_with_receiver(three, 2, 2)
    deadline = time.time() + 240
    while not any(m.get("version") == 2 for m in trainer_metrics(Path(three.run_dir))):
        assert time.time() < deadline and all(p.is_alive() for p in procs), (
            "ZeRO-3 ranks did not train 2 steps:\n" + (Path(three.run_dir) / "trainer0.log").read_text()[-3000:]
        )
        time.sleep(0.5)
    for p in procs:
        os.kill(p.pid, signal.SIGTERM)
    wait_all(procs, Path(three.run_dir), timeout=120)
    final = final_weights(three.run_dir, 2)
    assert update_error(final, results["zero3"], initial) < REL_TOL
    # Built partitioned (zero.Init): each rank held its share from the start; ZeRO-3 pads
    # every parameter to a multiple of the world size, so at most one element more per parameter.
    for rank in range(2):
        log = (Path(three.run_dir) / f"trainer{rank}.log").read_text()
        found = re.search(r"holds (\d+) of the model's (\d+) parameter elements", log)
        assert found, log[-3000:]
        held, total = int(found[1]), int(found[2])
        assert held <= total // 2 + len(initial), f"rank {rank} held {held} of {total} elements after loading"
    hf_dir = latest_checkpoint(Path(three.run_dir))[0]
    shards = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    assert len(shards) >= 2 and (hf_dir / "model.safetensors.index.json").exists(), shards
    loaded = hf_model(hf_dir, {})
    assert all(torch.equal(p, final[n]) for n, p in loaded.named_parameters())
    receiver.join(30)
    assert not errors and sorted(received) == [1, 2], f"received versions {sorted(received)}, errors {errors}"
    assert received[2].keys() == final.keys()
    assert all(torch.equal(received[2][k], final[k]) for k in final)
    assert not all(torch.equal(received[1][k], final[k]) for k in final)
    assert all(m["weight_broadcast_s"] > 0 for m in trainer_metrics(Path(three.run_dir)))
    # Same data, different normalisation: the two references really differ.
    assert update_error(results["zero2"], results["zero3"], initial) > 100 * REL_TOL


def test_stale_sample_is_not_trained_on(tiny_model, tmp_path):
    """max_lag=0: at version 1, a sample of version 0 (lag 1) is dropped by the gate, so the
    weights equal those of a run whose data never had it; with a larger max_lag they differ."""
    fresh = make_steps(tiny_model, steps=2, groups=2, seed=2)
    stale = make_steps(tiny_model, steps=1, groups=1, seed=3, versions=[0])[0][:1]
    with_stale = [fresh[0], fresh[1] + stale]

    def weights_after(name: str, steps, *overrides) -> dict[str, torch.Tensor]:
        cfg = trainer_config(tmp_path / name, tiny_model, "shared.max_steps=2", *LINEAR_ADAM, *overrides)
        write_steps(cfg, steps, ranks=1)
        train(cfg)
        return final_weights(cfg.run_dir, 2)

    gated = weights_after("gated", with_stale, "shared.max_lag=0")
    without = weights_after("without", fresh, "shared.max_lag=0")
    kept = weights_after("kept", with_stale, "shared.max_lag=1")
    initial = load_file(tiny_model / "model.safetensors")
    assert update_error(gated, without, initial) < REL_TOL
    assert update_error(kept, without, initial) > 100 * REL_TOL

    metrics = trainer_metrics(tmp_path / "gated")
    assert [m["dropped_samples"] for m in metrics] == [0, 1]
    assert metrics[-1]["dropped_total"] == 1
    assert metrics[-1]["lag_hist"] == {"0": len(fresh[1]), "1": 1}
    assert trainer_metrics(tmp_path / "kept")[-1]["dropped_samples"] == 0

    # Consistency of behaviour and trainer logprobs on lag-0 tokens. Step 0: the behaviour
    # logprobs came from the same fp32 weights (only summation order differs: ~1e-6 of
    # logprobs of size ~5). Step 1: its samples claim version 1, but their logprobs came from
    # the initial weights, which the first (lr 1) update moved far: the metric must see it.
    first, second = trainer_metrics(tmp_path / "without")
    assert first["mismatch/lag0_tokens"] == first["trained_tokens"]
    assert first["mismatch/lag0_abs_logprob_diff"] < 1e-4 and abs(first["mismatch/lag0_kl"]) < 1e-4
    assert second["mismatch/lag0_abs_logprob_diff"] > 1e-2 and second["mismatch/lag0_kl"] > 1e-3
    # Every token of that run is of lag 0: the KL to the behaviour policy over all trained
    # tokens is the lag-0 one. With a kept stale sample it covers more tokens than lag 0 does.
    assert second["behaviour_kl"] == pytest.approx(second["mismatch/lag0_kl"], rel=1e-9)
    kept_last = trainer_metrics(tmp_path / "kept")[-1]
    assert kept_last["behaviour_kl"] != pytest.approx(kept_last["mismatch/lag0_kl"], rel=1e-6)
    assert all(m["optimizer_s"] > 0 for m in metrics)


def test_optimizer_offload_gives_the_same_update(tiny_model, tmp_path):
    """ZeRO-Offload (fp32 state on the host, DeepSpeed's CPU AdamW) trains to the same weights
    as torch's AdamW on the device, within the fp32 reduction-order bound REL_TOL."""
    steps = make_steps(tiny_model, steps=2, groups=4, seed=2)
    initial = load_file(tiny_model / "model.safetensors")
    results = {}
    for name, offload in [("device", "false"), ("offload", "true")]:
        cfg = trainer_config(
            tmp_path / name, tiny_model, "shared.max_steps=2", f"trainer.optimizer.offload={offload}", *LINEAR_ADAM
        )
        write_steps(cfg, steps, ranks=1)
        train(cfg, timeout=400)  # DeepSpeed compiles its CPU Adam op on first use (~1-2 min)
        results[name] = final_weights(cfg.run_dir, 2)
    log = (tmp_path / "offload" / "trainer0.log").read_text()
    assert "optimizer DeepSpeedCPUAdam with its state in host memory (ZeRO-Offload)" in log, log[-3000:]
    assert update_error(results["offload"], results["device"], initial) < REL_TOL


def test_compiled_logprob_kernel_gives_the_same_update(tiny_model, tmp_path):
    """model.logprob_kernel=compiled (the GPU default; torch.compile's CPU backend here) trains
    to the eager kernel's weights within the fp32 reduction-order bound REL_TOL."""
    steps = make_steps(tiny_model, steps=2, groups=4, seed=4)
    initial = load_file(tiny_model / "model.safetensors")
    results = {}
    for kernel in ("eager", "compiled"):
        cfg = trainer_config(
            tmp_path / kernel, tiny_model, "shared.max_steps=2", f"model.logprob_kernel={kernel}", *LINEAR_ADAM
        )
        write_steps(cfg, steps, ranks=1)
        train(cfg, timeout=400)  # the first compile in a fresh cache takes about a minute on 2 cores
        assert f"logprob kernel {kernel}" in (tmp_path / kernel / "trainer0.log").read_text()
        results[kernel] = final_weights(cfg.run_dir, 2)
    assert update_error(results["compiled"], results["eager"], initial) < REL_TOL


@pytest.mark.parametrize("normalize", ["token", "sequence"])
def test_filtered_groups_counted_in_the_denominators_scale_the_steps_gradient(tiny_model, tmp_path, normalize):
    """As many filtered tokens (sequences) as trained ones halve each token's weight, so the
    step's gradient norm: the same arithmetic but for one factor, equal to a few roundings."""
    (step,) = make_steps(tiny_model, steps=1, groups=2, seed=3)
    tokens, samples = sum(s.loss_tokens for s in step), len(step)
    norms = {}
    for filtered in [(0, 0), (tokens, samples)]:
        cfg = trainer_config(
            tmp_path / f"f{filtered[0]}", tiny_model, "shared.max_steps=1", f"trainer.loss.normalize={normalize}"
        )
        write_steps(cfg, [step], ranks=1, filtered=filtered)
        train(cfg)
        (norms[filtered[0]],) = [m["grad_norm"] for m in trainer_metrics(Path(cfg.run_dir)) if "grad_norm" in m]
    assert norms[tokens] == pytest.approx(norms[0] / 2, rel=1e-4)


def test_lr_by_signal_scales_an_update_by_the_share_of_its_samples_that_carry_a_signal(tiny_model, tmp_path):
    """trainer.optimizer.lr_by_signal: a step with as many filtered samples as trained ones has
    half the lr, so (AdamW linear in its first step, LINEAR_ADAM) half the update of the same
    step without it, to a rounding (a multiplication by 0.5 is exact); with nothing filtered the
    share is 1 and the update is the one without it. `unsolved` counts only the filtered samples
    of groups below the step's mean: half the update when all of them are, the whole one when
    none is."""
    (step,) = make_steps(tiny_model, steps=1, groups=2, seed=6)
    filtered = (sum(s.loss_tokens for s in step), len(step))
    initial = load_file(tiny_model / "model.safetensors")
    results = {}
    cases = [
        ("plain", filtered, 0, "scheduled"),
        ("scaled", filtered, 0, "all"),
        ("unsolved_all", filtered, len(step), "unsolved"),
        ("unsolved_none", filtered, 0, "unsolved"),
        ("unfiltered", (0, 0), 0, "scheduled"),
        ("unfiltered_by_signal", (0, 0), 0, "all"),
    ]
    for name, counted, unsolved, by_signal in cases:
        cfg = trainer_config(
            tmp_path / name,
            tiny_model,
            "shared.max_steps=1",
            f"trainer.optimizer.lr_by_signal={by_signal}",
            *LINEAR_ADAM,
        )
        write_steps(cfg, [step], ranks=1, filtered=counted, unsolved=unsolved)
        train(cfg)
        results[name] = final_weights(cfg.run_dir, 1)
    half = {k: initial[k] + (results["plain"][k] - initial[k]) / 2 for k in initial}
    assert update_error(results["scaled"], half, initial) < REL_TOL
    assert update_error(results["plain"], half, initial) > 100 * REL_TOL
    assert update_error(results["unsolved_all"], half, initial) < REL_TOL
    assert update_error(results["unsolved_none"], results["plain"], initial) < REL_TOL
    assert update_error(results["unfiltered_by_signal"], results["unfiltered"], initial) < REL_TOL


def test_the_entropy_bonus_moves_a_step_without_advantage_towards_higher_entropy(tiny_model, tmp_path):
    """trainer.loss.entropy_coef on the trainer's path (packed logprobs with the entropy's
    gradient): a step whose advantages are all 0 leaves the weights exactly as they were without
    the bonus, and with it raises the policy's mean entropy on the step's completion tokens
    (a sign, so no tolerance: the update is a small step along the entropy's gradient)."""
    (step,) = make_steps(tiny_model, steps=1, groups=2, seed=8)
    for seq in step:
        seq.advantages = [0.0] * len(seq.advantages)
    initial = load_file(tiny_model / "model.safetensors")

    def mean_entropy(weights: dict[str, torch.Tensor]) -> float:
        model, total, tokens = hf_model(tiny_model, weights), 0.0, 0
        for seq in step:
            ids = torch.tensor([seq.input_ids])
            with torch.no_grad():
                _, entropy = packed_logprobs(model, ids, torch.arange(ids.shape[1])[None], 1.0)
            total += sum(e for e, m in zip(entropy.tolist(), seq.loss_mask) if m)
            tokens += sum(seq.loss_mask)
        return total / tokens

    results = {}
    for coef in (0.0, 0.01):
        cfg = trainer_config(
            tmp_path / f"c{coef}", tiny_model, "shared.max_steps=1", f"trainer.loss.entropy_coef={coef}"
        )
        write_steps(cfg, [step], ranks=1)
        train(cfg)
        results[coef] = final_weights(cfg.run_dir, 1)
    assert all(torch.equal(results[0.0][k], initial[k]) for k in initial)
    assert mean_entropy(results[0.01]) > mean_entropy(initial)


def test_cpu_trainers_leave_out_deepspeeds_shm_all_reduce():
    """ZeRO training never calls DeepSpeed's shared-memory all-reduce (its inference layers do), so
    a CPU trainer makes its process group without building or loading that op: DeepSpeed's own
    loader, which the group calls, finds it unavailable."""
    from deepspeed.comm.torch import build_shm_op

    leave_out_shm_all_reduce()
    assert build_shm_op() is None


def test_updates_per_step_equal_consecutive_steps(tiny_model, tmp_path):
    """One step of two micro-batches with updates_per_step=2 makes the same two optimizer
    updates (each normalised over its own micro-batch) as two steps of one micro-batch each;
    with one update per step the same data gives a different result."""
    data = make_steps(tiny_model, steps=2, groups=2, seed=4, versions=[0, 0])

    def weights_after(name: str, merged: bool, *overrides) -> dict[str, torch.Tensor]:
        # 8 sequences of at most 20 tokens: each step's data fits one 256-token micro-batch.
        cfg = trainer_config(tmp_path / name, tiny_model, "preprocess.seq_length=256", *LINEAR_ADAM, *overrides)
        if merged:
            mbs = [mb for s, seqs in enumerate(data) for mb in pack_step(seqs, s, 1, 256)[0]]
            assert len(mbs) == 2
            streams = open_streams(cfg)
            writer = streams.writer("trainer")
            for i, mb in enumerate(mbs):
                mb.step, mb.index, mb.count = 0, i, len(mbs)
                writer.write(mb)
            streams.close()
        else:
            write_steps(cfg, data, ranks=1)
        train(cfg)
        return final_weights(cfg.run_dir, cfg.shared.max_steps)

    two_steps = weights_after("two_steps", False, "shared.max_steps=2")
    two_updates = weights_after("two_updates", True, "shared.max_steps=1", "trainer.updates_per_step=2")
    one_update = weights_after("one_update", True, "shared.max_steps=1")
    initial = load_file(tiny_model / "model.safetensors")
    assert update_error(two_updates, two_steps, initial) < REL_TOL
    assert update_error(one_update, two_steps, initial) > 100 * REL_TOL
    metrics = trainer_metrics(tmp_path / "two_updates")
    assert [(m["version"], m["optimizer_updates"]) for m in metrics] == [(1, 2)]


def test_epochs_equal_the_same_step_trained_twice(tiny_model, tmp_path):
    """epochs=2 makes, on one step, the same two optimizer updates as two steps of the same
    micro-batches (same behaviour logprobs, so the second is as off-policy as a second pass);
    one pass gives a different result. Samples and tokens are counted once."""
    data = make_steps(tiny_model, steps=1, groups=2, seed=5, versions=[0])

    def weights_after(name: str, steps, *overrides) -> dict[str, torch.Tensor]:
        cfg = trainer_config(tmp_path / name, tiny_model, *LINEAR_ADAM, *overrides)
        write_steps(cfg, steps, ranks=1)
        train(cfg)
        return final_weights(cfg.run_dir, cfg.shared.max_steps)

    twice = weights_after("twice", data * 2, "shared.max_steps=2")
    two_epochs = weights_after("two_epochs", data, "shared.max_steps=1", "trainer.epochs=2")
    one_epoch = weights_after("one_epoch", data, "shared.max_steps=1")
    initial = load_file(tiny_model / "model.safetensors")
    assert update_error(two_epochs, twice, initial) < REL_TOL
    assert update_error(one_epoch, twice, initial) > 100 * REL_TOL
    (two,) = trainer_metrics(tmp_path / "two_epochs")
    (one,) = trainer_metrics(tmp_path / "one_epoch")
    assert two["optimizer_updates"] == 2 and one["optimizer_updates"] == 1
    counted = (8, sum(sum(s.loss_mask) for s in data[0]))
    assert (two["samples"], two["trained_tokens"]) == (one["samples"], one["trained_tokens"]) == counted
    # The second pass sees moved weights: its importance weights leave 1, the first pass's do not.
    assert one["ess"] == pytest.approx(1.0, abs=1e-4) and two["ess"] < one["ess"]


def test_step_collector_skips_trained_steps_and_restarts_rewritten_ones(tmp_path):
    """Without DeepSpeed: the collector over a real JSONL trainer stream."""
    from pipeline_rl.streams.records import MicroBatch
    from pipeline_rl.trainer.steps import StepCollector

    def mb(step, index, count, tag=0):
        return MicroBatch(
            step=step,
            index=index,
            count=count,
            input_ids=[tag],
            position_ids=[0],
            loss_mask=[0],
            advantages=[0.0],
            old_logprobs=[0.0],
            versions=[-1],
            seq_lengths=[1],
            sample_versions=[-1],
            group_ids=[""],
            rewards=[0.0],
            step_tokens=0,
            step_samples=0,
        )

    cfg = trainer_config(tmp_path, tmp_path)
    streams = open_streams(cfg)
    writer = streams.writer("trainer")
    # Step 0 was trained already; step 1's first copy is torn after index 0 and written again.
    for record in [mb(0, 0, 2), mb(0, 1, 2), mb(1, 0, 2, tag=1), mb(1, 0, 2, tag=2), mb(1, 1, 2, tag=2), mb(2, 1, 2)]:
        writer.write(record)
    collector = StepCollector(streams.reader("trainer", MicroBatch), rank=0)
    batch = collector.next_step(version=1, stop=lambda: False)
    assert [(m.step, m.index, m.input_ids[0]) for m in batch] == [(1, 0, 2), (1, 1, 2)]
    assert (collector.skipped, collector.restarted) == (2, 1)
    # The step is complete after its last micro-batch: nothing beyond it was consumed.
    with pytest.raises(ValueError, match=r"partition 0 offset \d+: micro-batch 1 of 2 of step 2, expected index 0"):
        collector.next_step(version=2, stop=lambda: False)
    assert collector.next_step(version=3, stop=lambda: True) is None
    streams.close()


def test_non_finite_gradients_stop_the_trainer_before_publishing(tiny_model, tmp_path):
    """DeepSpeed does not check gradients before an update (its per-tensor check costs a device
    wait each update): the trainer reads the update's gradient norm and stops, naming the cause,
    with nothing published or checkpointed after the bad update."""
    cfg = trainer_config(
        tmp_path,
        tiny_model,
        "shared.max_steps=2",
        "trainer.loss.function=fixtures.scaled_loss:loss",
        "trainer.loss.settings.factor=nan",
    )
    write_steps(cfg, make_steps(tiny_model, steps=2, groups=2, seed=3), ranks=1)
    wait_all(start_ranks(Path(cfg.run_dir), 1), Path(cfg.run_dir), 120, expect=1)
    log = (Path(cfg.run_dir) / "trainer0.log").read_text()
    assert "NonFiniteGradients" in log and "optimizer update 0" in log, log[-2000:]
    found = latest_checkpoint(Path(cfg.run_dir))
    assert found is None or found[1] == 0, found
    assert trainer_metrics(Path(cfg.run_dir)) == []
