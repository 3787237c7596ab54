"""A conversation as the trainer will see it: token ids, never text.

The model's turns are the engine's output tokens as they are (with their behaviour logprobs and
policy versions, mask 1); what the environment adds between turns is appended as the token ids
of the new messages alone (mask 0, logprob 0.0, version -1). Nothing already in the transcript
is tokenized again, so what the trainer scores is exactly what the engine conditioned on and
sampled: re-tokenizing a decoded conversation can merge or split tokens at turn boundaries and
silently train on sequences the policy never produced."""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline_rl.core.routes import encode_routes, no_routes
from pipeline_rl.streams.records import Rollout


class Transcript:
    def __init__(self, prompt_ids: list[int]):
        self.prompt_ids = list(prompt_ids)
        self.completion_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.mask: list[int] = []
        self.routes: list[np.ndarray] | None = []
        """With routing replay, each turn's and each environment message's rows of routes."""
        self.turns = 0
        self.finish_reason = ""

    @property
    def tokens(self) -> list[int]:
        """The next turn's prompt: everything so far."""
        return self.prompt_ids + self.completion_ids

    def add_model_turn(self, completion: Any) -> None:
        """An LLMClient Completion, token for token."""
        n = len(completion.token_ids)
        if not len(completion.logprobs) == len(completion.versions) == n:
            raise ValueError(
                f"completion of {n} tokens has {len(completion.logprobs)} logprobs, {len(completion.versions)} versions"
            )
        self.completion_ids += completion.token_ids
        self.logprobs += completion.logprobs
        self.versions += completion.versions
        self.mask += [1] * n
        routes = getattr(completion, "routes", None)
        if routes is None or self.routes is None:
            self.routes = None
        else:
            self.routes.append(routes.reshape(n, -1))
        self.turns += 1
        self.finish_reason = completion.finish_reason

    def add_environment(self, token_ids: list[int]) -> None:
        if not self.turns:
            raise ValueError("environment tokens before the first model turn belong in the prompt")
        n = len(token_ids)
        self.completion_ids += token_ids
        self.logprobs += [0.0] * n
        self.versions += [-1] * n
        self.mask += [0] * n
        if self.routes:
            self.routes.append(no_routes(n, self.routes[0].shape[1]))

    def rollout(self, reward: float, finish_reason: str | None = None, **metadata: Any) -> Rollout:
        if not self.turns:
            raise ValueError("a conversation without a model turn has nothing to train on")
        return Rollout(
            prompt_ids=list(self.prompt_ids),
            completion_ids=list(self.completion_ids),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            reward=float(reward),
            finish_reason=finish_reason or self.finish_reason,
            mask=list(self.mask),
            routes=encode_routes(np.concatenate(self.routes)) if self.routes else None,
            metadata={"turns": self.turns, **metadata},
        )
