"""The trainer's replay log: the micro-batches a rank trained since its last checkpoint, kept in
the run directory so that the Redis trainer topic can drop them as soon as they are trained.

Without it the topic had to keep every micro-batch since the last checkpoint, because a
restart resumes from there and trains those steps again: on a 32B run that is tens of GB of
Redis memory. With it, each rank appends a step's micro-batches to
RUN_DIR/trainer_replay/rank{r}.jsonl (flushed and fsynced) and only then trims its partition
below the step, so Redis holds only the steps not yet trained (the preprocessor's lead: at
most the admission lag + 1 steps); the log holds the rest, on disk, until the next checkpoint
drops the steps it contains. A resumed rank reads the log first (the steps after its
checkpoint, in order), then its partition from the checkpoint's position: the entries the log
replaces are gone from Redis, so the partition continues where the log ends. Delivery stays
at-least-once; the step collector skips what the checkpoint already holds.

Only backends that trim (Redis) need it: JSONL files keep everything.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline_rl.streams.api import Entry, Reader
from pipeline_rl.streams.records import MicroBatch, decode, encode

REPLAY_DIR = "trainer_replay"


def replay_path(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / REPLAY_DIR / f"rank{rank}.jsonl"


class ReplayLog:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._batches = [decode(line, MicroBatch) for line in self._lines()]
        last = self._batches[-1] if self._batches else None
        if last is not None and sum(mb.step == last.step for mb in self._batches) < last.count:
            # A crash during the append left part of a step, which the stream still holds
            # whole (it is trimmed only after the append): that copy is the one to train.
            self._batches = [mb for mb in self._batches if mb.step != last.step]
            self._rewrite([encode(mb) for mb in self._batches])
        self.last_step = max((mb.step for mb in self._batches), default=-1)
        """The newest whole step in the log: a step replayed from it is not appended again."""

    def _lines(self) -> list[bytes]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        # A line cut short by a crash mid-append has no newline: its step was never trimmed
        # from the stream (the trim comes after the fsync), so it is dropped here.
        return data.split(b"\n")[:-1]

    def pending(self) -> list[MicroBatch]:
        """The micro-batches in the log, oldest first (read once, at start)."""
        batches, self._batches = self._batches, []
        return batches

    def append(self, batch: list[MicroBatch]) -> None:
        """Make a trained step durable here, before the stream drops it."""
        if not batch or batch[0].step <= self.last_step:
            return
        with open(self.path, "ab") as f:
            f.write(b"".join(encode(mb) + b"\n" for mb in batch))
            f.flush()
            os.fsync(f.fileno())
        self.last_step = batch[0].step

    def keep_from(self, version: int) -> None:
        """A checkpoint of `version` holds steps 0 .. version-1: keep only later ones."""
        self._rewrite([line for line in self._lines() if decode(line, MicroBatch).step >= version])

    def _rewrite(self, lines: list[bytes]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "wb") as f:
            f.write(b"".join(line + b"\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


class ReplayingReader:
    """A trainer partition's reader that first returns the replay log's micro-batches."""

    def __init__(self, reader: Reader, replay: list[MicroBatch]):
        self.reader = reader
        self._replay = replay
        self._next = 0

    def read(self, timeout: float = 1.0, max_count: int = 256) -> list[Entry]:
        if self._next < len(self._replay):
            batch = self._replay[self._next : self._next + max_count]
            start, self._next = self._next, self._next + len(batch)
            return [Entry(-1, f"replay:{start + i}", mb) for i, mb in enumerate(batch)]
        return self.reader.read(timeout=timeout, max_count=max_count)

    def position(self) -> dict:
        return self.reader.position()

    @property
    def dead_letters(self) -> int:
        return self.reader.dead_letters
