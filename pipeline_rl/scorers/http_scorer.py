"""A reward server the user already runs, called over HTTP with JSON.

Protocol: `POST url` with body {"items": [ITEM, ...]}, one ITEM per rollout:
{"group_id", "problem_id", "prompt", "completion" (texts decoded with the policy's tokenizer),
"prompt_ids", "completion_ids", "reward" (the actor's rule reward), "metadata"}. The reply is
{"rewards": [float per item]}, optionally with "token_rewards": [null or one float per
completion token, per item].

Groups are never split across requests: each request carries up to `batch_groups` whole groups,
and up to `concurrency` requests are in flight. A request that times out (`timeout_s`), fails
to connect or gets a 5xx answer is tried again up to `retries` times, `backoff_s` apart
(doubling); a 4xx answer or a malformed reply is final. The groups of a request that failed for
good are returned as failed, so the preprocessor dead-letters them with the error (counted as
lost by the actors) while the rest of the batch goes on.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson

from pipeline_rl.config import RunConfig
from pipeline_rl.scorers.base import Scorer, ScorerOutput
from pipeline_rl.scorers.hf import load_tokenizer
from pipeline_rl.scorers.reward_model import Combine, combine
from pipeline_rl.streams.records import RolloutGroup


class FinalError(Exception):
    """A failure that trying again cannot fix."""


class HttpScorer(Scorer):
    """See the module docstring. kwargs: `url`, `batch_groups` (8), `concurrency` (4),
    `timeout_s` (30), `retries` (2), `backoff_s` (0.5), `combine` (replace or add, default
    replace), `weight` (1.0)."""

    produces = frozenset({ScorerOutput.reward, ScorerOutput.token_rewards})

    def __init__(
        self,
        cfg: RunConfig,
        url: str,
        batch_groups: int = 8,
        concurrency: int = 4,
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        combine: str = "replace",
        weight: float = 1.0,
    ):
        super().__init__(cfg)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        if batch_groups < 1 or concurrency < 1 or retries < 0 or timeout_s <= 0:
            raise ValueError("batch_groups and concurrency must be >= 1, retries >= 0, timeout_s > 0")
        self.url = url
        self.batch_groups, self.timeout_s = int(batch_groups), float(timeout_s)
        self.retries, self.backoff_s = int(retries), float(backoff_s)
        self.combine, self.weight = Combine(combine), float(weight)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.pool = ThreadPoolExecutor(int(concurrency), thread_name_prefix="http-scorer")

    def _items(self, groups: list[RolloutGroup]) -> list[dict[str, Any]]:
        decode = self.tokenizer.decode
        return [
            {
                "group_id": g.group_id,
                "problem_id": g.problem_id,
                "prompt": decode(r.prompt_ids, skip_special_tokens=True),
                "completion": decode(r.completion_ids, skip_special_tokens=True),
                "prompt_ids": r.prompt_ids,
                "completion_ids": r.completion_ids,
                "reward": r.reward,
                "metadata": r.metadata,
            }
            for g in groups
            for r in g.rollouts
        ]

    def _post(self, body: bytes) -> Any:
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                return orjson.loads(reply.read())
        except urllib.error.HTTPError as e:
            text = e.read()[:200].decode(errors="replace")
            if 400 <= e.code < 500:
                raise FinalError(f"HTTP {e.code} from {self.url}: {text}") from None
            raise OSError(f"HTTP {e.code} from {self.url}: {text}") from None
        except orjson.JSONDecodeError as e:
            raise FinalError(f"reply of {self.url} is not JSON: {e}") from None

    def _post_with_retries(self, body: bytes) -> Any:
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return self._post(body)
            except OSError as e:  # timeouts, refused connections, 5xx
                if attempt == self.retries:
                    raise FinalError(f"{self.url} failed {attempt + 1} times, last: {type(e).__name__}: {e}") from None
                time.sleep(delay)
                delay *= 2

    def _check(self, reply: Any, lengths: list[int]) -> tuple[list[Any], list[Any]]:
        """The reply's rewards and token rewards (None or one number per token, per item), or
        FinalError naming what is wrong with it."""

        def numbers(x: Any, n: int) -> bool:
            return isinstance(x, list) and len(x) == n and all(isinstance(v, (int, float)) for v in x)

        rewards: Any = reply.get("rewards") if isinstance(reply, dict) else None
        if not numbers(rewards, len(lengths)):
            raise FinalError(f"reply of {self.url} has no list 'rewards' of {len(lengths)} numbers")
        token_rewards = reply.get("token_rewards") or [None] * len(lengths)
        if not isinstance(token_rewards, list) or len(token_rewards) != len(lengths):
            raise FinalError(f"reply of {self.url}: 'token_rewards' must hold one entry per item")
        for i, (t, n) in enumerate(zip(token_rewards, lengths)):
            if t is not None and not numbers(t, n):
                raise FinalError(f"reply of {self.url}: token_rewards[{i}] is not null or {n} numbers")
        return rewards, token_rewards

    def _call(self, groups: list[RolloutGroup]) -> str | None:
        """Score one request's groups in place; returns the error if it failed for good."""
        rollouts = [r for g in groups for r in g.rollouts]
        try:
            reply = self._post_with_retries(orjson.dumps({"items": self._items(groups)}))
            rewards, token_rewards = self._check(reply, [len(r.completion_ids) for r in rollouts])
        except FinalError as e:
            return str(e)
        for r, value, tokens in zip(rollouts, rewards, token_rewards):
            r.reward = combine(r.reward, float(value), self.combine, self.weight)
            if tokens is not None:
                base = r.token_rewards or [0.0] * len(r.completion_ids)
                r.token_rewards = [a + float(b) for a, b in zip(base, tokens)]
        return None

    def score(self, groups: list[RolloutGroup]) -> dict[str, str]:
        chunks = [groups[i : i + self.batch_groups] for i in range(0, len(groups), self.batch_groups)]
        failed: dict[str, str] = {}
        for chunk, error in zip(chunks, self.pool.map(self._call, chunks)):
            if error is not None:
                failed.update({g.group_id: error for g in chunk})
        return failed

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
