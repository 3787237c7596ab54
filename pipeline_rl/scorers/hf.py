"""What the built-in model scorers share: loading a Hugging Face model where the preprocessor
runs, the policy's tokenizer, packing sequences into rows of at most `preprocess.seq_length`
tokens for one forward pass each, and batching them by length (`batched_logits`).

Packed rows restart position_ids at 0 for each sequence and pass no attention mask and no
cache: transformers then attends within each sequence only (see
pipeline_rl/core/logprobs.py), for causal LMs and the token-classification heads built on
them alike.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from pipeline_rl.config import RunConfig


def scorer_device(cfg: RunConfig) -> torch.device:
    """The preprocessor's GPU when it has one (world.preprocessor_gpus > 0), else the CPU."""
    use_gpu = cfg.world.preprocessor_gpus > 0 and torch.cuda.is_available()
    return torch.device("cuda" if use_gpu else "cpu")


_LOADING = threading.Lock()
"""transformers' from_pretrained swaps PreTrainedModel.tie_weights and init_weights for no-ops
at class level while it loads, and puts back what it found: two loads in two threads can leave
the no-ops in place for good, and every later model of the process loads with its embeddings
untied and new weights uninitialised (measured with transformers 5.19)."""


def load_model(auto_class: Any, path: str, cfg: RunConfig, device: torch.device, **kwargs: Any) -> Any:
    """A frozen model of `auto_class` (e.g. AutoModelForCausalLM) from `path`, in cfg.model.dtype:
    a transformers PreTrainedModel (typed Any: its `.config` is dynamic). Loads are serialised
    in a process (see _LOADING)."""
    with _LOADING:
        model = auto_class.from_pretrained(path, dtype=getattr(torch, cfg.model.dtype), **kwargs)
    return model.to(device).eval().requires_grad_(False)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def pack_rows(lengths: list[int], seq_length: int) -> list[list[int]]:
    """Consecutive sequence indices packed into rows of up to seq_length tokens (a longer
    sequence gets a row to itself)."""
    rows: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if not rows or used + n > seq_length:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def batched_logits(model: torch.nn.Module, sequences: list[list[int]], max_tokens: int, device: torch.device):
    """Per sequence, the model's logits at each of its positions ([len, C] float32 tensors on
    the CPU). Sequences go longest first into right-padded batches of at most `max_tokens`
    tokens, padding included, with an attention mask: a batch of sequences of about one length
    costs their attention alone, where one packed row of `max_tokens` would attend over all of
    its tokens (on CPU, several times slower for the short prefixes step guidance scores)."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]), reverse=True)
    while order:
        width = len(sequences[order[0]])
        size = max(1, max_tokens // max(width, 1))
        batch, order = order[:size], order[size:]
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
            mask[row, : len(sequences[i])] = 1
        with torch.no_grad():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
        logits = logits.float().cpu()
        for row, i in enumerate(batch):
            out[i] = logits[row, : len(sequences[i])]
    return out
