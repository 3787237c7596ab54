"""The in-flight swap's exactness check, shared by the TP = 1 and TP > 1 engine tests.

A swap from another thread during a long greedy generation takes effect at the next decode
step: tokens tagged with the old version are model A's argmax, tokens tagged with the new
version are model B's argmax given A's cached keys/values of the earlier tokens.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import torch
from helpers import hf_model


def argmax_agreement(logits: torch.Tensor, tokens: list[int]) -> tuple[int, int]:
    """(positions whose argmax is the token, positions where argmax is clear: top-2 gap > 1e-3)."""
    top2 = logits.topk(2, dim=-1)
    clear = (top2.values[:, 0] - top2.values[:, 1]) > 1e-3
    agree = top2.indices[:, 0] == torch.tensor(tokens)
    return int((agree | ~clear).sum()), len(tokens)


def swap_during_generation(
    client,
    tiny_model,
    weights_a: dict,
    weights_b: dict,
    swap: Callable[[], object],
    max_tokens: int = 160,
    model_of: Callable[[dict], torch.nn.Module] | None = None,
) -> None:
    """`client` serves `weights_a`; `swap()` (run in another thread after 40 forward passes)
    loads `weights_b` as the next version. `model_of(weights)` is the transformers model that
    serves them (default: the tiny model holding them)."""
    hook = client.hook
    old, new = hook.version, hook.version + 1
    prompt = client.tokenizer.encode("12 + 7 =")
    swap_after = 40

    def swap_when_k_tokens_done(start: int):
        while hook.forward_passes < start + swap_after:
            time.sleep(0.0005)
        swap()

    swaps_before = hook.swap_count
    thread = threading.Thread(target=swap_when_k_tokens_done, args=(hook.forward_passes,))
    thread.start()
    [c] = asyncio.run(client.generate(prompt, 1, max_tokens, 0.0, ignore_eos=True))
    thread.join()

    assert hook.swap_count == swaps_before + 1 and client.version == new
    stats = hook.recent_swaps()[0][-1]
    assert stats.lock_wait_s < 1.0 and stats.load_s < 1.0
    s = c.versions.index(new)  # first token produced by the new weights
    assert c.versions == [old] * s + [new] * (len(c.token_ids) - s)
    assert swap_after <= s < len(c.token_ids) - 20, f"swap at token {s} of {len(c.token_ids)}"

    tokens = c.token_ids
    model_of = model_of or (lambda weights: hf_model(tiny_model, weights))
    model_a, model_b = model_of(weights_a), model_of(weights_b)
    P = len(prompt)
    with torch.no_grad():
        full_a = model_a(torch.tensor([prompt + tokens])).logits[0, P - 1 : -1]
        # B's decode steps start from A's KV cache of the prompt and of tokens[:s-1].
        cache = model_a(torch.tensor([prompt + tokens[: s - 1]]), use_cache=True).past_key_values
        after = model_b(torch.tensor([tokens[s - 1 : -1]]), past_key_values=cache).logits[0]
    agree, total = argmax_agreement(full_a[:s], tokens[:s])
    assert agree == total, f"only {agree}/{total} tokens before the swap are model A's greedy choice"
    agree, total = argmax_agreement(after, tokens[s:])
    assert agree == total, f"only {agree}/{total} tokens after the swap are model B's greedy choice on A's cache"
    # Model A would have continued differently: the swap changed the generation.
    assert (full_a[s:].argmax(-1) != torch.tensor(tokens[s:])).any()
    # Greedy logprobs are the plain log-softmax; they match on both sides of the swap.
    expected = torch.cat([full_a[:s].log_softmax(-1), after.log_softmax(-1)]).gather(-1, torch.tensor(tokens)[:, None])[
        :, 0
    ]
    # Engine and transformers sum the same fp32 products in different orders (vLLM's CPU kernels
    # pick theirs by ISA; TP adds an all-reduce of two partial sums). Each of the 4 layers' dot
    # products (length <= 512) can then differ by up to length * 2^-24 of the sum of the absolute
    # products, about 3e-5 relative each: 1e-3 on log-probabilities bounds what that accumulates
    # to over the layers and the log-softmax, while a wrong version's logits differ by far more
    # (the argmax checks above).
    diff = (expected - torch.tensor(c.logprobs)).abs().max().item()
    assert diff < 1e-3, f"behaviour logprobs differ from transformers' by {diff:.2e}"


def worst_logprob_error(model: torch.nn.Module, prompts: list[list[int]], groups: list, temperature: float) -> float:
    """The largest |engine logprob - transformers logprob at `temperature`| over every sampled
    token of `groups` (one group of completions per prompt); also checks each completion's
    lengths and that its tokens carry one version."""
    worst = 0.0
    for prompt, group in zip(prompts, groups):
        for c in group:
            assert len(c.token_ids) == len(c.logprobs) == len(c.versions) > 0
            assert len(set(c.versions)) == 1
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1] / temperature
            expected = logits.log_softmax(-1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
            worst = max(worst, (expected - torch.tensor(c.logprobs)).abs().max().item())
    return worst
