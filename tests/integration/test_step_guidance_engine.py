"""Step guidance on a real vLLM engine: the actor's guide, the preprocessor's scoring service and
real JSONL streams between them, in one process. Attempts whose second step is scored wrong end
at that step with finish_reason "cut", their tokens, logprobs and versions those of the step."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from pipeline_rl.actor.in_flight import RecordingGenerator
from pipeline_rl.actor.in_flight_keeper import GroupRun
from pipeline_rl.actor.step_guide import StepGuide
from pipeline_rl.config import load_config
from pipeline_rl.preprocess.step_service import StepService
from pipeline_rl.scorers.process_reward import separator_ends
from pipeline_rl.streams import open_streams

pytestmark = pytest.mark.vllm

PROMPT = "Q: 12+34="
N, MAX_TOKENS = 8, 160


def test_a_step_scored_wrong_cuts_its_attempt_after_that_step(tiny_model, tmp_path):
    from pipeline_rl.engine.llm_client import LLMClient

    base = [f"run_dir={tmp_path}", f"model.path={tiny_model}", "actor.llm.kv_cache_gib=0.25"]
    llm = LLMClient.create(load_config("tiny", base), str(tiny_model), version=0)
    try:
        prompt_ids = llm.tokenizer.encode(PROMPT)
        # The separator: the token this model samples most past its answer, so that attempts
        # have steps whatever the CPU's floats make of the model.
        free = asyncio.run(llm.generate(prompt_ids, N, MAX_TOKENS, 1.0, ignore_eos=True))
        special = set(llm.tokenizer.all_special_ids)
        common = Counter(t for c in free for t in c.token_ids if t not in special).most_common(1)[0][0]
        separator = llm.tokenizer.decode([common])
        cfg = load_config(
            "tiny",
            base
            + [
                "step_guidance.mode=cut",
                "step_guidance.scorer.cls=fixtures.step_scorers:WrongFromStep",
                "step_guidance.scorer.kwargs.bad=1",
                f"step_guidance.separator='{separator}'",
            ],
        )
        streams = open_streams(cfg)
        service = StepService(cfg, streams, index=0, actors=1).start()
        guide = StepGuide(cfg, llm, streams, actor=0, actors=1)
        run = GroupRun("actor0-test-0", {}, RecordingGenerator(llm))

        async def guided():
            call = asyncio.create_task(run.generator.generate(prompt_ids, N, MAX_TOKENS, 1.0, ignore_eos=True))
            while not call.done():
                await guide.poll([run])
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)  # verdicts still on their way arrive late
            await guide.poll([run])
            return call.result()

        completions = asyncio.run(guided())
        service.check()
        service.close()
    finally:
        llm.close()
    assert guide.separator == [common]
    cut = [c for c in completions if c.finish_reason == "cut"]
    assert cut, f"no attempt was cut: {[c.finish_reason for c in completions]}, {guide.values()}"
    for c in cut:
        # Cut right after its second step: the scorer's first 0.0.
        assert len(separator_ends(c.token_ids, [common])) == 2 and c.token_ids[-1] == common
        assert len(c.logprobs) == len(c.versions) == len(c.token_ids)
        assert all(lp <= 0.0 for lp in c.logprobs) and set(c.versions) == {0}
        assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    for c in completions:
        if c.finish_reason != "cut":
            assert c.finish_reason == "length" and len(c.token_ids) == MAX_TOKENS
    values = guide.values()
    assert values["step_guidance/cuts_total"] == len(cut)
    # Every attempt that completed a second step was cut, or its verdict came too late and was counted.
    reached = sum(len(separator_ends(c.token_ids, [common])) >= 2 for c in completions)
    missed = values["step_guidance/late_verdicts_total"] + values["step_guidance/cuts_missed_total"]
    assert len(cut) + missed >= reached
    streams.close()
