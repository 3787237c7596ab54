"""Scorers the preprocessor runs on every batch: the interface (`base.py`) and the built-ins."""

from pipeline_rl.scorers.base import Scorer, load_scorers
from pipeline_rl.scorers.reference import ReferenceLogprobScorer

__all__ = ["ReferenceLogprobScorer", "Scorer", "load_scorers"]
