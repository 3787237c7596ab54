"""Checks shared by the agent and verifiers tests: a recording LLMClient, groups rolled out by
the configured domain, and the check that a rollout's model turns are exactly the engine's
outputs."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from pipeline_rl.rollouts.domains import load_domain
from pipeline_rl.streams.records import Rollout, RolloutGroup, decode, encode


class Recording:
    """The LLMClient, recording every generate call's prompt and completion."""

    def __init__(self, llm):
        self.llm, self.calls = llm, []

    def __getattr__(self, name):
        return getattr(self.llm, name)

    async def generate(self, prompt_ids, **kwargs):
        out = await self.llm.generate(prompt_ids, **kwargs)
        self.calls.append((list(prompt_ids), out))
        return out


def model_turns(r: Rollout) -> list[tuple[int, int]]:
    """(start, end) in completion_ids of each run of mask-1 tokens."""
    mask = r.mask or []
    turns, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            turns.append((start, i))
            start = None
    return turns


def check_engine_exact(r: Rollout, recording: Recording) -> list:
    """Every model turn is the completion the engine returned for exactly the tokens before it;
    environment tokens carry mask 0, logprob 0.0, version -1. Returns the turns' completions."""
    by_prompt: dict[tuple, list] = {}
    for prompt, (completion,) in recording.calls:  # a group's episodes share their first prompt
        by_prompt.setdefault(tuple(prompt), []).append(completion)
    completions = []
    turns = model_turns(r)
    assert len(turns) == r.metadata["turns"]
    for start, end in turns:
        candidates = by_prompt[tuple(r.prompt_ids + r.completion_ids[:start])]
        turn = (r.completion_ids[start:end], r.logprobs[start:end], r.versions[start:end])
        matching = [c for c in candidates if (c.token_ids, c.logprobs, c.versions) == turn]
        assert matching, f"turn {turn} is none of the engine's {candidates}"
        completions.append(matching[0])
    env = [i for i, m in enumerate(r.mask or []) if m == 0]
    assert sum(e - s for s, e in turns) + len(env) == len(r.completion_ids)
    assert all(r.versions[i] == -1 and r.logprobs[i] == 0.0 for i in env)
    return completions


def run_groups(llm, cfg, problems, timeout_s=120) -> tuple[list[RolloutGroup], Recording]:
    """One group per problem from cfg.actor.domain on `llm` (recorded); each group survives the
    stream codec unchanged."""
    recording = Recording(llm)
    rollout = load_domain(cfg.actor.domain)

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(rollout(p, recording, cfg) for p in problems)), timeout_s)

    groups = asyncio.run(main())
    for group in groups:
        assert decode(encode(group), RolloutGroup) == group
    return groups, recording


class ScriptedEngine:
    """An LLMClient that answers each generate call with the next scripted (text, finish reason),
    closed by the token `end` when it stopped; records the prompts it was given."""

    def __init__(self, tokenizer, replies: list[tuple[str, str]], max_model_len: int = 4096, end: str = "<|im_end|>"):
        self.tokenizer, self.replies, self.max_model_len = tokenizer, list(replies), max_model_len
        self.end = tokenizer.convert_tokens_to_ids(end)
        self.prompts: list[list[int]] = []
        self.version = 0

    async def generate(self, prompt_ids, n, max_tokens, temperature, top_p, stop=None):
        self.prompts.append(list(prompt_ids))
        text, finish = self.replies.pop(0)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if finish == "stop":
            ids.append(self.end)
        self.version += 1
        n_ids = len(ids)
        return [
            SimpleNamespace(
                token_ids=ids,
                logprobs=[-0.25] * n_ids,
                versions=[self.version] * n_ids,
                finish_reason=finish,
                text=text,
            )
        ]
