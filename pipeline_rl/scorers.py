"""Scorers: user plug-ins that the preprocessor runs on every batch of rollout groups.

A scorer is named in the config (`preprocess.scorers: [{cls: "module:Class", kwargs: {...}}]`),
built once per preprocessor as `Class(cfg, **kwargs)`, and called as `score(groups)` on each
batch of groups, in config order, before advantages are computed. It edits the groups in
place; what it may change:

- `rollout.reward`: e.g. an outcome reward model, or a penalty;
- `rollout.token_rewards`: per-token rewards, e.g. a process reward model that scores each
  step of a (partial or finished) rollout and puts the score on the step's last token.
  They reach the advantages as a reward-to-go (pipeline_rl/advantages.py);
- `rollout.ref_logprobs`: per-token logprobs under another model, for the trainer's KL term
  (`trainer.loss.kl_coef`); see ReferenceLogprobScorer;
- `rollout.metadata` / `group.metadata`: anything else worth keeping.

A scorer that raises fails its batch only: the preprocessor dead-letters each group of the
batch (topic SCORER_DEAD_TOPIC, with the error) and goes on with the next batch.
"""

from __future__ import annotations

import importlib
from typing import Optional

from pipeline_rl.config import ConfigError, RunConfig
from pipeline_rl.records import RolloutGroup

SCORER_DEAD_TOPIC = "scorer.dead"


class Scorer:
    """Base class of scorers. Subclasses take `(cfg, **kwargs)` and implement `score`."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg

    def score(self, groups: list[RolloutGroup]) -> None:
        """Edit `groups` in place (rewards, token_rewards, ref_logprobs, metadata)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release models or connections; called once when the preprocessor stops."""


def load_scorers(cfg: RunConfig) -> list[Scorer]:
    """Import and build the scorers of `cfg.preprocess.scorers`, in order."""
    scorers = []
    for i, spec in enumerate(cfg.preprocess.scorers):
        key = f"preprocess.scorers.{i}.cls"
        module_name, _, class_name = spec.cls.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"bad value for '{key}': cannot import {spec.cls!r}: {e}") from None
        if not (isinstance(cls, type) and issubclass(cls, Scorer)):
            raise ConfigError(f"bad value for '{key}': {spec.cls!r} is not a subclass of pipeline_rl.scorers.Scorer")
        scorers.append(cls(cfg, **dict(spec.kwargs)))
    return scorers


class ReferenceLogprobScorer(Scorer):
    """Per-token logprobs of every completion under a frozen model, into `rollout.ref_logprobs`.

    kwargs: `path` (a Hugging Face model directory; default cfg.model.path, the initial
    policy, which gives the usual KL-to-reference term). Pointing `path` at a stronger
    teacher turns the same KL term into on-policy distillation. Logprobs are taken at the
    sampling temperature (cfg.actor.temperature), like the policy's own, over packed rows of
    up to cfg.preprocess.seq_length tokens (a longer sequence gets a row to itself). Runs on
    the GPU when the preprocessor has one (world.preprocessor_gpus > 0)."""

    def __init__(self, cfg: RunConfig, path: Optional[str] = None):
        super().__init__(cfg)
        import torch
        from transformers import AutoModelForCausalLM

        self.path = path or cfg.model.path
        use_gpu = cfg.world.preprocessor_gpus > 0 and torch.cuda.is_available()
        self.device = torch.device("cuda" if use_gpu else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=getattr(torch, cfg.model.dtype))
        self.model.to(self.device).eval().requires_grad_(False)

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

        from pipeline_rl.logprobs import packed_logprobs

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
                r.ref_logprobs = logprobs[first:first + len(r.completion_ids)]
                start += len(sequences[i])

    def close(self) -> None:
        del self.model
