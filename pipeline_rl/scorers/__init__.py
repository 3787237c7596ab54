"""Scorers the preprocessor runs on every batch: the interface (`base.py`) and the built-ins; and
the step scorers of step guidance (`step_scorer.py`)."""

from pipeline_rl.scorers.base import Scorer, ScorerOutput, check_scorers, load_scorers
from pipeline_rl.scorers.http_scorer import HttpScorer
from pipeline_rl.scorers.process_reward import ProcessRewardScorer, ProcessRewardStepScorer
from pipeline_rl.scorers.reference import DistillationScorer, ReferenceLogprobScorer
from pipeline_rl.scorers.reward_model import RewardModelScorer
from pipeline_rl.scorers.step_scorer import StepScorer, load_step_scorer, step_scorer_class

__all__ = [
    "DistillationScorer",
    "HttpScorer",
    "ProcessRewardScorer",
    "ProcessRewardStepScorer",
    "ReferenceLogprobScorer",
    "RewardModelScorer",
    "Scorer",
    "ScorerOutput",
    "StepScorer",
    "check_scorers",
    "load_scorers",
    "load_step_scorer",
    "step_scorer_class",
]
