"""Contract tests of the stream layer, run against both backends (JSONL files and a real
redis-server), with real writer/reader processes started by multiprocessing 'spawn'."""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from pipeline_rl.config import load_config, load_saved_config, save_config
from pipeline_rl.streams import PositionStore, api, open_streams, partitions_for
from pipeline_rl.streams.api import BATCH_RECORDS, READ_BYTES
from pipeline_rl.streams.jsonl_backend import partition_path
from pipeline_rl.streams.records import DeadLetter, Metrics, Rollout, RolloutGroup, encode

SPAWN = mp.get_context("spawn")


def make_cfg(tmp_path: Path, backend: str, port: int = 0):
    overrides = [f"run_dir={tmp_path / 'run'}", f"streams.backend={backend}", "name=streamtest"]
    if backend == "redis":
        overrides.append(f"streams.redis.port={port}")
    cfg = load_config("base", overrides)
    save_config(cfg, Path(cfg.run_dir) / "config.yaml")
    return cfg


@pytest.fixture(params=["jsonl", pytest.param("redis", marks=pytest.mark.redis)])
def backend(request):
    return request.param


@pytest.fixture
def cfg(backend, tmp_path, request):
    port = request.getfixturevalue("redis_server").port if backend == "redis" else 0
    return make_cfg(tmp_path, backend, port)


@pytest.fixture
def streams(cfg):
    s = open_streams(cfg)
    yield s
    s.close()


def group(i: int, tokens: int = 8, writer: str = "w") -> RolloutGroup:
    rollout = Rollout(
        prompt_ids=[1, 2, 3],
        completion_ids=list(range(tokens)),
        logprobs=[-0.5] * tokens,
        versions=[0] * tokens,
        reward=1.0,
        finish_reason="stop",
    )
    return RolloutGroup(problem_id=f"{writer}:{i}", group_id=f"{writer}:{i}", rollouts=[rollout])


def read_all(reader, n: int, timeout: float = 10.0, max_count: int = 256) -> list:
    """Entries until `n` are collected or `timeout` passes."""
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += reader.read(timeout=0.2, max_count=min(max_count, n - len(out)))
    return out


def ids(entries) -> list[str]:
    return [e.record.problem_id for e in entries]


# ---- child processes: each opens its own Streams from the saved config ----


def child_write(
    run_dir: str, topic: str, partition: int, writer: str, count: int, big_every: int, delay_s: float
) -> None:
    time.sleep(delay_s)
    s = open_streams(load_saved_config(Path(run_dir) / "config.yaml"))
    w = s.writer(topic, partitions=partition + 1)
    for i in range(count):
        record = group(i, 50_000 if big_every and i % big_every == 0 else 8, writer)
        record.metadata["sent"] = time.time()
        w.write(record, partition=partition)
    s.close()


def child_consume_then_die(run_dir: str, topic: str, count: int, done_file: str) -> None:
    """Process `count` records (append their ids to done_file), save the position, then SIGKILL itself."""
    s = open_streams(load_saved_config(Path(run_dir) / "config.yaml"))
    store = PositionStore(Path(run_dir) / "positions" / "consumer.json")
    r = s.reader(topic, RolloutGroup, position=store.load())
    done = 0
    while done < count:
        entries = r.read(timeout=5.0, max_count=min(3, count - done))
        with open(done_file, "a") as f:
            f.writelines(e.record.problem_id + "\n" for e in entries)
        store.save(r.position())
        done += len(entries)
    os.kill(os.getpid(), signal.SIGKILL)


def child_write_huge(run_dir: str, topic: str, nbytes: int) -> None:
    s = open_streams(load_saved_config(Path(run_dir) / "config.yaml"))
    w = s.writer(topic)
    for i in range(3):
        w.write(group(i))
    w.write(Metrics(process="huge", time=0.0, values={"blob": "x" * nbytes}))
    s.close()


def start(target, *args):
    proc = SPAWN.Process(target=target, args=args)
    proc.start()
    return proc


# ---- contract tests ----


def test_order_offsets_and_position(streams):
    w = streams.writer("actor")
    for i in range(300):
        w.write(group(i))
    w.flush()
    r = streams.reader("actor", RolloutGroup)
    first = r.read(timeout=5, max_count=100)
    assert ids(first) == [f"w:{i}" for i in range(100)]
    rest = read_all(r, 200)
    assert ids(rest) == [f"w:{i}" for i in range(100, 300)]
    assert all(e.partition == 0 and isinstance(e.offset, str) for e in first + rest)
    assert len({e.offset for e in first + rest}) == 300
    assert r.read(timeout=0.1) == []
    assert r.dead_letters == 0


def test_read_times_out_with_empty_list(streams):
    r = streams.reader("actor", RolloutGroup)
    t0 = time.monotonic()
    assert r.read(timeout=0.5) == []
    elapsed = time.monotonic() - t0
    assert 0.45 <= elapsed < 2.0


def test_read_wakes_when_another_process_writes(streams, cfg):
    r = streams.reader("actor", RolloutGroup)
    proc = start(child_write, cfg.run_dir, "actor", 0, "child", 1, 0, 0.5)
    t0 = time.monotonic()
    entries = r.read(timeout=30)
    received = time.time()
    proc.join(10)
    assert ids(entries) == ["child:0"]
    assert time.monotonic() - t0 < 25
    # Woken within a fraction of a second of the write, not at the end of the timeout.
    assert received - entries[0].record.metadata["sent"] < 0.5


def test_writer_processes_do_not_interleave(streams, cfg):
    # Two processes append to the same partition, with 400 KB records among 1 KB ones.
    procs = [start(child_write, cfg.run_dir, "actor", 0, name, 60, 7, 0.0) for name in ("a", "b")]
    r = streams.reader("actor", RolloutGroup)
    entries = read_all(r, 120, timeout=60)
    for proc in procs:
        proc.join(10)
        assert proc.exitcode == 0
    assert r.dead_letters == 0
    for name in ("a", "b"):
        mine = [e for e in entries if e.record.group_id.startswith(name + ":")]
        assert ids(mine) == [f"{name}:{i}" for i in range(60)]
        assert [len(e.record.rollouts[0].completion_ids) for e in mine][:8] == [50_000] + [8] * 6 + [50_000]


def test_round_robin_partitions_and_split(streams):
    w = streams.writer("actor", partitions=3)
    for i in range(9):
        w.write(group(i))
    w.write(group(100), partition=1)
    w.flush()
    with pytest.raises(ValueError, match="partition 3"):
        w.write(group(0), partition=3)
    assert partitions_for(0, 2, 3) == [0, 2] and partitions_for(1, 2, 3) == [1]
    assert partitions_for(3, 4, 3) == []
    with pytest.raises(ValueError):
        partitions_for(2, 2, 3)
    got = {}
    for consumer in range(2):
        r = streams.reader("actor", RolloutGroup, partitions=partitions_for(consumer, 2, 3))
        for e in read_all(r, 6 - 2 * consumer, timeout=5.0):
            got.setdefault(e.partition, []).append(e.record.problem_id)
        assert r.read(timeout=0.1) == []
    assert got == {0: ["w:0", "w:3", "w:6"], 1: ["w:1", "w:4", "w:7", "w:100"], 2: ["w:2", "w:5", "w:8"]}


def test_resume_after_reader_process_dies(streams, cfg, tmp_path):
    w = streams.writer("actor")
    for i in range(20):
        w.write(group(i))
    w.flush()
    done_file = tmp_path / "done.txt"
    proc = start(child_consume_then_die, cfg.run_dir, "actor", 7, str(done_file))
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    first = done_file.read_text().split()
    position = PositionStore(Path(cfg.run_dir) / "positions" / "consumer.json").load()
    r = streams.reader("actor", RolloutGroup, position=position)
    rest = ids(read_all(r, 13, timeout=10))
    assert r.read(timeout=0.2) == []
    assert first + rest == [f"w:{i}" for i in range(20)]


def test_malformed_records_go_to_dead_letter_topic(streams):
    w = streams.writer("actor")
    w.write(group(0))
    w.write_raw(b'{"kind": "rollout_group", "problem_id": "torn')
    w.write(Metrics(process="p", time=0.0, values={}))  # valid JSON of the wrong record type
    w.write_raw(b'{"kind": "rollout_group", "problem_id": "x", "group_id": "x", "rollouts": [{"prompt_ids": [1]}]}')
    w.write(group(1))
    w.flush()
    r = streams.reader("actor", RolloutGroup)
    entries = read_all(r, 2, timeout=5)
    assert ids(entries) == ["w:0", "w:1"]
    assert r.dead_letters == 3
    dead = read_all(streams.reader("actor.dead", DeadLetter), 3, timeout=5)
    letters = [e.record for e in dead]
    assert [d.topic for d in letters] == ["actor"] * 3 and [d.partition for d in letters] == [0] * 3
    assert "not valid JSON" in letters[0].error and letters[0].payload.endswith('"torn')
    assert "expected a 'rollout_group' record, got 'metrics'" in letters[1].error
    assert "rollouts[0]" in letters[2].error
    # The offsets point between the two good entries, in order, and are distinct.
    offsets = [d.offset for d in letters]
    assert len(set(offsets)) == 3 and entries[0].offset not in offsets and entries[1].offset not in offsets


def test_batched_writes_are_read_back_complete_and_in_order(streams):
    # Several batches (by count), interleaved over two partitions; one record lands in one batch.
    n = 3 * BATCH_RECORDS + 7
    w = streams.writer("actor", partitions=2)
    for i in range(n):
        w.write(group(i), partition=i % 2)
    w.flush()
    r = streams.reader("actor", RolloutGroup, partitions=(0, 1))
    entries = read_all(r, n, max_count=1000)
    assert r.read(timeout=0.1) == [] and r.dead_letters == 0
    for partition in (0, 1):
        assert ids(e for e in entries if e.partition == partition) == [f"w:{i}" for i in range(partition, n, 2)]


def test_an_unflushed_record_becomes_visible_by_itself(streams):
    w = streams.writer("actor")
    w.write(group(0))  # no flush: the writer's background thread sends it within milliseconds
    assert ids(streams.reader("actor", RolloutGroup).read(timeout=5)) == ["w:0"]


def test_a_read_leaves_the_garbage_collector_as_it_found_it(streams):
    w = streams.writer("actor")
    for i in range(4):
        w.write(group(i))
    w.flush()
    r = streams.reader("actor", RolloutGroup)
    assert len(r.read(timeout=5, max_count=2)) == 2 and gc.isenabled()
    gc.disable()
    try:
        assert len(r.read(timeout=5, max_count=2)) == 2 and not gc.isenabled()
    finally:
        gc.enable()


def test_position_store_is_atomic_json(tmp_path):
    store = PositionStore(tmp_path / "positions" / "p.json")
    assert store.load() is None
    store.save({"0": "12", "1": "1-0"})
    assert store.load() == {"0": "12", "1": "1-0"}
    assert list((tmp_path / "positions").iterdir()) == [tmp_path / "positions" / "p.json"]
    (tmp_path / "positions" / "p.json").write_text("{")
    with pytest.raises(ValueError, match=r"p\.json"):
        store.load()


# ---- JSONL torn lines ----


def test_jsonl_torn_line_is_terminated_and_dead_lettered(tmp_path):
    cfg = make_cfg(tmp_path, "jsonl")
    s = open_streams(cfg)
    w = s.writer("actor")
    w.write(group(0))
    w.flush()
    path = partition_path(Path(cfg.run_dir) / "streams", "actor", 0)
    assert path == tmp_path / "run" / "streams" / "actor" / "0.jsonl"
    fragment_at = path.stat().st_size
    with open(path, "ab") as f:
        f.write(encode(group(1))[:40])  # what a killed writer leaves behind
    r = s.reader("actor", RolloutGroup)
    assert ids(r.read(timeout=1)) == ["w:0"]
    assert r.read(timeout=0.3) == [] and r.dead_letters == 0  # the fragment is not handed out
    w.write(group(2))  # the next write, even by a writer opened earlier, terminates the fragment
    assert ids(r.read(timeout=1)) == ["w:2"]
    assert r.dead_letters == 1
    letter = s.reader("actor.dead", DeadLetter).read(timeout=1)[0].record
    assert letter.offset == str(fragment_at)
    s.close()


def test_jsonl_writer_sends_a_full_batch_as_plain_json_lines(tmp_path, monkeypatch):
    """With time out of the picture, records stay buffered until the batch is full; then they
    are all in the file, one JSON document per line, and flush() sends the rest."""
    monkeypatch.setattr(api, "LINGER_S", 3600.0)
    cfg = make_cfg(tmp_path, "jsonl")
    s = open_streams(cfg)
    w = s.writer("actor")
    path = partition_path(Path(cfg.run_dir) / "streams", "actor", 0)
    for i in range(BATCH_RECORDS - 1):
        w.write(group(i))
    assert not path.exists() or path.stat().st_size == 0
    w.write(group(BATCH_RECORDS - 1))  # fills the batch: sent before write() returns
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and [json.loads(line)["problem_id"] for line in lines[:-1]] == [
        f"w:{i}" for i in range(BATCH_RECORDS)
    ]
    for i in range(BATCH_RECORDS, BATCH_RECORDS + 3):
        w.write(group(i))
    w.flush()
    r = s.reader("actor", RolloutGroup)
    assert ids(read_all(r, BATCH_RECORDS + 3)) == [f"w:{i}" for i in range(BATCH_RECORDS + 3)]
    s.close()


def test_jsonl_batch_torn_by_a_crash_keeps_its_whole_lines(tmp_path):
    """A writer killed in the middle of a batch leaves whole lines and one fragment: readers
    take the whole lines, and the fragment is dead-lettered once the next write terminates it."""
    cfg = make_cfg(tmp_path, "jsonl")
    path = partition_path(Path(cfg.run_dir) / "streams", "actor", 0)
    path.parent.mkdir(parents=True)
    batch = b"".join(encode(group(i)) + b"\n" for i in range(3))
    path.write_bytes(batch + encode(group(3))[:25])
    s = open_streams(cfg)
    r = s.reader("actor", RolloutGroup)
    assert ids(read_all(r, 3)) == ["w:0", "w:1", "w:2"]
    assert r.read(timeout=0.2) == [] and r.dead_letters == 0
    w = s.writer("actor")
    w.write(group(4))
    w.flush()
    assert ids(r.read(timeout=1)) == ["w:4"] and r.dead_letters == 1
    assert s.reader("actor.dead", DeadLetter).read(timeout=1)[0].record.offset == str(len(batch))
    s.close()


def kill_mid_write(cfg, topic: str) -> bool:
    """Start a writer of three small records and a 64 MB one; SIGKILL it while the big line is
    partly in the file. False if the write finished first (a very busy machine)."""
    path = partition_path(Path(cfg.run_dir) / "streams", topic, 0)
    proc = start(child_write_huge, cfg.run_dir, topic, 64 << 20)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size > 4 << 20:
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.001)
    proc.join(10)
    assert proc.exitcode == -signal.SIGKILL
    return path.read_bytes()[-1:] != b"\n"


def test_jsonl_writer_killed_mid_write(tmp_path):
    cfg = make_cfg(tmp_path, "jsonl")
    topic = next(t for t in ("actor", "actor1", "actor2") if kill_mid_write(cfg, t))
    s = open_streams(cfg)
    r = s.reader(topic, RolloutGroup)
    assert ids(read_all(r, 3, timeout=5)) == ["w:0", "w:1", "w:2"]
    assert r.read(timeout=0.2) == [] and r.dead_letters == 0  # the torn line is not handed out
    torn_at = r.position()[0]
    proc = start(child_write, cfg.run_dir, topic, 0, "next", 2, 0, 0.0)
    assert ids(read_all(r, 2, timeout=30)) == ["next:0", "next:1"]
    proc.join(10)
    assert r.dead_letters == 1
    letter = read_all(s.reader(f"{topic}.dead", DeadLetter), 1)[0].record
    assert letter.offset == torn_at
    assert "payload of" in letter.error and len(letter.payload) <= 1 << 16
    s.close()


# ---- Redis ----


@pytest.mark.redis
def test_redis_trims_only_what_readers_have_consumed(tmp_path, redis_server):
    """Broadcast topics are capped by length; a data topic keeps every entry until its
    reader's saved position says it is consumed, and then keeps the entries from there on."""
    import redis

    cfg = make_cfg(tmp_path, "redis", redis_server.port)
    cfg.streams.redis.maxlen = 50
    s = open_streams(cfg)
    w = s.writer("actor", partitions=2)
    m = s.writer("metrics")
    for i in range(2000):
        w.write(group(i), partition=1)
        m.write(Metrics(process="p", time=0.0, values={"i": i}))
    w.flush()
    m.flush()
    client = redis.Redis(port=redis_server.port)
    assert sorted(client.keys("*")) == [b"pipeline_rl:streamtest:actor:1", b"pipeline_rl:streamtest:metrics:0"]
    # MAXLEN ~ trims whole macro-nodes (100 entries by default), so the length is approximate.
    assert 50 <= client.xlen("pipeline_rl:streamtest:metrics:0") < 300
    assert client.xlen("pipeline_rl:streamtest:actor:1") == 2000
    r = s.reader("actor", RolloutGroup, partitions=(1,))
    first = read_all(r, 700, max_count=100)
    s.trim_below("actor", r.position())
    # MINID ~ drops whole macro-nodes (up to 100 entries) below the last consumed entry, which stays.
    assert 2000 - 699 <= client.xlen("pipeline_rl:streamtest:actor:1") < 2000 - 699 + 100
    rest = read_all(r, 1300)
    assert ids(first + rest) == [f"w:{i}" for i in range(2000)]
    s.close()
    client.close()


@pytest.mark.redis
def test_redis_writer_and_reader_survive_a_restart(tmp_path, redis_server, caplog):
    caplog.set_level(logging.WARNING, logger="pipeline_rl.streams.redis_backend")
    s = open_streams(make_cfg(tmp_path, "redis", redis_server.port))
    w = s.writer("actor")
    r = s.reader("actor", RolloutGroup)
    w.write(group(0))
    w.flush()
    assert ids(r.read(timeout=5)) == ["w:0"]
    got = []

    def consume():  # blocked in XREAD when the server goes away
        deadline = time.monotonic() + 30
        while len(got) < 2 and time.monotonic() < deadline:
            got.extend(r.read(timeout=0.5))

    consumer = threading.Thread(target=consume)
    consumer.start()
    time.sleep(0.3)
    restart = threading.Thread(target=redis_server.restart, kwargs={"down_s": 1.5})
    restart.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    w.write(group(1))
    w.write(group(2))
    w.flush()  # blocks, retrying, until the new server takes the batch
    assert time.monotonic() - t0 > 0.5
    restart.join()
    consumer.join()
    # The restarted server has no persistence: w:0 is gone, the new records flow.
    assert ids(got) == ["w:1", "w:2"]
    lost = [m.getMessage() for m in caplog.records if "connection lost" in m.getMessage()]
    assert any("writer of topic 'actor'" in m for m in lost)
    assert any("reader of topic 'actor'" in m for m in lost)
    s.close()


@pytest.mark.redis
def test_redis_entries_not_made_by_a_writer(tmp_path, redis_server):
    """An entry is read for its `data` field, whatever other fields it has; one without it is
    dead-lettered."""
    import redis

    s = open_streams(make_cfg(tmp_path, "redis", redis_server.port))
    client = redis.Redis(port=redis_server.port)
    key = "pipeline_rl:streamtest:actor:0"
    client.xadd(key, {"data": encode(group(0))})
    client.xadd(key, {"other": encode(group(1))})
    client.xadd(key, {"data": encode(group(2)), "extra": b"1"})
    client.xadd(key, {"data": encode(group(3))})
    r = s.reader("actor", RolloutGroup)
    assert ids(read_all(r, 3)) == ["w:0", "w:2", "w:3"] and r.dead_letters == 1
    s.close()
    client.close()


def test_a_read_holds_about_read_bytes_of_payload(streams):
    w = streams.writer("actor")
    for i in range(100):
        w.write(group(i, tokens=8000))  # ~100 KB each
    w.flush()
    size = len(encode(group(0, tokens=8000)))
    r = streams.reader("actor", RolloutGroup)
    got = r.read(timeout=5, max_count=1)  # Redis learns the record size from the first read
    batches = []
    while len(got) < 100 and (entries := r.read(timeout=5, max_count=256)):
        batches.append(len(entries))
        got += entries
    assert ids(got) == [f"w:{i}" for i in range(100)]
    assert len(batches) > 2 and all(1 <= n <= READ_BYTES // size + 1 for n in batches)


def test_reads_of_any_size_in_turn_with_writes_lose_and_repeat_nothing(streams):
    """The Redis reader sends its next XREAD before its caller decodes (and may ask for more
    than the next call takes, or get nothing): whatever the sizes of reads and of the batches
    written between them, every record comes once, in order, and a reader opened at the
    position reads exactly the records not handed out yet."""
    w = streams.writer("actor")
    r = streams.reader("actor", RolloutGroup)
    got, written = [], 0
    for sizes in ((1, 1), (5, 3), (40, 7), (0, 2), (300, 256), (2, 1), (0, 1)):
        for _ in range(sizes[0]):
            w.write(group(written))
            written += 1
        w.flush()
        entries = r.read(timeout=0.5, max_count=sizes[1])
        # A reply sent ahead holds what was there when it was asked for: maybe fewer.
        assert 1 <= len(entries) <= min(sizes[1], written - len(got))
        got += entries
    resumed = streams.reader("actor", RolloutGroup, position=r.position())
    rest = read_all(r, written - len(got))
    assert ids(got + rest) == [f"w:{i}" for i in range(written)]
    assert r.read(timeout=0.2) == []
    assert ids(read_all(resumed, len(rest) + 1, timeout=1.0)) == ids(rest)


@pytest.mark.redis
def test_redis_write_that_redis_refuses_raises_at_flush(tmp_path, redis_server):
    """A writer reads a batch's replies after sending the next one; an error reply (here: the
    stream's key holds a string) still reaches the writing process, at the latest at flush()."""
    import redis

    s = open_streams(make_cfg(tmp_path, "redis", redis_server.port))
    client = redis.Redis(port=redis_server.port)
    client.set("pipeline_rl:streamtest:actor:0", b"not a stream")
    w = s.writer("actor")
    w.write(group(0))
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        w.flush()
    client.delete("pipeline_rl:streamtest:actor:0")
    w.write(group(1))
    w.flush()
    assert ids(read_all(s.reader("actor", RolloutGroup), 1)) == ["w:1"]
    s.close()
    client.close()
