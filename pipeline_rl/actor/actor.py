"""The actor process: `python -m pipeline_rl.actor --run-dir RUN_DIR --index I`.

One in-process vLLM engine (pipeline_rl/engine/llm_client.py) and an asyncio loop that runs the
domain's rollout (pipeline_rl/rollouts/domains) for up to `actor.max_groups_in_flight` problems at
once; continuous batching puts all their requests into the same forward passes. Each finished
group goes to partition I of the "actor" stream. A group starts only when admission control
(pipeline_rl/actor/admission.py) allows it, so a slow or stalled trainer slows the actor down instead
of letting it run ahead; the time spent waiting is reported.

Problems: the training set is shuffled once per epoch with the run's seed, and actor I takes
every n-th problem of each epoch's order, so the actors cover it without overlap. Actor 0 also
evaluates every `actor.eval_every_s` seconds (and once at start) on the first
`actor.eval_problems` held-out problems, one sample each at the sampling temperature, and logs
"eval/reward" with the version it evaluated; evaluation groups are never written to the stream.

Weights: the engine starts from the latest checkpoint's Hugging Face model (at that version)
or from model.path (version 0), and takes the trainer's versions through the weight-update group
(actor/weight_link.py).

Failures: a reward check that fails is counted and shown with its last error text (the
rollout gets the failure reward); a rollout that raises is logged, counted and skipped. The
actor exits non-zero when its engine has failed (at once, whether or not a rollout is in
flight) and when MAX_CONSECUTIVE_FAILURES rollouts in a row fail (a broken domain). A failed
weight update (a peer died) is logged and counted: the engine keeps its weights, and the
actor takes the next update, from the group the trainer forms next.
SIGTERM/SIGINT stop it cleanly (exit 0).

Lost groups: a group that no step will take (its rollout raised here; or a preprocessor's
scorer failed on it, or its record could not be decoded, reported on the "lost" stream)
gives its admission slot back, so the actor makes another group instead of waiting for one
that never lands. Counted by cause in `groups_lost/*` metrics and the status line.

Scaling (pipeline_rl/core/actor_count.py): the job's actor count is read from its stream; a
change rebases admission to the new share and takes the problems of the new share from the next
epoch on. An actor whose index is no longer below the count drains: it starts no group, hands
those in flight over to the actors that stay (a continuable domain's; else lets them land),
leaves the weight-update group and ends (exit 0). An actor added to a running job counts its
groups from the trainer's latest version.

Resume: a restarted actor (the run resumed, or the launcher replaced a dead one) goes on from its
position file, RUN_DIR/positions/actorI.json; what the file holds and the counts it resumes with
are in actor/resume.py, the partition's end they go with in actor/partition.py.

Rollouts in flight (actor/in_flight.py): every `actor.in_flight_save_s` and at a graceful stop
the actor saves its groups in flight to RUN_DIR/in_flight/actorI.json; the next actor in its
slot continues those that did not land. Groups started after the last save are counted lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from pipeline_rl.actor.admission import Admission, admission_lag
from pipeline_rl.actor.evaluation import evaluate
from pipeline_rl.actor.in_flight import ContinuationMismatch, RecordingGenerator
from pipeline_rl.actor.in_flight_keeper import GroupRun, InFlightKeeper
from pipeline_rl.actor.partition import Partition
from pipeline_rl.actor.problems import ProblemOrder, SolvedSkip, next_problem
from pipeline_rl.actor.resume import SavedCounts, resume
from pipeline_rl.actor.step_guide import StepGuide
from pipeline_rl.actor.swap_metrics import SwapMetrics
from pipeline_rl.actor.totals import Totals
from pipeline_rl.actor.weight_link import WeightLink
from pipeline_rl.actor.window import Window
from pipeline_rl.collectives import prepare_collectives
from pipeline_rl.config import RunConfig, StepGuidanceMode
from pipeline_rl.core.actor_count import ActorCountWatch
from pipeline_rl.core.process import run_pool_process
from pipeline_rl.metrics import MetricsLogger
from pipeline_rl.rollouts.agent.stats import AgentStats
from pipeline_rl.rollouts.datasets import load_problems
from pipeline_rl.rollouts.domains import load_domain
from pipeline_rl.rollouts.interface import is_continuable
from pipeline_rl.streams import open_streams
from pipeline_rl.streams.records import GroupsLost, RolloutGroup
from pipeline_rl.wire import Topic

log = logging.getLogger("pipeline_rl.actor.actor")

MAX_CONSECUTIVE_FAILURES = 50
POLL_S = 0.01
"""How often the loop looks for finished groups, a new version and the stop flag (short: in sync
mode every step waits here for the new version)."""
SAVE_EVERY_S = 1.0
"""Most often the position file is rewritten (it is fsynced)."""


class Actor:
    def __init__(self, cfg: RunConfig, index: int):
        from pipeline_rl.actor.engine_start import start_engine  # imports the engine's modules

        self.cfg, self.index = cfg, index
        self.name = f"actor{index}"
        run_dir = Path(cfg.run_dir)
        data = cfg.actor.dataset
        self.problems = load_problems(data.loader, data.train)
        self.eval_problems: list[dict] = []
        if index == 0 and cfg.actor.eval_every_s > 0:
            self.eval_problems = load_problems(data.loader, data.test)[: cfg.actor.eval_problems]
        domain = load_domain(cfg.actor)
        self.rollout = domain.rollout
        self.train_ctx = domain.context(cfg, cfg.actor.attempts)
        self.eval_ctx = domain.context(cfg, 1)  # one sample per held-out problem

        # Before the engine: its TP workers inherit the NCCL settings with the environment.
        prepare_collectives(cfg.world.collective_timeout_s, cfg.world.socket_ifname)
        self.llm, version = start_engine(cfg, self.name)
        self.streams = open_streams(cfg)
        self.actor_count = ActorCountWatch(self.streams, cfg.world.actors)
        if index >= self.actor_count.largest:
            raise ValueError(f"--index {index} is not below the job's {self.actor_count.count} actors (world.actors)")
        self.weights = WeightLink(cfg, index, self.llm, self.streams, self.actor_count.largest)

        self.partition = Partition(self.streams, index, run_dir / "positions" / f"{self.name}.json")
        saved = self.partition.saved()
        self.totals = Totals(lost_reported=saved.lost)
        # The share this actor's saved counts were made at; rebased to the job's below.
        actors = saved.actors or self.actor_count.count
        self.order = ProblemOrder(self.problems, cfg.seed, index, actors)
        self.solved = SolvedSkip(cfg.actor.skip_solved, f"{cfg.seed}/skip/{index}")
        self.admission = Admission(cfg.shared.groups_per_step, saved.present or actors, admission_lag(cfg))
        # Groups the preprocessors reported lost give their admission slots back (see admission.py).
        self.lost_reader = self.streams.reader(
            Topic.LOST, GroupsLost, partitions=(index,), position=saved.lost_position
        )
        self._lost_ids: set[str] = set()
        # No group before the step of the weights it starts from (the trainer's latest, for an
        # actor added to a running job).
        first_group = self.admission.first_group_of(max(version, self._published_version()))
        landed = self.partition.landed_since(saved.stream_end) if saved.was_saved else []
        unsaved = len(landed)
        if unsaved:
            log.info("%d groups reached the stream after the last position save: counted as written", unsaved)
        # Routing replay would need each saved token's experts to continue a group; a branch adds
        # a sequence to a call, which a continued rollout could not replay.
        continuable = (
            is_continuable(self.rollout)
            and not cfg.shared.routing_replay
            and cfg.step_guidance.mode != StepGuidanceMode.branch
        )
        self.keeper = InFlightKeeper(run_dir, self.name, self.llm, continuable, cfg.actor.in_flight_save_s)
        self.to_continue = self.keeper.saved(self.partition.landed_since, self.partition.trimmed_after)
        counts = resume(saved, first_group, unsaved, continued=len(self.to_continue))
        self.totals.written, self.drawn, self.totals.lost_stopped = counts.written, counts.drawn, counts.lost_stopped
        self.admission.started, self.admission.offset = counts.admission_started, counts.admission_offset
        if index < self.actor_count.count:
            self._rescale(self.actor_count.count, self.actor_count.present)
        self.incarnation = f"{int(time.time() * 1000):x}"
        self.metrics = MetricsLogger(cfg, self.name, self.streams)

        self.window = Window()
        self.agent_stats = AgentStats()
        self.swap_metrics = SwapMetrics(self.llm)
        self.guide = None
        if cfg.step_guidance.mode != StepGuidanceMode.none:
            self.guide = StepGuide(cfg, self.llm, self.streams, index, self.actor_count.largest)
        self._saved_at = 0.0
        self.drained = False
        """Whether the actor ended because the job was scaled below it."""

    # -- the loop -------------------------------------------------------------------------

    async def run(self, stop: Callable[[], bool]) -> None:
        tasks: dict[asyncio.Task, GroupRun] = {}
        eval_task: asyncio.Task | None = None
        for run in self.keeper.runs(self.to_continue):  # resume's counts hold them
            self._start(tasks, run)
        stopping = False
        next_eval = time.monotonic() if self.eval_problems else float("inf")
        next_metrics = time.monotonic() + self.cfg.actor.metrics_every_s
        blocked_since: float | None = None
        try:
            while not stop():
                if self.llm.failure is not None:
                    # Fatal even when no rollout is in flight to fail (admission may be waiting
                    # for a version that this engine can no longer receive).
                    raise RuntimeError(f"the vLLM engine failed: {self.llm.failure}")
                count = self.actor_count.poll()
                draining = self.index >= count
                if draining and tasks and self.keeper.continuable:
                    await self._hand_over(tasks)
                if draining and not tasks:
                    # Off the event loop: the engine (an evaluation in flight, its output
                    # handling) goes on while the weight-update group re-forms without it.
                    await asyncio.to_thread(self._leave, count)
                    return
                present = self.actor_count.present
                if not draining and (present != self.admission.actors or count != self.order.actors):
                    # Off the event loop: a shrink asks the sender for the trainer's version.
                    await asyncio.to_thread(self._rescale, count, present)
                while not draining and len(tasks) < self.cfg.actor.max_groups_in_flight:
                    if not self.admission.may_start(self.llm.version):
                        blocked_since = blocked_since or time.monotonic()
                        break
                    blocked_since = self._unblock(blocked_since)
                    self.admission.start()
                    number, problem = next_problem(self.order, self.drawn, self.solved)
                    self.drawn = number + 1
                    group_id = f"{self.name}-{self.incarnation}-{number}"
                    self._start(tasks, GroupRun(group_id, problem, RecordingGenerator(self.llm)))
                if tasks:
                    done, _ = await asyncio.wait(tasks, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
                else:
                    done = set()
                    idle_from = time.monotonic()
                    await asyncio.sleep(POLL_S)
                    self.totals.idle_s += time.monotonic() - idle_from
                for task in done:
                    self._finish(task, tasks.pop(task))
                self._take_lost()
                if self.guide is not None and self.guide.due():
                    await self.guide.poll(list(tasks.values()))
                now = time.monotonic()
                if now >= next_eval and (eval_task is None or eval_task.done()):
                    eval_task = asyncio.create_task(
                        evaluate(self.rollout, self.llm, self.eval_ctx, self.eval_problems, self.metrics)
                    )
                    next_eval = now + self.cfg.actor.eval_every_s
                if now >= next_metrics:
                    blocked_since = self._unblock(blocked_since, reopen=True)
                    self._log_metrics(len(tasks))
                    next_metrics = now + self.cfg.actor.metrics_every_s
                if self.keeper.continuable and not draining:
                    if self.keeper.due():
                        await self._save_in_flight(tasks, hold=False)
                    if now - self._saved_at >= SAVE_EVERY_S:
                        await self._adopt(tasks)
                self._save(force=False, in_flight=len(tasks))
            stopping = True
        finally:
            if stopping and self.keeper.continuable and tasks and self.llm.failure is None:
                # Held: the engine generates nothing after this, so nothing is thrown away.
                await self._save_in_flight(tasks, hold=True)
            for task in list(tasks) + ([eval_task] if eval_task else []):
                task.cancel()
            await asyncio.gather(*tasks, *([eval_task] if eval_task else []), return_exceptions=True)
            self._unblock(blocked_since)
            self._take_lost()
            self._save(force=True, in_flight=len(tasks))
            self._log_metrics(0)

    def _published_version(self) -> int:
        """The trainer's latest version, for an actor added to a running job (0 otherwise: at
        the launch the trainer may not be up yet, and a restarted actor has its saved count)."""
        return self.weights.published_version() if self.actor_count.scaled else 0

    def _rescale(self, actors: int, present: int) -> None:
        """The job has `actors` actors, `present` of them running (core/actor_count.py): on a
        change, admission takes the share of those present from the next group on, and the
        problems this actor's share of each epoch of all of them, from the next epoch on."""
        if present != self.admission.actors:
            log.info("%d actors generate now (was %d): rebasing admission", present, self.admission.actors)
            trainer_version = self.weights.trainer_version() if present < self.admission.actors else None
            self.admission.rebase(present, self.llm.version, trainer_version)
        if actors != self.order.actors:
            log.info("the job now has %d actors (was %d): rebasing the problem order", actors, self.order.actors)
            self.order, self.drawn = self.order.rescaled(actors, self.drawn)

    def _leave(self, count: int) -> None:
        """Drained (the job was scaled below this actor): every group it started has landed;
        leave the weight-update group before the engine stops, so no transfer waits for it."""
        log.info(
            "the job was scaled to %d actors: %s drained after writing %d groups", count, self.name, self.totals.written
        )
        self.drained = True
        self.weights.leave(self.actor_count.largest)

    def _take_lost(self) -> None:
        """Give back the admission slot of every group a preprocessor reported lost."""
        for entry in self.lost_reader.read(timeout=0.0):
            report: GroupsLost = entry.record
            new = [i for i in report.ids if i not in self._lost_ids]
            self._lost_ids.update(new)
            for _ in new:
                self.admission.abandon()
            self.totals.lost_reported += len(new)
            self.totals.lost_by_cause[report.cause] += len(new)
            if new:
                log.warning("%d group(s) lost (%s): %s", len(new), report.cause, report.error)

    def _unblock(self, since: float | None, reopen: bool = False) -> float | None:
        """Add a blocked stretch to the counters; with `reopen` it goes on from now."""
        if since is None:
            return None
        now = time.monotonic()
        self.window.blocked_s += now - since
        self.totals.blocked_s += now - since
        return now if reopen else None

    def _finish(self, task: asyncio.Task, run: GroupRun) -> None:
        """Write a finished group."""
        try:
            group = task.result()
            if not isinstance(group, RolloutGroup) or not group.rollouts:
                raise TypeError(
                    f"domain {self.cfg.actor.domain!r} returned {type(group).__name__} "
                    f"without rollouts, expected a RolloutGroup"
                )
            group.group_id = run.group_id
            group.actor = self.index
            group.written_at = time.time()
            self.partition.write(group)
        except ContinuationMismatch as e:
            self.admission.abandon()
            self.totals.lost_continuation += 1
            log.error("group %s could not be continued, lost: %s", run.group_id, e)
            return
        except Exception as e:
            self.admission.abandon()
            error = self.totals.rollout_failed(e)
            log.error("rollout of group %s failed: %s", run.group_id, error)
            if self.totals.consecutive_failures >= MAX_CONSECUTIVE_FAILURES:
                raise RuntimeError(
                    f"{self.totals.consecutive_failures} rollouts in a row failed, the last with {error}"
                ) from e
            return
        self.totals.group_written(self.window.add(group, self.llm.version))
        self.solved.record(group)
        for rollout in group.rollouts:
            self.agent_stats.add(rollout.metadata)

    def _log_metrics(self, in_flight: int) -> None:
        values = {
            "version": self.llm.version,
            **self.window.values(),
            **self.totals.values(),
            "groups_started_total": self.admission.started,
            "skipped_solved_total": self.solved.skipped,
            "groups_in_flight": in_flight,
            "tokens_generated_total": self.llm.tokens_generated,
            "waiting_on": self._waiting_on(in_flight),
            **self.swap_metrics.values(),
            # Groups in flight at a stop continued here, their tokens not generated again; and
            # groups this actor handed over when the job was scaled below it.
            "groups_continued_total": self.keeper.continued_total,
            "tokens_continued_total": self.keeper.tokens_continued_total,
            "groups_handed_over_total": self.keeper.handed_over_total,
            **self.agent_stats.take(),  # turns, tool calls and errors of agent episodes
            **(self.guide.values() if self.guide is not None else {}),
        }
        self.metrics.log({k: v for k, v in values.items() if v is not None}, step=self.llm.version)
        self.window = Window()

    def _waiting_on(self, in_flight: int) -> str:
        if self.admission.may_start(self.llm.version):
            return f"generation ({in_flight} groups in flight)"
        step = self.admission.step_of(self.admission.started)
        return (
            f"admission: next group lands in step {step}, needs a policy version >= "
            f"{step - self.admission.max_lag} (has {self.llm.version}; {in_flight} groups in flight)"
        )

    def _save(self, force: bool, in_flight: int) -> None:
        now = time.monotonic()
        if force or now - self._saved_at >= SAVE_EVERY_S:
            self.partition.save(
                SavedCounts(
                    written=self.totals.written,
                    problems=self.drawn,
                    lost=self.totals.lost_reported,
                    lost_position=self.lost_reader.position(),
                    lost_stopped=self.totals.lost_stopped,
                    in_flight=in_flight,
                    actors=self.order.actors,
                    present=self.admission.actors,
                    admission_offset=self.admission.offset,
                )
            )
            self._saved_at = now

    def _start(self, tasks: dict[asyncio.Task, GroupRun], run: GroupRun) -> None:
        tasks[asyncio.create_task(self.rollout(run.problem, run.generator, self.train_ctx))] = run

    async def _save_in_flight(self, tasks: dict[asyncio.Task, GroupRun], hold: bool) -> None:
        """Save the groups in flight, and the counts that go with them."""
        await self.keeper.save(list(tasks.values()), hold, self.partition.flushed_end)
        self._save(force=True, in_flight=len(tasks))

    async def _adopt(self, tasks: dict[asyncio.Task, GroupRun]) -> None:
        """Continue the groups of the hand-over files this actor claims."""
        groups, files = self.keeper.claim({run.group_id for run in tasks.values()})
        for run in self.keeper.runs(groups):
            self.admission.start()
            self._start(tasks, run)
        if files:
            await self._save_in_flight(tasks, hold=False)  # in this actor's file before the claimed go
            for path in files:
                path.unlink()

    async def _hand_over(self, tasks: dict[asyncio.Task, GroupRun]) -> None:
        """Drained with groups in flight: hand them over to the actors that stay and stop
        generating them here, so the actor leaves at once."""
        await self.keeper.hand_over(list(tasks.values()), self.incarnation)
        for task in tasks:
            task.cancel()
            self.admission.abandon()
        await asyncio.gather(*tasks, return_exceptions=True)
        tasks.clear()
        self._save(force=True, in_flight=0)

    def close(self) -> None:
        self.llm.close()
        self.weights.close()
        self.metrics.close()
        self.streams.close()


def serve(cfg: RunConfig, index: int, stop: Callable[[], bool]) -> str:
    if index < 0:
        raise ValueError(f"--index {index} is negative")
    actor = Actor(cfg, index)
    try:
        asyncio.run(actor.run(stop))
    finally:
        actor.close()
    return f"{'drained' if actor.drained else 'stopped'} after writing {actor.totals.written} groups"


def main(argv: list[str] | None = None) -> int:
    return run_pool_process("actor", serve, argv)
