"""Running real DeepSpeed trainer ranks for the trainer and checkpoint tests: configs, rollout
data laid out as the preprocessor would, forked torchrun-style ranks, and comparing weights.

Every trainer is a real process with torchrun-style env, forked from the test process, that
runs pipeline_rl.trainer's main().
"""

from __future__ import annotations

import multiprocessing
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import torch
from helpers import free_port, hf_model
from safetensors.torch import load_file

from pipeline_rl.config import RunConfig, load_config, save_config
from pipeline_rl.core.checkpoint_layout import latest_checkpoint
from pipeline_rl.core.logprobs import packed_logprobs
from pipeline_rl.preprocess.advantages import sequence_advantages
from pipeline_rl.preprocess.packing import Sequence, pack_step, rollout_sequence
from pipeline_rl.streams import open_streams
from pipeline_rl.streams.records import Rollout, WeightUpdate
from pipeline_rl.weight_sync import WeightReceiver
from pipeline_rl.wire import WEIGHT_SYNC_ADDR_ENV

# Trainer ranks are forked from a fork server: a clean process that never ran a vLLM engine
# (forking the test process itself would copy whatever state an in-process engine left behind),
# and that has imported the trainer once, so every rank starts in about a second. DeepSpeed's
# ZeRO optimizer check imports the muon module, which pulls in torch's compiler stack (~10 s).
_RANKS = multiprocessing.get_context("forkserver")
_RANKS.set_forkserver_preload(["pipeline_rl.trainer.trainer", "deepspeed.runtime.zero.muon.muon_optimizer"])

# Update-equality tolerance, relative to the size of the update itself. Two runs of the same
# data differ only in fp32 summation order (micro-batch layout, BLAS blocking, the gradient
# all-reduce). Reordering a sum of N terms changes it by at most N*u*sum|x| (u = 2**-24); a
# gradient entry here sums N <= 4 groups * 4 rollouts * 20 tokens = 320 per-token terms of
# either sign, whose cancellation ratio sum|x| / |sum x| is about sqrt(N) ~ 18: a relative
# gradient error of at most 320 * 6e-8 * 18 = 3.4e-4 per step, 6.9e-4 over the two steps.
# That bound carries over to the update only if the optimizer step is Lipschitz in the
# gradient: LINEAR_ADAM makes it so (below). Measured on one machine: 1.7e-7 (ZeRO-2), 4.6e-6 (ZeRO-3).
REL_TOL = 1e-3

LINEAR_ADAM = ("trainer.optimizer.eps=1", "trainer.optimizer.lr=1")
"""AdamW with eps far above |g| / sqrt(v): its step lr * m / (sqrt(v) + eps) changes by at most
lr / eps per unit of gradient. With the default eps (1e-8) the first step is lr * sign(g) for
every entry, so an entry whose exact gradient is ~0 (the k_proj biases: softmax ignores a
per-query constant) turns rounding noise into a full-size step: 1.5e-3 on one machine, 1.2e-4 on
another. For tests that compare runs of different layouts; resume tests keep the default, where
the Adam moments matter."""


def trainer_config(run_dir: Path, model_path: Path, *overrides: str) -> RunConfig:
    cfg = load_config(
        "base",
        [
            f"run_dir={run_dir}",
            f"model.path={model_path}",
            "metrics.tensorboard=false",
            "actor.temperature=0.8",
            "trainer.optimizer.lr=1e-3",
            "trainer.checkpoint_every=0",
            "trainer.max_lag=100",
            "preprocess.seq_length=64",
            *overrides,
        ],
    )
    save_config(cfg, run_dir / "config.yaml")
    return cfg


def make_steps(
    model_path: Path, steps: int, groups: int, seed: int, versions: list[int] | None = None
) -> list[list[Sequence]]:
    """Random rollout groups (4 attempts, prompt 4-8 tokens, completion 3-12) laid out as the
    preprocessor would, with behaviour logprobs from the initial model at temperature 0.8.
    Step s's samples carry policy version versions[s] (default s)."""
    model = hf_model(model_path, {})
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
                rollouts.append(
                    Rollout(
                        prompt_ids=prompt,
                        completion_ids=completion,
                        logprobs=lp[len(prompt) :].tolist(),
                        versions=[version] * len(completion),
                        reward=float(rng.random() < 0.5),
                        finish_reason="stop",
                    )
                )
            advantages = sequence_advantages([r.reward for r in rollouts])
            seqs += [
                rollout_sequence(r, [a] * len(r.completion_ids), f"s{s}g{g}", 64) for r, a in zip(rollouts, advantages)
            ]
        out.append(seqs)
    return out


def write_steps(cfg: RunConfig, steps: list[list[Sequence]], ranks: int, first_step: int = 0) -> None:
    streams = open_streams(cfg)
    writer = streams.writer("trainer", partitions=ranks)
    for s, seqs in enumerate(steps, start=first_step):
        for rank, micro_batches in enumerate(pack_step(seqs, s, ranks, cfg.preprocess.seq_length)):
            for mb in micro_batches:
                writer.write(mb, partition=rank)
    streams.close()


def rank_env(rank: int, ranks: int, port: int) -> dict[str, str]:
    return dict(
        RANK=str(rank),
        WORLD_SIZE=str(ranks),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )


def _rank_main(env: dict[str, str], argv: list[str], log_path: str, before_main: Callable | None) -> None:
    # Both levels: C code writes to fds 1/2, Python to sys.stdout/stderr (pytest replaces those).
    sys.stdout = sys.stderr = open(log_path, "a", buffering=1)
    os.dup2(sys.stdout.fileno(), 1)
    os.dup2(sys.stdout.fileno(), 2)
    os.environ.pop(WEIGHT_SYNC_ADDR_ENV, None)
    os.environ.update(env)
    from pipeline_rl.trainer.trainer import main

    if before_main is not None:
        before_main()
    os._exit(main(argv))


def start_ranks(
    run_dir: Path, ranks: int, before_main: Callable | None = None, env: dict[str, str] | None = None
) -> list[multiprocessing.Process]:
    """Trainer ranks as real processes running pipeline_rl.trainer.trainer.main(), forked from the
    fork server (see _RANKS); the test process itself never joins a process group. `before_main`
    (picklable: a module-level function or a partial of one) runs in each child first; tests use
    it to make a rank crash at a chosen point."""
    # A child forked from a process whose torch has a thread pool can deadlock in its first
    # parallel op; the fork server inherits this process's OMP_NUM_THREADS.
    assert os.environ.get("OMP_NUM_THREADS") == "1", "forking trainers needs OMP_NUM_THREADS=1 (tests/conftest.py)"
    port = free_port()
    procs = []
    for rank in range(ranks):
        argv = ["--run-dir", str(run_dir), "--index", str(rank)]
        proc = _RANKS.Process(
            target=_rank_main,
            args=(
                {**rank_env(rank, ranks, port), **(env or {})},
                argv,
                str(run_dir / f"trainer{rank}.log"),
                before_main,
            ),
        )
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
    """Rank 0's step metrics (not its heartbeats while it waits)."""
    path = run_dir / "metrics" / "trainer0.jsonl"
    records = [orjson.loads(line)["values"] for line in path.read_bytes().splitlines()] if path.exists() else []
    return [r for r in records if "waiting_on" not in r]


def final_weights(run_dir: Path, version: int) -> dict[str, torch.Tensor]:
    found = latest_checkpoint(run_dir)
    assert found is not None and found[1] == version, f"latest checkpoint of {run_dir}: {found}"
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(found[0].glob("*.safetensors")):
        weights.update(load_file(shard))
    return weights


def update_error(
    weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]
) -> float:
    """|weights - reference| / |reference - initial| over all parameters (L2)."""
    assert weights.keys() == reference.keys()
    diff = sum(((weights[k] - reference[k]) ** 2).sum() for k in weights) ** 0.5
    update = sum(((reference[k] - initial[k]) ** 2).sum() for k in weights) ** 0.5
    assert update > 0, "the reference run did not change the weights"
    return float(diff / update)


def receive_weights(cfg: RunConfig, addr: str, versions: int, received: dict, errors: list) -> None:
    """An actor's side of the weight broadcast: announcements from the "weights" stream, tensors
    from WeightReceiver (rank 1 of 2)."""
    streams = open_streams(cfg)
    reader = streams.reader("weights", WeightUpdate)
    endpoint = WeightReceiver(addr, rank=1, world_size=2, backend="gloo", timeout_s=60)
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


def start_ranks_with_receiver(
    cfg: RunConfig, ranks: int, versions: int
) -> tuple[list[multiprocessing.Process], threading.Thread, dict, list]:
    """Trainer ranks whose rank 0 broadcasts each version to an actor's receiver that runs in a
    thread here (receive_weights, until `versions` arrived): (ranks, thread, received, errors)."""
    sync_addr = f"127.0.0.1:{free_port()}"
    received: dict = {}
    errors: list = []
    receiver = threading.Thread(target=receive_weights, args=(cfg, sync_addr, versions, received, errors), daemon=True)
    receiver.start()
    procs = start_ranks(Path(cfg.run_dir), ranks, env={WEIGHT_SYNC_ADDR_ENV: sync_addr})
    return procs, receiver, received, errors


def _probe_main(env: dict[str, str], config_path: str, probe: Callable, out) -> None:
    os.environ.pop(WEIGHT_SYNC_ADDR_ENV, None)
    os.environ.update(env)
    try:
        from pipeline_rl.config import load_saved_config
        from pipeline_rl.trainer.trainer import Trainer, _init_distributed

        cfg = load_saved_config(Path(config_path))
        _init_distributed(cfg)
        trainer = Trainer(cfg, 0, 1)
        batch = trainer.collector.next_step(0, lambda: False, lambda what: None)
        out.put(("ok", probe(trainer, batch)))
    except BaseException as e:  # the test shows the child's error instead of waiting for a value
        out.put(("error", repr(e)))
    out.close()
    out.join_thread()  # the queue's feeder thread must deliver before the process ends
    os._exit(0)


def probe_trainer(cfg: RunConfig, probe: Callable, timeout: float = 120):
    """`probe(trainer, batch)` (picklable) run in a forked one-rank trainer process: a real
    `Trainer` built from `cfg` (DeepSpeed on gloo), `batch` its first step's micro-batches from
    the stream. Returns what the probe returns."""
    assert os.environ.get("OMP_NUM_THREADS") == "1", "forking trainers needs OMP_NUM_THREADS=1 (tests/conftest.py)"
    out = _RANKS.Queue()
    proc = _RANKS.Process(
        target=_probe_main, args=(rank_env(0, 1, free_port()), str(Path(cfg.run_dir) / "config.yaml"), probe, out)
    )
    proc.start()
    try:
        status, value = out.get(timeout=timeout)
    finally:
        proc.join(10)
        if proc.exitcode is None:
            proc.kill()
    assert status == "ok", f"trainer probe failed: {value}"
    return value


def saved_for_backward(trainer, batch) -> dict[str, int]:
    """A probe (probe_trainer): bytes of the distinct storages that autograd keeps for backward
    from the trainer's own forward of its first micro-batch (`Trainer._micro_batch_loss`),
    parameters left out; the micro-batch's tokens; and whether the model is in train mode."""
    from pipeline_rl.trainer.lag_gate import apply_lag_gate

    mb = batch[0]
    gate = apply_lag_gate(mb, trainer.version, trainer.cfg.trainer.max_lag, trainer.cfg.trainer.lag_gate)
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        trainer._micro_batch_loss(mb, gate.loss_mask, sum(gate.loss_mask), gate.samples)
    params = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    return {
        "saved_bytes": sum(n for ptr, n in storages.items() if ptr not in params),
        "tokens": len(mb.input_ids),
        "training": int(trainer.model.training),
    }


def repeated_logprobs(trainer, batch) -> dict[str, list[float]]:
    """A probe (probe_trainer): the trained tokens' logprobs of the first micro-batch from the
    trainer's training forward, twice, and from the same weights in eval mode, twice (LoRA
    adapters get random B matrices first)."""
    from pipeline_rl.trainer.lag_gate import apply_lag_gate

    mb = batch[0]
    gate = apply_lag_gate(mb, trainer.version, trainer.cfg.trainer.max_lag, trainer.cfg.trainer.lag_gate)
    trained = [t for t, m in enumerate(gate.loss_mask) if m]
    # LoRA's B starts at zero, where dropout on the adapter's input changes nothing: give it values.
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def logprobs() -> list[float]:
        with torch.no_grad():
            lp = packed_logprobs(
                trainer.engine,
                torch.tensor([mb.input_ids]),
                torch.tensor([mb.position_ids]),
                trainer.cfg.actor.temperature,
                mb.seq_lengths,
                wanted=trained,
            )[0]
        return lp[trained].tolist()

    out = {"train_a": logprobs(), "train_b": logprobs()}
    trainer.engine.eval()
    out.update(eval_a=logprobs(), eval_b=logprobs())
    return out
