"""Step guidance end to end on the tiny model: the actor process asks, the preprocessor process
scores on its thread (a step scorer that calls every first step wrong, and no other), and the
actor cuts: cut rollouts land ending with the separator, and every verdict the preprocessor wrote
reached the actor, taken or counted late."""

from __future__ import annotations

import os

import pytest
from fixtures.helpers import ROOT, TESTS
from fixtures.launches import launch, stream_records

from pipeline_rl.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.deepspeed]

SEPARATOR = "1"
GUIDED = [
    # Completions of 48 tokens (EOS ignored) live for dozens of engine steps: time for verdicts.
    "actor.domain=fixtures.long_domain:rollout",
    "actor.max_new_tokens=48",
    "step_guidance.mode=cut",
    f"step_guidance.separator='{SEPARATOR}'",
    "step_guidance.scorer.cls=fixtures.step_scorers:WrongFromStep",
    # Only the first step is wrong: a preprocessor behind the actor passes a request over for
    # newer ones (step_service.py), and a later step's verdict then cuts nothing.
    "step_guidance.scorer.kwargs.bad=0",
    "step_guidance.scorer.kwargs.until=0",
]
ENV = {"PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}


def test_a_guided_run_cuts_attempts_at_the_step_its_preprocessor_scored_wrong(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    separator = AutoTokenizer.from_pretrained(tiny_model).encode(SEPARATOR, add_special_tokens=False)
    run_dir = tmp_path / "run"
    code, out = launch(run_dir, *GUIDED, "shared.max_steps=4", "trainer.checkpoint_every=0", env=ENV)
    assert code == 0, out[-4000:]
    rollouts = [r for g in stream_records(run_dir, "actor") for r in g["rollouts"]]
    cut = [r for r in rollouts if r["finish_reason"] == "cut"]
    assert cut, f"no rollout was cut: {sorted({r['finish_reason'] for r in rollouts})}"
    for r in cut:
        ids = r["completion_ids"]
        # Cut right after its first step, which the scorer called wrong.
        assert ids[-len(separator) :] == separator and ids[: -len(separator)].count(separator[0]) == 0
        assert len(r["logprobs"]) == len(r["versions"]) == len(ids) and min(r["versions"]) >= 0
    latest: dict[str, dict] = {}
    for record in read_metrics(run_dir):
        latest.setdefault(record["process"], {}).update(record["values"])
    actor, preprocessor = latest["actor0"], latest["preprocessor0"]
    assert actor["step_guidance/cuts_total"] >= len(cut)
    assert preprocessor["step_guidance/scorer_s_total"] > 0
    # Every request the actor counted is in the stream, every verdict it took or counted late was
    # written (the rest were on their way at the stop), and none came without a request.
    requests, verdicts = stream_records(run_dir, "step_requests"), stream_records(run_dir, "step_verdicts")
    assert len(requests) == actor["step_guidance/steps_sent_total"]
    taken = actor["step_guidance/verdicts_total"] + actor["step_guidance/late_verdicts_total"]
    assert 0 < taken <= len(verdicts) <= len(requests)
    assert preprocessor["step_guidance/steps_scored_total"] <= len(verdicts)
    assert {v["key"] for v in verdicts} <= {r["key"] for r in requests}
