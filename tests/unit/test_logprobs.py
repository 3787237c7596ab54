"""packed_logprobs: packed sequences give the same logprobs/entropies as each run alone."""

import importlib.util

import pytest
import torch
from fixtures import helpers

from pipeline_rl.config import ConfigError, attention_kernel, load_config
from pipeline_rl.core.logprobs import packed_logprobs, sequence_starts
from pipeline_rl.core.packed_attention import PAD_TO


def random_qwen2(attn: str) -> torch.nn.Module:
    return helpers.random_qwen2(attn, max_len=64)


def alone(model, ids: list[int], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: one unpacked sequence, logprobs from the plain full-vocabulary softmax."""
    x = torch.tensor([ids])
    logits = model(input_ids=x).logits[0, :-1].float() / temperature
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, x[0, 1:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    return torch.cat([torch.zeros(1), lp]), torch.cat([torch.zeros(1), ent])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_equals_each_sequence_alone(attn):
    model = random_qwen2(attn)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (6, 1, 9, 4)]
    input_ids = torch.tensor([sum(seqs, [])])
    position_ids = torch.tensor([sum((list(range(len(s))) for s in seqs), [])])
    with torch.no_grad():
        lp, ent = packed_logprobs(model, input_ids, position_ids, temperature=0.7)
        expected = [alone(model, s, 0.7) for s in seqs]
    exp_lp = torch.cat([e[0] for e in expected])
    exp_ent = torch.cat([e[1] for e in expected])
    assert lp.shape == ent.shape == (input_ids.shape[1],)
    torch.testing.assert_close(lp, exp_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, exp_ent, atol=1e-5, rtol=1e-5)
    # Each sequence's first token has no prediction.
    assert (lp[sequence_starts(position_ids)] == 0).all()


def test_unpacked_positions_would_leak_across_sequences():
    """The same tokens with one continuous position range attend across the boundary, so
    the packed test above would fail if the packing mask were not applied."""
    model = random_qwen2("sdpa")
    seqs = [[5, 6, 7, 8], [9, 10, 11]]
    input_ids = torch.tensor([seqs[0] + seqs[1]])
    with torch.no_grad():
        packed, _ = packed_logprobs(model, input_ids, torch.tensor([[0, 1, 2, 3, 0, 1, 2]]), 1.0)
        leaked, _ = packed_logprobs(model, input_ids, torch.arange(7)[None], 1.0)
    assert not torch.allclose(packed[5:], leaked[5:], atol=1e-4)


def test_temperature_scales_logits_and_gradients_flow():
    model = random_qwen2("sdpa")
    input_ids = torch.tensor([[3, 4, 5, 6, 7]])
    position_ids = torch.arange(5)[None]
    lp_hot, ent_hot = packed_logprobs(model, input_ids, position_ids, temperature=2.0)
    _, ent_cold = packed_logprobs(model, input_ids, position_ids, temperature=0.5)
    assert (ent_hot[1:] > ent_cold[1:]).all()  # higher temperature: flatter distribution
    lp_hot.sum().backward()
    assert model.model.embed_tokens.weight.grad is not None


def test_rejects_batched_input():
    with pytest.raises(ValueError, match=r"\[1, T\]"):
        packed_logprobs(
            random_qwen2("sdpa"), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), 1.0
        )


def shared_layout(prompt: list[int], completions: list[list[int]]):
    """A block: the head holds prompt + first completion, the followers only their completion."""
    seqs = [prompt + completions[0]] + completions[1:]
    prefix = [0] + [len(prompt)] * (len(completions) - 1)
    positions = list(range(len(seqs[0]))) + [
        p for c in completions[1:] for p in range(len(prompt), len(prompt) + len(c))
    ]
    return seqs, prefix, positions


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prompt_equals_each_rollout_alone(attn):
    """Two groups packed as prompt + completions give each completion token the logprob and
    entropy it has in its own prompt + completion sequence, and standalone sequences mixed in
    are unaffected."""
    model = random_qwen2(attn)
    g = torch.Generator().manual_seed(2)
    rand = lambda n: torch.randint(0, 97, (n,), generator=g).tolist()  # noqa: E731
    groups = [(rand(5), [rand(3), rand(1), rand(4)]), (rand(2), [rand(2), rand(3)])]
    lone = rand(6)
    seqs, prefix, positions, expected_lp, expected_ent = [], [], [], [], []
    for g_index, (prompt, completions) in enumerate(groups):
        s, p, pos = shared_layout(prompt, completions)
        seqs += s
        prefix += p
        positions += pos
        for i, c in enumerate(completions):
            lp, ent = alone(model, prompt + c, 0.8)
            keep = slice(0, None) if i == 0 else slice(len(prompt), None)
            expected_lp.append(lp[keep])
            expected_ent.append(ent[keep])
        if g_index == 0:
            seqs.append(lone)
            prefix.append(0)
            positions += range(len(lone))
            lp, ent = alone(model, lone, 0.8)
            expected_lp.append(lp)
            expected_ent.append(ent)
    input_ids = torch.tensor([sum(seqs, [])])
    with torch.no_grad():
        lp, ent = packed_logprobs(model, input_ids, torch.tensor([positions]), 0.8, [len(s) for s in seqs], prefix)
    torch.testing.assert_close(lp, torch.cat(expected_lp), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, torch.cat(expected_ent), atol=1e-5, rtol=1e-5)


def test_shared_prompt_gradients_match_separate_sequences():
    """The gradient of a loss on the completion tokens is the same in the shared layout as with
    each rollout packed as prompt + completion: the prompt is computed once but serves all."""
    prompt, completions = [7, 8, 9, 10], [[11, 12], [13], [14, 15, 16]]
    weights = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0, 2.0])

    def grad(shared: bool) -> torch.Tensor:
        model = random_qwen2("sdpa")
        if shared:
            seqs, prefix, positions = shared_layout(prompt, completions)
            lp, _ = packed_logprobs(
                model, torch.tensor([sum(seqs, [])]), torch.tensor([positions]), 1.0, [len(s) for s in seqs], prefix
            )
            completion_lp = lp[len(prompt) :]
        else:
            seqs = [prompt + c for c in completions]
            lp, _ = packed_logprobs(
                model, torch.tensor([sum(seqs, [])]), torch.tensor([sum((list(range(len(s))) for s in seqs), [])]), 1.0
            )
            parts, start = [], 0
            for s in seqs:
                parts.append(lp[start + len(prompt) : start + len(s)])
                start += len(s)
            completion_lp = torch.cat(parts)
        (completion_lp * weights).sum().backward()
        return model.model.embed_tokens.weight.grad.clone()

    torch.testing.assert_close(grad(True), grad(False), atol=1e-5, rtol=1e-4)


def test_shared_prompt_layout_errors_name_the_sequence():
    model = random_qwen2("sdpa")
    with pytest.raises(ValueError, match="sequence 0: prefix length 2"):
        packed_logprobs(model, torch.tensor([[1, 2, 3]]), torch.tensor([[2, 3, 4]]), 1.0, [3], [2])
    with pytest.raises(ValueError, match="position_ids"):
        packed_logprobs(model, torch.tensor([[1, 2, 3, 4]]), torch.tensor([[0, 1, 2, 0]]), 1.0, [3, 1], [0, 2])


@pytest.mark.parametrize("shared", [False, True])
def test_chunked_rows_give_the_same_values_and_gradients(shared):
    """chunk_tokens only changes how many rows of the float32 log-softmax exist at once: values
    and parameter gradients are those of the unchunked computation (row by row the same ops;
    the tolerance covers the different order of the gradient sums over chunks), with chunk
    sizes that do and do not divide the row count."""
    model = random_qwen2("eager")
    g = torch.Generator().manual_seed(5)
    prompt, completions = torch.randint(0, 97, (5,), generator=g).tolist(), [[7, 8, 9], [10, 11], [12, 13, 14, 15]]
    if shared:
        seqs, prefix, positions = shared_layout(prompt, completions)
    else:
        seqs = [prompt + c for c in completions]
        prefix, positions = None, [p for s in seqs for p in range(len(s))]
    input_ids, position_ids = torch.tensor([sum(seqs, [])]), torch.tensor([positions])
    lengths = [len(s) for s in seqs]
    results = []
    for chunk in (0, 4, 7, 1000):
        model.zero_grad()
        lp, ent = packed_logprobs(model, input_ids, position_ids, 0.9, lengths, prefix, chunk_tokens=chunk)
        (lp.sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]))
    for lp, ent, grads in results[1:]:
        torch.testing.assert_close(lp, results[0][0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ent, results[0][1], atol=1e-6, rtol=1e-6)
        for a, b in zip(grads, results[0][2]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_attention_kernel_follows_the_config(monkeypatch):
    cfg = load_config("tiny", ["shared.share_prompts=false"])
    assert attention_kernel(cfg, cuda=False) == "varlen"
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "flash_attn" else found(name))
    assert attention_kernel(cfg, cuda=True) == "flash_attention_2"
    assert attention_kernel(cfg, cuda=False) == "varlen"  # flash-attn is CUDA only
    shared = load_config("tiny", ["shared.share_prompts=true"])
    assert attention_kernel(shared, cuda=True) == "sdpa"  # shared prompts need an explicit mask
    assert attention_kernel(load_config("tiny", ["trainer.attention=eager"]), cuda=True) == "eager"
    with pytest.raises(ConfigError, match=r"'trainer\.attention' flash_attention_2 cannot run 'shared\.share_prompts'"):
        load_config("tiny", ["trainer.attention=flash_attention_2", "shared.share_prompts=true"])
    with pytest.raises(ConfigError, match=r"trainer\.attention"):
        load_config("tiny", ["trainer.attention=flash"])


class _VocabRows(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the most vocabulary-wide rows any single tensor held: ops' outputs whose last
    dimension is the vocabulary, forward and backward."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.most = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab:
                self.most = max(self.most, t.numel() // self.vocab)
        return out


def test_no_full_vocabulary_logits_for_the_whole_micro_batch():
    """The logprob step's largest [rows, V] tensor (forward and backward) has `chunk_tokens`
    rows whatever the micro-batch length: the output layer runs one chunk at a time, so the
    step's peak memory grows with the chunk, not with the tokens. Without chunking it has
    every row, which shows the probe sees the logits."""
    from transformers import Qwen2ForCausalLM

    from pipeline_rl.demo.tiny_model import qwen2_config

    vocab, chunk = 1000, 32
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen2_config(vocab, hidden=32, layers=1, intermediate=64, max_len=1024))
    calls = []
    model.lm_head.register_forward_pre_hook(lambda _module, args: calls.append(args[0].shape[-2]))
    for tokens, chunk_tokens, rows in ((256, chunk, chunk), (768, chunk, chunk), (256, 0, 255)):
        ids = torch.randint(0, vocab, (1, tokens))
        probe = _VocabRows(vocab)
        calls.clear()
        with probe:
            lp, ent = packed_logprobs(model, ids, torch.arange(tokens)[None], 1.0, chunk_tokens=chunk_tokens)
            (lp.sum() + ent.sum()).backward()
        assert probe.most == rows, (tokens, chunk_tokens)
        # The output layer is called twice whatever the chunk count (the model's call, left
        # with no rows, and one for all rows): under ZeRO-3 each call is a collective all ranks make.
        assert calls == [tokens, tokens - 1], calls


def test_models_with_transformed_logits_use_their_own_logits():
    """A config naming a logit transform (LOGIT_TRANSFORMS) takes the model's logits instead of
    the output layer's; Qwen2 applies none, so both routes must give the same values."""
    model = random_qwen2("sdpa")
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(3))
    plain, _ = packed_logprobs(model, ids, torch.arange(12)[None], 0.8, chunk_tokens=5)
    model.config.final_logit_softcapping = 30.0
    via_logits, _ = packed_logprobs(model, ids, torch.arange(12)[None], 0.8, chunk_tokens=5)
    torch.testing.assert_close(via_logits, plain, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_one_token_row_has_a_zero_logprob_and_a_gradient_path(compiled):
    """A padding micro-batch is one token: nothing is predicted, and backward still runs (the
    output layer is called with no rows on every rank alike), with either logprob kernel."""
    model = random_qwen2("sdpa")
    lp, ent = packed_logprobs(model, torch.tensor([[5]]), torch.tensor([[0]]), 1.0, chunk_tokens=4, compiled=compiled)
    assert lp.tolist() == [0.0] and ent.tolist() == [0.0]
    (lp.sum() + ent.sum()).backward()


def test_auto_attention_is_varlen_without_flash_attn_and_sdpa_with_shared_prompts(monkeypatch):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "flash_attn" else found(name))
    cfg = load_config("tiny", ["shared.share_prompts=false"])
    assert attention_kernel(cfg, cuda=True) == "varlen"
    assert attention_kernel(cfg, cuda=False) == "varlen"
    shared = load_config("tiny", ["shared.share_prompts=true"])
    assert attention_kernel(shared, cuda=True) == attention_kernel(shared, cuda=False) == "sdpa"
    with pytest.raises(ConfigError, match=r"'trainer\.attention' varlen cannot run 'shared\.share_prompts'"):
        load_config("tiny", ["trainer.attention=varlen", "shared.share_prompts=true"])


def _packed_batch(lengths: list[int], seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (1, sum(lengths)), generator=g)
    return ids, torch.tensor([[p for n in lengths for p in range(n)]])


def test_varlen_attention_gives_the_logprobs_and_gradients_of_the_masked_row():
    """trainer.attention=varlen (each sequence attended alone) against sdpa over the whole row
    with transformers' block-diagonal mask: same values and parameter gradients (float32; the
    tolerance covers summation order inside the kernels)."""
    lengths = [6, 1, 9, 4, 9, 3]
    ids, pos = _packed_batch(lengths)
    results = []
    for attn in ("sdpa", "varlen"):
        model = random_qwen2(attn)
        lp, ent = packed_logprobs(model, ids, pos, 0.8, lengths)
        (lp.sum() + 0.3 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), [p.grad for p in model.parameters()]))
    helpers.assert_same_logprobs_and_gradients(results[1], results[0])


def test_varlen_attention_needs_the_sequence_lengths():
    ids, pos = _packed_batch([4, 4])
    with pytest.raises(ValueError, match="varlen attention needs seq_lengths"):
        packed_logprobs(random_qwen2("varlen"), ids, pos, 1.0)


class _AttentionWork(torch.utils._python_dispatch.TorchDispatchMode):
    """Sums batch x heads x query length x key length x head size over every forward call of an
    sdpa kernel, whichever one the dispatcher picks: the attention's multiply-adds as called
    (torch's flop counter has no formula for the CPU kernels)."""

    def __init__(self):
        super().__init__()
        self.work = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if "scaled_dot_product" in name and "backward" not in name:
            q, k = args[0], args[1]
            self.work += q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]
        return func(*args, **(kwargs or {}))


def _attention_flops(attn: str, lengths: list[int]) -> int:
    model = random_qwen2(attn)
    ids, pos = _packed_batch(lengths)
    with torch.no_grad(), _AttentionWork() as counter:
        packed_logprobs(model, ids, pos, 1.0, lengths)
    return counter.work


def test_varlen_attention_work_follows_the_sequences_not_the_row():
    """Attention work of one row of 8 x PAD_TO tokens: as 8 sequences of PAD_TO under varlen it
    is 1/8 of the row as one sequence (sum of squared lengths: 8 x PAD_TO^2 against
    (8 x PAD_TO)^2); sdpa with the block-diagonal mask does the whole row's work either way. On
    CPU a sequence is padded to a multiple of PAD_TO: one token past it costs as much as 2 x
    PAD_TO, and sequences of many lengths up to PAD_TO cost as much as PAD_TO each."""
    packed, single = [PAD_TO] * 8, [8 * PAD_TO]
    varlen_packed, varlen_single = _attention_flops("varlen", packed), _attention_flops("varlen", single)
    assert varlen_single > 0 and varlen_packed * 8 == varlen_single
    assert _attention_flops("sdpa", packed) == _attention_flops("sdpa", single) == varlen_single
    assert _attention_flops("varlen", [PAD_TO + 1]) == _attention_flops("varlen", [2 * PAD_TO]) == varlen_packed // 2
    assert _attention_flops("varlen", list(range(1, PAD_TO + 1))) == 4 * varlen_packed


@pytest.mark.parametrize("weights", [(1.0, 0.0), (0.0, 1.0), (1.0, 0.5)], ids=["logprob", "entropy", "both"])
def test_output_layer_gradient_is_autograds(weights):
    """The chunked output layer's hand-written gradient against autograd through the plain
    log-softmax of the model's own logits (LOGIT_TRANSFORMS route), for a loss on the logprobs,
    on the entropies and on both, with chunks that do not divide the rows."""
    ids, pos = _packed_batch([7, 5, 9])
    grads = []
    for via_logits in (False, True):
        model = random_qwen2("sdpa")
        if via_logits:
            model.config.final_logit_softcapping = 1.0  # listed, so the logits route; a no-op here
        lp, ent = packed_logprobs(model, ids, pos, 0.7, chunk_tokens=4)
        (weights[0] * (lp * torch.linspace(-1, 1, lp.numel())).sum() + weights[1] * ent.sum()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for ours, reference in zip(*grads):
        torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-5)


def test_wanted_tokens_get_the_same_values_and_gradients():
    """`wanted`: the output layer runs only for those tokens; their logprobs and entropies, and
    the gradients of a loss on them, are those of the full computation; other tokens get 0."""
    lengths = [6, 4, 9]
    ids, pos = _packed_batch(lengths)
    wanted = [2, 3, 5, 8, 9, 12, 18]
    keep = torch.zeros(ids.shape[1])
    keep[wanted] = 1.0
    results = []
    for subset in (None, wanted):
        model = random_qwen2("sdpa")
        lp, ent = packed_logprobs(model, ids, pos, 0.9, lengths, chunk_tokens=3, wanted=subset)
        ((lp + 0.2 * ent) * keep).sum().backward()
        results.append((lp.detach() * keep, ent.detach() * keep, lp.detach(), [p.grad for p in model.parameters()]))
    (lp_all, ent_all, _, grads_all), (lp_some, ent_some, raw_some, grads_some) = results
    torch.testing.assert_close(lp_some, lp_all, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent_some, ent_all, atol=1e-6, rtol=1e-6)
    assert (raw_some[keep == 0] == 0).all()
    for a, b in zip(grads_all, grads_some):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match=r"wanted tokens \[6\] begin a sequence"):
        packed_logprobs(random_qwen2("sdpa"), ids, pos, 1.0, lengths, wanted=[5, 6])
