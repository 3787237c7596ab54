"""The sequences an LLMClient generates: the completions it returns, each sequence while the engine
generates it (with the versions its tokens came from), and the group of one `generate` call.

The engine thread owns SequenceRequests and CallGroups; the event loop sees only a call's future,
resolved with `post`. `parts_so_far` reads, between two engine steps, how far each sequence of a
call has got, for `LLMClient.snapshot` (and `part_of` one sequence, for `LLMClient.cut`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    """Logprob of each sampled token at the sampling temperature."""
    versions: list[int]
    """Policy version of the forward pass that produced each token."""
    finish_reason: str
    """stop, length, abort, or cut (step guidance stopped it); "" for a part of an unfinished
    sequence."""
    text: str
    routes: np.ndarray | None = None
    """With routing replay: the experts each token was routed to, uint8 (tokens, MoE layers,
    top_k), NO_ROUTE for the last token (engine/routes.py)."""
    shared: int = 0
    """Leading tokens copied from another sequence of the same call (step guidance's branch,
    `LLMClient.cut`): trained as that sequence's, not as this one's."""


@dataclass
class SequenceRequest:
    """One sequence being generated."""

    group: CallGroup
    index: int
    segments: list[tuple[int, int]]
    """(index of the first token, version): the version from that token on."""
    engine_id: str = ""
    """vLLM's internal request id (the scheduler's key)."""
    prompt_len: int = 0
    prefix: Completion | None = None
    """A continued sequence's saved part, re-entered after the prompt (`generate(resume=...)`), or
    the part of another sequence a branch continues."""
    shared: int = 0
    """A branch's tokens taken from another sequence (Completion.shared)."""

    def versions(self, n: int) -> list[int]:
        versions = [self.segments[0][1]] * n
        for start, version in self.segments[1:]:
            versions[start:] = [version] * max(0, n - start)
        return versions

    def completion(self, token_ids: list[int], logprobs: list[float], finish_reason: str, text: str) -> Completion:
        """The sequence with the engine's `token_ids` so far, after the saved prefix if any."""
        versions = self.versions(len(token_ids))
        if self.prefix is None:
            return Completion(token_ids, logprobs, versions, finish_reason, text)
        p = self.prefix
        joined = p.token_ids + token_ids, p.logprobs + logprobs, p.versions + versions
        return Completion(*joined, finish_reason, text, shared=self.shared)


@dataclass
class CallGroup:
    """The n sequences of one `generate` call and the future they resolve."""

    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    completions: list[Completion | None]
    remaining: int
    requests: list[SequenceRequest] = field(default_factory=list)
    """Its sequences still in the engine."""
    prompt_ids: list[int] = field(default_factory=list)
    params: Any = None
    """The call's SamplingParams for a sequence that continues a part (a function of the part)."""
    max_tokens: int = 0


def _resolve(future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def post(group: CallGroup, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve a group's future from the engine thread (a closed loop has no one waiting)."""
    try:
        group.loop.call_soon_threadsafe(_resolve, group.future, result, error)
    except RuntimeError:
        pass


def part_of(request: SequenceRequest, request_states: dict[str, Any]) -> Completion:
    """A sequence still in the engine as far as it has got, from vLLM's output processor's
    `request_states` (read between two steps): finish_reason "", text ""."""
    token_ids: list[int] = []
    logprobs: list[float] = []
    state = request_states.get(request.engine_id)
    if state is not None and state.detokenizer is not None:
        token_ids = list(state.detokenizer.output_token_ids)
        # FlatLogprobs (flat_logprobs=True): one sampled logprob per position.
        flat: Any = state.logprobs_processor.logprobs if state.logprobs_processor is not None else None
        logprobs = list(flat.logprobs[: len(token_ids)]) if flat is not None else []
        token_ids = token_ids[: len(logprobs)]
    return request.completion(token_ids, logprobs, "", "")


def parts_so_far(group: CallGroup, request_states: dict[str, Any]) -> list[Completion | None]:
    """A call's sequences as far as they have got (`part_of`): per sequence, the finished
    completion, its part so far, or None before its first token."""
    parts: list[Completion | None] = list(group.completions)
    for request in group.requests:
        part = part_of(request, request_states)
        parts[request.index] = part if part.token_ids else None
    return parts
