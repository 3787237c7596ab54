"""The trainer pool: DeepSpeed ZeRO data-parallel ranks that turn micro-batches into policy versions.

Rank r reads partition r of the "trainer" stream. One optimizer step = the `count`
micro-batches of one `step` (micro-batches of steps already trained are skipped, and a step
whose index 0 arrives again while it is being assembled restarts from that copy: the
preprocessor rewrote it). For each step the ranks agree (all-reduces) on whether to stop
and on how many samples and tokens the max_lag gate left in each update, so that every rank
uses the same denominators; each micro-batch's loss is a share of its update's global mean, so
the gradients summed over micro-batches and ranks are those of one rank holding all the data.

Policy version = steps done. A step is `updates_per_step` optimizer updates (one by default),
each over its own consecutive share of the micro-batches, repeated for `epochs` passes over
them; a step whose samples the gate dropped entirely advances the version without an update.
Every `weight_update_interval` versions rank 0 gathers the full weights (all ranks take part
under ZeRO-3) and broadcasts them to the actors in the weight-update group (trainer/publisher.py:
one that died is left out, its replacement joins at a later version); every `checkpoint_every`
versions, at max_steps and on SIGTERM/SIGINT the ranks write a checkpoint (trainer/checkpoint.py)
and a restart resumes from it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from pipeline_rl.collectives import prepare_collectives
from pipeline_rl.config import LogprobKernel, RunConfig, logprob_kernel
from pipeline_rl.core.logprobs import packed_logprobs
from pipeline_rl.core.process import launched_at, run_pool_process
from pipeline_rl.lora import trained_parameters
from pipeline_rl.metrics import MetricsLogger
from pipeline_rl.streams import open_streams
from pipeline_rl.streams.records import MicroBatch
from pipeline_rl.trainer import checkpoint
from pipeline_rl.trainer.full_weights import gathered_chunks, parameter_specs
from pipeline_rl.trainer.grad_norm import finite_norms
from pipeline_rl.trainer.inputs import consistency_sums, micro_batch_inputs
from pipeline_rl.trainer.lag_gate import GateResult, apply_lag_gate
from pipeline_rl.trainer.loss import LossInputs, load_loss
from pipeline_rl.trainer.model import (
    deepspeed_config,
    leave_out_shm_all_reduce,
    load_model,
    lr_factor,
    make_optimizer,
)
from pipeline_rl.trainer.publisher import WeightPublisher
from pipeline_rl.trainer.replay import ReplayingReader, ReplayLog, replay_path
from pipeline_rl.trainer.routing_replay import RoutingReplay
from pipeline_rl.trainer.step_metrics import GateTotals, RankReduction, StepCounts, StepTotals, step_values
from pipeline_rl.trainer.steps import StepCollector, update_slices
from pipeline_rl.wire import Topic

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: RunConfig, rank: int, world_size: int):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.loss_fn = load_loss(cfg.trainer.loss)
        self.run_dir = Path(cfg.run_dir)
        model = load_model(cfg)
        log.info(
            "rank %d holds %d of the model's %d parameter elements after loading",
            rank,
            sum(getattr(p, "ds_tensor", p).numel() for p in model.parameters()),  # ZeRO-3: its partition
            sum(math.prod(shape) for _, shape, _ in parameter_specs(list(model.named_parameters()))),
        )
        # from_pretrained leaves the model in eval mode, where transformers neither checkpoints
        # layers nor applies dropout (LoRA's included).
        model.train()
        if cfg.trainer.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        # Under LoRA nothing before the first layer needs a gradient (the embeddings are frozen),
        # but the first layer's checkpoint, and ZeRO-3's release of a layer gathered whole once
        # its backward is done, hang on its input's gradient.
        if cfg.model.lora is not None and (cfg.trainer.gradient_checkpointing or cfg.trainer.zero_stage == 3):
            model.enable_input_require_grads()
        self.routing = RoutingReplay(model) if cfg.shared.routing_replay else None
        self.published = trained_parameters(model)
        """What a weight update and a checkpoint's model carry: all parameters, or the adapter."""
        log.info(
            "training %d parameter elements (%d tensors)",
            sum(math.prod(shape) for _, shape, _ in parameter_specs(self.published)),
            len(self.published),
        )
        optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            config=deepspeed_config(cfg),
            # DeepSpeed's annotation names the old _LRScheduler base; any LRScheduler works.
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(cfg, started=launched_at())),  # pyright: ignore[reportArgumentType]
        )
        self.model: torch.nn.Module = model  # the engine's module: DeepSpeed wraps it in place
        self.device = torch.device(self.engine.device or "cpu")
        self.ranks = RankReduction(self.device)
        """Sums and ranges of the step's counts over the ranks (trainer/step_metrics.py)."""
        kernel = logprob_kernel(cfg, self.device.type == "cuda")
        self.compiled_logprobs = kernel == LogprobKernel.compiled
        offload = " with its state in host memory (ZeRO-Offload)" if self.engine.zero_offload_optimizer() else ""
        log.info("optimizer %s%s; logprob kernel %s", type(optimizer).__name__, offload, kernel.value)
        if torch.cuda.is_available():  # what the memory plan calls model and optimizer state
            log.info("device memory after set-up: %.2f GiB allocated", torch.cuda.memory_allocated() / 2**30)
        # The stop agreement travels on the host (gloo): over NCCL it would make every
        # micro-batch wait for the device to finish the one before.
        self.host_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.world.collective_timeout_s))
        self.streams = open_streams(cfg)
        self.metrics = MetricsLogger(cfg, f"trainer{rank}", self.streams) if rank == 0 else None
        self.version = 0
        self.dropped_total = 0
        position = None
        if rank == 0:
            checkpoint.clean_leftovers(self.run_dir)
        dist.barrier()
        found = checkpoint.latest_dir(self.run_dir)
        if found is not None:
            ckpt_dir, state = found
            position = checkpoint.load(self.engine, ckpt_dir, state, rank, world_size)
            self.version = int(state["version"])
            self.dropped_total = int(state.get("dropped_total", 0))
            log.info("resumed from %s: version %d", ckpt_dir, self.version)
        self.reader = self.streams.reader(Topic.TRAINER, MicroBatch, partitions=(rank,), position=position)
        # Redis drops each step once it is trained and logged here (trainer/replay.py).
        self.replay = ReplayLog(replay_path(self.run_dir, rank)) if cfg.streams.backend == "redis" else None
        source = ReplayingReader(self.reader, self.replay.pending()) if self.replay is not None else self.reader
        self.collector = StepCollector(source, rank)
        self.trained_position = self.reader.position()
        self.saved_version = self.version if found is not None else None
        self.publisher = WeightPublisher(cfg, rank, self.streams, world_size)

    def _waiting(self, what: str) -> None:
        if self.metrics is not None:
            self.metrics.heartbeat(what, version=self.version)
        # A replacement actor that registered while no step runs gets the current weights now:
        # it may be the one whose groups the next step waits for. Under ZeRO-3 every rank would
        # have to join the gathers: it waits for the next step's update there.
        if self.publisher.has_joiners():
            log.info("a receiver joined the weight-update group: sending version %d again", self.version)
            self.publisher.publish(self.version, self.published)

    def train(self, stop: Callable[[], bool]) -> int:
        cfg = self.cfg
        while self.version < cfg.shared.max_steps:
            t0, cpu0 = time.perf_counter(), time.process_time()
            batch = self.collector.next_step(self.version, stop, self._waiting)
            wait_s = time.perf_counter() - t0
            if self._stop_or_check(batch) or batch is None:
                break
            gates = [apply_lag_gate(mb, self.version, cfg.shared.max_lag, cfg.trainer.lag_gate) for mb in batch]
            for g in gates:
                for lag in g.dropped_lags:
                    log.info(
                        "max_lag gate: dropped a sample of lag %d > %d at version %d",
                        lag,
                        cfg.shared.max_lag,
                        self.version,
                    )
            t1 = time.perf_counter()
            values = self._step(batch, gates, stop)
            if values is None:  # a stop mid-step: the checkpoint below is of the last whole step
                break
            compute_s = time.perf_counter() - t1
            # CPU time of reading + computing the step: unlike wall time, not inflated by other processes.
            step_cpu_s = time.process_time() - cpu0
            self.version += 1
            self.dropped_total += int(values["dropped_samples"])
            self.trained_position = self.reader.position()
            if self.replay is not None:
                self.replay.append(batch)  # durable in the log first: only then may the stream drop it
                self.streams.trim_below(Topic.TRAINER, self.trained_position)
            values.update(
                wait_s=wait_s,
                compute_s=compute_s,
                step_cpu_s=step_cpu_s,
                dropped_total=self.dropped_total,
                samples_per_s=values["samples"] / (wait_s + compute_s),
                tokens_per_s=values["tokens"] / (wait_s + compute_s),
                compute_tokens_per_s=values["tokens"] / compute_s,
                skipped_microbatches=self.collector.skipped,
                restarted_steps=self.collector.restarted,
                dead_letters=self.reader.dead_letters,
            )
            if self.version % cfg.shared.weight_update_interval == 0:
                values.update(self.publisher.publish(self.version, self.published))
            if cfg.trainer.checkpoint_every and self.version % cfg.trainer.checkpoint_every == 0:
                values["checkpoint_s"] = self.save()
            if self.metrics is not None:
                values["version"] = self.version
                self.metrics.log(values, step=self.version)
        self.save()
        return self.version

    def _stop_or_check(self, batch: list[MicroBatch] | None) -> bool:
        """True if any rank is stopping; otherwise check that all ranks hold the same step with
        the same number of micro-batches (a mismatch would hang the collectives later)."""
        step, count = (batch[0].step, batch[0].count) if batch else (-1, -1)
        going = float(batch is not None)
        (least_going, _), steps, counts = self.ranks.ranges([(going, going), (step, step), (count, count)])
        if least_going == 0:
            return True
        if steps[0] != steps[1] or counts[0] != counts[1]:
            raise RuntimeError(
                f"trainer ranks disagree on the step: steps {steps[0]:.0f}..{steps[1]:.0f}, "
                f"micro-batches per rank {counts[0]:.0f}..{counts[1]:.0f} (rank {self.rank} has "
                f"step {step} with {count})"
            )
        return False

    def _stopping(self, stop: Callable[[], bool]) -> bool:
        """Whether any rank was asked to stop (one collective: every rank must leave the step
        at the same micro-batch, or the next gradient reduction would wait for the others)."""
        flag = torch.tensor([float(stop())])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.host_group)
        return flag.item() > 0

    def _step(self, batch: list[MicroBatch], gates: list[GateResult], stop: Callable[[], bool]) -> dict | None:
        """Forward/backward over the step's micro-batches, split into `updates_per_step`
        mini-batches of one optimizer update each, for `epochs` passes; returns metrics (the
        step's samples, rewards and lags counted once), or None when a stop was
        requested between two micro-batches of its first update (a 32B step takes minutes: the
        stop grace period must not wait for it). The step is then left unfinished: its
        gradients are dropped, and a resumed run trains it again from its first micro-batch."""
        updates = update_slices(len(batch), self.cfg.trainer.updates_per_step)
        # Denominators over all ranks: each mini-batch's loss is its own mean (of tokens or of
        # samples), so that it does not matter how its tokens are spread over ranks.
        first = batch[0]
        gated = GateTotals.reduce(
            gates, updates, self.ranks, (first.filtered_tokens, first.filtered_samples, first.unsolved_samples)
        )
        counts = StepCounts.zeros(self.device)
        optimizer_s = 0.0
        lrs: list[float] = []  # each update's lr, as scaled by lr_by_signal
        done = 0  # optimizer updates made (a mini-batch the gate emptied makes none)
        norms: list = []  # each update's gradient norm, read at the step's end with its metrics
        passes = [(epoch, i, u) for epoch in range(self.cfg.trainer.epochs) for i, u in enumerate(updates)]
        for epoch, i, u in passes:
            trained = gated.update_tokens[i]
            step_tokens, step_samples = gated.denominators(i)
            for k, (mb, gate) in enumerate(zip(batch[u], gates[u])):
                # Only before the step's first optimizer update: after it, the weights are no
                # longer those of any whole version, and the step runs to its end.
                if epoch == 0 and i == 0 and k > 0 and self._stopping(stop):
                    log.info(
                        "stop requested: leaving step %d after %d of %d micro-batches; checkpointing version %d",
                        mb.step,
                        k,
                        len(batch),
                        self.version,
                    )
                    return None
                if epoch == 0:
                    counts.count_samples(mb, gate)
                if trained == 0:
                    continue
                loss, stats, mismatch = self._micro_batch_loss(mb, gate.loss_mask, step_tokens, step_samples)
                # DeepSpeed averages gradients over ranks; each rank's loss is already its share of the sum.
                self.engine.backward(loss * self.world_size)
                counts.add_loss_stats(stats)
                if epoch == 0:  # later passes see weights that no version had
                    counts.consistency += mismatch.to(counts.consistency)
            if trained > 0:
                t = time.perf_counter()
                lrs.append(self._scale_lr(gated.signal_share(i, self.cfg.trainer.optimizer.lr_by_signal)))
                self.engine.step()  # the lr scheduler's step sets the next update's lr afresh
                optimizer_s += time.perf_counter() - t
                norms.append(self.engine.get_global_grad_norm())
                done += 1
        routes = self.routing.take_counts() if self.routing is not None else (0, 0)
        totals = StepTotals.reduce(counts, routes, self.ranks)
        values = step_values(totals, gated, self.cfg.trainer.epochs, done)
        values.update(lr=sum(lrs) / len(lrs) if lrs else self.engine.get_lr()[0], optimizer_s=optimizer_s)
        if done:
            values["grad_norm"] = float(finite_norms(norms, self.version + 1, self.saved_version)[-1])
        return values

    def _scale_lr(self, signal_share: float) -> float:
        """trainer.optimizer.lr_by_signal: this update's lr times the share of its samples that
        carry a signal (the scheduler's step after the update sets the next lr anew); returns
        the lr the update uses."""
        scheduler = self.engine.lr_scheduler  # the LambdaLR of trainer/model.py's lr_factor
        assert isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler)
        for group in scheduler.optimizer.param_groups:
            group["lr"] *= signal_share
        return scheduler.optimizer.param_groups[0]["lr"]

    def _micro_batch_loss(
        self, mb: MicroBatch, loss_mask: list[int], step_tokens: float, step_samples: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """The loss plug-in's (loss, stats) and the micro-batch's `consistency_sums`."""
        dev = micro_batch_inputs(mb, loss_mask, self.device)
        if self.routing is not None:
            where = f"step {mb.step}, micro-batch {mb.index}"
            if mb.routes is None:
                raise ValueError(f"{where} has no routes, and shared.routing_replay is set")
            self.routing.set(mb.routes, len(mb.input_ids), where, self.device)
        wanted = [t for t, m in enumerate(loss_mask) if m > 0]
        logprobs, entropy = packed_logprobs(
            self.engine,
            dev["input_ids"][None],
            dev["position_ids"][None],
            self.cfg.shared.temperature,
            mb.seq_lengths,
            mb.prefix_lengths,
            self.cfg.model.logprob_chunk_tokens,
            wanted=wanted,
            compiled=self.compiled_logprobs,
        )
        inputs = LossInputs(
            logprobs=logprobs,
            entropy=entropy,
            old_logprobs=dev["old_logprobs"],
            advantages=dev["advantages"],
            loss_mask=dev["loss_mask"],
            seq_index=dev["seq_index"],
            step_tokens=step_tokens,
            step_samples=step_samples,
            ref_logprobs=dev.get("ref_logprobs"),
        )
        loss, stats = self.loss_fn(inputs, self.cfg.trainer.loss)
        mismatch = consistency_sums(
            logprobs.detach(),
            dev["old_logprobs"],
            dev["loss_mask"],
            dev["versions"],
            dev["seq_index"],
            len(mb.seq_lengths),
            self.version,
        )
        return loss, stats, mismatch

    def save(self) -> float:
        """Write a checkpoint of the current version (unless it is already saved); returns seconds."""
        if self.saved_version == self.version:
            return 0.0
        start = time.perf_counter()
        path = checkpoint.save(
            self.engine,
            self.run_dir,
            self.cfg.model.path,
            self.version,
            self.trained_position,
            self.rank,
            self.world_size,
            gathered_chunks(self.published, self.rank, self.cfg.trainer.weight_bucket_mb),
            self.cfg.trainer.keep_checkpoints,
            {"dropped_total": self.dropped_total},
            self.cfg.model.lora,
        )
        self.saved_version = self.version
        if self.replay is not None:
            self.replay.keep_from(self.version)
        log.info("checkpoint %s (version %d)", path, self.version)
        return time.perf_counter() - start

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self.publisher.close()
        self.streams.close()


def _init_distributed(cfg: RunConfig) -> None:
    """Join the trainers' process group (once per process: DeepSpeed caches its groups), with
    world.collective_timeout_s, NCCL raising on a dead peer and the sockets on the interface
    toward node 0 (pipeline_rl/collectives.py)."""
    if dist.is_initialized():
        return
    timeout = prepare_collectives(cfg.world.collective_timeout_s, cfg.world.socket_ifname)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    leave_out_shm_all_reduce()
    deepspeed.init_distributed(verbose=False, timeout=timeout)


def run(cfg: RunConfig, rank: int, stop: Callable[[], bool] | None = None) -> int:
    """Train until cfg.shared.max_steps or until `stop()` is true; returns the final version.
    Needs the torchrun-style env (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if int(os.environ.get("RANK", rank)) != rank:
        raise ValueError(f"--index {rank} disagrees with env RANK={os.environ['RANK']}")
    torch.manual_seed(cfg.seed)
    _init_distributed(cfg)
    trainer = Trainer(cfg, rank, world_size)
    try:
        return trainer.train(stop or (lambda: False))
    finally:
        trainer.close()


def main(argv: list[str] | None = None) -> int:
    return run_pool_process("trainer", lambda cfg, rank, stop: f"done at version {run(cfg, rank, stop)}", argv)
