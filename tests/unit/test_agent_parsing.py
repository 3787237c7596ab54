"""The model's tool calls parsed from its text (<tool_call> JSON blocks), the transcript's token
bookkeeping (model tokens mask 1 with their logprobs and versions, environment tokens mask 0,
logprob 0, version -1) and the actor's agent metrics."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pipeline_rl.rollouts.agent.tool_calls import parse_reply
from pipeline_rl.rollouts.agent.transcript import Transcript


def test_one_call_without_text():
    reply = parse_reply('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', "c")
    assert reply.content is None and reply.malformed == 0
    assert reply.tool_calls == [
        {"id": "c0", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": 1, "b": 2})}}
    ]


def test_text_around_two_calls_stays_content():
    text = 'Let me add. <tool_call>{"name": "a", "arguments": {}}</tool_call> then <tool_call>{"name": "b"}</tool_call> done'
    reply = parse_reply(text, "x")
    assert reply.content == "Let me add.  then  done"
    assert [c["function"]["name"] for c in reply.tool_calls] == ["a", "b"]
    assert [c["id"] for c in reply.tool_calls] == ["x0", "x1"]
    assert reply.tool_calls[1]["function"]["arguments"] == "{}"


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        '<tool_call>["add"]</tool_call>',
        '<tool_call>{"name": "add", "arguments": {}}',  # never closed (cut off)
    ],
)
def test_malformed_calls_stay_in_the_content_and_are_counted(block):
    reply = parse_reply(f"answer {block}", "c")
    assert reply.tool_calls == [] and reply.malformed == 1
    assert reply.content == f"answer {block}"


def test_no_calls():
    assert parse_reply(" 85 ", "c") == parse_reply("85", "c")
    assert parse_reply("85", "c").content == "85" and parse_reply("", "c").content == ""


def completion(ids, version, finish="stop"):
    return SimpleNamespace(
        token_ids=ids, logprobs=[-0.5] * len(ids), versions=[version] * len(ids), finish_reason=finish
    )


def test_transcript_bookkeeping():
    t = Transcript([1, 2, 3])
    with pytest.raises(ValueError, match="before the first model turn"):
        t.add_environment([9])
    t.add_model_turn(completion([10, 11], version=4))
    assert t.tokens == [1, 2, 3, 10, 11]
    t.add_environment([20, 21, 22])
    t.add_model_turn(completion([30], version=5, finish="length"))
    r = t.rollout(0.5, tool_calls=1)
    assert r.prompt_ids == [1, 2, 3]
    assert r.completion_ids == [10, 11, 20, 21, 22, 30]
    assert r.mask == [1, 1, 0, 0, 0, 1]
    assert r.versions == [4, 4, -1, -1, -1, 5]
    assert r.logprobs == [-0.5, -0.5, 0.0, 0.0, 0.0, -0.5]
    assert r.finish_reason == "length" and r.reward == 0.5
    assert r.metadata == {"turns": 2, "tool_calls": 1}
    assert t.rollout(0.0, "error").finish_reason == "error"


def test_transcript_refuses_a_completion_with_misaligned_lists():
    bad = completion([1, 2], 0)
    bad.versions = [0]
    with pytest.raises(ValueError, match="2 tokens has 2 logprobs, 1 versions"):
        Transcript([1]).add_model_turn(bad)


def test_agent_stats_per_window_and_in_total():
    from pipeline_rl.rollouts.agent.stats import AgentStats

    stats = AgentStats()
    stats.add({"reward_error": "x"})  # not an agent rollout
    assert stats.take() == {}
    ok = {"turns": 3, "tool_calls": 2, "tool_errors": 0, "tool_s": 0.5, "malformed_tool_calls": 1}
    failed = {"turns": 1, "tool_calls": 1, "tool_errors": 1, "tool_s": 2.0, "malformed_tool_calls": 0}
    stats.add(ok)
    stats.add({**failed, "agent_error": "tool 'hangs' failed"})
    first = stats.take()
    assert first["agent/turns_per_rollout"] == 2.0 and first["agent/tool_calls_per_rollout"] == 1.5
    assert first["agent/tool_s_per_call"] == pytest.approx(2.5 / 3)
    assert (first["agent/tool_errors"], first["agent/errors_total"], first["agent/malformed_tool_calls_total"]) == (
        1,
        1,
        1,
    )
    assert first["agent/last_error"] == "tool 'hangs' failed"
    stats.add(ok)
    second = stats.take()
    assert second["agent/tool_calls"] == 2 and second["agent/tool_calls_total"] == 5
    assert second["agent/tool_errors"] == 0 and second["agent/tool_errors_total"] == 1
    quiet = stats.take()  # a window without agent rollouts keeps the totals, has no per-rollout means
    assert quiet["agent/tool_calls_total"] == 5 and "agent/turns_per_rollout" not in quiet
