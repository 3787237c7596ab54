"""`conf=tiny_moe` end to end: a mixture-of-experts policy served by vLLM and trained by
DeepSpeed, with routing replay, through the launcher's JSONL run."""

from __future__ import annotations

import pytest
from fixtures.launches import launch, stream_records, trainer_steps

from pipeline_rl.core.routes import NO_ROUTE, decode_routes
from pipeline_rl.demo.tiny_moe import TOP_K, save_random
from pipeline_rl.streams.records import PAD_GROUP_ID

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.deepspeed]

LAYERS = 4
"""MoE layers of the tiny MoE policy (demo/tiny_moe.py)."""


def test_conf_tiny_moe_replays_the_engines_routes_through_the_whole_run(tmp_path):
    """The shipped config on a random tiny MoE policy (routers scaled so that routing ties are
    rare): every micro-batch reaches the trainer with one row of routes per token, the engine's
    routes on generated tokens; the trainer replays them on every step (the step would fail on a
    micro-batch without routes), and on lag-0 tokens of rollouts no swap touched its fp32
    logprobs are the engine's up to the summation order, as for the dense models (a swap
    mid-rollout leaves KV entries of older weights in the engine, on either model)."""
    model = save_random(tmp_path / "tiny_moe", seed=0, router_scale=10.0)
    run_dir = tmp_path / "run"
    # A random policy is never right: keep the groups without reward spread, so steps train.
    overrides = ["shared.max_steps=4", "trainer.checkpoint_every=0", "preprocess.advantage.filter_zero=false"]
    code, out = launch(run_dir, f"model.path={model}", *overrides, conf="tiny_moe")
    assert code == 0, out[-4000:]
    steps = [s["values"] for s in trainer_steps(run_dir)]
    assert [s["version"] for s in steps] == [1, 2, 3, 4]
    batches = stream_records(run_dir, "trainer")
    assert batches
    recorded = 0
    for b in batches:
        if all(g == PAD_GROUP_ID for g in b["group_ids"]):
            continue  # a step whose every group was filtered out: padding alone, nothing routed
        rows = decode_routes(b["routes"], len(b["input_ids"]), f"step {b['step']}")
        assert rows.shape[1] == LAYERS * TOP_K
        routed = (rows != NO_ROUTE).all(axis=1)
        # Whole rows or none: a token is routed by the engine in every layer, or by the trainer.
        assert ((rows == NO_ROUTE).all(axis=1) | routed).all()
        recorded += int(routed.sum())
    assert recorded > 0
    trained = [s for s in steps if s.get("trained_tokens")]
    assert trained and all(s["routing/replayed"] > 0 for s in trained), steps
    lag0 = [s for s in steps if "mismatch/unswapped_abs_logprob_diff" in s]
    assert lag0 and all(s["mismatch/unswapped_abs_logprob_diff"] < 1e-3 for s in lag0), lag0
