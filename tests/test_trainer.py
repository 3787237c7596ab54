"""Real DeepSpeed trainer ranks on gloo: data parallelism gives the same update as one rank,
and the max_lag gate keeps stale samples out of the update.

Every trainer is a real process with torchrun-style env, forked from the test process, that
runs pipeline_rl.trainer.main() (the ZeRO-3 pair is stopped with SIGTERM, as the launcher
does). Helpers here are shared with tests/test_checkpoint.py.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import orjson
import pytest
import torch
from safetensors.torch import load_file

from conftest import free_port
from pipeline_rl.advantages import sequence_advantages
from pipeline_rl.checkpoint import latest_checkpoint
from pipeline_rl.config import RunConfig, load_config, save_config
from pipeline_rl.logprobs import packed_logprobs
from pipeline_rl.packing import Sequence, pack_step, rollout_sequence
from pipeline_rl.records import Rollout, WeightUpdate
from pipeline_rl.streams import Streams
from pipeline_rl.weight_sync import WeightReceiver

pytestmark = pytest.mark.deepspeed

# DeepSpeed's ZeRO optimizer check imports this module, which pulls in torch's compiler stack
# (~10 s here): importing it once in the test process lets every forked trainer skip that.
with contextlib.suppress(ImportError):
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401

# Update-equality tolerance, relative to the size of the update itself: runs differ only in
# float summation order (micro-batch layout, gradient reduction), which Adam's normalised
# step turns into noise of up to lr on parameters whose exact gradient is ~0 (the k_proj
# biases: softmax ignores a per-query constant). Measured: 5e-6 (ZeRO-2), 1.2e-4 (ZeRO-3).
REL_TOL = 1e-3


def trainer_config(run_dir: Path, model_path: Path, *overrides: str) -> RunConfig:
    cfg = load_config("base", [
        f"run_dir={run_dir}", f"model.path={model_path}", "metrics.tensorboard=false", "actor.temperature=0.8",
        "trainer.optimizer.lr=1e-3", "trainer.checkpoint_every=0", "trainer.max_lag=100", "preprocess.seq_length=64",
        *overrides,
    ])
    save_config(cfg, run_dir / "config.yaml")
    return cfg


def make_steps(model_path: Path, steps: int, groups: int, seed: int, versions: list[int] | None = None
               ) -> list[list[Sequence]]:
    """Random rollout groups (4 attempts, prompt 4-8 tokens, completion 3-12) laid out as the
    preprocessor would, with behaviour logprobs from the initial model at temperature 0.8.
    Step s's samples carry policy version versions[s] (default s)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    vocab = model.config.vocab_size
    rng = random.Random(seed)
    out = []
    for s in range(steps):
        version = s if versions is None else versions[s]
        seqs = []
        for g in range(groups):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(4, 8))]
            rollouts = []
            for _ in range(4):
                completion = [rng.randrange(vocab) for _ in range(rng.randint(3, 12))]
                ids = torch.tensor([prompt + completion])
                with torch.no_grad():
                    lp, _ = packed_logprobs(model, ids, torch.arange(ids.shape[1])[None], 0.8)
                rollouts.append(Rollout(prompt_ids=prompt, completion_ids=completion,
                                        logprobs=lp[len(prompt):].tolist(), versions=[version] * len(completion),
                                        reward=float(rng.random() < 0.5), finish_reason="stop"))
            advantages = sequence_advantages([r.reward for r in rollouts])
            seqs += [rollout_sequence(r, [a] * len(r.completion_ids), f"s{s}g{g}", 64)
                     for r, a in zip(rollouts, advantages)]
        out.append(seqs)
    return out


def write_steps(cfg: RunConfig, steps: list[list[Sequence]], ranks: int, first_step: int = 0) -> None:
    streams = Streams.from_config(cfg)
    writer = streams.writer("trainer", partitions=ranks)
    for s, seqs in enumerate(steps, start=first_step):
        for rank, micro_batches in enumerate(pack_step(seqs, s, ranks, cfg.preprocess.seq_length)):
            for mb in micro_batches:
                writer.write(mb, partition=rank)
    streams.close()


def rank_env(rank: int, ranks: int, port: int) -> dict[str, str]:
    return dict(RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port), OMP_NUM_THREADS="1")


def _forked_main(env: dict[str, str], argv: list[str], log_path: str, before_main: Optional[Callable]) -> None:
    # Both levels: C code writes to fds 1/2, Python to sys.stdout/stderr (pytest replaces those).
    sys.stdout = sys.stderr = open(log_path, "a", buffering=1)
    os.dup2(sys.stdout.fileno(), 1)
    os.dup2(sys.stdout.fileno(), 2)
    os.environ.pop("PIPELINE_RL_WEIGHT_SYNC_ADDR", None)
    os.environ.update(env)
    from pipeline_rl.trainer import main

    if before_main is not None:
        before_main()
    os._exit(main(argv))


def start_ranks(run_dir: Path, ranks: int, before_main: Optional[Callable] = None,
                env: Optional[dict[str, str]] = None) -> list[multiprocessing.Process]:
    """Trainer ranks as real processes running pipeline_rl.trainer.main(), forked from the test
    process: it has already imported torch/DeepSpeed/transformers, so they start in about a
    second, and the test process itself never joins a process group. `before_main` runs in
    each child first (tests use it to make a rank crash at a chosen point)."""
    # A child forked from a process whose torch has a thread pool can deadlock in its first parallel op.
    assert torch.get_num_threads() == 1, "forking trainers needs OMP_NUM_THREADS=1 (tests/conftest.py)"
    port = free_port()
    procs = []
    for rank in range(ranks):
        argv = ["--run-dir", str(run_dir), "--index", str(rank)]
        proc = multiprocessing.get_context("fork").Process(
            target=_forked_main,
            args=({**rank_env(rank, ranks, port), **(env or {})}, argv, str(run_dir / f"trainer{rank}.log"), before_main))
        proc.start()
        procs.append(proc)
    return procs


def wait_all(procs: list[multiprocessing.Process], run_dir: Path, timeout: float, expect: int = 0) -> None:
    deadline = time.time() + timeout
    for proc in procs:
        proc.join(max(1.0, deadline - time.time()))
    for rank, proc in enumerate(procs):
        if proc.exitcode is None:
            proc.kill()
            proc.join()
        log = (Path(run_dir) / f"trainer{rank}.log").read_text()[-3000:]
        assert proc.exitcode == expect, f"trainer{rank} exited with {proc.exitcode}, expected {expect}:\n{log}"


def train(cfg: RunConfig, ranks: int = 1, timeout: float = 120) -> None:
    wait_all(start_ranks(Path(cfg.run_dir), ranks), Path(cfg.run_dir), timeout)


def trainer_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics" / "trainer0.jsonl"
    return [orjson.loads(line)["values"] for line in path.read_bytes().splitlines()] if path.exists() else []


def final_weights(run_dir: Path, version: int) -> dict[str, torch.Tensor]:
    found = latest_checkpoint(run_dir)
    assert found is not None and found[1] == version, f"latest checkpoint of {run_dir}: {found}"
    return load_file(found[0] / "model.safetensors")


def update_error(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                 initial: dict[str, torch.Tensor]) -> float:
    """|weights - reference| / |reference - initial| over all parameters (L2)."""
    assert weights.keys() == reference.keys()
    diff = sum(((weights[k] - reference[k]) ** 2).sum() for k in weights) ** 0.5
    update = sum(((reference[k] - initial[k]) ** 2).sum() for k in weights) ** 0.5
    assert update > 0, "the reference run did not change the weights"
    return float(diff / update)


def receive_weights(cfg: RunConfig, addr: str, versions: int, received: dict, errors: list) -> None:
    """An actor's side of the weight broadcast: announcements from the "weights" stream, tensors
    from WeightReceiver (rank 1 of 2)."""
    streams = Streams.from_config(cfg)
    reader = streams.reader("weights", WeightUpdate)
    endpoint = WeightReceiver(addr, rank=1, world_size=2)
    deadline = time.time() + 120
    try:
        while len(received) < versions and time.time() < deadline:
            for entry in reader.read(timeout=0.5):
                received[entry.record.version] = {k: v.clone() for k, v in endpoint.receive(entry.record)}
    except Exception as e:
        errors.append(repr(e))
    finally:
        endpoint.close()
        streams.close()


def test_two_ranks_give_the_same_update_as_one(tiny_model, tmp_path):
    steps = make_steps(tiny_model, steps=2, groups=4, seed=1)
    initial = load_file(tiny_model / "model.safetensors")
    results = {}
    cases = [("zero2", "trainer.zero_stage=2", "trainer.loss.normalize=token"),
             ("zero3", "trainer.zero_stage=3", "trainer.loss.normalize=sequence")]
    for name, *overrides in cases:
        ref = trainer_config(tmp_path / f"{name}_1rank", tiny_model, "trainer.max_steps=2", "trainer.zero_stage=2",
                             *overrides[1:])
        write_steps(ref, steps, ranks=1)
        train(ref)
        results[name] = final_weights(ref.run_dir, 2)

    # ZeRO-2: two ranks that stop at max_steps.
    two = trainer_config(tmp_path / "zero2_2ranks", tiny_model, "trainer.max_steps=2", "world.trainers=2",
                         *cases[0][1:])
    write_steps(two, steps, ranks=2)
    train(two, ranks=2)
    assert update_error(final_weights(two.run_dir, 2), results["zero2"], initial) < REL_TOL

    # ZeRO-3: two ranks stopped by SIGTERM (as the launcher does) once both steps are trained;
    # they save the final checkpoint and exit 0. An actor's weight receiver runs in a thread
    # here: rank 0 broadcasts the gathered weights after each step.
    three = trainer_config(tmp_path / "zero3_2ranks", tiny_model, "trainer.max_steps=50", "world.trainers=2",
                           *cases[1][1:])
    write_steps(three, steps, ranks=2)
    sync_addr = f"127.0.0.1:{free_port()}"
    received, errors = {}, []
    receiver = threading.Thread(target=receive_weights, args=(three, sync_addr, 2, received, errors), daemon=True)
    receiver.start()
    procs = start_ranks(Path(three.run_dir), 2, env={"PIPELINE_RL_WEIGHT_SYNC_ADDR": sync_addr})
    deadline = time.time() + 240
    while not any(m.get("version") == 2 for m in trainer_metrics(Path(three.run_dir))):
        assert time.time() < deadline and all(p.is_alive() for p in procs), \
            "ZeRO-3 ranks did not train 2 steps:\n" + (Path(three.run_dir) / "trainer0.log").read_text()[-3000:]
        time.sleep(0.5)
    for p in procs:
        os.kill(p.pid, signal.SIGTERM)
    wait_all(procs, Path(three.run_dir), timeout=120)
    final = final_weights(three.run_dir, 2)
    assert update_error(final, results["zero3"], initial) < REL_TOL
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
        cfg = trainer_config(tmp_path / name, tiny_model, "trainer.max_steps=2", *overrides)
        write_steps(cfg, steps, ranks=1)
        train(cfg)
        return final_weights(cfg.run_dir, 2)

    gated = weights_after("gated", with_stale, "trainer.max_lag=0")
    without = weights_after("without", fresh, "trainer.max_lag=0")
    kept = weights_after("kept", with_stale, "trainer.max_lag=1")
    initial = load_file(tiny_model / "model.safetensors")
    assert update_error(gated, without, initial) < REL_TOL
    assert update_error(kept, without, initial) > 100 * REL_TOL

    metrics = trainer_metrics(tmp_path / "gated")
    assert [m["dropped_samples"] for m in metrics] == [0, 1]
    assert metrics[-1]["dropped_total"] == 1
    assert metrics[-1]["lag_hist"] == {"0": len(fresh[1]), "1": 1}
    assert trainer_metrics(tmp_path / "kept")[-1]["dropped_samples"] == 0


def test_step_collector_skips_trained_steps_and_restarts_rewritten_ones(tmp_path):
    """Without DeepSpeed: the collector over a real JSONL trainer stream."""
    from pipeline_rl.records import MicroBatch
    from pipeline_rl.trainer import StepCollector

    def mb(step, index, count, tag=0):
        return MicroBatch(step=step, index=index, count=count, input_ids=[tag], position_ids=[0], loss_mask=[0],
                          advantages=[0.0], old_logprobs=[0.0], versions=[-1], seq_lengths=[1], sample_versions=[-1],
                          group_ids=[""], rewards=[0.0], step_tokens=0, step_samples=0)

    cfg = trainer_config(tmp_path, tmp_path)
    streams = Streams.from_config(cfg)
    writer = streams.writer("trainer")
    # Step 0 was trained already; step 1's first copy is torn after index 0 and written again.
    for record in [mb(0, 0, 2), mb(0, 1, 2), mb(1, 0, 2, tag=1), mb(1, 0, 2, tag=2), mb(1, 1, 2, tag=2),
                   mb(2, 1, 2)]:
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
