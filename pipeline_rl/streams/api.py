"""The stream layer: append-only topics split into partitions, shared by every pool.

A writer appends records to (topic, partition); a reader reads partitions from a position,
blocking up to a timeout. Two backends implement the same contract:
`pipeline_rl.streams.jsonl_backend` (files under RUN_DIR/streams, one node) and
`pipeline_rl.streams.redis_backend` (Redis streams, several nodes); `cfg.streams.backend` picks one.

Delivery is at-least-once and in order per partition. A payload a reader cannot decode as its
record type is not handed out: it is counted (`Reader.dead_letters`), logged with its
topic/partition/offset, copied as a `DeadLetter` record to partition 0 of f"{topic}.dead"
(with at most DEAD_PAYLOAD_MAX bytes of the payload; the whole payload stays in the source
partition at its offset), and the reader goes on.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

from pipeline_rl.streams.records import DeadLetter, RecordError, decode, encode
from pipeline_rl.wire import dead_topic

log = logging.getLogger(__name__)

DEAD_PAYLOAD_MAX = 1 << 16
"""Bytes of a bad payload copied into its DeadLetter record."""
READ_BYTES = 1 << 20
"""A read stops taking entries once they hold this many payload bytes (it takes at least one).
Bounds a reader's memory when it catches up on large records, and decoding a few MB at a
time is faster per record than decoding tens of MB (scripts/bench_streams.py)."""

BATCH_RECORDS = 256
BATCH_BYTES = 4 << 20
LINGER_S = 0.002
"""A writer sends its buffer once it holds BATCH_RECORDS records or BATCH_BYTES bytes, or its
oldest record is LINGER_S old."""
CLOSE_TIMEOUT_S = 5.0
"""How long close() waits for a writer's flush thread (and a Redis writer retries a lost
server) before it gives up."""

_TOPIC = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class Entry(NamedTuple):
    """One record read, and where it was. (A tuple: a frozen dataclass took 0.4 us to make,
    a tenth of a 1 KB record's decoding.)"""

    partition: int
    offset: str
    """Where the record sits in its partition: a byte offset (JSONL) or an entry ID (Redis)."""
    record: Any


def check_topic(topic: str) -> None:
    # Topics become file names and Redis key parts.
    if not _TOPIC.match(topic):
        raise ValueError(f"bad topic name {topic!r}: use letters, digits, '_', '.', '-'")


def partitions_for(consumer: int, consumers: int, partitions: int) -> list[int]:
    """The partitions consumer `consumer` of `consumers` reads: every consumers-th one.
    Together the consumers cover each partition exactly once; a consumer beyond the number of
    partitions gets none."""
    if consumers < 1 or not 0 <= consumer < consumers:
        raise ValueError(f"consumer {consumer} is not in range for {consumers} consumers")
    return [p for p in range(partitions) if p % consumers == consumer]


class PositionStore:
    """A JSON file that holds a consumer's position, replaced atomically on each save."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def save(self, obj: Any) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def load(self) -> Any:
        """The saved object, or None when nothing was saved yet."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"position file {self.path} is not valid JSON: {e}") from None


class Writer:
    """Appends records to the partitions of one topic, in batches. Backends implement `_send`.

    write() buffers the record; the buffer goes to `_send` in one batch once it holds
    BATCH_RECORDS records or BATCH_BYTES bytes or its oldest record is LINGER_S old, so the
    cost of a system call or a round trip is shared by many records. When writes stop, a
    background thread sends what is left within about 2 * LINGER_S. So a record is visible to
    readers within a few milliseconds of write() returning, and at once after flush() or
    close(). Batches go out one at a time, in write order. (The writing thread sends while it
    writes: a background sender would wait for the GIL behind the encoding thread at every
    system call.) A process must close (or flush) its writers before it exits: what is still
    buffered when it dies is lost, like a record it had not written yet."""

    def __init__(self, topic: str, partitions: int):
        check_topic(topic)
        if partitions < 1:
            raise ValueError(f"topic {topic!r}: partitions must be >= 1, got {partitions}")
        self.topic = topic
        self.partitions = partitions
        self._next = 0
        self._buf: list[tuple[int, bytes]] = []
        self._bytes = 0
        self._first = 0.0
        """When the oldest buffered record was written (time.monotonic)."""
        self._buf_lock = threading.Lock()
        self._send_lock = threading.Lock()  # one batch in flight at a time keeps write order
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.ends: dict[int, str] = {}
        """Per partition, a reader's position right after this writer's last record there that
        reached the stream (set by the backend as a batch lands; complete after flush())."""

    def write(self, record: Any, partition: int | None = None) -> None:
        """Append `record` to `partition`, or round-robin over the writer's partitions."""
        if partition is None:
            partition = self._next
            self._next = (self._next + 1) % self.partitions
        self.write_raw(encode(record), partition)

    def _check_partition(self, partition: int) -> None:
        if not 0 <= partition < self.partitions:
            raise ValueError(f"topic {self.topic!r}: partition {partition} not in [0, {self.partitions})")

    def write_raw(self, payload: bytes, partition: int = 0) -> None:
        """Append an already encoded payload (tests use it to inject malformed records)."""
        self._check_partition(partition)
        if self._error is not None:
            raise RuntimeError(f"topic {self.topic!r}: background flush failed: {self._error}") from self._error
        now = time.monotonic()
        with self._buf_lock:
            first = not self._buf
            if first:
                self._first = now
            self._buf.append((partition, payload))
            self._bytes += len(payload)
            due = len(self._buf) >= BATCH_RECORDS or self._bytes >= BATCH_BYTES or now - self._first >= LINGER_S
        if due:
            self._push(settle=False)
        elif first:  # the flush loop watches each batch from its first record on
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._flush_loop, daemon=True, name=f"stream-writer-{self.topic}"
                )
                self._thread.start()
            self._wake.set()

    def flush(self) -> None:
        """Make every record written so far visible to readers."""
        self._push(settle=True)

    def _push(self, settle: bool) -> None:
        with self._send_lock:
            with self._buf_lock:
                batch, self._buf, self._bytes = self._buf, [], 0
            if batch:
                self._send(batch)
            if settle:
                self._settle()

    def _send(self, batch: list[tuple[int, bytes]]) -> None:
        """Append (partition, payload) pairs, in order, after every batch sent before; a backend
        may return before the batch is confirmed, as long as `_settle` then waits for it."""
        raise NotImplementedError

    def _settle(self) -> None:
        """Return once readers can see every batch sent so far (flush() ends with it)."""

    def _flush_loop(self) -> None:
        """Send what an idle writer left in its buffer."""
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closing.wait(LINGER_S):  # close() sends what is left
                return
            with self._buf_lock:
                pending = bool(self._buf)
                due = pending and time.monotonic() - self._first >= LINGER_S
            if not due:
                if pending:
                    self._wake.set()  # a young batch: look again later
                continue
            try:
                self.flush()
            except Exception as e:  # surfaced to the caller on its next write()
                log.error("writer of topic %r: background flush failed: %s", self.topic, e)
                self._error = e
                return

    def close(self) -> None:
        self.flush()
        self._closing.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=CLOSE_TIMEOUT_S)
            self._thread = None


RawEntry = tuple[int, str, bytes]  # partition, offset, payload


class Reader:
    """Reads records of one type from some partitions of a topic. Backends implement
    `_read_raw`, which returns up to `max_count` raw entries in partition order (stopping
    once they hold READ_BYTES of payload) and advances `self._position` past them."""

    def __init__(
        self,
        topic: str,
        record_type: type,
        partitions: Iterable[int],
        position: dict | None,
        start: str,
        dead_writer: Callable[[], Writer],
    ):
        check_topic(topic)
        self.topic = topic
        self.record_type = record_type
        self.partitions = tuple(partitions)
        if not self.partitions:
            raise ValueError(f"topic {topic!r}: a reader needs at least one partition")
        given = {int(p): str(o) for p, o in (position or {}).items()}  # JSON turns int keys into str
        self._position = {p: given.get(p, start) for p in self.partitions}
        self.dead_letters = 0
        self._dead_writer = dead_writer
        self.on_dead_letter: Callable[[DeadLetter], None] | None = None
        """Called with each dead letter after it is copied to the dead topic."""

    def position(self) -> dict[int, str]:
        """Where to resume: right after the last entry returned (JSON-able)."""
        return dict(self._position)

    def read(self, timeout: float = 1.0, max_count: int = 256) -> list[Entry]:
        """Up to `max_count` entries, fewer once they hold READ_BYTES of payload; blocks up to
        `timeout` seconds for at least one, [] on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            raw = self._read_raw(max(0.0, deadline - time.monotonic()), max_count)
            entries = self._decode(raw)
            if entries or time.monotonic() >= deadline:
                return entries

    def _decode(self, raw: list[RawEntry]) -> list[Entry]:
        entries, dead = [], []
        # A batch makes thousands of lists and dicts that all live until it is returned: the
        # cyclic GC would scan them over and over while they are made (a quarter of a reader's
        # time with 1 KB records). Paused, it looks at them once, after the batch.
        gc_enabled = gc.isenabled()
        gc.disable()
        try:
            for partition, offset, payload in raw:
                try:
                    entries.append(Entry(partition, offset, decode(payload, self.record_type)))
                except RecordError as e:
                    dead.append(self._dead_letter(partition, offset, payload, str(e)))
        finally:
            if gc_enabled:
                gc.enable()
        if dead:
            self.dead_letters += len(dead)
            writer = self._dead_writer()
            for letter in dead:
                log.warning(
                    "dead letter: topic %s partition %d offset %s: %s (copied to %s.dead)",
                    letter.topic,
                    letter.partition,
                    letter.offset,
                    letter.error,
                    self.topic,
                )
                writer.write(letter, partition=0)
            writer.flush()
            if self.on_dead_letter is not None:
                for letter in dead:
                    self.on_dead_letter(letter)
        return entries

    def _dead_letter(self, partition: int, offset: str, payload: bytes, error: str) -> DeadLetter:
        if len(payload) > DEAD_PAYLOAD_MAX:
            error += f" (payload of {len(payload)} bytes, first {DEAD_PAYLOAD_MAX} kept)"
        text = payload[:DEAD_PAYLOAD_MAX].decode("utf-8", errors="replace")
        return DeadLetter(self.topic, partition, offset, error, text)

    def _read_raw(self, timeout: float, max_count: int) -> list[RawEntry]:
        raise NotImplementedError

    def close(self) -> None:
        """Release the reader's resources."""


class Streams:
    """Factory of writers and readers of one backend; `close()` flushes and closes them all."""

    reader_class: Callable[..., Reader]
    """The backend's Reader, built as reader_class(*_where(), topic, record_type, partitions,
    position, dead_writer)."""

    def __init__(self) -> None:
        self._writers: list[Writer] = []
        self._readers: list[Reader] = []
        self._dead: dict[str, Writer] = {}

    def writer(self, topic: str, partitions: int = 1) -> Writer:
        writer = self._make_writer(topic, partitions)
        self._writers.append(writer)
        return writer

    def reader(
        self, topic: str, record_type: type, partitions: Iterable[int] = (0,), position: dict | None = None
    ) -> Reader:
        dead_writer = lambda: self._dead_writer(topic)  # noqa: E731 (made only if a record is dead-lettered)
        reader = self.reader_class(*self._where(), topic, record_type, partitions, position, dead_writer)
        self._readers.append(reader)
        return reader

    def _dead_writer(self, topic: str) -> Writer:
        if topic not in self._dead:
            self._dead[topic] = self.writer(dead_topic(topic))
        return self._dead[topic]

    def trim_below(self, topic: str, position: dict) -> None:
        """Let the backend drop entries before `position` (a reader's saved position: every
        entry before it is consumed for good). JSONL files keep everything."""

    def trimmed_after(self, topic: str, partition: int, position: str | None) -> bool:
        """Whether `trim_below` may have dropped entries of `partition` that came after `position`
        (None: any entry), so that a reader from there no longer sees every entry that landed
        after it. JSONL files keep everything."""
        return False

    def _make_writer(self, topic: str, partitions: int) -> Writer:
        raise NotImplementedError

    def _where(self) -> tuple:
        """What the backend's reader class takes before (topic, record_type, partitions,
        position, dead_writer): the backend's location (a directory, a client and namespace)."""
        raise NotImplementedError

    def close(self) -> None:
        for writer in self._writers:
            writer.close()
        for reader in self._readers:
            reader.close()
        self._writers, self._readers, self._dead = [], [], {}
