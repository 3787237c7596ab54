"""Step guidance on a real vLLM engine: the actor's guide, the preprocessor's scoring service and
real JSONL streams between them, in one process, with a step scorer that calls every second step
wrong. Cut attempts end after that step with finish_reason "cut", their tokens, logprobs and
versions those the engine sampled; a branch continues a prefix of another attempt of its call."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from pipeline_rl.actor.in_flight import RecordingGenerator
from pipeline_rl.actor.in_flight_keeper import GroupRun
from pipeline_rl.actor.step_guide import StepGuide
from pipeline_rl.config import load_config
from pipeline_rl.preprocess.step_service import StepService
from pipeline_rl.rollouts.domains import make_rollout
from pipeline_rl.scorers.process_reward import separator_ends
from pipeline_rl.streams import open_streams

pytestmark = pytest.mark.vllm

PROMPT = "Q: 12+34="
N, MAX_TOKENS = 8, 160


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    """The engine and the separator: the token this model samples most past its answer, so that
    attempts have steps whatever the CPU's floats make of the model."""
    from pipeline_rl.engine.llm_client import LLMClient

    run_dir = tmp_path_factory.mktemp("run")
    base = [f"model.path={tiny_model}", "actor.llm.kv_cache_gib=0.25", "actor.llm.max_model_len=256"]
    llm = LLMClient.create(load_config("tiny", [f"run_dir={run_dir}", *base]), str(tiny_model), version=0)
    prompt_ids = llm.tokenizer.encode(PROMPT)
    free = asyncio.run(llm.generate(prompt_ids, N, MAX_TOKENS, 1.0, ignore_eos=True))
    special = set(llm.tokenizer.all_special_ids)
    common = Counter(t for c in free for t in c.token_ids if t not in special).most_common(1)[0][0]
    yield llm, base, prompt_ids, common
    llm.close()


def guided(engine, run_dir, *overrides):
    """One generate call of N attempts with the guide polling and the service scoring; returns
    the call's completions and the guide."""
    llm, base, prompt_ids, common = engine
    cfg = load_config(
        "tiny",
        [
            f"run_dir={run_dir}",
            *base,
            "step_guidance.scorer.cls=fixtures.step_scorers:WrongFromStep",
            "step_guidance.scorer.kwargs.bad=1",
            *overrides,
        ],
    )
    cfg.step_guidance.separator = llm.tokenizer.decode([common])  # any character, unquoted
    streams = open_streams(cfg)
    service = StepService(cfg, streams, index=0, actors=1).start()
    guide = StepGuide(cfg, llm, streams, actor=0, actors=1)
    run = GroupRun("actor0-test-0", {}, RecordingGenerator(llm))

    async def call():
        task = asyncio.create_task(run.generator.generate(prompt_ids, N, MAX_TOKENS, 1.0, ignore_eos=True))
        while not task.done():
            await guide.poll([run])
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # verdicts still on their way arrive late
        await guide.poll([run])
        return task.result()

    try:
        completions = asyncio.run(call())
        service.check()
    finally:
        service.close()
        streams.close()
    assert guide.separator == [common]
    return completions, guide


def check_cut(completions, common, llm):
    cut = [c for c in completions if c.finish_reason == "cut"]
    for c in cut:
        # Cut right after its second step: the scorer's first 0.0.
        assert len(separator_ends(c.token_ids, [common])) == 2 and c.token_ids[-1] == common
        assert len(c.logprobs) == len(c.versions) == len(c.token_ids)
        assert all(lp <= 0.0 for lp in c.logprobs) and set(c.versions) == {0}
        assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    for c in completions:
        if c.finish_reason != "cut":
            assert c.finish_reason == "length" and len(c.token_ids) == MAX_TOKENS
    return cut


def test_a_step_scored_wrong_cuts_its_attempt_after_that_step(engine, tmp_path):
    llm, _, _, common = engine
    completions, guide = guided(engine, tmp_path, "step_guidance.mode=cut")
    assert len(completions) == N
    cut = check_cut(completions, common, llm)
    assert cut, f"no attempt was cut: {[c.finish_reason for c in completions]}, {guide.values()}"
    values = guide.values()
    assert values["step_guidance/cuts_total"] == len(cut) + values["step_guidance/cuts_missed_total"]
    # Every attempt that completed a second step was cut, or its verdict came too late and was counted.
    reached = sum(len(separator_ends(c.token_ids, [common])) >= 2 for c in completions)
    assert len(cut) + values["step_guidance/late_verdicts_total"] + values["step_guidance/cuts_missed_total"] >= reached


def test_a_branch_continues_a_prefix_of_its_call_and_trains_only_its_own_tokens(engine, tmp_path):
    llm, _, _, common = engine
    budget = 2 * MAX_TOKENS
    completions, guide = guided(engine, tmp_path, "step_guidance.mode=branch", f"step_guidance.branch_tokens={budget}")
    branches = completions[N:]
    assert branches, f"no branch: {guide.values()}"
    assert len(branches) == guide.values()["step_guidance/branches_total"]
    # Each branch starts with the first step of an attempt of the call (every first step scores
    # 1.0, the longest wins), and its budget was charged MAX_TOKENS less that prefix.
    assert sum(MAX_TOKENS - b.shared for b in branches) <= budget
    check_cut(completions, common, llm)
    for b in branches:
        assert 0 < b.shared < len(b.token_ids) and b.token_ids[b.shared - 1] == common
        assert any(c.token_ids[: b.shared] == b.token_ids[: b.shared] for c in completions if c is not b)
        rollout = make_rollout(llm.tokenizer.encode(PROMPT), b, 0.0)
        assert rollout.mask == [0] * b.shared + [1] * (len(b.token_ids) - b.shared)
