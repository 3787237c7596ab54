"""The tiny model's data set and tokenizer (cheap checks; the model's vLLM accuracy is checked
in test_domains.py)."""

from __future__ import annotations

import json

from fixtures.helpers import CACHE

from pipeline_rl.demo.tiny_model import TEST_PROBLEMS, TINY_STEPS, make_problems, make_tokenizer
from pipeline_rl.rollouts.datasets import load_problems


def test_problems_are_deterministic_disjoint_and_correct():
    train, test = make_problems(seed=0)
    assert (train, test) == make_problems(seed=0)
    assert make_problems(seed=1) != (train, test)
    assert len(test) == TEST_PROBLEMS and len(train) + len(test) == 90 * 90
    assert not {p["id"] for p in train} & {p["id"] for p in test}
    for p in train[:50] + test[:50]:
        a, b = map(int, p["prompt"][len("Q: ") : -1].split("+"))
        assert p["prompt"] == f"Q: {a}+{b}=" and p["answer"] == str(a + b) and 10 <= a <= 99 and 10 <= b <= 99


def test_tokenizer_digits_are_single_tokens_and_text_round_trips():
    tok = make_tokenizer()
    assert len(tok) == 258 and tok.eos_token_id == 0 and tok.pad_token_id == 1
    digits = [tok.encode(str(d), add_special_tokens=False) for d in range(10)]
    assert all(len(ids) == 1 for ids in digits) and len({ids[0] for ids in digits}) == 10
    for text in ("Q: 37+48=", "85", "any text, ünïcode ✓ and \\boxed{x}"):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    assert tok.decode(tok.encode("85", add_special_tokens=False) + [tok.eos_token_id], skip_special_tokens=True) == "85"


def test_built_model_and_data(tiny_model):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model)
    assert config.model_type == "qwen2" and config.vocab_size == 258 and config.eos_token_id == 0
    assert AutoTokenizer.from_pretrained(tiny_model).encode("Q: 1+2=") == make_tokenizer().encode("Q: 1+2=")
    report = json.loads((tiny_model / "pretrain_report.json").read_text())
    assert 0.2 <= report["test_accuracy_exact_t1"] <= 0.5 and 0.2 <= report["test_accuracy_sampled_t1"] <= 0.5
    # A fixed recipe: the same steps on every CPU. Where the model leaves its plateau differs
    # (steps 600-1900 measured, docs/testing.md); the greedy accuracy it ends with (0.95-0.996
    # measured, 0.818 where it left the plateau at step 1,900) keeps a margin above this floor,
    # far above the plateau's (below 0.1).
    assert report["steps"] == TINY_STEPS and report["test_accuracy_greedy"] >= 0.7
    assert (tiny_model / "model.safetensors").exists()
    train = load_problems("jsonl", str(CACHE / "arithmetic" / "train.jsonl"))
    test = load_problems("jsonl", str(CACHE / "arithmetic" / "test.jsonl"))
    assert not {p["id"] for p in train} & {p["id"] for p in test}
