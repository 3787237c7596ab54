"""Step guidance's scoring side (the actor's side: pipeline_rl/actor/step_guide.py): a
preprocessor scores the steps that its actors' attempts complete while they are generated.

Preprocessor i of n serves the actors whose groups it reads (partitions_for(i, n, actors) of
Topic.STEP_REQUESTS), on a thread of its own beside its scoring of finished groups: it reads the
requests waiting, scores the newest BATCH of them with the step scorer (`step_guidance.scorer`,
pipeline_rl/scorers/step_scorer.py) and writes each verdict to its actor's partition of
Topic.STEP_VERDICTS at once (an actor cuts an attempt only as soon as its verdict comes).

A request older than STALE_S when it is read (a restarted preprocessor reading what its
predecessor left), or passed over for newer ones, is not scored, and is counted: a scorer slower
than the actors' steps then spends itself on the newest requests, whose verdicts can still cut,
instead of on a backlog whose verdicts all come after their attempts have ended.
A scorer that raises stops the service; the preprocessor's loop then raises its error
(`check`), so the run stops naming it instead of going on unguided.
"""

from __future__ import annotations

import logging
import threading
import time

from pipeline_rl.config import RunConfig
from pipeline_rl.scorers.step_scorer import load_step_scorer
from pipeline_rl.streams import Streams, partitions_for
from pipeline_rl.streams.records import StepRequest, StepVerdict
from pipeline_rl.wire import Topic

log = logging.getLogger("pipeline_rl.preprocess.step_service")

BATCH = 64
"""Most requests scored together: the newest of those waiting (a verdict's delay is about one
batch's scoring)."""
BACKLOG = 16 * BATCH
"""Most requests read at a time: all that wait, in practice, so that the newest are scored."""
STALE_S = 5.0
"""A request older than this is skipped (counted)."""
READ_S = 0.2
"""Longest wait for requests before the thread looks at its stop flag again."""


class StepService:
    def __init__(self, cfg: RunConfig, streams: Streams, index: int, actors: int):
        self.scorer = load_step_scorer(cfg)
        self.partitions = partitions_for(index, cfg.world.preprocessors, actors)
        self.requests = (
            streams.reader(Topic.STEP_REQUESTS, StepRequest, partitions=self.partitions) if self.partitions else None
        )
        self.verdicts = streams.writer(Topic.STEP_VERDICTS, partitions=actors)
        self.scored = self.stale = 0
        self.scorer_s = self.age_s = 0.0
        """Totals: seconds in the scorer, and requests' ages when scored (their sum)."""
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="step-service", daemon=True)

    def start(self) -> StepService:
        if self.requests is not None:
            self._thread.start()
        return self

    def serve(self, requests: list[StepRequest]) -> list[StepVerdict]:
        """Score the newest BATCH of `requests` and write their verdicts; the stale ones and
        those passed over for newer ones are skipped (counted)."""
        now = time.time()
        fresh = sorted((r for r in requests if now - r.sent_at <= STALE_S), key=lambda r: r.sent_at)[-BATCH:]
        self.stale += len(requests) - len(fresh)
        if not fresh:
            return []
        start = time.perf_counter()
        scores = self.scorer.score_steps(fresh)
        self.scorer_s += time.perf_counter() - start
        if len(scores) != len(fresh):
            raise RuntimeError(f"the step scorer returned {len(scores)} scores for {len(fresh)} requests")
        verdicts = []
        for request, score in zip(fresh, scores):
            verdict = StepVerdict(request.key, request.step, len(request.completion_ids), float(score), request.sent_at)
            self.verdicts.write(verdict, partition=request.actor)
            verdicts.append(verdict)
            self.age_s += now - request.sent_at
        self.verdicts.flush()
        self.scored += len(fresh)
        return verdicts

    def _serve(self) -> None:
        assert self.requests is not None
        try:
            while not self._stop.is_set():
                entries = self.requests.read(timeout=READ_S, max_count=BACKLOG)
                if entries:
                    self.serve([e.record for e in entries])
        except BaseException as e:
            log.exception("the step scorer failed")
            self.error = e

    def check(self) -> None:
        """Raise the service's failure in the calling thread."""
        if self.error is not None:
            raise RuntimeError(f"step guidance's scorer {type(self.scorer).__name__} failed: {self.error!r}")

    def values(self) -> dict[str, float]:
        return {
            "step_guidance/steps_scored_total": self.scored,
            "step_guidance/stale_requests_total": self.stale,
            "step_guidance/scorer_s_total": self.scorer_s,
            "step_guidance/request_age_s": self.age_s / max(1, self.scored),
        }

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=READ_S * 10)
        self.scorer.close()
