"""Environments of the verifiers library (actor.domain: verifiers) on a real vLLM engine with the
tiny model: a vf.MultiTurnEnv, a vf.ToolEnv and an McpToolEnv with a real MCP server
(tests/fixtures/verifiers_envs.py) give rollouts whose model tokens, logprobs and versions are exactly the
engine's outputs and whose mask covers exactly them, with the rubric's reward; a conversation
across a weight swap carries both versions; an environment that raises ends its rollouts with a
recorded error (before its first turn: fails its group); the real actor loop writes the groups
and the agent metrics; bad configs fail naming the key.
Skipped without the `verifiers` extra (bash scripts/setup_cpu.sh --verifiers)."""

from __future__ import annotations

import asyncio

import pytest

vf = pytest.importorskip("verifiers", reason="the verifiers extra is not installed (scripts/setup_cpu.sh --verifiers)")

from fixtures.agent_checks import check_engine_exact, run_groups  # noqa: E402
from fixtures.helpers import CACHE, TESTS, perturbed  # noqa: E402

from pipeline_rl.config import ConfigError, load_config  # noqa: E402
from pipeline_rl.rollouts.datasets import load_problems  # noqa: E402
from pipeline_rl.streams.records import RolloutGroup  # noqa: E402


def vf_cfg(run_dir, tiny_model, environment: str, *extra: str):
    return load_config(
        "tiny",
        [
            f"run_dir={run_dir}",
            f"model.path={tiny_model}",
            "actor.attempts=2",
            "actor.llm.kv_cache_gib=0.25",
            "actor.domain=verifiers",
            f"actor.domain_settings.environment={environment}",
            f"actor.domain_settings.chat_template={TESTS / 'fixtures' / 'agent_tiny.jinja'}",
            "actor.domain_settings.error_reward=-1",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def llm(tiny_model, tmp_path_factory):
    from pipeline_rl.engine.llm_client import LLMClient

    cfg = vf_cfg(tmp_path_factory.mktemp("run"), tiny_model, "fixtures.verifiers_envs:two_questions")
    client = LLMClient.create(cfg, str(tiny_model), version=0)
    yield client
    client.close()


@pytest.fixture(scope="module")
def problems(tiny_model):
    return load_problems("jsonl", str(CACHE / "arithmetic" / "test.jsonl"))


def reward_or_error(r, expected: float) -> None:
    """The rubric's reward, or (verifiers refuses an empty reply, possible at temperature 1) the
    error reward with verifiers' error recorded."""
    if "agent_error" in r.metadata:
        assert "EmptyModelResponseError" in r.metadata["agent_error"] and r.reward == -1.0
        assert r.finish_reason == "error"
    else:
        assert r.reward == expected


@pytest.mark.vllm
def test_multiturn_environment_is_token_exact_and_scored_by_its_rubric(llm, problems, tmp_path, tiny_model):
    cfg = vf_cfg(tmp_path, tiny_model, "fixtures.verifiers_envs:two_questions")
    chosen = problems[:4]
    groups, recording = run_groups(llm, cfg, chosen)
    tok = llm.tokenizer
    for problem, group in zip(chosen, groups):
        assert len(group.rollouts) == cfg.actor.attempts
        for r in group.rollouts:
            assert tok.decode(r.prompt_ids) == problem["prompt"]
            turns = check_engine_exact(r, recording)
            if "agent_error" in r.metadata:
                reward_or_error(r, 0.0)
                continue
            first, second = turns
            env = r.completion_ids[len(first.token_ids) : len(r.completion_ids) - len(second.token_ids)]
            closing = [] if first.finish_reason == "stop" else tok.encode("<|endoftext|>", add_special_tokens=False)
            assert env == closing + tok.encode(
                f"\nQ: {problem['prompt'][3:-1].split('+')[1]}+{problem['prompt'][3:-1].split('+')[0]}=",
                add_special_tokens=False,
            )
            right = [c.text.strip() == problem["answer"] for c in (first, second)]
            assert r.reward == float(all(right))
            assert r.metadata["verifiers_metrics"]["both_right"] == r.reward
            assert r.metadata["verifiers_metrics"]["num_turns"] == 2
            assert r.metadata["stop_condition"] == "max_turns_reached"
    # The full checks above ran (an empty reply, which verifiers refuses, is common after the tool's).
    assert sum("agent_error" not in r.metadata for g in groups for r in g.rollouts) >= 2


@pytest.mark.vllm
def test_tool_environment_is_token_exact_and_scored_by_its_rubric(llm, problems, tmp_path, tiny_model):
    cfg = vf_cfg(tmp_path, tiny_model, "fixtures.verifiers_envs:checked_by_tool")
    chosen = problems[4:12]
    groups, recording = run_groups(llm, cfg, chosen)
    for problem, group in zip(chosen, groups):
        for r in group.rollouts:
            turns = check_engine_exact(r, recording)
            if "agent_error" in r.metadata:
                reward_or_error(r, 0.0)
                continue
            first, second = turns
            env = r.completion_ids[len(first.token_ids) : len(r.completion_ids) - len(second.token_ids)]
            text = llm.tokenizer.decode(env, skip_special_tokens=False)
            assert text.endswith(f"\n[{problem['answer']}]")  # the ToolEnv's call of `add`, as the template shows it
            assert r.reward == float(second.text.strip() == problem["answer"])
            assert r.metadata["verifiers_metrics"]["second_right"] == r.reward
            assert "add_calls" in r.metadata["verifiers_metrics"]  # verifiers' ToolEnv monitor ran
    # The full checks above ran (an empty reply, which verifiers refuses, is common after the tool's).
    assert sum("agent_error" not in r.metadata for g in groups for r in g.rollouts) >= 2


@pytest.mark.vllm
def test_mcp_tool_environment_calls_the_server(llm, problems, tmp_path, tiny_model):
    cfg = vf_cfg(tmp_path, tiny_model, "fixtures.verifiers_envs:checked_by_mcp")
    chosen = problems[22:28]
    groups, recording = run_groups(llm, cfg, chosen)
    done = 0
    for problem, group in zip(chosen, groups):
        for r in group.rollouts:
            turns = check_engine_exact(r, recording)
            if "agent_error" in r.metadata:
                reward_or_error(r, 0.0)
                continue
            done += 1
            first, second = turns
            env = r.completion_ids[len(first.token_ids) : len(r.completion_ids) - len(second.token_ids)]
            assert llm.tokenizer.decode(env, skip_special_tokens=False).endswith(f"\n[{problem['answer']}]")
            assert r.reward == float(second.text.strip() == problem["answer"])
    assert done >= 1


@pytest.mark.vllm
def test_a_verifiers_conversation_across_a_swap_carries_both_versions(llm, problems, tmp_path, tiny_model, monkeypatch):
    from fixtures import verifiers_envs
    from safetensors.torch import load_file

    cfg = vf_cfg(tmp_path, tiny_model, "fixtures.verifiers_envs:two_questions", "actor.attempts=1")
    trained = load_file(str(tiny_model / "model.safetensors"))
    before = llm.version

    async def swap():
        llm.hook.swap(perturbed(trained, seed=5).items(), before + 1)

    monkeypatch.setattr(verifiers_envs, "between_turns", swap)
    try:
        for problem in problems[12:20]:  # the next problem if verifiers refused an empty first reply (no swap)
            [group], recording = run_groups(llm, cfg, [problem])
            if llm.version == before + 1:
                break
    finally:
        llm.hook.swap(trained.items(), llm.version + 1)  # the checkpoint's weights for later tests
    [r] = group.rollouts
    first, second = check_engine_exact(r, recording)
    assert set(first.versions) == {before} and set(second.versions) == {before + 1}
    assert {v for v in r.versions if v >= 0} == {before, before + 1}


@pytest.mark.vllm
def test_an_environment_that_raises_ends_its_rollouts_with_the_error(llm, problems, tmp_path, tiny_model):
    cfg = vf_cfg(tmp_path, tiny_model, "fixtures.verifiers_envs:broken")
    [group], recording = run_groups(llm, cfg, problems[20:21])
    for r in group.rollouts:
        check_engine_exact(r, recording)
        assert r.reward == -1.0 and r.finish_reason == "error" and r.metadata["turns"] == 1
        assert "ZeroDivisionError: the environment's own bug" in r.metadata["agent_error"]


@pytest.mark.vllm
def test_an_environment_that_raises_before_the_first_turn_fails_its_group(llm, problems, tmp_path, tiny_model):
    cfg = vf_cfg(tmp_path, tiny_model, "fixtures.verifiers_envs:broken_at_setup")
    with pytest.raises(RuntimeError, match="before its first model turn: KeyError: 'no such resource'"):
        run_groups(llm, cfg, problems[21:22])


@pytest.mark.vllm
@pytest.mark.parametrize("backend, mode", [("jsonl", "async"), pytest.param("redis", "sync", marks=pytest.mark.redis)])
def test_actor_loop_writes_verifiers_groups_and_agent_metrics(
    backend, mode, llm, tmp_path, tiny_model, request, monkeypatch
):
    """The real actor loop (in this process, on this engine), groups of 2 until admission stops it
    at the engine's version (steps of 4 groups, shared.max_lag=1; sync mode: no lag)."""
    import json
    import time

    from pipeline_rl.actor import actor as actor_module
    from pipeline_rl.engine.llm_client import LLMClient
    from pipeline_rl.streams import open_streams

    cfg = vf_cfg(
        tmp_path,
        tiny_model,
        "fixtures.verifiers_envs:two_questions",
        f"actor.dataset.train={CACHE / 'arithmetic' / 'train.jsonl'}",
        "actor.eval_every_s=0",
        "actor.metrics_every_s=0.5",
        "actor.max_groups_in_flight=4",
        "shared.groups_per_step=4",
        "shared.max_lag=1",
        "metrics.tensorboard=false",
        f"streams.backend={backend}",
        f"actor.mode={mode}",
        *([f"streams.redis.port={request.getfixturevalue('redis_server').port}"] if backend == "redis" else []),
    )
    monkeypatch.setattr(LLMClient, "create", classmethod(lambda cls, *a, **k: llm))
    actor = actor_module.Actor(cfg, 0)
    # Admission's cap at the engine's version (earlier tests in this module swapped weights).
    cap = (llm.version + (0 if mode == "sync" else 1) + 1) * 4
    deadline = time.monotonic() + 180
    try:
        asyncio.run(actor.run(lambda: actor.totals.written >= cap or time.monotonic() > deadline))
    finally:
        actor.metrics.close()
        actor.streams.close()
    assert actor.totals.written == cap and actor.totals.rollout_errors == 0

    streams = open_streams(cfg)
    reader = streams.reader("actor", RolloutGroup, partitions=(0,))
    rollouts = [r for batch in iter(lambda: reader.read(timeout=0.0), []) for e in batch for r in e.record.rollouts]
    streams.close()
    assert len(rollouts) == 2 * cap
    for r in rollouts:
        failed = "agent_error" in r.metadata
        assert r.metadata["turns"] == 2 or failed
        assert r.reward == (-1.0 if failed else r.metadata["verifiers_metrics"]["both_right"])
    values = [json.loads(line)["values"] for line in (tmp_path / "metrics" / "actor0.jsonl").read_text().splitlines()]
    windows = [v for v in values if "agent/turns_per_rollout" in v]
    assert windows and all(1.0 <= v["agent/turns_per_rollout"] <= 2.0 for v in windows)
    assert values[-1]["agent/errors_total"] == sum("agent_error" in r.metadata for r in rollouts)


def test_bad_environments_fail_at_launch_naming_the_key(tmp_path):
    from pipeline_rl.launch.launcher import check_plugins

    key = "'actor.domain_settings.environment'"
    for spec, error in [
        ("fixtures.verifiers_envs:nothing", "cannot import"),
        ("fixtures.agent_envs:swapped", "raised TypeError"),  # needs an argument
        ("builtins:dict", "returned dict, not a verifiers Environment"),
        ("no_such_verifiers_env", "raised"),  # not an installed environment id
    ]:
        cfg = vf_cfg(tmp_path, tmp_path, spec)
        with pytest.raises(ConfigError, match=f"bad value for {key}.*{error}"):
            check_plugins(cfg)
    cfg = vf_cfg(
        tmp_path, tmp_path, "fixtures.verifiers_envs:two_questions", "actor.domain_settings.args={max_turns: 3}"
    )
    with pytest.raises(ConfigError, match=f"bad value for {key}.*unexpected keyword"):
        check_plugins(cfg)
    with pytest.raises(ConfigError, match=r"needs 'actor\.domain_settings\.environment'"):
        check_plugins(vf_cfg(tmp_path, tmp_path, "''"))
    with pytest.raises(ConfigError, match=r"unknown key 'actor\.domain_settings\.nope'"):
        check_plugins(
            vf_cfg(tmp_path, tmp_path, "fixtures.verifiers_envs:two_questions", "actor.domain_settings.nope=1")
        )
