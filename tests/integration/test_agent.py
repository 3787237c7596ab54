"""Agent environments on a real vLLM engine with the tiny model (pipeline_rl/rollouts/agent/):
multi-turn and tool environments give rollouts whose model tokens, logprobs and versions are
exactly the engine's outputs for each turn (whose prompt was everything before it) and whose
mask covers exactly those tokens; a conversation across a weight swap carries both versions;
the HTTP endpoint serves the openai package's client and raw JSON; and the actor loop counts
failing, hanging and garbage-returning tools and goes on writing groups."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from fixtures.agent_checks import check_engine_exact, model_turns, run_groups
from fixtures.helpers import CACHE, TESTS, perturbed

from pipeline_rl.config import load_config
from pipeline_rl.rollouts.datasets import load_problems
from pipeline_rl.streams import open_streams
from pipeline_rl.streams.records import RolloutGroup

pytestmark = pytest.mark.vllm

TOOLS = "[fixtures.agent_tools:add,fixtures.agent_tools:fails,fixtures.agent_tools:hangs,fixtures.agent_tools:garbage]"


def agent_cfg(run_dir, tiny_model, environment: str, *extra: str):
    return load_config(
        "tiny",
        [
            f"run_dir={run_dir}",
            f"model.path={tiny_model}",
            "actor.attempts=2",
            "actor.llm.kv_cache_gib=0.25",
            "actor.domain=agent",
            f"actor.domain_settings.environment={environment}",
            f"actor.domain_settings.chat_template={TESTS / 'fixtures' / 'agent_tiny.jinja'}",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def llm(tiny_model, tmp_path_factory):
    from pipeline_rl.engine.llm_client import LLMClient

    cfg = agent_cfg(tmp_path_factory.mktemp("run"), tiny_model, "fixtures.agent_envs:two_questions")
    client = LLMClient.create(cfg, str(tiny_model), version=0)
    yield client
    client.close()


@pytest.fixture(scope="module")
def problems(tiny_model):
    return load_problems("jsonl", str(CACHE / "arithmetic" / "test.jsonl"))


def test_multiturn_environment_is_token_exact(llm, problems, tmp_path, tiny_model):
    cfg = agent_cfg(tmp_path, tiny_model, "fixtures.agent_envs:two_questions")
    chosen = problems[:4]
    groups, recording = run_groups(llm, cfg, chosen)
    tok = llm.tokenizer
    for problem, group in zip(chosen, groups):
        assert len(group.rollouts) == cfg.actor.attempts
        for r in group.rollouts:
            assert tok.decode(r.prompt_ids) == problem["prompt"]
            first, second = check_engine_exact(r, recording)
            # Between the turns: the second question, rendered alone (the first turn ended with EOS).
            env = r.completion_ids[len(first.token_ids) : len(r.completion_ids) - len(second.token_ids)]
            a, b = problem["prompt"][3:-1].split("+")
            closing = [] if first.finish_reason == "stop" else tok.encode("<|endoftext|>", add_special_tokens=False)
            assert env == closing + tok.encode(f"\nQ: {b}+{a}=", add_special_tokens=False)
            right = [c.text.strip() == problem["answer"] for c in (first, second)]  # the env's check
            assert r.reward == float(all(right))
            assert r.metadata["tool_calls"] == 0 and "agent_error" not in r.metadata


def test_an_environments_own_settings_reach_it(llm, problems, tmp_path, tiny_model):
    env = "actor.domain_settings.environment_settings"
    cfg = agent_cfg(tmp_path, tiny_model, "fixtures.agent_envs:asked_again", f"{env}.times=3")
    chosen = problems[:2]
    groups, recording = run_groups(llm, cfg, chosen)
    for problem, group in zip(chosen, groups):
        for r in group.rollouts:
            turns = check_engine_exact(r, recording)
            assert len(turns) == 3  # the environment's default is 2
            assert r.reward == float(all(t.text.strip() == problem["answer"] for t in turns))


def test_tool_environment_is_token_exact(llm, problems, tmp_path, tiny_model):
    cfg = agent_cfg(tmp_path, tiny_model, "fixtures.agent_envs:checked_by_tool", f"actor.domain_settings.tools={TOOLS}")
    chosen = problems[4:8]
    groups, recording = run_groups(llm, cfg, chosen)
    for problem, group in zip(chosen, groups):
        for r in group.rollouts:
            first, second = check_engine_exact(r, recording)
            env = r.completion_ids[len(first.token_ids) : len(r.completion_ids) - len(second.token_ids)]
            text = llm.tokenizer.decode(env, skip_special_tokens=False)
            assert text.endswith(f"\n[{problem['answer']}]")  # the tool's result, as the template shows it
            assert r.metadata["tool_calls"] == 1 and r.metadata["tool_errors"] == 0 and r.metadata["tool_s"] > 0
            assert r.finish_reason in ("stop", "length")


def test_a_conversation_across_a_swap_carries_both_versions(llm, problems, tmp_path, tiny_model):
    from safetensors.torch import load_file

    cfg = agent_cfg(tmp_path, tiny_model, "fixtures.agent_envs:two_questions", "actor.attempts=1")
    trained = load_file(str(tiny_model / "model.safetensors"))
    before = llm.version

    async def swap():
        llm.hook.swap(perturbed(trained, seed=3).items(), before + 1)

    problem = dict(problems[8], between_turns=swap)
    try:
        [group], recording = run_groups(llm, cfg, [problem])
    finally:
        llm.hook.swap(trained.items(), llm.version + 1)  # the checkpoint's weights for later tests
    [r] = group.rollouts
    first, second = check_engine_exact(r, recording)
    assert set(first.versions) == {before} and set(second.versions) == {before + 1}
    assert {v for v in r.versions if v >= 0} == {before, before + 1}


def test_http_endpoint_serves_the_openai_client(llm, problems, tmp_path, tiny_model):
    from openai.types.chat import ChatCompletion

    cfg = agent_cfg(tmp_path, tiny_model, "fixtures.agent_envs:over_openai_http", "actor.domain_settings.http=true")
    chosen = [dict(p) for p in problems[10:12]]
    groups, recording = run_groups(llm, cfg, chosen)
    for problem, group in zip(chosen, groups):
        replies = [c for pair in problem["replies"] for c in pair]
        assert len(replies) == 2 * cfg.actor.attempts
        for reply in replies:
            assert isinstance(reply, ChatCompletion) and reply.object == "chat.completion"
            assert reply.usage is not None and reply.usage.total_tokens > reply.usage.prompt_tokens
        turns = [c for r in group.rollouts for c in check_engine_exact(r, recording)]
        # What the openai client parsed is what the engine generated, turn for turn.
        assert sorted(c.text.strip() for c in turns) == sorted(r.choices[0].message.content or "" for r in replies)
        assert {r.reward for r in group.rollouts} <= {0.0, 1.0}


def test_http_endpoint_answers_raw_json(llm, problems, tmp_path, tiny_model):
    cfg = agent_cfg(
        tmp_path, tiny_model, "fixtures.agent_envs:raw_http", "actor.domain_settings.http=true", "actor.attempts=1"
    )
    problem = dict(problems[12])
    [group], recording = run_groups(llm, cfg, [problem])
    [(ok, refused, nowhere)] = problem["raw"]
    status, body = ok
    assert status == 200 and body["object"] == "chat.completion" and isinstance(body["id"], str)
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
    [r] = group.rollouts
    [completion] = check_engine_exact(r, recording)
    assert choice["message"]["content"] == completion.text.strip()
    usage = body["usage"]
    assert usage["completion_tokens"] == len(completion.token_ids) == len(r.completion_ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert refused[0] == 400 and "do not continue this conversation" in refused[1]["error"]["message"]
    assert nowhere[0] == 404 and nowhere[1]["error"]["type"] == "not_found"


def test_actor_loop_counts_tool_failures_and_goes_on(llm, tmp_path, tiny_model, monkeypatch):
    """The real actor loop (in this process, on this engine): groups of 2 episodes, until
    admission stops it, cycle through a failing, a hanging (1 s limit), a garbage-returning and
    the working tool."""
    from fixtures import agent_envs

    from pipeline_rl.actor import actor as actor_module
    from pipeline_rl.engine.llm_client import LLMClient

    cfg = agent_cfg(
        tmp_path,
        tiny_model,
        "fixtures.agent_envs:cycling_tools",
        f"actor.domain_settings.tools={TOOLS}",
        "actor.domain_settings.tool_timeout_s=1",
        "actor.domain_settings.error_reward=-1",
        f"actor.dataset.train={CACHE / 'arithmetic' / 'train.jsonl'}",
        "actor.eval_every_s=0",
        "actor.metrics_every_s=0.5",
        "actor.max_groups_in_flight=4",
        "shared.groups_per_step=4",
        "shared.max_lag=1",
        "metrics.tensorboard=false",
    )
    monkeypatch.setattr(agent_envs, "_episodes", iter(range(10**6)))
    monkeypatch.setattr(LLMClient, "create", classmethod(lambda cls, *a, **k: llm))
    actor = actor_module.Actor(cfg, 0)
    # Admission's cap at the engine's version (steps of 4 groups, max_lag 1; an earlier test in
    # this module swapped weights): several groups can end in one turn of the loop, so the
    # loop is stopped by the cap, not by a count it could pass.
    groups = (llm.version + 2) * 4
    episodes = 2 * groups
    deadline = time.monotonic() + 180
    try:
        asyncio.run(actor.run(lambda: actor.totals.written >= groups or time.monotonic() > deadline))
    finally:
        actor.metrics.close()
        actor.streams.close()
    assert actor.totals.written == groups and actor.totals.rollout_errors == 0

    streams = open_streams(cfg)
    reader = streams.reader("actor", RolloutGroup, partitions=(0,))
    rollouts = [r for batch in iter(lambda: reader.read(timeout=0.0), []) for e in batch for r in e.record.rollouts]
    streams.close()
    errors = [r.metadata.get("agent_error", "") for r in rollouts]
    assert sum("fails was called" in e for e in errors) == episodes // 4
    assert sum("timed out after 1 s" in e for e in errors) == episodes // 4
    assert sum("neither a string nor a JSON value" in e for e in errors) == episodes // 4
    for r in rollouts:
        failed = bool(r.metadata.get("agent_error"))
        assert (r.finish_reason == "error") == failed and (r.reward == -1.0) == failed
        assert r.metadata["turns"] == (1 if failed else 2) and r.metadata["tool_calls"] == 1
        assert len(model_turns(r)) == r.metadata["turns"]

    values = [json.loads(line)["values"] for line in (tmp_path / "metrics" / "actor0.jsonl").read_text().splitlines()]
    last = values[-1]
    tool_failures = 3 * episodes // 4
    assert last["agent/tool_calls_total"] == episodes and last["agent/tool_errors_total"] == tool_failures
    assert last["agent/errors_total"] == tool_failures and "agent_tools" in last["agent/last_error"]
    windows = [v for v in values if "agent/turns_per_rollout" in v]
    assert sum(v["agent/tool_calls"] for v in values if "agent/tool_calls" in v) == episodes
    assert all(1.0 <= v["agent/turns_per_rollout"] <= 2.0 for v in windows)
    assert any("agent/tool_s_per_call" in v for v in values)
