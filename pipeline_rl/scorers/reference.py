"""The reference-logprob scorer: per-token logprobs under a frozen model, for the KL term."""

from __future__ import annotations

from typing import cast

from pipeline_rl.config import RunConfig
from pipeline_rl.scorers.base import Scorer
from pipeline_rl.streams.records import RolloutGroup


class ReferenceLogprobScorer(Scorer):
    """Per-token logprobs of every completion under a frozen model, into `rollout.ref_logprobs`.

    kwargs: `path` (a Hugging Face model directory; default cfg.model.path, the initial
    policy, which gives the usual KL-to-reference term). Pointing `path` at a stronger
    teacher turns the same KL term into on-policy distillation. Logprobs are taken at the
    sampling temperature (cfg.actor.temperature), like the policy's own, over packed rows of
    up to cfg.preprocess.seq_length tokens (a longer sequence gets a row to itself). Runs on
    the GPU when the preprocessor has one (world.preprocessor_gpus > 0)."""

    def __init__(self, cfg: RunConfig, path: str | None = None):
        super().__init__(cfg)
        import torch
        from transformers import AutoModelForCausalLM

        self.path = path or cfg.model.path
        use_gpu = cfg.world.preprocessor_gpus > 0 and torch.cuda.is_available()
        self.device = torch.device("cuda" if use_gpu else "cpu")
        # cast: transformers' own annotation of `.to` on its models confuses the type checker.
        model = cast(
            torch.nn.Module, AutoModelForCausalLM.from_pretrained(self.path, dtype=getattr(torch, cfg.model.dtype))
        )
        self.model = model.to(self.device).eval().requires_grad_(False)

    def _rows(self, sequences: list[list[int]]) -> list[list[int]]:
        """Consecutive sequence indices packed into rows of up to seq_length tokens."""
        rows: list[list[int]] = []
        used = 0
        for i, ids in enumerate(sequences):
            if not rows or used + len(ids) > self.cfg.preprocess.seq_length:
                rows.append([])
                used = 0
            rows[-1].append(i)
            used += len(ids)
        return rows

    def score(self, groups: list[RolloutGroup]) -> None:
        import torch

        from pipeline_rl.trainer.logprobs import packed_logprobs

        rollouts = [r for g in groups for r in g.rollouts]
        sequences = [r.prompt_ids + r.completion_ids for r in rollouts]
        for row in self._rows(sequences):
            ids = [t for i in row for t in sequences[i]]
            pos = [p for i in row for p in range(len(sequences[i]))]
            with torch.no_grad():
                logprobs, _ = packed_logprobs(
                    self.model,
                    torch.tensor([ids], device=self.device),
                    torch.tensor([pos], device=self.device),
                    self.cfg.actor.temperature,
                )
            logprobs = logprobs.tolist()
            start = 0
            for i in row:
                r = rollouts[i]
                first = start + len(r.prompt_ids)
                r.ref_logprobs = logprobs[first : first + len(r.completion_ids)]
                start += len(sequences[i])

    def close(self) -> None:
        del self.model
