"""Hugging Face model loads in several threads of one process (two preprocessors in one
process, as tests/integration/test_preprocessor.py runs them) leave later loads intact."""

import threading

import torch
from fixtures.helpers import random_qwen2
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen2ForCausalLM

from pipeline_rl.config import load_config
from pipeline_rl.scorers.hf import load_model


def test_concurrent_loads_leave_later_models_tied(tmp_path):
    config = random_qwen2().config
    config.tie_word_embeddings = True
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)  # no lm_head in the checkpoint
    cfg = load_config("tiny")
    args = (AutoModelForCausalLM, str(tmp_path), cfg, torch.device("cpu"))
    tie_weights = PreTrainedModel.tie_weights
    # Unserialised, transformers 5.19 left its no-op tie_weights behind in the first of these
    # rounds in each of 3 tries; a few rounds make a pass by luck unlikely.
    for _ in range(5):
        threads = [threading.Thread(target=load_model, args=args) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert PreTrainedModel.tie_weights is tie_weights
        later = load_model(*args)
        assert later.lm_head.weight is later.model.embed_tokens.weight
