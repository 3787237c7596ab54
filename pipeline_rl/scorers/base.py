"""Scorers: user plug-ins that the preprocessor runs on every batch of rollout groups.

A scorer is named in the config (`preprocess.scorers: [{cls: "module:Class", kwargs: {...}}]`),
built once per preprocessor as `Class(cfg, **kwargs)`, and called as `score(groups)` on each
batch of groups, in config order, before advantages are computed. It edits the groups in
place; what it may change:

- `rollout.reward`: e.g. an outcome reward model, or a penalty;
- `rollout.token_rewards`: per-token rewards, e.g. a process reward model that scores each
  step of a (partial or finished) rollout and puts the score on the step's last token.
  They reach the advantages as a reward-to-go (pipeline_rl/preprocess/advantages.py);
- `rollout.ref_logprobs`: per-token logprobs under another model, for the trainer's KL term
  (`trainer.loss.kl_coef`); see `reference.py`;
- `rollout.metadata` / `group.metadata`: anything else worth keeping.

A scorer declares what it writes in `produces` (ScorerOutput members); `check_scorers` uses
that (a KL term needs a scorer that produces ref_logprobs), not class names.

A scorer that raises fails its batch only: the preprocessor dead-letters each group of the
batch (topic Topic.SCORER_DEAD, with the error) and goes on with the next batch. A scorer that
could score only part of the batch (a remote server that failed for some requests) returns
{group_id: error} for the groups it could not score: those alone are dead-lettered.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar

from pipeline_rl.config import ConfigError, RunConfig
from pipeline_rl.core.plugins import load_plugin
from pipeline_rl.streams.records import RolloutGroup


class ScorerOutput(StrEnum):
    """What a scorer writes into the groups it scores."""

    reward = "reward"
    token_rewards = "token_rewards"
    ref_logprobs = "ref_logprobs"


class Scorer:
    """Base class of scorers. Subclasses take `(cfg, **kwargs)`, implement `score` and set
    `produces`."""

    produces: ClassVar[frozenset[ScorerOutput]] = frozenset()
    """What `score` writes (`check_scorers` checks it against what the loss needs)."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg

    def score(self, groups: list[RolloutGroup]) -> dict[str, str] | None:
        """Edit `groups` in place (rewards, token_rewards, ref_logprobs, metadata). Returns
        {group_id: error} for groups that could not be scored (dead-lettered), or None."""
        raise NotImplementedError

    def close(self) -> None:
        """Release models or connections; called once when the preprocessor stops."""


def scorer_classes(cfg: RunConfig) -> list[type[Scorer]]:
    """Import the classes of `cfg.preprocess.scorers`, in order (no model is loaded)."""
    return [
        load_plugin(
            spec.cls,
            f"preprocess.scorers.{i}.cls",
            "a subclass of pipeline_rl.scorers.Scorer",
            check=lambda c: isinstance(c, type) and issubclass(c, Scorer),
        )
        for i, spec in enumerate(cfg.preprocess.scorers)
    ]


def check_scorers(cfg: RunConfig) -> list[type[Scorer]]:
    """The classes of `cfg.preprocess.scorers` (no model is loaded), once they are known to
    produce what the loss needs; raises ConfigError naming the key otherwise."""
    classes = scorer_classes(cfg)
    produced = {out for cls in classes for out in cls.produces}
    if cfg.trainer.loss.kl_coef > 0 and ScorerOutput.ref_logprobs not in produced:
        raise ConfigError(
            "'trainer.loss.kl_coef' > 0 needs a scorer in 'preprocess.scorers' that produces ref_logprobs "
            "(e.g. pipeline_rl.scorers:ReferenceLogprobScorer)"
        )
    return classes


def load_scorers(cfg: RunConfig) -> list[Scorer]:
    """Import and build the scorers of `cfg.preprocess.scorers`, in order (the launcher ran
    `check_scorers` before starting the pool). A constructor that rejects its kwargs fails with
    the config key."""
    scorers = []
    for i, (cls, spec) in enumerate(zip(scorer_classes(cfg), cfg.preprocess.scorers)):
        try:
            scorers.append(cls(cfg, **dict(spec.kwargs)))
        except (TypeError, ValueError) as e:
            raise ValueError(f"bad value for 'preprocess.scorers.{i}.kwargs': {cls.__name__}: {e}") from e
    return scorers
