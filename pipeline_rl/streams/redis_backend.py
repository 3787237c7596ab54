"""Redis backend of the stream layer: one Redis stream per partition (several nodes).

Keys are "{namespace}:{topic}:{partition}" with namespace `wire.redis_namespace(cfg.name)`. Each
entry has one field, `data`, holding the orjson payload; an offset is the entry ID. XADD
caps the broadcast topics with MAXLEN ~ cfg.streams.redis.maxlen (0: no cap); the data
topics (`wire.CONSUMED_TOPICS`) are never capped, only trimmed by `trim_below` (exact XTRIM
MINID) below a position their one reader has saved, so no entry goes before it is consumed.

Writes are batched (see `api.Writer`): each batch goes out as one pipeline of XADDs, and its
replies are read while the next batch is being made. A reader asks for its next entries before
it decodes the ones it got. Each writer and reader has a connection of its own for that.

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
from redis.connection import Connection
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
    """Sends each batch as one pipeline of XADDs on its own connection and reads the replies
    when the next batch goes out (or at flush): Redis appends one batch while the next is
    encoded. A batch whose replies were not read when the connection went is sent again."""

    def __init__(self, client: redis.Redis, namespace: str, topic: str, partitions: int, maxlen: int):
        super().__init__(topic, partitions)
        self._client = client
        self._conn: Connection | None = None
        self._keys = [f"{namespace}:{topic}:{p}" for p in range(partitions)]
        self._trim = ("MAXLEN", "~", maxlen) if maxlen > 0 else ()
        self._backoff = Backoff(f"writer of topic {topic!r}")
        self._unconfirmed: list[tuple[int, bytes]] = []
        """The batch sent last, whose replies are not read yet."""
        self._give_up_at: float | None = None
        """Set by close(): a process that is stopping retries a lost Redis only this long."""

    def _send(self, batch: list[tuple[int, bytes]]) -> None:
        self._settle()
        self._unconfirmed = batch
        try:
            self._transmit(batch)
        except _LOST as e:
            self._lost(e)
            self._settle()

    def _transmit(self, batch: list[tuple[int, bytes]]) -> None:
        if self._conn is None:
            self._conn = self._client.connection_pool.get_connection()
        commands = [("XADD", self._keys[partition], *self._trim, "*", FIELD, payload) for partition, payload in batch]
        self._conn.send_packed_command(self._conn.pack_commands(commands))

    def _settle(self) -> None:
        while self._unconfirmed:
            try:
                if self._conn is None:  # lost while sending: send again
                    self._transmit(self._unconfirmed)
                conn, batch = self._conn, self._unconfirmed
                assert conn is not None
                errors = []
                for partition, _ in batch:
                    try:
                        entry_id = conn.read_response()
                        self.ends[partition] = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                    except redis.ResponseError as e:
                        errors.append(e)
                self._unconfirmed = []
                self._backoff.succeeded()
                if errors:
                    raise errors[0]
            except _LOST as e:
                self._lost(e)

    def _lost(self, error: Exception) -> None:
        """Drop the connection and wait before the batch is sent again (or give up when closing)."""
        if self._conn is not None:
            self._conn.disconnect()
            self._client.connection_pool.release(self._conn)
            self._conn = None
        if self._give_up_at is not None and time.monotonic() > self._give_up_at:
            log.error(
                "writer of topic %r: closing with Redis unreachable; %d records were not delivered",
                self.topic,
                len(self._unconfirmed),
            )
            self._unconfirmed = []
            return
        time.sleep(self._backoff.failed(error, cap=CLOSE_TIMEOUT_S / 4 if self._give_up_at else RETRY_MAX_S))

    def close(self) -> None:
        self._give_up_at = time.monotonic() + CLOSE_TIMEOUT_S
        super().close()
        with self._send_lock:
            if self._conn is not None:
                self._client.connection_pool.release(self._conn)
                self._conn = None


class RedisReader(Reader):
    """Reads with XREAD on its own connection. After a read that returned entries it sends the
    next XREAD at once (without BLOCK) and reads its reply on the next call: Redis gathers the
    next entries while this batch is decoded."""

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
        self._conn: Connection | None = None
        self._ahead = False
        """An XREAD was sent ahead and its reply is not read yet."""
        self._keys = {f"{namespace}:{topic}:{p}".encode(): p for p in self.partitions}
        self._backoff = Backoff(f"reader of topic {topic!r}")
        self._entry_bytes = 1
        """Mean payload size of the last read (unknown before the first, which takes max_count):
        XREAD's COUNT is set so that a read holds about READ_BYTES."""

    def _xread(self, count: int, block_ms: int) -> None:
        if self._conn is None:
            self._conn = self._client.connection_pool.get_connection()
        # BLOCK 0 would mean forever in Redis; no BLOCK means return at once.
        block = ("BLOCK", block_ms) if block_ms else ()
        positions = [self._position[p] for p in self._keys.values()]
        self._conn.send_command("XREAD", "COUNT", count, *block, "STREAMS", *self._keys, *positions)

    def _read_raw(self, timeout: float, max_count: int) -> list[RawEntry]:
        count = max(1, min(max_count, READ_BYTES // self._entry_bytes))
        try:
            reply = None
            if self._ahead:
                self._ahead = False
                assert self._conn is not None
                reply = self._conn.read_response()
            if not reply:
                self._xread(count, int(min(timeout, BLOCK_MAX_S) * 1000))
                assert self._conn is not None
                reply = self._conn.read_response()
            self._backoff.succeeded()
        except _LOST as e:
            self._drop()
            time.sleep(self._backoff.failed(e, cap=timeout))
            return []
        out = self._parse(reply, count)
        if out:
            try:
                self._xread(count, 0)
                self._ahead = True
            except _LOST:
                self._drop()  # the next call connects again
        return out

    def _parse(self, reply: Any, count: int) -> list[RawEntry]:
        """Take up to `count` entries of an XREAD reply and move the positions past them."""
        out: list[RawEntry] = []
        # The reply as Redis sends it: [[key, entries], ...], or {key: entries} under RESP3;
        # each entry is [id, [field, value, ...]].
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

    def _drop(self) -> None:
        self._ahead = False
        if self._conn is not None:
            self._conn.disconnect()
            self._client.connection_pool.release(self._conn)
            self._conn = None

    def close(self) -> None:
        self._drop()


def _entry_id(entry: str | bytes) -> tuple[int, int]:
    """A stream entry id ("MS-SEQ") as the pair it sorts by."""
    ms, _, seq = (entry.decode() if isinstance(entry, bytes) else entry).partition("-")
    return int(ms), int(seq or 0)


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

    def _make_writer(self, topic: str, partitions: int) -> Writer:
        maxlen = 0 if topic in CONSUMED_TOPICS else self.maxlen
        return RedisWriter(self.client, self.namespace, topic, partitions, maxlen)

    def trim_below(self, topic: str, position: dict) -> None:
        for partition, offset in position.items():
            if offset != "0-0":
                # Exact (redis-py's default is "~", which keeps whole radix-tree nodes of up to
                # 100 entries): the memory bound the plan states counts entries, not nodes.
                self.client.xtrim(f"{self.namespace}:{topic}:{partition}", minid=offset, approximate=False)

    def trimmed_after(self, topic: str, partition: int, position: str | None) -> bool:
        try:
            info = self.client.xinfo_stream(f"{self.namespace}:{topic}:{partition}")
        except redis.ResponseError:  # no such stream: nothing was written to it
            return False
        if info.get("entries-added") == info["length"]:
            return False
        if position is None:
            return True
        # Every entry before the first kept one is gone; whether one of them came after `position`
        # is not recorded, so the first kept entry past `position` counts as a gap.
        first = info["first-entry"][0] if info["length"] else info["last-generated-id"]
        return _entry_id(first) > _entry_id(position)

    def _where(self) -> tuple:
        return (self.client, self.namespace)

    def delete_all(self) -> int:
        """Delete every stream of this run (its namespace); returns how many keys went."""
        keys = list(self.client.scan_iter(match=f"{self.namespace}:*", count=1000))
        return self.client.delete(*keys) if keys else 0

    def close(self) -> None:
        super().close()
        self.client.close()
