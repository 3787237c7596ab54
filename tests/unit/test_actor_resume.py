"""An actor's resume arithmetic (actor/resume.py) on hand-made position files."""

from __future__ import annotations

import itertools

import pytest

from pipeline_rl.actor.resume import ResumedCounts, SavedCounts, resume


def test_a_first_start_begins_at_zero_or_at_the_published_step():
    first = SavedCounts.from_file(None)
    assert not first.was_saved
    assert resume(first, first_group=0, unsaved=0) == ResumedCounts(0, 0, 0, 0, 0)
    # An actor added to a running job at version 5 with a share of 4 groups a step starts at
    # group 20; the 20 groups it skipped go into the offset, not into what it wrote.
    assert resume(first, first_group=20, unsaved=0) == ResumedCounts(
        written=0, admission_started=20, admission_offset=20, drawn=0, lost_stopped=0
    )


def test_a_killed_actor_counts_what_landed_after_its_save_and_frees_what_did_not():
    saved = SavedCounts(written=10, stream_end="0-10", problems=12, lost=2, lost_stopped=1, in_flight=3, actors=1)
    # Two of the three groups in flight landed after the save; the third never will.
    assert resume(saved, first_group=4, unsaved=2) == ResumedCounts(
        written=12, admission_started=10, admission_offset=0, drawn=12, lost_stopped=2
    )
    # Four landed: one in flight at the save did not, and three were started (and drawn) after it.
    # The count goes on from the saved one (8), the checkpoint's first group (4) being behind it.
    assert resume(saved, first_group=4, unsaved=4) == ResumedCounts(
        written=14, admission_started=12, admission_offset=0, drawn=13, lost_stopped=1
    )


def test_a_checkpoint_ahead_of_the_counts_moves_admission_on_through_the_offset():
    saved = SavedCounts(written=6, problems=6, lost=1, actors=2, admission_offset=-1)
    got = resume(saved, first_group=10, unsaved=0)
    assert got.admission_started == 10 and got.admission_offset == -1 + (10 - 4) and got.written == 6


@pytest.mark.parametrize(
    "written, lost, offset, in_flight, first_group, unsaved",
    list(itertools.product([0, 7], [0, 3], [-2, 0, 5], [0, 2], [0, 6, 30], [0, 1, 4])),
)
def test_admission_less_its_offset_is_what_landed_less_what_was_lost(
    written, lost, offset, in_flight, first_group, unsaved
):
    """The invariant admission.py relies on, whatever the saved counts: groups started less the
    rebases equal the groups written less those whose slots came back."""
    saved = SavedCounts(written=written, lost=lost, admission_offset=offset, in_flight=in_flight, actors=1)
    got = resume(saved, first_group, unsaved)
    assert got.admission_started - got.admission_offset == got.written - lost
    assert got.admission_started >= first_group
    landed_of_in_flight = min(unsaved, in_flight)
    assert got.lost_stopped + landed_of_in_flight == in_flight  # each one in flight landed or was freed
    assert got.drawn - saved.problems == unsaved - landed_of_in_flight  # the rest were drawn after the save


@pytest.mark.parametrize("unsaved, continued", [(0, 0), (0, 3), (1, 2), (3, 0)])
def test_continued_groups_are_started_again_not_lost(unsaved, continued):
    """Of three groups in flight at the save, `unsaved` landed after it and `continued` are
    started again from the in-flight file: only the rest are lost; admission counts the
    continued ones as started (they will land), on top of what was written less what was lost."""
    saved = SavedCounts(written=10, problems=13, lost=2, lost_stopped=1, in_flight=3, actors=1)
    got = resume(saved, first_group=0, unsaved=unsaved, continued=continued)
    assert got.lost_stopped == 1 + 3 - unsaved - continued
    assert got.admission_started - got.admission_offset == got.written - saved.lost + continued
    assert got.drawn == 13  # continued groups keep their problems; nothing new was drawn


def test_the_position_file_round_trips_and_unknown_keys_are_refused():
    saved = SavedCounts(written=3, stream_end="1-2", problems=4, lost=1, lost_position={"0": "5"}, actors=2)
    assert SavedCounts.from_file(saved.to_file()) == saved
    with pytest.raises(ValueError, match=r"runs/x/positions/actor0.json: unknown keys \['writen'\]"):
        SavedCounts.from_file({"writen": 3}, "runs/x/positions/actor0.json")
