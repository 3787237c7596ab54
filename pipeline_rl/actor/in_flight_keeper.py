"""What an actor does with its groups in flight across stops: it saves them, continues the saved
ones that did not land, and hands them over when it leaves a scaled-down job. The records, the
hand-over files and how a continued rollout replays its calls: actor/in_flight.py.

A group is in one file at a time: an actor that claims a hand-over file saves the groups in its
own file before it removes the claimed one, and a leaving actor empties its own file before it
writes the hand-over file.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline_rl.actor.in_flight import HANDOVER_PREFIX, InFlight, RecordingGenerator, SavedGroup, claim_handovers

log = logging.getLogger("pipeline_rl.actor.in_flight_keeper")


@dataclass
class GroupRun:
    """A group in flight: its id (unique over the run, kept when it is continued elsewhere), its
    problem and what its rollout samples through."""

    group_id: str
    problem: dict
    generator: RecordingGenerator


class InFlightKeeper:
    def __init__(self, run_dir: Path, name: str, llm: Any, continuable: bool, save_every_s: float):
        self.dir = run_dir / "in_flight"
        self.path = self.dir / f"{name}.json"
        """This actor's own file: its groups in flight at its last save."""
        self.name, self.llm, self.continuable, self.save_every_s = name, llm, continuable, save_every_s
        self.saved_at = time.monotonic()
        self.continued_total = self.handed_over_total = 0
        self.tokens_continued_total = 0
        """Generated tokens that continued groups did not have to generate again."""

    def saved(
        self, landed_since: Callable[[str | None], list[str]], trimmed_after: Callable[[str | None], bool]
    ) -> list[SavedGroup]:
        """The groups of this actor's last save that did not land after it (`landed_since`: the
        ids of the groups in this actor's partition after a stream end). Where groups that landed
        after the save may be gone from the partition (`trimmed_after`: consumed and trimmed),
        none is continued: one that landed would be trained twice; they are counted lost."""
        saved = InFlight.load(self.path)
        if saved is None or not saved.groups:
            return []
        if not self.continuable:
            log.warning(
                "%d saved groups in flight not continued: the domain's rollouts are not continuable", len(saved.groups)
            )
            return []
        landed = set(landed_since(saved.stream_end))
        groups = [g for g in saved.groups if g.group_id not in landed]
        if groups and trimmed_after(saved.stream_end):
            log.warning(
                "%d saved groups in flight not continued: groups that landed after the save were consumed and "
                "trimmed from the stream, so which of these landed cannot be told",
                len(groups),
            )
            return []
        log.info(
            "continuing %d groups in flight at the last stop (%d tokens)", len(groups), sum(g.tokens for g in groups)
        )
        return groups

    def runs(self, groups: Sequence[SavedGroup]) -> list[GroupRun]:
        """Saved `groups` to run again, each replaying its saved calls."""
        for saved in groups:
            self.continued_total += 1
            self.tokens_continued_total += saved.tokens
        return [GroupRun(g.group_id, g.problem, RecordingGenerator(self.llm, g.calls)) for g in groups]

    def due(self) -> bool:
        """Whether the periodic save (`actor.in_flight_save_s`; 0: none) is due."""
        return self.continuable and time.monotonic() - self.saved_at >= self.save_every_s > 0

    def claim(self, running: set[str]) -> tuple[list[SavedGroup], list[Path]]:
        """The groups of the hand-over files this actor claims but for those in `running` (a
        claimant killed before removing a file had continued them), and the files, to remove
        once this actor's own file holds the groups."""
        groups, files = claim_handovers(self.dir, self.name)
        groups = [g for g in groups if g.group_id not in running]
        if groups:
            log.info("continuing %d groups handed over by a leaving actor", len(groups))
        return groups, files

    async def save(self, runs: Sequence[GroupRun], hold: bool, flushed_end: Callable[[], str | None]) -> None:
        """Save `runs` as far as they have got; `flushed_end`: the partition's end once every
        group written before the snapshot is in the stream."""
        groups = await self._snapshot(runs, hold)
        end = flushed_end()
        # Off the event loop: a large model's groups in flight are tens of MB to write.
        await asyncio.to_thread(InFlight(groups, end).save, self.path)
        self.saved_at = time.monotonic()

    async def hand_over(self, runs: Sequence[GroupRun], incarnation: str) -> int:
        """Save `runs` (the engine held: it generates no more here) for the actors that stay;
        returns how many groups it handed over."""
        groups = await self._snapshot(runs, hold=True)
        # A kill between these two writes loses the groups (counted by the next actor here).
        InFlight([], None).save(self.path)
        InFlight(groups).save(self.dir / f"{HANDOVER_PREFIX}{self.name}-{incarnation}.json")
        self.handed_over_total += len(groups)
        log.info("handed %d groups in flight over to the actors that stay", len(groups))
        return len(groups)

    async def _snapshot(self, runs: Sequence[GroupRun], hold: bool) -> list[SavedGroup]:
        """Every run as far as it has got (one engine snapshot, between two steps)."""
        parts = await self.llm.snapshot([h for r in runs for h in r.generator.handles], hold)
        groups, i = [], 0
        for run in runs:
            k = len(run.generator.handles)
            groups.append(SavedGroup(run.group_id, run.problem, run.generator.calls(parts[i : i + k])))
            i += k
        return groups
