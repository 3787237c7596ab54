"""The builders of the models kept in tests/models, each run briefly and chained as
scripts/make_tiny_model.py chains them: the tiny model (with its data set), the quick PRM from
it, the quick outcome RM from that, and the long task's PRM (here from the tiny model). Each writes a model transformers loads, with the tokenizer
and the report of its build. (The kept models are those builders' full recipes; the tests that
use them hold them to their floors.)"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from pipeline_rl.demo import long_chain, long_chain_prm, outcome_rm, prm, tiny_model

pytestmark = pytest.mark.slow


def test_the_builders_chain_on_short_recipes(tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification

    steps = 20
    policy = tiny_model.build(tmp_path, 0, replace(tiny_model.TINY, steps=steps, soften_to=None, eval_every=10))
    train = (tmp_path / "arithmetic" / "train.jsonl").read_text().splitlines()
    test = (tmp_path / "arithmetic" / "test.jsonl").read_text().splitlines()
    assert len(train) > len(test) > 0 and not {json.loads(x)["prompt"] for x in train} & {
        json.loads(x)["prompt"] for x in test
    }
    assert json.loads((policy / "pretrain_report.json").read_text())["steps"] == steps
    assert AutoModelForCausalLM.from_pretrained(policy).config.num_hidden_layers > 0

    scorer = prm.build(tmp_path, 0, replace(prm.QUICK, steps=steps, eval_every=10))
    rm = outcome_rm.build(tmp_path, 0, replace(outcome_rm.QUICK, steps=steps, eval_every=10))
    long_prm = long_chain_prm.build(
        tmp_path, 0, replace(long_chain_prm.FULL, steps=steps, eval_every=10), base=tiny_model.TINY.name
    )
    # Judged on the base model's own attempts: every held-out problem sampled once.
    judged = json.loads((long_prm / "report.json").read_text())["on_policy_attempts"]
    assert judged["attempts"] == long_chain.TEST_PROBLEMS, judged
    ids = torch.tensor([[1, 2, 3]])
    for path, auto, labels in (
        (scorer, AutoModelForTokenClassification, 2),
        (rm, AutoModelForSequenceClassification, 1),
        (long_prm, AutoModelForTokenClassification, 2),
    ):
        report = json.loads((path / "report.json").read_text())
        # A fixed recipe runs all its steps and keeps its best evaluation's weights.
        assert report["steps"] == steps and report["kept_step"] in (10, 20), report
        model = auto.from_pretrained(path)
        assert model.config.num_labels == labels
        assert model(input_ids=ids).logits.shape[-1] == labels
        assert (path / "tokenizer.json").read_text() == (policy / "tokenizer.json").read_text()
