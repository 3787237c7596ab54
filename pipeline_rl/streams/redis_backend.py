"""Redis backend of the stream layer: one Redis stream per partition (several nodes).

Keys are "{namespace}:{topic}:{partition}" with namespace `wire.redis_namespace(cfg.name)`. Each
entry has one field, `data`, holding the orjson payload; an offset is the entry ID. XADD
caps the broadcast topics with MAXLEN ~ cfg.streams.redis.maxlen (0: no cap); the data
topics (`wire.CONSUMED_TOPICS`) are never capped, only trimmed by `trim_below` (exact XTRIM
MINID) below a position their one reader has saved, so no entry goes before it is consumed.

Writes are batched (see `api.Writer`): each batch goes out as one pipeline of XADDs, one round
trip.

A lost connection is logged and retried with exponential backoff (RETRY_MIN_S doubling up to
RETRY_MAX_S) for as long as it takes: a writer's flush() blocks until its batch is in;
a reader's read() returns [] at its timeout and tries again on the next call. A batch whose
reply was lost with the connection is sent again, so delivery is at-least-once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pipeline_rl.config import RedisConfig
from pipeline_rl.streams.api import CLOSE_TIMEOUT_S, READ_BYTES, RawEntry, Reader, Streams, Writer
from pipeline_rl.wire import CONSUMED_TOPICS

log = logging.getLogger(__name__)

FIELD = b"data"
RETRY_MIN_S, RETRY_MAX_S = 0.1, 5.0
BLOCK_MAX_S = 10.0
"""Longest single XREAD block; the socket timeout is well above it."""
SOCKET_TIMEOUT_S = 30.0

_LOST = (redis.ConnectionError, redis.TimeoutError)


class Backoff:
    """Delays between retries of one operation, with a log line for each failure."""

    def __init__(self, what: str):
        self.what = what
        self.failures = 0

    def failed(self, error: Exception, cap: float = RETRY_MAX_S) -> float:
        delay = min(RETRY_MIN_S * 2**self.failures, RETRY_MAX_S, cap)
        self.failures += 1
        log.warning("%s: redis connection lost (%s); retry %d in %.1f s", self.what, error, self.failures, delay)
        return delay

    def succeeded(self) -> None:
        if self.failures:
            log.warning("%s: redis connection back after %d retries", self.what, self.failures)
        self.failures = 0


class RedisWriter(Writer):
    def __init__(self, client: redis.Redis, namespace: str, topic: str, partitions: int, maxlen: int):
        super().__init__(topic, partitions)
        self._client = client
        self._keys = [f"{namespace}:{topic}:{p}" for p in range(partitions)]
        self._trim = ("MAXLEN", "~", maxlen) if maxlen > 0 else ()
        self._backoff = Backoff(f"writer of topic {topic!r}")
        self._give_up_at: float | None = None
        """Set by close(): a process that is stopping retries a lost Redis only this long."""

    def _send(self, batch: list[tuple[int, bytes]]) -> None:
        while True:
            pipe = self._client.pipeline(transaction=False)
            for partition, payload in batch:
                # The command itself rather than pipe.xadd, which checks and rebuilds its arguments.
                pipe.execute_command("XADD", self._keys[partition], *self._trim, "*", FIELD, payload)
            try:
                pipe.execute()
                self._backoff.succeeded()
                return
            except _LOST as e:
                if self._give_up_at is not None and time.monotonic() > self._give_up_at:
                    log.error(
                        "writer of topic %r: closing with Redis unreachable; %d records were not delivered",
                        self.topic,
                        len(batch),
                    )
                    return
                time.sleep(self._backoff.failed(e, cap=CLOSE_TIMEOUT_S / 4 if self._give_up_at else RETRY_MAX_S))

    def close(self) -> None:
        self._give_up_at = time.monotonic() + CLOSE_TIMEOUT_S
        super().close()


class RedisReader(Reader):
    def __init__(
        self,
        client: redis.Redis,
        namespace: str,
        topic: str,
        record_type: type,
        partitions: Iterable[int],
        position: dict | None,
        dead_writer: Callable[[], Writer],
    ):
        super().__init__(topic, record_type, partitions, position, "0-0", dead_writer)
        self._client = client
        self._keys = {f"{namespace}:{topic}:{p}".encode(): p for p in self.partitions}
        self._backoff = Backoff(f"reader of topic {topic!r}")
        self._entry_bytes = 1
        """Mean payload size of the last read (unknown before the first, which takes max_count):
        XREAD's COUNT is set so that a read holds about READ_BYTES."""

    def _read_raw(self, timeout: float, max_count: int) -> list[RawEntry]:
        block_ms = int(min(timeout, BLOCK_MAX_S) * 1000)
        count = max(1, min(max_count, READ_BYTES // self._entry_bytes))
        # BLOCK 0 would mean forever in Redis; no BLOCK means return at once.
        block = ("BLOCK", block_ms) if block_ms else ()
        positions = [self._position[p] for p in self._keys.values()]
        try:
            reply: Any = self._client.execute_command(
                "XREAD", "COUNT", count, *block, "STREAMS", *self._keys, *positions
            )
            self._backoff.succeeded()
        except _LOST as e:
            time.sleep(self._backoff.failed(e, cap=timeout))
            return []
        out: list[RawEntry] = []
        # The reply as Redis sends it (see RedisStreams): [[key, entries], ...], or {key: entries}
        # under RESP3; each entry is [id, [field, value, ...]].
        for key, items in reply.items() if isinstance(reply, dict) else reply or ():
            partition = self._keys[key]
            for entry_id, fields in items[: count - len(out)]:
                offset = entry_id.decode()
                # A Writer's entry has the one field `data`; any other is searched for it.
                if len(fields) == 2 and fields[0] == FIELD:
                    payload = fields[1]
                else:
                    payload = dict(zip(fields[::2], fields[1::2])).get(FIELD, b"")
                out.append((partition, offset, payload))
                self._position[partition] = offset
        if out:
            self._entry_bytes = max(1, sum(len(e[2]) for e in out) // len(out))
        return out


def _as_sent(reply: Any, **options: Any) -> Any:
    return reply


class RedisStreams(Streams):
    reader_class = RedisReader

    def __init__(self, rcfg: RedisConfig, namespace: str, password: str | None = None):
        """`password`: the run's (streams.redis_secret.redis_password), never a config value."""
        super().__init__()
        self.namespace = namespace
        self.maxlen = rcfg.maxlen
        # Retries are ours (logged, with backoff), so redis-py's own are turned off.
        self.client = redis.Redis(
            host=rcfg.host,
            port=rcfg.port,
            password=password,
            ssl=rcfg.tls,
            # The server's certificate is always verified (redis-py's defaults: required, and
            # the hostname checked); a client certificate only when the server asks for one.
            ssl_ca_certs=rcfg.tls_ca_file,
            ssl_certfile=rcfg.tls_cert_file,
            ssl_keyfile=rcfg.tls_key_file,
            socket_connect_timeout=5.0,
            socket_timeout=SOCKET_TIMEOUT_S,
            socket_keepalive=True,
            retry=Retry(NoBackoff(), 0),
        )
        # Readers take XREAD's reply as it comes: redis-py would build a dict for every entry.
        self.client.set_response_callback("XREAD", _as_sent)

    def _make_writer(self, topic: str, partitions: int) -> Writer:
        maxlen = 0 if topic in CONSUMED_TOPICS else self.maxlen
        return RedisWriter(self.client, self.namespace, topic, partitions, maxlen)

    def trim_below(self, topic: str, position: dict) -> None:
        for partition, offset in position.items():
            if offset != "0-0":
                # Exact (redis-py's default is "~", which keeps whole radix-tree nodes of up to
                # 100 entries): the memory bound the plan states counts entries, not nodes.
                self.client.xtrim(f"{self.namespace}:{topic}:{partition}", minid=offset, approximate=False)

    def _where(self) -> tuple:
        return (self.client, self.namespace)

    def delete_all(self) -> int:
        """Delete every stream of this run (its namespace); returns how many keys went."""
        keys = list(self.client.scan_iter(match=f"{self.namespace}:*", count=1000))
        return self.client.delete(*keys) if keys else 0

    def close(self) -> None:
        super().close()
        self.client.close()
