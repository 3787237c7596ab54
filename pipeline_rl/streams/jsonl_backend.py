"""JSONL backend of the stream layer: one append-only file per partition (one node).

Layout: ROOT/<topic>/<partition>.jsonl, one encoded record per line; an offset is the byte
offset of a line's first byte, as a string.

Writing: records are batched (see `api.Writer`); the lines of a batch for one partition go out
in one os.write on an O_APPEND descriptor, under an exclusive flock, so lines of several
writer processes never interleave, whatever their size. Once flush() returns, its lines are
in the file: a crash of the writing process cannot lose them.

Torn lines: a writer killed mid-write leaves a last line without its '\\n'. Readers only hand
out lines that end in '\\n', so they wait at the fragment. The next write to the file (by any
writer, under the lock) sees that the file does not end in '\\n' and terminates the fragment
with one, which makes it a line of its own that readers dead-letter (with its offset) and
skip. The fragment is kept rather than truncated so that nothing disappears unreported.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from pipeline_rl.streams.api import READ_BYTES, RawEntry, Reader, Streams, Writer, check_topic

log = logging.getLogger(__name__)

READ_CHUNK = 4 << 20
"""Bytes a reader reads from a file at once (more when one line is longer)."""
POLL_MIN_S, POLL_MAX_S = 0.0005, 0.01
"""A waiting reader polls file sizes, backing off from the first to the second interval."""


def partition_path(root: Path, topic: str, partition: int) -> Path:
    check_topic(topic)
    return root / topic / f"{partition}.jsonl"


class JsonlWriter(Writer):
    def __init__(self, root: Path, topic: str, partitions: int):
        super().__init__(topic, partitions)
        self._root = root
        self._fds: dict[int, int] = {}
        self._ends: dict[int, int] = {}
        """File size right after this writer's last write: if unchanged, the file ends in '\\n'."""

    def _fd(self, partition: int) -> int:
        fd = self._fds.get(partition)
        if fd is None:
            path = partition_path(self._root, self.topic, partition)
            path.parent.mkdir(parents=True, exist_ok=True)
            # O_RDWR so that the torn-line check can pread the last byte.
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            self._fds[partition] = fd
            self._ends[partition] = -1
        return fd

    def write_raw(self, payload: bytes, partition: int = 0) -> None:
        if b"\n" in payload:
            raise ValueError(f"topic {self.topic!r}: a JSONL payload cannot contain a newline")
        super().write_raw(payload, partition)

    def _send(self, batch: list[tuple[int, bytes]]) -> None:
        lines: dict[int, list[bytes]] = {}
        for partition, payload in batch:
            lines.setdefault(partition, []).append(payload)
        for partition, payloads in lines.items():
            payloads.append(b"")  # so that the join ends in '\n' too
            self._append(partition, b"\n".join(payloads))

    def _append(self, partition: int, lines: bytes) -> None:
        fd = self._fd(partition)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            size = os.fstat(fd).st_size
            if size != self._ends[partition] and size > 0 and os.pread(fd, 1, size - 1) != b"\n":
                log.warning(
                    "topic %s partition %d: terminating a torn line before offset %d (left by a "
                    "killed writer); readers will dead-letter it",
                    self.topic,
                    partition,
                    size,
                )
                os.write(fd, b"\n")
                size += 1
            view = memoryview(lines)
            while view:
                view = view[os.write(fd, view) :]
            self._ends[partition] = size + len(lines)
            self.ends[partition] = str(size + len(lines))
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        super().close()
        with self._send_lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class JsonlReader(Reader):
    def __init__(
        self,
        root: Path,
        topic: str,
        record_type: type,
        partitions: Iterable[int],
        position: dict | None,
        dead_writer: Callable[[], Writer],
    ):
        super().__init__(topic, record_type, partitions, position, "0", dead_writer)
        self._paths = {p: partition_path(root, topic, p) for p in self.partitions}
        self._fds: dict[int, int] = {}
        # Per partition: bytes read from the file but not handed out yet start at _buf[p][_skip[p]:],
        # which is at file offset _position[p].
        self._buf = {p: b"" for p in self.partitions}
        self._skip = {p: 0 for p in self.partitions}
        self._rotate = 0

    def _fill(self, partition: int) -> bool:
        """Append more of the partition's file to its buffer; False when there was nothing new."""
        fd = self._fds.get(partition)
        if fd is None:
            try:
                fd = self._fds[partition] = os.open(self._paths[partition], os.O_RDONLY)
            except FileNotFoundError:
                return False
        pending = self._buf[partition][self._skip[partition] :]
        start = int(self._position[partition]) + len(pending)
        size = os.fstat(fd).st_size
        if size <= start:
            return False
        self._buf[partition] = pending + os.pread(fd, min(size - start, READ_CHUNK), start)
        self._skip[partition] = 0
        return True

    def _take(self, partition: int, limit: int, budget: int, out: list[RawEntry]) -> int:
        """Move up to `limit` complete lines from the partition's buffer to `out`, stopping once
        they hold `budget` bytes; returns the budget left."""
        buf, i = self._buf[partition], self._skip[partition]
        pos = int(self._position[partition]) - i  # file offset of buf[0]
        while limit > 0 and budget > 0:
            j = buf.find(b"\n", i)
            if j < 0:
                # No complete line buffered: read more, unless the file has nothing new.
                self._skip[partition], self._position[partition] = i, str(pos + i)
                if not self._fill(partition):
                    break
                buf, i = self._buf[partition], 0
                pos = int(self._position[partition])
                continue
            out.append((partition, str(pos + i), buf[i:j]))
            i, limit, budget = j + 1, limit - 1, budget - (j - i)
        self._skip[partition], self._position[partition] = i, str(pos + i)
        return budget

    def _read_raw(self, timeout: float, max_count: int) -> list[RawEntry]:
        deadline = time.monotonic() + timeout
        sleep = POLL_MIN_S
        # Start at a different partition each call so that a busy one cannot starve the others.
        order = self.partitions[self._rotate :] + self.partitions[: self._rotate]
        self._rotate = (self._rotate + 1) % len(self.partitions)
        while True:
            out: list[RawEntry] = []
            budget = READ_BYTES
            for p in order:
                budget = self._take(p, max_count - len(out), budget, out)
                if len(out) >= max_count or budget <= 0:
                    break
            remaining = deadline - time.monotonic()
            if out or remaining <= 0:
                return out
            time.sleep(min(sleep, remaining))
            sleep = min(sleep * 2, POLL_MAX_S)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class JsonlStreams(Streams):
    reader_class = JsonlReader

    def __init__(self, root: Path):
        super().__init__()
        self.root = Path(root)

    def _make_writer(self, topic: str, partitions: int) -> Writer:
        return JsonlWriter(self.root, topic, partitions)

    def _where(self) -> tuple:
        return (self.root,)
