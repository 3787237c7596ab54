"""Step scorers: what scores an attempt's steps while it is generated (step guidance,
pipeline_rl/actor/step_guide.py). Named in the config as `step_guidance.scorer: {cls:
"module:Class", kwargs: {...}}`, built once per preprocessor as `Class(cfg, **kwargs)`, and
called as `score_steps(requests)` on each batch of StepRequests: per request (a prompt and a
completion that ends with a step), how likely the attempt is still right after that step, in
[0, 1]. A scorer that raises stops its preprocessor, which names it: a run whose attempts are
no longer scored would silently turn into an unguided one.

Built-ins: `pipeline_rl.scorers:ProcessRewardStepScorer` (a process reward model, as
`ProcessRewardScorer` reads it) and `pipeline_rl.demo.long_chain:StepChecker` (exact, by rule,
for conf=tiny_long).
"""

from __future__ import annotations

from pipeline_rl.config import RunConfig
from pipeline_rl.core.plugins import load_plugin
from pipeline_rl.streams.records import StepRequest


class StepScorer:
    """Base class of step scorers. Subclasses take `(cfg, **kwargs)` and implement `score_steps`."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg

    def score_steps(self, requests: list[StepRequest]) -> list[float]:
        """One score in [0, 1] per request, in order."""
        raise NotImplementedError

    def close(self) -> None:
        """Release models or connections; called once when the preprocessor stops."""


def step_scorer_class(cfg: RunConfig) -> type[StepScorer]:
    """Import the class `step_guidance.scorer.cls` names (no model is loaded); raises ConfigError
    naming the key."""
    return load_plugin(
        cfg.step_guidance.scorer.cls,
        "step_guidance.scorer.cls",
        "a subclass of pipeline_rl.scorers.StepScorer",
        check=lambda c: isinstance(c, type) and issubclass(c, StepScorer),
    )


def load_step_scorer(cfg: RunConfig) -> StepScorer:
    """Import and build `step_guidance.scorer`; raises ConfigError or ValueError naming the key."""
    spec = cfg.step_guidance.scorer
    cls = step_scorer_class(cfg)
    try:
        return cls(cfg, **dict(spec.kwargs))
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad value for 'step_guidance.scorer.kwargs': {cls.__name__}: {e}") from e
