"""Streams between pools: the API (`api.py`), two backends and the record types.

`open_streams(cfg)` picks the backend; the backends import the API, never this package's
`__init__`, so there is no import circle.
"""

from __future__ import annotations

from pathlib import Path

from pipeline_rl.config import RunConfig
from pipeline_rl.streams.api import Entry, PositionStore, Reader, Streams, Writer, partitions_for
from pipeline_rl.wire import redis_namespace


def open_streams(cfg: RunConfig) -> Streams:
    """The run's streams: JSONL files under RUN_DIR/streams, or Redis (with the run's password:
    streams/redis_secret.py)."""
    if cfg.streams.backend == "redis":
        from pipeline_rl.streams.redis_backend import RedisStreams
        from pipeline_rl.streams.redis_secret import redis_password

        return RedisStreams(cfg.streams.redis, namespace=redis_namespace(cfg.name), password=redis_password(cfg))
    from pipeline_rl.streams.jsonl_backend import JsonlStreams

    return JsonlStreams(Path(cfg.run_dir) / "streams")


__all__ = ["Entry", "PositionStore", "Reader", "Streams", "Writer", "open_streams", "partitions_for"]
