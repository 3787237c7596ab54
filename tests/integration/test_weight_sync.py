"""Bucketed weight broadcast from a trainer-like sender process to a real vLLM engine.

The sender is this file run as a script in its own process: it hosts the store, announces
each update on the JSONL "weights" stream and broadcasts over gloo with 1 MiB buckets (the
tiny model needs several). The engine's receiver thread (LLMClient.start_receiver) reads the
announcements and swaps the weights in. One sender goes through: a good update; a shape
mismatch; a stall past the receiver's timeout; a good update again (the group is rebuilt);
it is SIGKILLed mid-transfer; a new sender at the same address (a restarted trainer) sends
again; that one is killed between updates and restarted too. After each failure the engine still serves the last complete version.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fixtures.helpers import ROOT, TESTS, free_port, hf_model, perturbed, record_messages, wait_for
from safetensors.torch import load_file

from pipeline_rl.config import load_config
from pipeline_rl.streams import open_streams
from pipeline_rl.streams.records import WeightUpdate
from pipeline_rl.weight_layout import plan_buckets
from pipeline_rl.weight_sync import PeerGone, WeightReceiver, WeightSender

pytestmark = pytest.mark.vllm

TIMEOUT_S = 4.0
BUCKET_MB = 1


def run_config(run_dir: str):
    return load_config(
        "base",
        [
            f"run_dir={run_dir}",
            "model.dtype=float32",
            "actor.llm.kv_cache_gib=0.25",
            "actor.llm.max_model_len=128",
            "actor.llm.max_num_seqs=32",
        ],
    )


def sender_main(addr: str, model_dir: str, run_dir: str) -> None:
    """Trainer-like sender: reads `send VERSION SEED MODE` lines; MODE is ok, shape (one
    tensor of a wrong shape), stall (the second buffer waits past the receivers' timeout) or
    hang (the second buffer never comes: the test kills this process)."""
    streams = open_streams(run_config(run_dir))
    writer = streams.writer("weights")

    def announce(update):
        writer.write(update)
        writer.flush()

    sender = WeightSender(addr, world_size=2, backend="gloo", timeout_s=TIMEOUT_S)
    start = sender._start
    base = load_file(str(Path(model_dir) / "model.safetensors"))
    print("ready", flush=True)
    for line in sys.stdin:
        _, version, seed, mode = line.split()
        weights = perturbed(base, int(seed))
        if mode == "shape":
            weights["model.norm.weight"] = torch.ones(weights["model.norm.weight"].shape[0] + 1)
        buffers = [0]

        def gated(buffer, mode=mode):
            buffers[0] += 1
            if buffers[0] == 2 and mode == "stall":
                time.sleep(TIMEOUT_S + 1)
            if buffers[0] == 2 and mode == "hang":
                print("hanging", flush=True)
                time.sleep(3600)
            return start(buffer)

        sender._start = gated
        try:
            seconds = sender.send(int(version), weights.items(), announce, bucket_mb=BUCKET_MB)
            print(f"sent {version} {seconds:.3f}", flush=True)
        except Exception as e:
            print(f"failed {version} {type(e).__name__}", flush=True)


class Setup:
    """The engine with its receiver thread, and the trainer-like sender processes."""

    def __init__(self, model_dir: Path, run_dir: str, addr: str):
        from pipeline_rl.engine.llm_client import LLMClient

        self.model_dir, self.run_dir, self.addr = model_dir, run_dir, addr
        self.senders: list[subprocess.Popen] = []
        self.start_sender()
        cfg = run_config(run_dir)
        self.client = LLMClient.create(cfg, str(model_dir), version=0)
        self.streams = open_streams(cfg)
        self.client.start_receiver(
            WeightReceiver(addr, rank=1, world_size=2, backend="gloo", timeout_s=TIMEOUT_S),
            self.streams.reader("weights", WeightUpdate),
        )

    def start_sender(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT)]))
        self.senders.append(
            subprocess.Popen(
                [sys.executable, __file__, self.addr, str(self.model_dir), self.run_dir],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
        )

    @property
    def sender(self) -> subprocess.Popen:
        return self.senders[-1]

    def wait_ready(self) -> None:
        assert self.sender.stdout.readline().strip() == "ready"

    def restart_sender(self) -> None:
        """Kill the sender and start another at the same address (a trainer that died)."""
        self.sender.kill()
        self.start_sender()
        self.wait_ready()

    def close(self) -> None:
        self.client.close()
        for sender in self.senders:
            if sender.poll() is None:
                sender.kill()
            sender.wait()
        self.streams.close()


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    ctx = Setup(tiny_model, str(tmp_path_factory.mktemp("run")), f"127.0.0.1:{free_port()}")
    ctx.wait_ready()
    yield ctx
    ctx.close()


def greedy(client) -> list[tuple[list[int], list[int]]]:
    prompts = [client.tokenizer.encode(p) for p in ("12 + 7 =", "the quick brown", "3")]

    async def run():
        return await asyncio.gather(*(client.generate(p, 1, 24, 0.0, ignore_eos=True) for p in prompts))

    return [(g[0].token_ids, g[0].versions) for g in asyncio.run(run())]


def command(sender, line: str) -> None:
    sender.stdin.write(line + "\n")
    sender.stdin.flush()


def failures(client) -> int:
    return client.stats()["swap_failures"]


def test_buckets_are_consecutive_and_bounded():
    mib = 2**20
    assert plan_buckets([mib // 2, mib // 2, mib // 2, 3 * mib, 10], bucket_mb=1) == [2, 1, 1, 1]
    assert sum(plan_buckets([100] * 1000, bucket_mb=1)) == 1000
    with pytest.raises(ValueError, match="host:port"):
        WeightSender("localhost", world_size=2, backend="gloo", timeout_s=TIMEOUT_S)
    with pytest.raises(ValueError, match="rank"):
        WeightReceiver("127.0.0.1:1", rank=0, world_size=2, backend="gloo", timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("stage_on_host", [False, True])
def test_mixed_tensors_arrive_intact_in_reused_buffers(stage_on_host):
    """Packed small tensors and large ones sent from their own storage (>= 1 MiB), several
    dtypes, 0-d, empty and non-contiguous tensors; the second update reuses the buffers.
    Staged on host, each message goes through a bounce buffer of the largest message's size."""
    import threading

    addr = f"127.0.0.1:{free_port()}"
    sender = WeightSender(addr, world_size=2, backend="gloo", timeout_s=TIMEOUT_S)
    receiver = WeightReceiver(
        addr, rank=1, world_size=2, backend="gloo", timeout_s=TIMEOUT_S, stage_on_host=stage_on_host
    )
    for version in (1, 2):
        g = torch.Generator().manual_seed(version)
        weights = [
            ("a", torch.randn(3, 5, generator=g)),
            ("b", torch.randn((), generator=g).to(torch.bfloat16)),
            ("c", torch.empty(0, 4, dtype=torch.float16)),
            ("big", torch.randn(600, 600, generator=g)),
            ("t", torch.randn(40, 30, generator=g).t()),
            ("d", torch.randn(7, generator=g).double()),
        ]
        announced, got = [], []  # the receiver thread starts once announce has the record
        thread = threading.Thread(target=lambda: got.append(receiver.receive(announced[0])))
        sender.send(version, weights, lambda u: (announced.append(u), thread.start()), bucket_mb=1)
        thread.join(10)
        assert [n for n, _ in got[0]] == [n for n, _ in weights]
        for (_, sent), (_, received) in zip(weights, got[0]):
            assert received.dtype == sent.dtype and torch.equal(received, sent)
        bounce = receiver._bounce
        if stage_on_host:
            # The largest message is "big" on its own (600 x 600 fp32); the packed rest is smaller.
            assert bounce is not None and bounce.numel() == 600 * 600 * 4
        else:
            assert bounce is None
    sender.close()
    receiver.close()


class _Shard(torch.nn.Module):
    """Worker 1 of a tensor-parallel pair: q and k land in its half of the rows of one fused
    parameter (column-parallel), o in its half of the columns (row-parallel), n whole."""

    def __init__(self, rows: int, width: int):
        super().__init__()
        self.qk = torch.nn.Parameter(torch.zeros(rows, width), requires_grad=False)
        self.o = torch.nn.Parameter(torch.zeros(width, rows // 2), requires_grad=False)
        self.n = torch.nn.Parameter(torch.zeros(width), requires_grad=False)

    def load_weights(self, weights) -> None:
        half = self.qk.shape[0] // 2
        for name, t in weights:
            if name in ("q", "k"):
                at = 0 if name == "q" else half
                self.qk[at : at + half].copy_(t[t.shape[0] // 2 :])
            elif name == "o":
                self.o.copy_(t[:, t.shape[1] // 2 :])
            else:
                self.n.copy_(t)


def test_a_receiver_keeps_only_its_shard_of_an_update():
    """Staged on host with `keep` (a TP worker's copy plan's source views), the receiver's host
    buffer holds the shard alone, about half the update here, and the plan's copies from the
    kept blocks load exactly the shard a full receive would (torch.equal), update after update."""
    import threading

    from pipeline_rl.engine.load_plan import LoadPlan

    rows, width = 256, 512
    shapes = {"q": (rows, width), "k": (rows, width), "o": (width, rows), "n": (width,)}
    engine = _Shard(rows, width)
    checkpoint = [(name, torch.zeros(shape)) for name, shape in shapes.items()]
    plan = LoadPlan.capture(engine, checkpoint, list(shapes))
    keep = {
        name: [(shape, stride, offset) for _, shape, stride, offset in pairs] for name, pairs in plan.copies.items()
    }
    addr = f"127.0.0.1:{free_port()}"
    sender = WeightSender(addr, world_size=2, backend="gloo", timeout_s=TIMEOUT_S)
    receiver = WeightReceiver(addr, 1, 2, "gloo", TIMEOUT_S, stage_on_host=True, keep=keep)
    for version in (1, 2):
        g = torch.Generator().manual_seed(version)
        weights = [(name, torch.randn(shape, generator=g)) for name, shape in shapes.items()]
        announced, got = [], []
        thread = threading.Thread(target=lambda: got.append(receiver.receive_kept(announced[0])))
        sender.send(version, weights, lambda u: (announced.append(u), thread.start()), bucket_mb=1)
        thread.join(10)
        kept = got[0]
        plan.copy([(dst, block) for name, pairs in plan.copies.items() for (dst, *_), block in zip(pairs, kept[name])])
        expected = _Shard(rows, width)
        expected.load_weights(weights)
        for mine, want in zip(engine.parameters(), expected.parameters()):
            assert torch.equal(mine, want)
        shard_bytes = sum(p.numel() * 4 for p in engine.parameters())
        total_bytes = sum(t.numel() * 4 for _, t in weights)
        assert receiver._buffer is not None and receiver._buffer.numel() == shard_bytes < 0.51 * total_bytes
    with pytest.raises(ValueError, match="stages it on host"):
        WeightReceiver(addr, 1, 2, "gloo", TIMEOUT_S, stage_on_host=False, keep=keep)
    sender.close()
    receiver.close()


def test_sender_takes_each_tensor_only_when_its_message_is_built():
    """With specs, the announcement needs no tensor and the tensors are pulled from a generator
    one message at a time, and a bucket's messages are done before the next bucket's first
    tensor is taken (what lets the trainer gather one bucket at a time, and what makes reusing
    the pack area safe on NCCL, whose broadcasts run asynchronously); a generator that strays
    from the specs is refused, naming the tensor."""
    import threading

    g = torch.Generator().manual_seed(0)
    weights = [(f"w{i}", torch.randn(300, 300, generator=g)) for i in range(6)]  # 360 kB each
    weights.insert(3, ("empty", torch.empty(0)))
    specs = [(n, list(t.shape), t.dtype) for n, t in weights]
    events: list[str] = []

    def generate(items):
        for name, tensor in items:
            events.append(f"take {name}")
            yield name, tensor

    addr = f"127.0.0.1:{free_port()}"
    sender = WeightSender(addr, world_size=2, backend="gloo", timeout_s=TIMEOUT_S)
    receiver = WeightReceiver(addr, rank=1, world_size=2, backend="gloo", timeout_s=TIMEOUT_S)
    record_messages(sender, events, lambda buffer: (buffer.numel(), "send"))

    announced, got = [], []
    thread = threading.Thread(target=lambda: got.append(receiver.receive(announced[0])))

    def announce(update):
        events.append("announce")
        announced.append(update)
        thread.start()

    sender.send(1, generate(weights), announce, bucket_mb=1, specs=specs)
    thread.join(10)
    assert [n for n, _ in got[0]] == [n for n, _ in weights]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got[0], weights))
    # 1 MiB buckets of two 360 kB tensors each: a bucket's tensors are taken, then it is sent.
    msg = 300 * 300 * 4 * 2
    assert events == [
        "announce",
        *["take w0", "take w1", f"send {msg}", f"done {msg}"],
        *["take w2", "take empty", "take w3", f"send {msg}", f"done {msg}"],
        *["take w4", "take w5", f"send {msg}", f"done {msg}"],
    ], events

    wrong = [("other", weights[0][1]), *weights[1:]]
    with pytest.raises(
        ValueError, match=r"weight tensor 0 is other \[300, 300\] float32, announced as w0 \[300, 300\] float32"
    ):
        sender.send(2, generate(wrong), lambda update: None, bucket_mb=1, specs=specs)
    sender.close()
    receiver.close()


def test_broadcast_changes_engine_outputs_and_versions(setup, tiny_model):
    client, sender, streams = setup.client, setup.sender, setup.streams
    before = greedy(client)
    assert all(v == [0] * len(v) for _, v in before)
    command(sender, "send 1 1 ok")
    assert sender.stdout.readline().startswith("sent 1")
    wait_for(lambda: client.version == 1, 30, "version 1 in the engine")
    after = greedy(client)
    assert all(v == [1] * len(v) for _, v in after)
    assert [t for t, _ in after] != [t for t, _ in before]
    # The engine now computes with the sent weights: greedy tokens are their argmax.
    model = hf_model(tiny_model, perturbed(load_file(str(tiny_model / "model.safetensors")), 1))
    prompt = client.tokenizer.encode("12 + 7 =")
    with torch.no_grad():
        logits = model(torch.tensor([prompt + after[0][0]])).logits[0, len(prompt) - 1 : -1]
    assert logits.argmax(-1).tolist() == after[0][0]
    # The announcement split the tiny model into several buckets.
    [entry] = streams.reader("weights", WeightUpdate).read(timeout=1.0)
    assert len(entry.record.bucket_sizes) > 1 and entry.record.version == 1


def test_failed_updates_keep_the_last_complete_version(setup):
    client, sender = setup.client, setup.sender
    assert client.version == 1
    serving = greedy(client)

    # A tensor of the wrong shape: received, rejected before loading.
    count = failures(client)
    command(sender, "send 2 2 shape")
    assert sender.stdout.readline().startswith("sent 2")
    wait_for(lambda: failures(client) == count + 1, 30, "the shape mismatch to be counted")
    assert client.version == 1 and greedy(client) == serving

    # The sender stalls past the receiver's timeout: receive() raises instead of hanging.
    count = failures(client)
    started = time.monotonic()
    command(sender, "send 3 3 stall")
    wait_for(lambda: failures(client) == count + 1, 3 * TIMEOUT_S + 10, "the stalled transfer to time out")
    assert time.monotonic() - started < 3 * TIMEOUT_S + 5
    assert sender.stdout.readline().startswith("failed 3")
    assert client.version == 1 and greedy(client) == serving

    # The next update rebuilds the group on both sides and goes through.
    command(sender, "send 4 4 ok")
    assert sender.stdout.readline().startswith("sent 4")
    wait_for(lambda: client.version == 4, 30, "version 4 in the engine")
    serving = greedy(client)
    assert all(v == [4] * len(v) for _, v in serving)

    # The sender process is killed mid-transfer: the receiver fails fast, version 4 stays.
    count = failures(client)
    command(sender, "send 5 5 hang")
    assert sender.stdout.readline().strip() == "hanging"
    started = time.monotonic()
    os.kill(sender.pid, signal.SIGKILL)
    wait_for(lambda: failures(client) == count + 1, 30, "the killed transfer to be counted")
    assert time.monotonic() - started < TIMEOUT_S
    # What the actor logs and goes on from (actor.py): the failure names the sender that is gone.
    assert isinstance(client.group_failure, PeerGone)
    assert "trainer0 (weight-update rank 0, the sender) is gone" in str(client.group_failure)
    assert client.version == 4 and greedy(client) == serving

    # The trainer restarts (a new store at the same address): the receiver connects again.
    setup.start_sender()
    setup.wait_ready()
    command(setup.sender, "send 6 6 ok")
    assert setup.sender.stdout.readline().startswith("sent 6")
    wait_for(lambda: client.version == 6, 30, "version 6 in the engine")
    assert all(v == [6] * len(v) for _, v in greedy(client))

    # The trainer dies between updates and restarts: the receiver's store connection is stale.
    setup.restart_sender()
    command(setup.sender, "send 7 7 ok")
    assert setup.sender.stdout.readline().startswith("sent 7")
    wait_for(lambda: client.version == 7, 30, "version 7 in the engine")

    # The trainer restarts from a checkpoint older than the engine's version (it died before
    # checkpointing 7): the engine takes the new trainer's version, though it is lower.
    setup.restart_sender()
    command(setup.sender, "send 5 5 ok")
    assert setup.sender.stdout.readline().startswith("sent 5")
    wait_for(lambda: client.version == 5, 30, "version 5 of the restarted trainer in the engine")
    assert all(v == [5] * len(v) for _, v in greedy(client))


if __name__ == "__main__":
    sender_main(*sys.argv[1:])
