"""What an actor keeps between its starts (its position file) and the counts it resumes with.

An actor's counts must agree with three other records: the groups in its stream partition (what
landed), the lost stream (groups a preprocessor could not use, whose admission slots came back)
and admission's predicted landing step (actor/admission.py). `SavedCounts` is the position file
as a typed value; `resume` makes the counts a restarted actor goes on from:

- `written` counts groups that landed: the saved count, plus the groups that reached the stream
  after the last save (`unsaved`, read from the partition: up to one save interval of them when
  the actor was killed).
- admission's `started` is what admission has spent: written, less the slots lost groups gave
  back, plus the `offset` of rebases; never below `first_group`, the first group of the step the
  engine's weights start from (a resumed trainer's checkpoint, or the published version for an
  actor added to a running job); the groups skipped to get there go into the offset, not into
  `written`.
- `drawn` (problems taken from the order) goes on after the groups started after the save.
- groups in flight at the last save that did not land are `lost_stopped` (their slots are
  free), except the `continued` ones (actor/in_flight.py), which are started again: admission
  counts them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class SavedCounts:
    """An actor's position file: its counts when it last saved."""

    written: int = 0
    """Groups written to its partition, as of the save."""
    stream_end: str | None = None
    """The partition's end as of the save (None: before the first group landed)."""
    problems: int = 0
    """Problems drawn from its order."""
    lost: int = 0
    """Its groups reported lost by the preprocessors, as of `lost_position`."""
    lost_position: Any = None
    """Its reader's position in the lost stream."""
    lost_stopped: int = 0
    """Groups in flight at earlier stops that never landed."""
    in_flight: int = 0
    """Groups in flight at the save."""
    actors: int | None = None
    """The job's actor count its problem order was made at (None: no save yet)."""
    present: int | None = None
    """The actors present that admission's share was made at (None: all of `actors`)."""
    admission_offset: int = 0
    """What admission's rebases added to its count."""

    @classmethod
    def from_file(cls, saved: dict | None, path: object = "the position file") -> SavedCounts:
        """From the position file's dict (None or {}: the first start); `path` names it in errors."""
        saved = saved or {}
        unknown = set(saved) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{path}: unknown keys {sorted(unknown)} in an actor's position file")
        return cls(**saved)

    def to_file(self) -> dict:
        return asdict(self)

    @property
    def was_saved(self) -> bool:
        """Whether any save happened: then `stream_end` says where the groups after it begin."""
        return self.actors is not None


@dataclass(frozen=True)
class ResumedCounts:
    """The counts an actor starts from."""

    written: int
    admission_started: int
    admission_offset: int
    drawn: int
    lost_stopped: int


def resume(saved: SavedCounts, first_group: int, unsaved: int, continued: int = 0) -> ResumedCounts:
    """The counts after `saved`, with `unsaved` groups found in the partition after its save,
    `first_group` the first group admission may start and `continued` saved groups in flight
    started again (module docstring)."""
    counted = saved.written - saved.lost + saved.admission_offset
    return ResumedCounts(
        written=saved.written + unsaved,
        admission_started=max(counted, first_group) + unsaved + continued,
        admission_offset=saved.admission_offset + max(0, first_group - counted),
        drawn=saved.problems + max(0, unsaved - saved.in_flight),
        lost_stopped=saved.lost_stopped + max(0, saved.in_flight - unsaved - continued),
    )
