"""Benchmark of the stream layer: writer process -> reader process, side by side with raw Redis.

For RolloutGroup records of about 1 KB and 64 KB it measures records/s and MB/s of payload
from a writer process to a reader process (the reader decodes and type-checks every record)
for the JSONL and Redis backends, and a minimal redis-py loop (pipelined XADD of the same
payload bytes, XREAD in another process, no encoding or decoding) on the same redis-server,
and prints the Redis layer's rate as a fraction of the raw one. It starts its own
redis-server on a free port. Every process reports its peak RSS and its CPU time per record.

Goals: Redis layer >= 50% of raw Redis with 1 KB and with 64 KB records; JSONL >= 100 MB/s with
1 KB records.

With `--routes-bytes N` it also runs both layers on the ~64 KB groups' tokens carrying routing
replay's routes (N bytes per token: MoE layers x top_k; base64 in the record,
pipeline_rl/core/routes.py) and prints the bytes they add per token and the tokens/s with routes
against without.

--json PATH also keeps each case's best round there (scripts/bench_tables.py).

With `--codec-routes N,M` it also measures the codec alone on a group of 4 rollouts of 1,000
tokens with routes of each size and without: bytes, encode and decode CPU time per token.

    python scripts/bench_streams.py [--count-1k 20000] [--count-64k 1000] [--rounds 2] [--routes-bytes N]
        [--codec-routes N,M] [--json PATH]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline_rl.config import load_config, load_saved_config, save_config
from pipeline_rl.streams import open_streams
from pipeline_rl.streams.records import Rollout, RolloutGroup, decode, encode

TOPIC = "bench"
RAW_BATCH_RECORDS, RAW_BATCH_BYTES = 256, 4 << 20
RAW_MAXLEN = 100000  # same trimming as the layer's default (streams.redis.maxlen)


def group_of(tokens: int, routes: int = 0) -> RolloutGroup:
    """A RolloutGroup of 4 rollouts of `tokens` completion tokens each, each token carrying
    `routes` bytes of routes."""
    rollouts = [
        Rollout(
            prompt_ids=list(range(1000, 1000 + 16)),
            completion_ids=[(97 * i + r) % 32000 for i in range(tokens)],
            logprobs=[-0.1234567 * ((i % 7) + 1) for i in range(tokens)],
            versions=[3] * tokens,
            reward=1.0,
            finish_reason="stop",
            routes=base64.b64encode(bytes((7 * i) % 128 for i in range(tokens * routes))).decode() if routes else None,
        )
        for r in range(4)
    ]
    return RolloutGroup(problem_id="p", group_id="g", rollouts=rollouts)


def make_group(target_bytes: int, routes_bytes: int = 0) -> RolloutGroup:
    """A RolloutGroup of 4 rollouts whose encoding is about `target_bytes` long; with
    `routes_bytes`, the same tokens each carry that many bytes of routes besides."""
    per_token = (len(encode(group_of(200))) - len(encode(group_of(0)))) / 200
    return group_of(max(0, round((target_bytes - len(encode(group_of(0)))) / per_token)), routes_bytes)


def group_tokens(record: RolloutGroup) -> int:
    return sum(len(r.completion_ids) for r in record.rollouts)


def codec_us(record: RolloutGroup) -> tuple[float, float]:
    """CPU microseconds to encode and to decode (with type checks) `record`, in this process
    (best of 3 runs: other jobs on the machine only ever add time)."""
    payload = encode(record)
    n = max(20, 2_000_000 // len(payload))
    enc = dec = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        for _ in range(n):
            encode(record)
        t1 = time.process_time()
        for _ in range(n):
            decode(payload, RolloutGroup)
        t2 = time.process_time()
        enc, dec = min(enc, (t1 - t0) / n * 1e6), min(dec, (t2 - t1) / n * 1e6)
    return enc, dec


def codec_row(routes: int) -> dict:
    """What routes of `routes` bytes a token cost the codec: a group of 4 rollouts of 1,000
    tokens, its bytes and CPU time per token."""
    record = group_of(1000, routes)
    enc, dec = codec_us(record)
    tokens = group_tokens(record)
    return {
        "name": f"codec, routes {routes} B a token",
        "kind": "codec",
        "routes": routes,
        "bytes_per_token": len(encode(record)) / tokens,
        "encode_ns_per_token": enc * 1e3 / tokens,
        "decode_ns_per_token": dec * 1e3 / tokens,
    }


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_s() -> float:
    """CPU seconds this process used so far (user + system): less noisy than wall time on a busy machine."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def redis_client(port: int):
    import redis

    return redis.Redis(host="127.0.0.1", port=port)


# ---- roles, each run in its own process; results go to a JSON file ----


def role_writer(args) -> dict:
    record = make_group(args.size, args.routes)
    streams = open_streams(load_saved_config(Path(args.run_dir) / "config.yaml"))
    writer = streams.writer(TOPIC)
    t0, cpu0 = time.time(), cpu_s()
    for _ in range(args.count):
        writer.write(record)
    writer.flush()
    streams.close()
    return {
        "t0": t0,
        "t_done": time.time(),
        "cpu_s": cpu_s() - cpu0,
        "bytes": len(encode(record)) * args.count,
        "tokens": group_tokens(record) * args.count,
    }


def role_reader(args) -> dict:
    streams = open_streams(load_saved_config(Path(args.run_dir) / "config.yaml"))
    reader = streams.reader(TOPIC, RolloutGroup)
    Path(args.ready).touch()
    cpu0, got = cpu_s(), 0
    while got < args.count:
        entries = reader.read(timeout=30, max_count=256)
        if not entries:
            raise SystemExit(f"reader: no record for 30 s after {got} of {args.count}")
        got += len(entries)
    t_end = time.time()
    streams.close()
    return {"t_end": t_end, "cpu_s": cpu_s() - cpu0, "dead_letters": reader.dead_letters}


def role_raw_writer(args) -> dict:
    payload = encode(make_group(args.size))
    client = redis_client(args.port)
    per_batch = max(1, min(RAW_BATCH_RECORDS, RAW_BATCH_BYTES // len(payload)))
    t0, cpu0 = time.time(), cpu_s()
    pipe = client.pipeline(transaction=False)
    for _ in range(args.count):
        pipe.xadd(args.key, {b"data": payload}, maxlen=RAW_MAXLEN, approximate=True)
        if len(pipe) >= per_batch:
            pipe.execute()
    pipe.execute()
    return {"t0": t0, "t_done": time.time(), "cpu_s": cpu_s() - cpu0, "bytes": len(payload) * args.count}


def role_raw_reader(args) -> dict:
    client = redis_client(args.port)
    Path(args.ready).touch()
    cpu0, last, got = cpu_s(), "0-0", 0
    while got < args.count:
        reply: Any = client.xread({args.key: last}, count=256, block=30000)
        if not reply:
            raise SystemExit(f"raw reader: no entry for 30 s after {got} of {args.count}")
        items = reply[0][1]
        got += len(items)
        last = items[-1][0]
    return {"t_end": time.time(), "cpu_s": cpu_s() - cpu0, "dead_letters": 0}


ROLES = {"writer": role_writer, "reader": role_reader, "raw-writer": role_raw_writer, "raw-reader": role_raw_reader}


# ---- driver ----


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(workdir: Path) -> tuple[subprocess.Popen, int]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not on PATH")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"redis-server did not start on port {port}")


def spawn(role: str, common: list[str], workdir: Path) -> tuple[subprocess.Popen, Path]:
    result = workdir / f"{role}.json"
    cmd = [sys.executable, __file__, "--role", role, "--result", str(result)] + common
    return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}), result


def run_case(kind: str, size: int, count: int, port: int, workdir: Path, routes: int = 0) -> dict:
    """kind: jsonl, redis (the stream layer) or raw (plain redis-py); routes: bytes of routes per
    token on every rollout (the stream layer only)."""
    case_dir = workdir / f"{kind}-{size}-{routes}"
    case_dir.mkdir(parents=True)
    ready = case_dir / "ready"
    common = [
        "--size",
        str(size),
        "--count",
        str(count),
        "--port",
        str(port),
        "--ready",
        str(ready),
        "--run-dir",
        str(case_dir / "run"),
        "--key",
        f"bench:raw:{size}",
        "--routes",
        str(routes),
    ]
    if kind != "raw":
        cfg = load_config(
            "base",
            [
                f"run_dir={case_dir / 'run'}",
                f"name=bench{size}",
                f"streams.backend={kind}",
                f"streams.redis.port={port}",
            ],
        )
        save_config(cfg, case_dir / "run" / "config.yaml")
    prefix = "raw-" if kind == "raw" else ""
    reader, reader_out = spawn(prefix + "reader", common, case_dir)
    while not ready.exists():
        if reader.poll() is not None:
            raise SystemExit(f"{kind} reader exited with {reader.returncode}")
        time.sleep(0.01)
    writer, writer_out = spawn(prefix + "writer", common, case_dir)
    for proc in (writer, reader):
        if proc.wait(timeout=300) != 0:
            raise SystemExit(f"{kind} {size} B: a process exited with {proc.returncode}")
    w, r = json.loads(writer_out.read_text()), json.loads(reader_out.read_text())
    seconds = r["t_end"] - w["t0"]
    redis_client(port).flushall()
    shutil.rmtree(case_dir / "run", ignore_errors=True)
    return {
        "records_s": count / seconds,
        "tokens_s": w.get("tokens", 0) / seconds,
        "mb_s": w["bytes"] / seconds / 1e6,
        "seconds": seconds,
        "record_bytes": w["bytes"] // count,
        "writer_rss": w["rss_mb"],
        "reader_rss": r["rss_mb"],
        "writer_cpu_us": w["cpu_s"] / count * 1e6,
        "reader_cpu_us": r["cpu_s"] / count * 1e6,
        "dead": r["dead_letters"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count-1k", type=int, default=20000, help="records in the ~1 KB runs")
    parser.add_argument("--count-64k", type=int, default=1000, help="records in the ~64 KB runs")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each case; the best counts")
    parser.add_argument(
        "--routes-bytes",
        type=int,
        default=0,
        help="also run both layers with routing replay's routes of this many bytes per token (MoE layers x top_k)",
    )
    parser.add_argument(
        "--codec-routes",
        default="",
        help="comma-separated routes sizes in bytes a token (MoE layers x top_k): the codec's bytes and CPU time "
        "a token with each, and with none",
    )
    parser.add_argument("--json", type=Path, help="also keep each case's best round in this JSON")
    parser.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    for name in ("--result", "--run-dir", "--ready", "--key"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    for name in ("--size", "--count", "--port", "--routes"):
        parser.add_argument(name, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        result = ROLES[args.role](args)
        result["rss_mb"] = peak_rss_mb()
        Path(args.result).write_text(json.dumps(result))
        return

    workdir = Path(tempfile.mkdtemp(prefix="bench_streams_"))
    server, port = start_redis(workdir)
    cases = [
        (kind, size, count, 0)
        for size, count in ((1024, args.count_1k), (65536, args.count_64k))
        for kind in ("jsonl", "redis", "raw")
    ]
    if args.routes_bytes:  # the ~64 KB groups' tokens (the ~1 KB ones are almost all prompt)
        cases += [(kind, 65536, args.count_64k, args.routes_bytes) for kind in ("jsonl", "redis")]
    best: dict[tuple, dict] = {}
    try:
        # The machine is shared: run every case `rounds` times, interleaved, and keep the best.
        for round_ in range(args.rounds):
            for kind, size, count, routes in cases:
                res = run_case(kind, size, count, port, workdir / f"round{round_}", routes)
                if res["dead"]:
                    raise SystemExit(f"{kind} {size} B: {res['dead']} dead letters")
                key = (kind, size, routes)
                if key not in best or res["records_s"] > best[key]["records_s"]:
                    best[key] = res
        redis_rss = redis_peak_rss_mb(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"best of {args.rounds} rounds; MB/s of encoded payload; CPU time per record and peak RSS per process")
    print(
        f"{'case':<16}{'record':>9}{'records/s':>12}{'MB/s':>9}{'writer CPU':>12}{'reader CPU':>12}"
        f"{'writer RSS':>12}{'reader RSS':>12}"
    )
    for kind, size, _, routes in cases:
        res = best[kind, size, routes]
        name = "raw redis-py" if kind == "raw" else f"{kind} layer" + ("+routes" if routes else "")
        print(
            f"{name:<16}{res['record_bytes']:>8}B{res['records_s']:>12,.0f}{res['mb_s']:>9.1f}"
            f"{res['writer_cpu_us']:>10.0f}us{res['reader_cpu_us']:>10.0f}us"
            f"{res['writer_rss']:>10.0f}MB{res['reader_rss']:>10.0f}MB"
        )
    print(f"redis-server peak RSS: {redis_rss:.0f} MB")
    codec = (
        [codec_row(routes) for routes in [0, *map(int, filter(None, args.codec_routes.split(",")))]]
        if args.codec_routes
        else []
    )
    for row in codec:
        print(
            f"codec, routes {row['routes']:>4} B a token: {row['bytes_per_token']:.1f} B a token, "
            f"encode {row['encode_ns_per_token']:.0f} ns, decode {row['decode_ns_per_token']:.0f} ns a token"
        )
    if args.json:
        from bench_tables import keep, machine

        names = {"raw": "raw redis-py", "redis": "Redis layer", "jsonl": "JSONL layer"}
        # The layers encode and decode each record (raw redis-py neither); with routes, a larger one.
        per_record = {
            (size, kind, routes): dict(zip(("encode_us", "decode_us"), codec_us(make_group(size, routes))))
            if kind != "raw"
            else {}
            for kind, size, _, routes in cases
        }
        keep(
            args.json,
            [
                {
                    "name": f"{names[kind]}, ~{size // 1024} KB" + (f", routes {routes} B a token" if routes else ""),
                    "kind": kind,
                    "size": size,
                    "routes": routes,
                    "rounds": args.rounds,
                    "machine": machine(),
                    **best[kind, size, routes],
                    **per_record[size, kind, routes],
                }
                for kind, size, _, routes in cases
            ]
            + [row | {"machine": machine()} for row in codec],
        )
    for size in (1024, 65536):
        ratio = best["redis", size, 0]["records_s"] / best["raw", size, 0]["records_s"]
        enc, dec = codec_us(make_group(size))
        print(
            f"~{size // 1024} KB: redis layer / raw redis-py = {ratio:.2f} (goal >= 0.50); "
            f"jsonl layer {best['jsonl', size, 0]['mb_s']:.0f} MB/s"
            + (" (goal >= 100)" if size == 1024 else "")
            + f"; codec per record (raw does none): encode {enc:.0f} us, decode {dec:.0f} us"
        )
    if args.routes_bytes:
        plain, routed = make_group(65536), make_group(65536, args.routes_bytes)
        added = (len(encode(routed)) - len(encode(plain))) / group_tokens(plain)
        ratios = ", ".join(
            f"{kind} {best[kind, 65536, args.routes_bytes]['tokens_s'] / best[kind, 65536, 0]['tokens_s']:.2f}"
            for kind in ("jsonl", "redis")
        )
        print(
            f"the ~64 KB groups' {group_tokens(plain)} tokens with {args.routes_bytes} B of routes per token: "
            f"{added:.1f} B more per token; tokens/s with routes / without: {ratios}"
        )
        for kind in ("jsonl", "redis"):
            res = best[kind, 65536, args.routes_bytes]
            print(f"  {kind} layer with routes: {res['tokens_s']:,.0f} tokens/s, {res['mb_s']:.0f} MB/s")


def redis_peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


if __name__ == "__main__":
    main()
