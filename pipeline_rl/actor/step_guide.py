"""Step guidance (`step_guidance.mode: cut` or `branch`): an actor's attempts scored at each step
boundary while they are generated, and stopped at a step scored below `step_guidance.cut_below`.

Every POLL_S the guide takes a snapshot of its groups' generate calls (`LLMClient.snapshot`,
between two engine steps, without holding the engine), finds the steps each sequence has
completed since the last look (a step ends with the separator's token ids), and writes one
StepRequest per new step to partition `actor` of Topic.STEP_REQUESTS. A preprocessor scores it
(pipeline_rl/preprocess/step_service.py) and writes a StepVerdict to partition `actor` of
Topic.STEP_VERDICTS. A verdict below the threshold cuts its sequence (`LLMClient.cut`) after the
scored step's last token: the sequence returns with finish_reason "cut", and the tokens the
engine generated past that step while the verdict was on its way are thrown away and counted.
Scoring does not hold generation up: an attempt goes on until its verdict says otherwise.

Branch: a cut attempt's call also gets a new attempt, which continues the call's best-scored
prefix (the highest step score among its attempts' verdicts at or above the threshold, the
longest of equals), while the call's `step_guidance.branch_tokens` last; the new attempt's steps
within the prefix are not scored again.

A verdict for an attempt that has ended (finished, cut at an earlier step, or its group
written) is ignored and counted as late, as is one for a group of an earlier incarnation of the
actor. Evaluation is not guided: it measures the policy itself.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline_rl.actor.in_flight_keeper import GroupRun
from pipeline_rl.config import ConfigError, RunConfig, StepGuidanceMode
from pipeline_rl.engine.sequences import Completion
from pipeline_rl.scorers.process_reward import separator_ends
from pipeline_rl.streams import Streams
from pipeline_rl.streams.records import StepRequest, StepVerdict
from pipeline_rl.wire import Topic

POLL_S = 0.1
"""How often the guide looks for completed steps and verdicts: a step of a few tokens takes
several decode steps of a full engine, and each look copies every sequence's tokens so far."""


@dataclass
class Attempt:
    """One sequence of a generate call that the guide watches."""

    call: Any
    """The call's handle (engine/sequences.py CallGroup), for `LLMClient.cut`."""
    index: int
    prompt_ids: list[int]
    sent: int = 0
    """Steps requested so far."""
    ends: list[int] = field(default_factory=list)
    """Index of the last token of each step found so far."""
    scanned: int = 0
    """Tokens searched for the separator so far."""
    ended: bool = False
    part: Completion | None = None
    """The sequence as the last snapshot showed it."""
    good: list[tuple[float, int]] = field(default_factory=list)
    """(score, completion tokens to the step's end) of each step scored at or above the threshold."""


class StepGuide:
    def __init__(self, cfg: RunConfig, llm: Any, streams: Streams, actor: int, actors: int):
        guidance = cfg.step_guidance
        self.separator: list[int] = llm.tokenizer.encode(guidance.separator, add_special_tokens=False)
        if not self.separator:
            raise ConfigError(f"'step_guidance.separator' {guidance.separator!r} encodes to no token of the policy")
        self.llm, self.actor, self.cut_below = llm, actor, guidance.cut_below
        self.branch_tokens = guidance.branch_tokens if guidance.mode == StepGuidanceMode.branch else 0
        self.budgets: dict[int, int] = {}
        """Branch tokens left, per call (by id of its handle; pruned to the calls watched)."""
        self.requests = streams.writer(Topic.STEP_REQUESTS, partitions=actors)
        self.verdicts = streams.reader(Topic.STEP_VERDICTS, StepVerdict, partitions=(actor,))
        self.attempts: dict[str, Attempt] = {}
        self.next_poll = 0.0
        self.steps_sent = self.verdicts_taken = self.cuts = self.late_verdicts = 0
        self.verdict_age_s: list[float] = []
        """Request-to-verdict time of each verdict taken since the last metrics record."""

    def due(self) -> bool:
        return time.monotonic() >= self.next_poll

    async def poll(self, runs: Sequence[GroupRun]) -> None:
        """Request the steps completed since the last poll; act on the verdicts that came."""
        self.next_poll = time.monotonic() + POLL_S
        await self._request(runs)
        for entry in self.verdicts.read(timeout=0):
            self._take(entry.record)

    async def _request(self, runs: Sequence[GroupRun]) -> None:
        calls = [(run, k, h) for run in runs for k, h in enumerate(run.generator.handles)]
        parts = await self.llm.snapshot([h for *_, h in calls]) if calls else []
        watched: dict[str, Attempt] = {}
        for (run, k, handle), sequences in zip(calls, parts):
            prompt_ids = run.generator.prompts[k][0]
            for i, part in enumerate(sequences):
                key = f"{run.group_id}/{k}/{i}"
                if part is None:
                    continue
                attempt = self.attempts.get(key)
                if attempt is None:  # a branch's steps within its prefix were scored in its parent
                    attempt = Attempt(handle, i, prompt_ids)
                    attempt.sent = len(self._scan(attempt, part.token_ids[: part.shared]))
                watched[key] = attempt
                attempt.part = part
                if attempt.ended:
                    continue
                if part.finish_reason:
                    attempt.ended = True
                    continue
                ends = self._scan(attempt, part.token_ids)
                for step in range(attempt.sent, len(ends)):
                    ids = part.token_ids[: ends[step] + 1]
                    self.requests.write(StepRequest(key, self.actor, step, prompt_ids, ids, time.time()), self.actor)
                self.steps_sent += len(ends) - attempt.sent
                attempt.sent = len(ends)
        # The attempts of groups that have been written are no longer watched: their verdicts are late.
        self.attempts = watched
        live = {id(h) for *_, h in calls}
        self.budgets = {call: left for call, left in self.budgets.items() if call in live}

    def _scan(self, attempt: Attempt, ids: list[int]) -> list[int]:
        """The attempt's step ends in `ids`, searching only what earlier looks had not."""
        n = len(self.separator)
        start = max(attempt.ends[-1] + 1 if attempt.ends else 0, attempt.scanned - n + 1)
        attempt.ends += [start + e for e in separator_ends(ids[start:], self.separator)]
        attempt.scanned = len(ids)
        return attempt.ends

    def _take(self, verdict: StepVerdict) -> None:
        attempt = self.attempts.get(verdict.key)
        if attempt is None or attempt.ended:
            self.late_verdicts += 1
            return
        self.verdicts_taken += 1
        self.verdict_age_s.append(time.time() - verdict.sent_at)
        if verdict.score >= self.cut_below:
            attempt.good.append((verdict.score, verdict.end))
            return
        self.llm.cut(
            attempt.call, attempt.index, verdict.end, self._refill(attempt.call) if self.branch_tokens else None
        )
        attempt.ended = True
        self.cuts += 1

    def _refill(self, call: Any) -> Completion | None:
        """The call's best-scored prefix, when a branch from it fits in the call's budget."""
        scored = [(score, end, a) for a in self.attempts.values() if a.call is call for score, end in a.good]
        if not scored:
            return None
        _, end, source = max(scored, key=lambda s: (s[0], s[1]))
        left = self.budgets.setdefault(id(call), self.branch_tokens)
        cost = call.max_tokens - end
        part = source.part
        if cost > left or part is None or len(part.token_ids) < end:
            return None
        self.budgets[id(call)] = left - cost
        return Completion(part.token_ids[:end], part.logprobs[:end], part.versions[:end], "", "")

    def values(self) -> dict[str, float]:
        """Totals, and the mean verdict age since the last call."""
        ages, self.verdict_age_s = self.verdict_age_s, []
        values: dict[str, float] = {
            "step_guidance/steps_sent_total": self.steps_sent,
            "step_guidance/verdicts_total": self.verdicts_taken,
            "step_guidance/cuts_total": self.cuts,
            "step_guidance/branches_total": self.llm.branches,
            "step_guidance/late_verdicts_total": self.late_verdicts,
            "step_guidance/cuts_missed_total": self.llm.cuts_missed,
            "step_guidance/tokens_cut_total": self.llm.tokens_cut,
        }
        if ages:
            values["step_guidance/verdict_age_s"] = sum(ages) / len(ages)
        return values
