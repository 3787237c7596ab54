"""Rollouts in flight kept across a stop (actor/in_flight.py), without an engine: a continued
completion trains as the uninterrupted one would, its saved form round-trips, bad files are
named, of two actors claiming a hand-over one gets it, and the actor's keeper saves as often as
actor.in_flight_save_s says and continues what did not land."""

from __future__ import annotations

import time

import orjson
import pytest

from pipeline_rl.actor.in_flight import InFlight, SavedCall, SavedGroup, claim_handovers
from pipeline_rl.actor.in_flight_keeper import InFlightKeeper
from pipeline_rl.config import LagGateMode
from pipeline_rl.engine.sequences import Completion, SequenceRequest
from pipeline_rl.preprocess.packing import pack_step, rollout_sequence
from pipeline_rl.rollouts.domains import make_rollout
from pipeline_rl.trainer.lag_gate import apply_lag_gate

PROMPT = [5, 6, 7]
TOKENS = [11, 12, 13, 14, 15, 16]
LOGPROBS = [-0.5, -1.0, -0.25, -2.0, -0.125, -0.75]
SEQ_LENGTH = 64


def uninterrupted() -> Completion:
    """Six tokens generated in one go, weights swapped from version 3 to 5 after the third
    (the engine's segments: version 3 from token 0, version 5 from token 3)."""
    request = SequenceRequest(group=None, index=0, segments=[(0, 3), (3, 5)])  # pyright: ignore[reportArgumentType]
    return request.completion(TOKENS, LOGPROBS, "stop", "")


def continued() -> Completion:
    """The same tokens, stopped after the third (saved at version 3) and continued by an engine
    at version 5: the saved part is re-entered after the prompt, the rest is generated now."""
    saved = Completion(TOKENS[:3], LOGPROBS[:3], [3, 3, 3], "", "")
    request = SequenceRequest(group=None, index=0, segments=[(0, 5)], prefix=saved)  # pyright: ignore[reportArgumentType]
    return request.completion(TOKENS[3:], LOGPROBS[3:], "stop", "")


def micro_batch(completion: Completion):
    rollout = make_rollout(PROMPT, completion, reward=1.0)
    seq = rollout_sequence(rollout, [0.5] * len(TOKENS), "g", SEQ_LENGTH)
    ((mb,),) = pack_step([seq], step=6, ranks=1, seq_length=SEQ_LENGTH)
    return mb


def test_a_rollout_continued_across_two_versions_trains_as_the_uninterrupted_one():
    a, b = micro_batch(uninterrupted()), micro_batch(continued())
    assert b.versions == a.versions == [-1] * 3 + [3, 3, 3, 5, 5, 5]
    assert b.old_logprobs == a.old_logprobs == [0.0] * 3 + LOGPROBS
    assert b.loss_mask == a.loss_mask and b.input_ids == a.input_ids and b.advantages == a.advantages
    assert b.sample_versions == a.sample_versions == [3]  # its oldest token
    for max_lag in (2, 3):
        for mode in LagGateMode:
            ga, gb = apply_lag_gate(a, 6, max_lag, mode), apply_lag_gate(b, 6, max_lag, mode)
            assert (gb.loss_mask, gb.lags, gb.dropped_samples, gb.masked_tokens) == (
                ga.loss_mask,
                ga.lags,
                ga.dropped_samples,
                ga.masked_tokens,
            )
    # At version 6 its oldest token (3) is 3 versions old: kept with max_lag 3, dropped with 2.
    assert apply_lag_gate(b, 6, 3).dropped_samples == 0
    dropped = apply_lag_gate(b, 6, 2)
    assert dropped.dropped_samples == 1 and dropped.loss_mask == [0] * 9 and dropped.dropped_lags == [3]
    # Token mode keeps its fresh tail (version 5) and masks the three stale tokens.
    token = apply_lag_gate(b, 6, 2, LagGateMode.token)
    assert token.dropped_samples == 0 and token.masked_tokens == 3 and token.loss_mask == [0] * 6 + [1] * 3


def group(gid: str, tokens: int) -> SavedGroup:
    parts = [
        Completion(list(range(tokens)), [-0.5] * tokens, [2] * tokens, "", ""),
        Completion([1, 2], [-0.1, -0.2], [1, 2], "stop", "12"),
        None,
    ]
    return SavedGroup(gid, {"id": gid, "prompt": "Q: 1+1=", "answer": "2"}, [SavedCall([9, 8], 3, parts)])


def test_saved_groups_round_trip_and_count_their_tokens(tmp_path):
    path = tmp_path / "in_flight" / "actor0.json"
    saved = InFlight([group("a", 4), group("b", 0)], stream_end="17")
    saved.save(path)
    loaded = InFlight.load(path)
    assert loaded == saved
    assert [g.tokens for g in loaded.groups] == [4 + 2, 0 + 2]
    assert InFlight.load(tmp_path / "missing.json") is None


def test_a_bad_in_flight_file_is_named_with_the_group_and_sequence(tmp_path):
    path = tmp_path / "actor0.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"actor0\.json is not valid JSON"):
        InFlight.load(path)
    saved = group("a", 3).to_dict()
    saved["calls"][0]["parts"][0]["versions"] = [2, 2]  # one version short
    path.write_bytes(orjson.dumps({"stream_end": None, "groups": [group("z", 1).to_dict(), saved]}))
    with pytest.raises(ValueError, match=r"group 1, call 0, sequence 0: 3 tokens, 3 logprobs and 2 versions"):
        InFlight.load(path)


def test_of_two_actors_claiming_a_hand_over_one_gets_it_and_a_killed_claimant_takes_it_again(tmp_path):
    InFlight([group("a", 2), group("b", 3)]).save(tmp_path / "handover-actor2-x.json")
    InFlight([group("c", 1)]).save(tmp_path / "handover-actor3-y.json")
    InFlight([group("mine", 1)]).save(tmp_path / "actor0.json")  # an actor's own file is never claimed
    got0, files0 = claim_handovers(tmp_path, "actor0")
    got1, files1 = claim_handovers(tmp_path, "actor1")
    assert sorted(g.group_id for g in got0) == ["a", "b", "c"] and got1 == [] and files1 == []
    # actor0 killed before removing what it claimed: its next start takes them again.
    again, files = claim_handovers(tmp_path, "actor0")
    assert sorted(g.group_id for g in again) == ["a", "b", "c"] and files == files0
    for f in files:
        f.unlink()
    assert claim_handovers(tmp_path, "actor0") == ([], [])


def test_the_keeper_saves_every_in_flight_save_s_and_never_with_0(tmp_path):
    """actor.in_flight_save_s: the actor's loop saves when `due()`, which is never with 0 (only
    at graceful stops) and never for a domain that is not continuable."""
    llm = None  # due() and saved() never touch the engine
    every = InFlightKeeper(tmp_path, "actor0", llm, continuable=True, save_every_s=0.2)
    never = InFlightKeeper(tmp_path, "actor1", llm, continuable=True, save_every_s=0.0)
    not_continuable = InFlightKeeper(tmp_path, "actor2", llm, continuable=False, save_every_s=0.2)
    assert not every.due()  # 0.2 s after it was made (it starts as saved: the continued groups are on file)
    time.sleep(0.25)
    assert every.due() and not never.due() and not not_continuable.due()
    every.saved_at = time.monotonic()  # what a save does
    assert not every.due()


def test_a_restarted_actor_continues_the_saved_groups_that_did_not_land_after_the_save(tmp_path):
    groups = [SavedGroup(f"g{i}", {"q": i}, [SavedCall(PROMPT, 1, [None])]) for i in range(3)]
    keeper = InFlightKeeper(tmp_path, "actor0", None, continuable=True, save_every_s=10)
    keeper.path.parent.mkdir()
    InFlight(groups, "41").save(keeper.path)
    asked: list[str | None] = []

    def landed_since(end: str | None) -> list[str]:
        asked.append(end)
        return ["g1"]

    def kept(end: str | None) -> bool:
        return False

    assert [g.group_id for g in keeper.saved(landed_since, kept)] == ["g0", "g2"] and asked == ["41"]
    # A domain that is not continuable continues none (they are counted lost by resume's arithmetic).
    assert InFlightKeeper(tmp_path, "actor0", None, continuable=False, save_every_s=10).saved(landed_since, kept) == []


def test_no_saved_group_is_continued_where_groups_that_landed_after_the_save_may_be_gone(tmp_path):
    """g1 is seen to have landed; g0 and g2 are not, but the partition dropped entries after the
    save (consumed and trimmed): either may have landed, so neither is continued."""
    groups = [SavedGroup(f"g{i}", {"q": i}, [SavedCall(PROMPT, 1, [None])]) for i in range(3)]
    keeper = InFlightKeeper(tmp_path, "actor0", None, continuable=True, save_every_s=10)
    keeper.path.parent.mkdir()
    InFlight(groups, "41").save(keeper.path)
    asked: list[str | None] = []

    def trimmed(end: str | None) -> bool:
        asked.append(end)
        return True

    assert keeper.saved(lambda end: ["g1"], trimmed) == [] and asked == ["41"]
    # Every saved group seen to have landed: nothing to continue, whatever was trimmed.
    assert keeper.saved(lambda end: ["g0", "g1", "g2"], trimmed) == []
    assert asked == ["41"]
