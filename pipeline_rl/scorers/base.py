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

A scorer that raises fails its batch only: the preprocessor dead-letters each group of the
batch (topic Topic.SCORER_DEAD, with the error) and goes on with the next batch.
"""

from __future__ import annotations

from pipeline_rl.config import RunConfig
from pipeline_rl.plugins import load_plugin
from pipeline_rl.streams.records import RolloutGroup


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
        cls = load_plugin(
            spec.cls,
            key,
            "a subclass of pipeline_rl.scorers.Scorer",
            check=lambda c: isinstance(c, type) and issubclass(c, Scorer),
        )
        scorers.append(cls(cfg, **dict(spec.kwargs)))
    return scorers
