"""The preprocessor pool: rollout groups in, packed micro-batches per trainer rank out.

Data flow. Preprocessor i of n reads the "actor" partitions partitions_for(i, n, actors) (over
every actor the job has had: ActorPartitions) in
batches of up to `preprocess.batch_groups` groups and runs the scorers on each batch (the
costly part, so it runs on every preprocessor). Step assembly must give every trainer rank
one consistent sequence of steps, so only preprocessor 0 assembles: preprocessors 1..n-1
write their scored groups to partition i of the Topic.SCORED topic, and preprocessor 0
takes groups from its own scoring and from those partitions. (With n = 1 there is no hop.)
Advantages are a cheap function of a scored group, so preprocessor 0 computes them.

Assembly, in preprocessor 0: per-token advantages; groups whose advantages are all zero are
dropped and counted (`preprocess.advantage.filter_zero`), their tokens still counted in the
step's loss denominators (`count_filtered`: the micro-batches carry them). A step is exactly
`shared.groups_per_step` groups *taken*, filtered ones included, so the number of groups an
actor must produce per step is fixed and its admission bound (pipeline_rl/actor/admission.py) can
never wait for groups that filtering threw away. The kept groups are packed (pipeline_rl/preprocess/packing.py) into the same
number of micro-batches for every rank and written to partition r of "trainer" for rank r.

Resume contract. Reads are capped so that a step never holds more groups than it needs;
once a step's micro-batches are written and flushed, preprocessor 0 saves
{actor position, scored position, next step} to RUN_DIR/positions/preprocessor0.json, so
nothing is buffered outside a saved position and a restart goes on at the next group and
the next step number. A crash after the writes but before the save makes the restart write
that step again (same step number, possibly other groups): the trainer skips micro-batches
of steps it has already trained, and when a step's index 0 arrives again while it is still
assembling that step it drops the partial copy. Preprocessors 1..n-1 save their actor
position after each batch is written to Topic.SCORED: a crash between the two re-scores
and re-sends that one batch (at-least-once).

Step guidance (`step_guidance.mode: cut`): each preprocessor also scores the steps of the
attempts its actors are generating, on a thread of its own (pipeline_rl/preprocess/step_service.py).

After `shared.max_steps` steps preprocessor 0 stops reading and waits to be stopped
(the launcher treats a pool process that exits on its own as a failure).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from pipeline_rl.config import RunConfig, StepGuidanceMode
from pipeline_rl.core.actor_count import ActorCountWatch
from pipeline_rl.core.process import run_pool_process
from pipeline_rl.metrics import MetricsLogger
from pipeline_rl.preprocess.advantages import all_zero, group_advantages
from pipeline_rl.preprocess.packing import is_padding, pack_step, rollout_sequence, share_prompt
from pipeline_rl.preprocess.step_service import StepService
from pipeline_rl.scorers import Scorer, load_scorers
from pipeline_rl.streams import Entry, PositionStore, Reader, Streams, open_streams, partitions_for
from pipeline_rl.streams.records import DeadLetter, GroupsLost, RolloutGroup, encode
from pipeline_rl.wire import Topic

log = logging.getLogger("pipeline_rl.preprocess.preprocessor")

IDLE_S = 0.2
"""Sleep between stop checks once there is nothing left to do."""


class Counters:
    """Counts since the last metrics record, and totals."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.reset()

    def reset(self) -> None:
        self.now: dict[str, float] = {}

    def add(self, key: str, value: float = 1) -> None:
        self.now[key] = self.now.get(key, 0) + value
        self.totals[key] = self.totals.get(key, 0) + value


class LostGroups:
    """Tells each actor which of its groups no step will take (Topic.LOST, partition = actor),
    so that its admission budget gives them back instead of waiting for them forever."""

    def __init__(self, streams: Streams, actors: int, counters: Counters):
        self.streams = streams
        self.writer = streams.writer(Topic.LOST, partitions=actors)
        self.counters = counters

    def widen(self, actors: int) -> None:
        """The job was scaled up to `actors` actors."""
        self.writer.close()
        self.writer = self.streams.writer(Topic.LOST, partitions=actors)

    def report(self, actor: int, cause: str, ids: list[str], error: str) -> None:
        self.writer.write(GroupsLost(actor=actor, cause=cause, ids=ids, error=error[:500]), partition=actor)
        self.writer.flush()
        self.counters.add(f"groups_lost_{cause}", len(ids))

    def undecodable(self, letter: DeadLetter) -> None:
        """An actor record no reader can use: the group it held is lost."""
        self.report(letter.partition, "decode", [f"actor:{letter.partition}:{letter.offset}"], letter.error)


class ActorPartitions:
    """This preprocessor's partitions of the "actor" topic (every n-th), over the actors the job
    has had since its launch (pipeline_rl/core/actor_count.py; a draining actor still writes,
    and a drained one's last groups may still be unread after a restart: its partition is in the
    saved position), widened when the job is scaled up."""

    def __init__(self, streams: Streams, cfg: RunConfig, index: int, position: dict | None, lost: LostGroups):
        self.streams, self.index, self.n, self.lost = streams, index, cfg.world.preprocessors, lost
        self.watch = ActorCountWatch(streams, cfg.world.actors)
        saved = 1 + max((int(p) for p in position or {}), default=-1)
        self.actors = max(self.watch.largest, saved)
        if self.actors != cfg.world.actors:
            lost.widen(self.actors)
        self.reader = self._open(position)

    def _open(self, position: dict | None) -> Reader | None:
        own = partitions_for(self.index, self.n, self.actors)
        if not own:
            return None
        reader = self.streams.reader(Topic.ACTOR, RolloutGroup, own, position=position)
        reader.on_dead_letter = self.lost.undecodable
        return reader

    def widen(self) -> bool:
        """Take the partitions of actors added since the last call; True when there were some."""
        self.watch.poll()
        if self.watch.largest <= self.actors:
            return False
        old = self.reader
        self.actors = self.watch.largest
        self.lost.widen(self.actors)
        self.reader = self._open(old.position() if old is not None else None)
        if old is not None:
            assert self.reader is not None
            self.reader.dead_letters = old.dead_letters
            old.close()
        own = self.reader.partitions if self.reader else ()
        log.info("preprocessor%d: the job has had %d actors: reading partitions %s", self.index, self.actors, own)
        return True


class ScoringStage:
    """Runs the scorers on one batch. A raising scorer dead-letters the batch's groups; groups a
    scorer reports as failed are dead-lettered alone and the rest go on to the next scorer."""

    def __init__(self, scorers: list[Scorer], streams: Streams, counters: Counters, lost: LostGroups):
        self.scorers = scorers
        self.dead = streams.writer(Topic.SCORER_DEAD)
        self.counters = counters
        self.lost = lost

    def __call__(self, entries: list[Entry]) -> list[RolloutGroup]:
        now = time.time()
        written = [e.record.written_at for e in entries if e.record.written_at is not None]
        # How far behind the actors this preprocessor is: age of the groups it starts scoring.
        self.counters.add("lag_s", sum(now - w for w in written))
        self.counters.add("lag_groups", len(written))
        start = time.monotonic()
        for scorer in self.scorers:
            name = type(scorer).__name__
            groups = [e.record for e in entries]
            t0 = time.monotonic()
            try:
                failed = scorer.score(groups) or {}
            except Exception as e:  # a user plug-in: any failure fails this batch only
                failed = dict.fromkeys((g.group_id for g in groups), f"{type(e).__name__}: {e}")
            self.counters.add(f"scorer_s/{name}", time.monotonic() - t0)
            if failed:
                entries = self._dead_letter(entries, failed, name)
        self.counters.add("scored_groups", len(entries))
        self.counters.add("batch_time_s", time.monotonic() - start)
        self.counters.add("batches")
        return [e.record for e in entries]

    def _dead_letter(self, entries: list[Entry], failed: dict[str, str], scorer: str) -> list[Entry]:
        """Dead-letter the failed groups, tell their actors; returns the entries left."""
        bad = [e for e in entries if e.record.group_id in failed]
        first = failed[bad[0].record.group_id] if bad else ""
        log.warning(
            "%s failed on %d of %d groups (%s), dead-lettered to %s: %s",
            scorer,
            len(bad),
            len(entries),
            ", ".join(e.record.group_id for e in bad),
            Topic.SCORER_DEAD,
            first,
        )
        by_actor: dict[int, list[Entry]] = {}
        for entry in bad:
            error = f"{scorer}: {failed[entry.record.group_id]}"
            self.dead.write(
                DeadLetter(Topic.ACTOR, entry.partition, entry.offset, error, encode(entry.record).decode())
            )
            by_actor.setdefault(entry.partition, []).append(entry)
        self.dead.flush()
        for actor, lost in by_actor.items():
            ids = [e.record.group_id for e in lost]
            self.lost.report(actor, "scorer", ids, f"{scorer}: {failed[ids[0]]}")
        self.counters.add("scorer_failures")
        self.counters.add("scorer_failed_groups", len(bad))
        return [e for e in entries if e.record.group_id not in failed]


class StepAssembler:
    """Preprocessor 0's step building: advantages, filtering, packing, writing, saving."""

    def __init__(self, cfg: RunConfig, streams: Streams, metrics: MetricsLogger, next_step: int):
        self.cfg = cfg
        self.writer = streams.writer(Topic.TRAINER, partitions=cfg.world.trainers)
        self.metrics = metrics
        self.next_step = next_step
        self.pending: list[tuple[RolloutGroup, list[list[float]]]] = []
        self.taken = 0
        self.filtered_tokens = self.filtered_samples = 0
        """What the step's filtered groups add to its loss denominators (count_filtered)."""
        self.filtered_rewards: list[tuple[float, int]] = []
        """Each counted filtered group's (reward, samples): which are unsolved is known only
        once the step's mean reward is."""
        self.counters = Counters()
        self.rewards: list[float] = []

    @property
    def needed(self) -> int:
        return self.cfg.shared.groups_per_step - self.taken

    def add(self, groups: list[RolloutGroup]) -> None:
        """Take scored groups; the caller never hands over more than `needed`."""
        for group in groups:
            advantages = group_advantages(group, self.cfg.preprocess.advantage)
            self.taken += 1
            self.counters.add("groups_in")
            self.rewards += [r.reward for r in group.rollouts]
            if self.cfg.preprocess.advantage.filter_zero and all_zero(advantages):
                self.counters.add("groups_filtered")
                if self.cfg.preprocess.advantage.count_filtered:
                    self._count_filtered(group, advantages)
                continue
            self.pending.append((group, advantages))
        assert self.taken <= self.cfg.shared.groups_per_step, "read more groups than the step needs"

    def _count_filtered(self, group: RolloutGroup, advantages: list[list[float]]) -> None:
        seq_length = self.cfg.preprocess.seq_length
        tokens = [
            rollout_sequence(r, a, group.group_id, seq_length).loss_tokens for r, a in zip(group.rollouts, advantages)
        ]
        samples = sum(t > 0 for t in tokens)
        self.filtered_tokens += sum(tokens)
        self.filtered_samples += samples
        self.filtered_rewards.append((sum(r.reward for r in group.rollouts) / len(group.rollouts), samples))

    def unsolved_samples(self) -> int:
        """The counted filtered samples of groups whose reward is below the step's mean."""
        mean = sum(self.rewards) / max(1, len(self.rewards))
        return sum(samples for reward, samples in self.filtered_rewards if reward < mean)

    def write_step(self) -> None:
        """Pack and write the full step `next_step` to every rank, then advance."""
        seq_length = self.cfg.preprocess.seq_length
        sequences = []
        for group, advantages in self.pending:
            seqs = []
            for rollout, adv in zip(group.rollouts, advantages):
                seq = rollout_sequence(rollout, adv, group.group_id, seq_length)
                if seq.truncated:
                    self.counters.add("truncated_sequences")
                    log.warning(
                        "group %s (problem %s): a sequence of %d tokens was truncated to preprocess.seq_length=%d",
                        group.group_id,
                        group.problem_id,
                        len(rollout.prompt_ids) + len(rollout.completion_ids),
                        seq_length,
                    )
                seqs.append(seq)
            prompt = group.rollouts[0].prompt_ids
            if self.cfg.shared.share_prompts and all(r.prompt_ids == prompt for r in group.rollouts):
                seqs = share_prompt(seqs, len(prompt), seq_length)
            sequences += seqs
        unsolved = self.unsolved_samples()
        per_rank = pack_step(
            sequences,
            self.next_step,
            self.cfg.world.trainers,
            seq_length,
            (self.filtered_tokens, self.filtered_samples),
            unsolved,
        )
        count = len(per_rank[0])
        for index in range(count):
            for rank, batches in enumerate(per_rank):
                self.writer.write(batches[index], partition=rank)
        self.writer.flush()
        real = [mb for batches in per_rank for mb in batches if not is_padding(mb)]
        tokens = [len(mb.input_ids) for mb in real]
        c = self.counters.now
        self.metrics.log(
            {
                "preprocess/groups_in": c.get("groups_in", 0),
                "preprocess/groups_out": len(self.pending),
                "preprocess/groups_filtered": c.get("groups_filtered", 0),
                "preprocess/groups_filtered_total": self.counters.totals.get("groups_filtered", 0),
                "preprocess/truncated_sequences_total": self.counters.totals.get("truncated_sequences", 0),
                "preprocess/micro_batches_per_rank": count,
                "preprocess/padding_micro_batches": count * len(per_rank) - len(real),
                "preprocess/tokens_per_micro_batch": sum(tokens) / max(1, len(tokens)),
                "preprocess/step_tokens": per_rank[0][0].step_tokens,
                "preprocess/step_samples": per_rank[0][0].step_samples,
                "preprocess/filtered_tokens": self.filtered_tokens,
                "preprocess/unsolved_samples": unsolved,
                "preprocess/reward_mean": sum(self.rewards) / max(1, len(self.rewards)),
            },
            step=self.next_step,
        )
        log.info("step %d: %d groups, %d micro-batches per rank", self.next_step, len(self.pending), count)
        self.counters.reset()
        self.rewards = []
        self.pending = []
        self.taken = 0
        self.filtered_tokens = self.filtered_samples = 0
        self.filtered_rewards = []
        self.next_step += 1


def _log_scoring(
    metrics: MetricsLogger, counters: Counters, reader_dead: int, step: int | None, step_guidance: dict[str, float]
) -> None:
    c = counters.now
    metrics.log(
        {
            "preprocess/scored_groups": c.get("scored_groups", 0),
            "preprocess/scorer_failures": c.get("scorer_failures", 0),
            "preprocess/scorer_failures_total": counters.totals.get("scorer_failures", 0),
            "preprocess/scorer_failed_groups_total": counters.totals.get("scorer_failed_groups", 0),
            "preprocess/batch_time_s": c.get("batch_time_s", 0.0) / max(1, c.get("batches", 0)),
            # Mean age of the groups scored in this window (0 when none carried a write time).
            "preprocess/lag_s": c.get("lag_s", 0.0) / max(1, c.get("lag_groups", 0)),
            **{
                f"preprocess/{k}_per_batch": v / max(1, c.get("batches", 0))
                for k, v in c.items()
                if k.startswith("scorer_s/")
            },
            "preprocess/actor_dead_letters_total": reader_dead,
            "preprocess/groups_lost_scorer_total": counters.totals.get("groups_lost_scorer", 0),
            "preprocess/groups_lost_decode_total": counters.totals.get("groups_lost_decode", 0),
            **step_guidance,
        },
        step=step,
    )
    counters.reset()


def run(cfg: RunConfig, index: int, stop: Callable[[], bool] | None = None) -> int:
    """Run preprocessor `index` until `stop()` is true; returns the next step number
    (meaningful for preprocessor 0)."""
    stop = stop or (lambda: False)
    n = cfg.world.preprocessors
    if not 0 <= index < n:
        raise ValueError(f"preprocessor index {index} not in [0, world.preprocessors={n})")
    store = PositionStore(Path(cfg.run_dir) / "positions" / f"preprocessor{index}.json")
    saved = store.load() or {}
    streams = open_streams(cfg)
    metrics = MetricsLogger(cfg, f"preprocessor{index}", streams)
    scorers = load_scorers(cfg)
    counters = Counters()
    lost = LostGroups(streams, cfg.world.actors, counters)
    scoring = ScoringStage(scorers, streams, counters, lost)
    partitions = ActorPartitions(streams, cfg, index, saved.get("actor"), lost)
    service = None
    if cfg.step_guidance.mode != StepGuidanceMode.none:
        service = StepService(cfg, streams, index, partitions.actors).start()

    def stopping() -> bool:
        if service is not None:
            service.check()
        return stop()

    def log_scoring(reader_dead: int, step: int | None) -> None:
        _log_scoring(metrics, counters, reader_dead, step, service.values() if service is not None else {})

    try:
        if index > 0:
            _run_scoring_only(cfg, index, partitions, scoring, streams, store, counters, stopping, log_scoring)
            return 0
        scored = None
        if n > 1:
            scored = streams.reader(Topic.SCORED, RolloutGroup, range(1, n), position=saved.get("scored"))
        assembler = StepAssembler(cfg, streams, metrics, int(saved.get("next_step", 0)))
        actor = partitions.reader
        sources = [s for s in (actor, scored) if s is not None]
        while not stopping():
            if assembler.next_step >= cfg.shared.max_steps:
                time.sleep(IDLE_S)
                continue
            if partitions.widen():
                actor = partitions.reader
                sources = [s for s in (actor, scored) if s is not None]
            timeout = 1.0 / len(sources) if sources else IDLE_S
            for source in sources:
                entries = source.read(timeout=timeout, max_count=min(cfg.preprocess.batch_groups, assembler.needed))
                if not entries:
                    metrics.heartbeat(
                        f"rollout groups for step {assembler.next_step} "
                        f"({assembler.taken} of {cfg.shared.groups_per_step} taken)"
                    )
                    continue
                assembler.add(scoring(entries) if source is actor else [e.record for e in entries])
                if assembler.needed == 0:
                    assembler.write_step()
                    store.save(
                        {
                            "actor": actor.position() if actor else None,
                            "scored": scored.position() if scored else None,
                            "next_step": assembler.next_step,
                        }
                    )
                    for topic, source in ((Topic.ACTOR, actor), (Topic.SCORED, scored)):
                        if source is not None:
                            streams.trim_below(topic, source.position())
                    log_scoring(actor.dead_letters if actor else 0, assembler.next_step - 1)
        return assembler.next_step
    finally:
        if service is not None:
            service.close()
        for scorer in scorers:
            scorer.close()
        metrics.close()
        streams.close()


def _run_scoring_only(
    cfg: RunConfig,
    index: int,
    partitions: ActorPartitions,
    scoring: ScoringStage,
    streams: Streams,
    store: PositionStore,
    counters: Counters,
    stop: Callable[[], bool],
    log_scoring: Callable[[int, int | None], None],
) -> None:
    """Preprocessors 1..n-1: score batches and hand them to preprocessor 0."""
    if partitions.reader is None:
        log.info("preprocessor%d has no actor partition (%d actors): idle", index, partitions.actors)
    out = streams.writer(Topic.SCORED, partitions=cfg.world.preprocessors)
    while not stop():
        partitions.widen()
        actor = partitions.reader
        if actor is None:
            time.sleep(IDLE_S)
            continue
        entries = actor.read(timeout=1.0, max_count=cfg.preprocess.batch_groups)
        if not entries:
            continue
        for group in scoring(entries):
            out.write(group, partition=index)
        out.flush()
        store.save({"actor": actor.position()})
        streams.trim_below(Topic.ACTOR, actor.position())
        log_scoring(actor.dead_letters, None)


def main(argv: list[str] | None = None) -> int:
    return run_pool_process("preprocessor", lambda cfg, index, stop: f"stopped at step {run(cfg, index, stop)}", argv)
