"""An outcome reward model: one scalar per completion from a sequence-classification model."""

from __future__ import annotations

from enum import Enum

import torch

from pipeline_rl.config import RunConfig
from pipeline_rl.scorers.base import Scorer, ScorerOutput
from pipeline_rl.scorers.hf import load_model, load_tokenizer, scorer_device
from pipeline_rl.streams.records import RolloutGroup


class Combine(Enum):
    """How a model's score meets the rule reward the actor computed."""

    replace = "replace"
    """reward = weight * score"""
    add = "add"
    """reward = reward + weight * score"""


def combine(reward: float, score: float, how: Combine, weight: float) -> float:
    return weight * score if how == Combine.replace else reward + weight * score


class RewardModelScorer(Scorer):
    """Scores prompt + completion with an `AutoModelForSequenceClassification` of one label.

    The policy's token ids are decoded to text and encoded with the reward model's tokenizer:
    with its chat template (the prompt as the user turn, the completion as the assistant's)
    when it has one, else as plain prompt + completion text. kwargs: `path`, `combine`
    (replace or add, default replace), `weight` (default 1.0), `batch_size` (sequences per
    forward pass, padded, default 16). The score is kept in `metadata["rm_score"]`."""

    produces = frozenset({ScorerOutput.reward})

    def __init__(self, cfg: RunConfig, path: str, combine: str = "replace", weight: float = 1.0, batch_size: int = 16):
        super().__init__(cfg)
        from transformers import AutoModelForSequenceClassification

        self.combine = Combine(combine)
        self.weight = float(weight)
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.device = scorer_device(cfg)
        self.policy_tokenizer = load_tokenizer(cfg.model.path)
        self.tokenizer = load_tokenizer(path)
        self.model = load_model(AutoModelForSequenceClassification, path, cfg, self.device)
        labels = getattr(self.model.config, "num_labels", None)
        if labels != 1:
            raise ValueError(f"{path}: a reward model has one label, this one has {labels}")
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id
        # The model finds each row's last real token by this id (right padding).
        self.model.config.pad_token_id = self.pad_id

    def encode(self, prompt_ids: list[int], completion_ids: list[int]) -> list[int]:
        prompt = self.policy_tokenizer.decode(prompt_ids, skip_special_tokens=True)
        completion = self.policy_tokenizer.decode(completion_ids, skip_special_tokens=True)
        if self.tokenizer.chat_template:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            return list(self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
        return self.tokenizer.encode(prompt + completion, add_special_tokens=False)

    def scores(self, sequences: list[list[int]]) -> list[float]:
        """The model's score of each token sequence, in batches of similar lengths."""
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        out = [0.0] * len(sequences)
        for b in range(0, len(order), self.batch_size):
            chunk = order[b : b + self.batch_size]
            width = max(len(sequences[i]) for i in chunk)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, i in enumerate(chunk):
                ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
                mask[row, : len(sequences[i])] = 1
            with torch.no_grad():
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            for row, i in enumerate(chunk):
                out[i] = float(logits[row, 0])
        return out

    def score(self, groups: list[RolloutGroup]) -> None:
        rollouts = [r for g in groups for r in g.rollouts]
        values = self.scores([self.encode(r.prompt_ids, r.completion_ids) for r in rollouts])
        for r, value in zip(rollouts, values):
            r.metadata["rm_score"] = value
            r.reward = combine(r.reward, value, self.combine, self.weight)

    def close(self) -> None:
        del self.model
