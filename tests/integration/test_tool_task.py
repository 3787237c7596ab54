"""The tool-use demo (`conf=tiny_tools`, pipeline_rl/demo/tool_task.py): an episode run by the
agent domain with the shipped config and its real tool workers is, token for token, the
conversation tools_policy was fine-tuned on (pipeline_rl/demo/tools_policy.py), with the loss
on exactly the model's turns; and the reward is the final number's. The same holds with `add`
served by a real MCP server process (actor.domain_settings.mcp_servers), whose failing and hanging tools
end the episode with a recorded error. The model's turns are scripted (the engine's part is
test_agent.py's), so the demo's contract holds whatever the built policy happens to sample."""

from __future__ import annotations

import json
import sys

import pytest
from fixtures.agent_checks import ScriptedEngine, run_groups
from fixtures.helpers import TESTS

from pipeline_rl.config import load_config
from pipeline_rl.demo import multistep, tiny_model
from pipeline_rl.demo.tool_task import TEMPLATE, call_text
from pipeline_rl.demo.tools_policy import transcript
from pipeline_rl.rollouts.agent.template import ChatTemplate

EOS = tiny_model.EOS_TOKEN
MCP_SERVER = [
    f"actor.domain_settings.mcp_servers=[{{command: {sys.executable}, args: [{TESTS / 'fixtures' / 'mcp_tools_server.py'}]}}]"
]


@pytest.fixture(scope="module")
def tokenizer():
    tok = tiny_model.make_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def problems():
    return multistep.make_problems(0)[1][:4]


def config(*overrides: str):
    return load_config("tiny_tools", ["actor.attempts=1", *overrides])


def tool_turns(problem: dict, last: str | None = None) -> list[tuple[str, str]]:
    a, b, c = multistep.operands(problem)
    return [(call_text(a, b), "stop"), (call_text(a + b, c), "stop"), (last or problem["answer"], "stop")]


def episode(tokenizer, cfg, problem: dict, turns: list[tuple[str, str]]):
    engine = ScriptedEngine(tokenizer, turns, max_model_len=cfg.actor.llm.max_model_len, end=EOS)
    (group,), _ = run_groups(engine, cfg, [problem])
    assert not engine.replies, "the episode ended before the scripted turns did"
    return group.rollouts[0]


def mcp_call(name: str, arguments: dict) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


@pytest.mark.parametrize(
    "with_tool,overrides",
    [(True, []), (False, []), (True, ["actor.domain_settings.tools=[]", *MCP_SERVER])],
    ids=["tool", "worked", "mcp-tool"],
)
def test_an_episode_is_the_conversation_the_policy_was_trained_on(tokenizer, problems, with_tool, overrides):
    cfg = config(*overrides)
    template = ChatTemplate(tokenizer, None, None)
    for problem in problems:
        turns = tool_turns(problem) if with_tool else [(problem["solution"], "stop")]
        r = episode(tokenizer, cfg, problem, turns)
        ids, trained = transcript(template, tokenizer.eos_token_id, problem, with_tool)
        assert r.prompt_ids + r.completion_ids == ids
        assert [0] * len(r.prompt_ids) + (r.mask or []) == trained
        assert r.reward == 1.0 and r.metadata["tool_calls"] == (2 if with_tool else 0)
        assert r.metadata["turns"] == len(turns) and r.metadata["tool_errors"] == 0
        assert len(ids) <= cfg.actor.llm.max_model_len
        assert all(len(tokenizer.encode(text)) + 1 <= cfg.actor.max_new_tokens for text, _ in turns)


def test_the_reward_is_the_final_numbers(tokenizer, problems):
    cfg = config()
    problem = problems[0]
    wrong = str(int(problem["answer"]) + 1)
    worked_wrong = problem["solution"].rpartition("=")[0] + "=" + wrong
    assert episode(tokenizer, cfg, problem, tool_turns(problem, last=wrong)).reward == 0.0
    assert episode(tokenizer, cfg, problem, [(worked_wrong, "stop")]).reward == 0.0
    # Cut off at the token limit: not an answer, even when the text so far is the number.
    assert episode(tokenizer, cfg, problem, [(problem["answer"], "length")]).reward == 0.0


def test_without_the_tool_a_call_ends_the_episode_with_the_error_reward(tokenizer, problems):
    cfg = config("actor.domain_settings.tools=[]", "actor.domain_settings.error_reward=-0.5")
    r = episode(tokenizer, cfg, problems[0], tool_turns(problems[0])[:1])
    assert r.reward == -0.5 and r.metadata["tool_calls"] == r.metadata["tool_errors"] == 1
    assert "actor.domain_settings.tools and mcp_servers are empty" in r.metadata["agent_error"]


def test_too_many_calls_end_the_episode(tokenizer, problems):
    problem = problems[0]
    a, b, _ = multistep.operands(problem)
    cfg = config("actor.domain_settings.max_turns=2")
    r = episode(tokenizer, cfg, problem, [(call_text(a, b), "stop")] * 2)
    assert r.reward == 0.0 and "max_turns=2" in r.metadata["agent_error"]


def test_failing_and_hanging_mcp_tools_end_the_episode_with_a_recorded_error(tokenizer, problems):
    cfg = config("actor.domain_settings.tools=[]", "actor.domain_settings.tool_timeout_s=2", *MCP_SERVER)
    problem = problems[0]
    failed = episode(tokenizer, cfg, problem, [(mcp_call("fails", {"a": 1}), "stop")])
    assert failed.reward == 0.0 and failed.metadata["tool_errors"] == 1
    assert "MCP tool 'fails' failed" in failed.metadata["agent_error"]
    hung = episode(tokenizer, cfg, problem, [(mcp_call("sleeps", {"seconds": 30}), "stop")])
    assert "'sleeps' timed out after 2 s" in hung.metadata["agent_error"]
    assert 2 <= hung.metadata["tool_s"] < 30
