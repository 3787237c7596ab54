"""Domains on a real vLLM engine with the tiny model: the arithmetic rollout, the two-turn
example domain (environment tokens masked, per-turn rewards), and the tiny model's sampled
accuracy at temperature 1 (pretrained to leave room for RL)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest
from fixtures.helpers import CACHE

from pipeline_rl.config import load_config
from pipeline_rl.rollouts.datasets import load_problems
from pipeline_rl.rollouts.domains import load_domain
from pipeline_rl.streams.records import RolloutGroup, decode, encode

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def llm_and_cfg(tiny_model, tmp_path_factory):
    from pipeline_rl.engine.llm_client import LLMClient

    cfg = load_config(
        "tiny",
        [
            f"run_dir={tmp_path_factory.mktemp('run')}",
            f"model.path={tiny_model}",
            "actor.attempts=4",
            "actor.llm.kv_cache_gib=0.25",
        ],
    )
    llm = LLMClient.create(cfg, str(tiny_model), version=0)
    yield llm, cfg
    llm.close()


@pytest.fixture(scope="module")
def test_problems(tiny_model):
    return load_problems("jsonl", str(CACHE / "arithmetic" / "test.jsonl"))


def run_all(cfg, problems, llm, timeout_s):
    """One group per problem of the domain `cfg` names, with its settings."""
    domain = load_domain(cfg.actor)
    ctx = domain.context(cfg, cfg.actor.attempts)

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(domain.rollout(p, llm, ctx) for p in problems)), timeout_s)

    return asyncio.run(main())


def check_group(group: RolloutGroup, problem: dict, llm, attempts: int) -> None:
    assert isinstance(group, RolloutGroup) and group.problem_id == problem["id"]
    assert len(group.rollouts) == attempts
    assert decode(encode(group), RolloutGroup) == group
    for r in group.rollouts:
        assert llm.tokenizer.decode(r.prompt_ids) == problem["prompt"]
        assert len(r.completion_ids) == len(r.logprobs) == len(r.versions) > 0
        assert all(lp <= 0 for lp in r.logprobs)


def test_arithmetic_rollout(llm_and_cfg, test_problems):
    llm, cfg = llm_and_cfg
    groups = run_all(cfg, test_problems[:8], llm, 60)
    for problem, group in zip(test_problems, groups):
        check_group(group, problem, llm, cfg.actor.attempts)
        for r in group.rollouts:
            assert r.versions == [0] * len(r.completion_ids)
            text = llm.tokenizer.decode(r.completion_ids, skip_special_tokens=True)
            stopped = r.completion_ids[-1] == llm.tokenizer.eos_token_id
            assert r.finish_reason == ("stop" if stopped else "length")
            assert r.reward == float(stopped and text == problem["answer"])


def test_multiturn_domain_with_settings_of_its_own(llm_and_cfg, test_problems):
    llm, cfg = llm_and_cfg
    cfg = replace(
        cfg,
        actor=replace(cfg.actor, domain="fixtures.multiturn_domain:rollout", domain_settings={"turn_reward": 0.25}),
    )
    problems = test_problems[:4]
    groups = run_all(cfg, problems, llm, 60)
    for problem, group in zip(problems, groups):
        check_group(group, problem, llm, cfg.actor.attempts)
        a, b = problem["prompt"][3:-1].split("+")
        env = llm.tokenizer.encode(f"\nQ: {b}+{a}=", add_special_tokens=False)
        for r in group.rollouts:
            first = r.mask.index(0)
            assert r.mask == [1] * first + [0] * len(env) + [1] * (len(r.mask) - first - len(env))
            assert r.completion_ids[first : first + len(env)] == env
            env_slice = slice(first, first + len(env))
            assert r.versions[env_slice] == [-1] * len(env) and r.logprobs[env_slice] == [0.0] * len(env)
            r1, r2 = r.metadata["turn_rewards"]
            # The setting's +-0.25 for a right / wrong turn (the domain's default is +-0.5).
            assert r.token_rewards[first - 1] == (r1 - 0.5) / 2 and r.token_rewards[-1] == (r2 - 0.5) / 2
            assert sum(r.token_rewards) == pytest.approx((r1 + r2 - 1.0) / 2)
            assert r.reward == r1 * r2


def test_tiny_model_sampled_accuracy_leaves_room_for_rl(llm_and_cfg, test_problems, tiny_model):
    llm, cfg = llm_and_cfg
    cfg = load_config("tiny", [f"run_dir={cfg.run_dir}", f"model.path={tiny_model}", "actor.attempts=1"])
    groups = run_all(cfg, test_problems, llm, 120)
    accuracy = sum(g.rollouts[0].reward for g in groups) / len(groups)
    report = json.loads((tiny_model / "pretrain_report.json").read_text())
    assert 0.2 <= accuracy <= 0.5, accuracy
    # vLLM's sampling and the exact T=1 probability the pretraining stopped at agree (500 samples: sd ~0.02).
    assert abs(accuracy - report["test_accuracy_exact_t1"]) < 0.1
