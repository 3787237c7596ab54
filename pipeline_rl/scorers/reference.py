"""Per-token logprobs of completions under a frozen causal LM: the reference scorer (for the
trainer's KL term) and the distillation scorer (a teacher's logprobs as per-token rewards)."""

from __future__ import annotations

import torch

from pipeline_rl.config import LogprobKernel, RunConfig, logprob_kernel
from pipeline_rl.scorers.base import Scorer, ScorerOutput
from pipeline_rl.scorers.hf import load_model, pack_rows, scorer_device
from pipeline_rl.streams.records import Rollout, RolloutGroup


class CompletionLogprobs:
    """logprob of every completion token under a frozen causal LM that shares the policy's
    tokenizer (token ids are passed as they are), at `temperature`, over packed rows of up to
    `seq_length` tokens."""

    def __init__(self, cfg: RunConfig, path: str, temperature: float):
        from transformers import AutoModelForCausalLM

        self.device = scorer_device(cfg)
        self.model = load_model(AutoModelForCausalLM, path, cfg, self.device)
        self.temperature = temperature
        self.seq_length = cfg.preprocess.seq_length
        self.chunk_tokens = cfg.model.logprob_chunk_tokens
        self.compiled = logprob_kernel(cfg, torch.device(self.device).type == "cuda") == LogprobKernel.compiled

    def __call__(self, rollouts: list[Rollout]) -> list[list[float]]:
        from pipeline_rl.core.logprobs import packed_logprobs

        sequences = [r.prompt_ids + r.completion_ids for r in rollouts]
        out: list[list[float]] = [[] for _ in rollouts]
        for row in pack_rows([len(s) for s in sequences], self.seq_length):
            ids = [t for i in row for t in sequences[i]]
            pos = [p for i in row for p in range(len(sequences[i]))]
            with torch.no_grad():
                logprobs, _ = packed_logprobs(
                    self.model,
                    torch.tensor([ids], device=self.device),
                    torch.tensor([pos], device=self.device),
                    self.temperature,
                    chunk_tokens=self.chunk_tokens,
                    compiled=self.compiled,
                )
            logprobs = logprobs.tolist()
            start = 0
            for i in row:
                first = start + len(rollouts[i].prompt_ids)
                out[i] = logprobs[first : first + len(rollouts[i].completion_ids)]
                start += len(sequences[i])
        return out


class ReferenceLogprobScorer(Scorer):
    """Per-token logprobs of every completion under a frozen model, into `rollout.ref_logprobs`.

    kwargs: `path` (a Hugging Face model directory; default cfg.model.path, the initial
    policy, which gives the usual KL-to-reference term). Logprobs are taken at the sampling
    temperature (cfg.shared.temperature), like the policy's own. Runs on the GPU when the
    preprocessor has one (world.preprocessor_gpus > 0)."""

    produces = frozenset({ScorerOutput.ref_logprobs})

    def __init__(self, cfg: RunConfig, path: str | None = None):
        super().__init__(cfg)
        self.path = path or cfg.model.path
        self.logprobs = CompletionLogprobs(cfg, self.path, cfg.shared.temperature)

    def score(self, groups: list[RolloutGroup]) -> None:
        rollouts = [r for g in groups for r in g.rollouts]
        for r, lp in zip(rollouts, self.logprobs(rollouts)):
            r.ref_logprobs = lp

    def close(self) -> None:
        del self.logprobs


class DistillationScorer(Scorer):
    """On-policy distillation: a teacher's per-token logprobs become per-token rewards.

    Each token the policy sampled (mask 1) gets `coef * (log p_teacher(token) - log
    p_behaviour(token))` added to `rollout.token_rewards`; through the reward-to-go of
    pipeline_rl/preprocess/advantages.py this is the policy gradient of the reverse KL from
    the policy to the teacher (minus coef times it). The teacher must share the policy's
    tokenizer. kwargs: `path` (the teacher), `coef` (default 1.0), `temperature` (default the
    actor's, so both logprobs are of the same tempered distributions). Independent of the
    reference scorer and the trainer's KL term."""

    produces = frozenset({ScorerOutput.token_rewards})

    def __init__(self, cfg: RunConfig, path: str, coef: float = 1.0, temperature: float | None = None):
        super().__init__(cfg)
        self.coef = float(coef)
        self.logprobs = CompletionLogprobs(cfg, path, temperature or cfg.shared.temperature)

    def score(self, groups: list[RolloutGroup]) -> None:
        rollouts = [r for g in groups for r in g.rollouts]
        for r, teacher in zip(rollouts, self.logprobs(rollouts)):
            mask = r.mask or [1] * len(r.completion_ids)
            rewards = r.token_rewards or [0.0] * len(r.completion_ids)
            r.token_rewards = [
                x + self.coef * (t - b) if m else x for x, t, b, m in zip(rewards, teacher, r.logprobs, mask)
            ]
            r.metadata["teacher_logprob_sum"] = sum(t for t, m in zip(teacher, mask) if m)

    def close(self) -> None:
        del self.logprobs
