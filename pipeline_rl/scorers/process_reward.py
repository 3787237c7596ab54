"""A process reward model (PRM): a score for each step of a completion, on the step's last token.

Steps: the completion is cut after each occurrence of the separator, matched in the policy's
token space (the ids the policy tokenizer gives for `separator`, or `separator_token` as one
id); the last step runs to the end of the completion. With Qwen-style tokenizers "\\n\\n" is
one token.

The PRM reads the prompt and the steps as text, re-encoded with its own tokenizer, with
`marker` after each step: prompt, step 1, marker, step 2, marker, ... Its score of step k is
read at the last token of the k-th marker:
- `kind: token_classification` (the Qwen2.5-Math-PRM family, `AutoModelForTokenClassification`):
  the probability of label `correct_label` (softmax over the labels);
- `kind: causal_lm` (Math-Shepherd style, `AutoModelForCausalLM`): the probability of
  `good_token` against `bad_token` (a softmax over those two logits).

Sequences are batched by length, up to `preprocess.seq_length` tokens per forward pass.

What the step scores s_1..s_K (each in [0, 1]) do, both optional:
- `step_reward: raw` adds `step_weight * s_k` to `token_rewards` at step k's last token;
  `centered` adds `step_weight * (s_k - m)`, m the mean step score over the group's rollouts
  (a centred signal: see the reward-to-go in pipeline_rl/preprocess/advantages.py); `none`: nothing;
- `outcome: min` (or `last`) adds `outcome_weight * min_k s_k` (or s_K) to `reward`.
The scores are kept in `metadata["prm_step_scores"]`.
"""

from __future__ import annotations

from enum import StrEnum

from pipeline_rl.config import RunConfig
from pipeline_rl.scorers.base import Scorer, ScorerOutput
from pipeline_rl.scorers.hf import batched_logits, load_model, load_tokenizer, scorer_device
from pipeline_rl.scorers.step_scorer import StepScorer
from pipeline_rl.streams.records import Rollout, RolloutGroup, StepRequest


class PrmKind(StrEnum):
    token_classification = "token_classification"
    causal_lm = "causal_lm"


class StepReward(StrEnum):
    none = "none"
    raw = "raw"
    centered = "centered"


class Outcome(StrEnum):
    none = "none"
    min = "min"
    last = "last"


def separator_ends(completion_ids: list[int], separator: list[int]) -> list[int]:
    """Index of the last token of each occurrence of `separator`: the steps completed so far."""
    ends, n, t = [], len(separator), 0
    while n and t + n <= len(completion_ids):
        if completion_ids[t : t + n] == separator:
            ends.append(t + n - 1)
            t += n
        else:
            t += 1
    return ends


def step_ends(completion_ids: list[int], separator: list[int]) -> list[int]:
    """Index of the last token of each step: the end of each separator occurrence, and the
    completion's last token unless a separator ends it."""
    ends = separator_ends(completion_ids, separator)
    if completion_ids and (not ends or ends[-1] != len(completion_ids) - 1):
        ends.append(len(completion_ids) - 1)
    return ends


class ProcessRewardScorer(Scorer):
    """See the module docstring. kwargs: `path`, `kind`, `marker`, `separator` (text, default
    "\\n\\n") or `separator_token` (a policy token id), `correct_label` (default 1),
    `good_token` / `bad_token` (default "+" / "-"), `step_reward` (default centered),
    `step_weight` (1.0), `outcome` (default none), `outcome_weight` (1.0)."""

    produces = frozenset({ScorerOutput.token_rewards, ScorerOutput.reward})

    def __init__(
        self,
        cfg: RunConfig,
        path: str,
        kind: str,
        marker: str,
        separator: str = "\n\n",
        separator_token: int | None = None,
        correct_label: int = 1,
        good_token: str = "+",
        bad_token: str = "-",
        step_reward: str = "centered",
        step_weight: float = 1.0,
        outcome: str = "none",
        outcome_weight: float = 1.0,
    ):
        super().__init__(cfg)
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

        self.kind = PrmKind(kind)
        self.step_reward, self.outcome = StepReward(step_reward), Outcome(outcome)
        self.step_weight, self.outcome_weight = float(step_weight), float(outcome_weight)
        self.device = scorer_device(cfg)
        self.policy_tokenizer = load_tokenizer(cfg.model.path)
        self.tokenizer = load_tokenizer(path)
        self.separator = (
            [int(separator_token)]
            if separator_token is not None
            else self.policy_tokenizer.encode(separator, add_special_tokens=False)
        )
        if not self.separator:
            raise ValueError("separator is empty")
        self.marker = self.tokenizer.encode(marker, add_special_tokens=False)
        if not self.marker:
            raise ValueError(f"marker {marker!r} encodes to no token")
        auto = AutoModelForTokenClassification if self.kind == PrmKind.token_classification else AutoModelForCausalLM
        self.model = load_model(auto, path, cfg, self.device)
        self.correct_label = int(correct_label)
        if self.kind == PrmKind.token_classification and not 0 <= self.correct_label < self.model.config.num_labels:
            raise ValueError(f"correct_label {correct_label} not among the model's {self.model.config.num_labels}")
        self.good_bad = [self._one_token(good_token, "good_token"), self._one_token(bad_token, "bad_token")]

    def _one_token(self, text: str, name: str) -> int:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if self.kind == PrmKind.causal_lm and len(ids) != 1:
            raise ValueError(f"{name} {text!r} must be one token of the PRM's tokenizer, got {ids}")
        return ids[0] if ids else -1

    def prm_input(self, rollout: Rollout, ends: list[int]) -> tuple[list[int], list[int]]:
        """The PRM's token ids for a rollout whose steps end at `ends`, and the position of each
        step's score (the last token of the marker after it)."""
        decode = self.policy_tokenizer.decode
        ids = self.tokenizer.encode(decode(rollout.prompt_ids, skip_special_tokens=True), add_special_tokens=False)
        positions, start = [], 0
        for end in ends:
            step = rollout.completion_ids[start : end + 1]
            if step[-len(self.separator) :] == self.separator:
                step = step[: -len(self.separator)]
            ids += self.tokenizer.encode(decode(step, skip_special_tokens=True), add_special_tokens=False)
            ids += self.marker
            positions.append(len(ids) - 1)
            start = end + 1
        return ids, positions

    def step_scores(self, rollouts: list[Rollout]) -> list[tuple[list[int], list[float]]]:
        """Per rollout, the last token of each step and the PRM's score of that step."""
        ends = [step_ends(r.completion_ids, self.separator) for r in rollouts]
        inputs = [self.prm_input(r, e) for r, e in zip(rollouts, ends)]
        logits = batched_logits(self.model, [ids for ids, _ in inputs], self.cfg.preprocess.seq_length, self.device)
        out = []
        for e, (_, positions), row in zip(ends, inputs, logits):
            at = row[positions]
            if self.kind == PrmKind.token_classification:
                probs = at.softmax(-1)[:, self.correct_label]
            else:
                probs = at[:, self.good_bad].softmax(-1)[:, 0]
            out.append((e, probs.tolist()))
        return out

    def score(self, groups: list[RolloutGroup]) -> None:
        scored = iter(self.step_scores([r for g in groups for r in g.rollouts]))
        for group in groups:
            steps = [next(scored) for _ in group.rollouts]
            flat = [s for _, row in steps for s in row]
            mean = sum(flat) / len(flat) if flat else 0.0
            for r, (ends, row) in zip(group.rollouts, steps):
                r.metadata["prm_step_scores"] = row
                if not row:
                    continue
                if self.step_reward != StepReward.none:
                    rewards = r.token_rewards or [0.0] * len(r.completion_ids)
                    for end, s in zip(ends, row):
                        rewards[end] += self.step_weight * (s - mean if self.step_reward == StepReward.centered else s)
                    r.token_rewards = rewards
                if self.outcome != Outcome.none:
                    r.reward += self.outcome_weight * (min(row) if self.outcome == Outcome.min else row[-1])

    def close(self) -> None:
        del self.model


class ProcessRewardStepScorer(StepScorer):
    """The PRM as a step scorer (step guidance, pipeline_rl/scorers/step_scorer.py): kwargs as
    ProcessRewardScorer's model keys (`path`, `kind`, `marker`, `separator` or `separator_token`,
    `correct_label`, `good_token`, `bad_token`). A request's score is the PRM's score of its last
    step, read with every step before it in the PRM's input, as ProcessRewardScorer reads a
    finished rollout's."""

    def __init__(self, cfg: RunConfig, **kwargs):
        super().__init__(cfg)
        self.prm = ProcessRewardScorer(cfg, **kwargs)

    def score_steps(self, requests: list[StepRequest]) -> list[float]:
        rollouts = [
            Rollout(r.prompt_ids, r.completion_ids, [0.0] * len(r.completion_ids), [0] * len(r.completion_ids), 0.0, "")
            for r in requests
        ]
        return [row[-1] for _, row in self.prm.step_scores(rollouts)]

    def close(self) -> None:
        self.prm.close()
