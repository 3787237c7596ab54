"""The trainer's routing replay on real DeepSpeed ranks (gloo): behaviour logprobs computed
with given routes (not the ones the router would pick) are exactly what the trainer computes
at lag 0 when it replays those routes, and measurably not when it routes by itself."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from fixtures.helpers import hf_model
from fixtures.trainer_runs import train, trainer_config, trainer_metrics, write_steps

from pipeline_rl.core.logprobs import packed_logprobs
from pipeline_rl.core.routes import NO_ROUTE, encode_routes, no_routes
from pipeline_rl.demo.tiny_moe import EXPERTS, save_random
from pipeline_rl.preprocess.advantages import sequence_advantages
from pipeline_rl.preprocess.packing import rollout_sequence
from pipeline_rl.streams.records import Rollout
from pipeline_rl.trainer.routing_replay import RoutingReplay, moe_routers

pytestmark = pytest.mark.deepspeed


def routed_steps(model_path, groups: int, seed: int):
    """One step of random rollouts whose completions were routed to the experts after the ones
    the router picks (expert + 1), their behaviour logprobs computed so, their last token
    unrouted (as the engine reports it)."""
    model = hf_model(model_path, {})
    replay = RoutingReplay(model)
    layers = len(moe_routers(model))
    rng = random.Random(seed)
    seqs = []
    for g in range(groups):
        prompt = [rng.randrange(2, 258) for _ in range(rng.randint(4, 8))]
        rollouts = []
        for _ in range(4):
            completion = [rng.randrange(2, 258) for _ in range(rng.randint(3, 12))]
            ids = torch.tensor([prompt + completion])
            picked: list[torch.Tensor] = []
            hooks = [r.register_forward_hook(lambda m, a, out: picked.append(out[2])) for r in moe_routers(model)]
            replay.set(None, ids.shape[1], "own", torch.device("cpu"))
            with torch.no_grad():
                model(ids)
            for h in hooks:
                h.remove()
            own = torch.stack(picked, 1).numpy()[len(prompt) :]
            routes = ((own + 1) % EXPERTS).astype(np.uint8)
            routes[-1] = NO_ROUTE
            rows = np.concatenate([no_routes(len(prompt), layers * own.shape[2]), routes.reshape(len(completion), -1)])
            replay.set(encode_routes(rows), ids.shape[1], "behaviour", torch.device("cpu"))
            with torch.no_grad():
                lp, _ = packed_logprobs(model, ids, torch.arange(ids.shape[1])[None], 0.8)
            rollouts.append(
                Rollout(
                    prompt_ids=prompt,
                    completion_ids=completion,
                    logprobs=lp[len(prompt) :].tolist(),
                    versions=[0] * len(completion),
                    reward=float(rng.random() < 0.5),
                    finish_reason="stop",
                    routes=encode_routes(routes),
                )
            )
        advantages = sequence_advantages([r.reward for r in rollouts])
        seqs += [rollout_sequence(r, [a] * len(r.completion_ids), f"g{g}", 64) for r, a in zip(rollouts, advantages)]
    return [seqs]


def test_the_trainer_replays_the_routes_its_samples_were_drawn_with(tmp_path):
    model_path = save_random(tmp_path / "moe", seed=0, router_scale=10.0)
    steps = routed_steps(model_path, groups=2, seed=1)
    diffs = {}
    for replay in (True, False):
        run = tmp_path / f"replay_{replay}"
        cfg = trainer_config(run, model_path, "shared.max_steps=1", f"shared.routing_replay={str(replay).lower()}")
        write_steps(cfg, steps, ranks=1)
        train(cfg)
        [first] = trainer_metrics(run)
        assert first["mismatch/lag0_tokens"] == first["trained_tokens"] > 0
        diffs[replay] = first["mismatch/lag0_abs_logprob_diff"]
    # replayed: the same network up to fp32 summation order (as a dense model's lag-0 tokens,
    # test_trainer.py); routed by the trainer itself: other experts, other logprobs
    assert diffs[True] < 1e-4, diffs
    assert diffs[False] > 1e-2, diffs
