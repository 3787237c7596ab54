"""Per-process metrics: a JSONL file in the run directory, TensorBoard, optional W&B, and
the `metrics` stream that the launcher's status line reads."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path
from typing import Any

import orjson

from pipeline_rl.config import RunConfig
from pipeline_rl.streams.records import Metrics
from pipeline_rl.wire import Topic

HEARTBEAT_S = 10.0
"""Most often a waiting process says what it waits on."""


class MetricsLogger:
    def __init__(self, cfg: RunConfig, process: str, streams: Any | None = None):
        self.process = process
        run_dir = Path(cfg.run_dir)
        (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
        self._file = open(run_dir / "metrics" / f"{process}.jsonl", "ab")
        self._writer = streams.writer(Topic.METRICS) if streams is not None else None
        self._tb = None
        if cfg.metrics.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard" / process))
        self._wandb = None
        if cfg.metrics.wandb_project:
            import wandb  # pyright: ignore[reportMissingImports]  (optional: installed by who asks for it)

            os.environ.setdefault("WANDB_MODE", cfg.metrics.wandb_mode)
            self._wandb = wandb.init(
                project=cfg.metrics.wandb_project,
                name=f"{cfg.name}/{process}",
                group=cfg.name,
                dir=str(run_dir),
                config={"process": process},
                reinit=True,
            )
        self._start = time.time()
        self._calls = 0
        self._heartbeat_at = 0.0

    def log(self, values: dict[str, Any], step: int | None = None) -> None:
        """Record scalar (or small dict) values; `step` is the x-axis in TensorBoard. Every
        record also carries the process's uptime, CPU seconds (all its threads, not its child
        processes) and peak RSS."""
        now = time.time()
        values = {
            **values,
            "uptime_s": now - self._start,
            "cpu_s": time.process_time(),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
        record = Metrics(process=self.process, time=now, values=values, step=step)
        self._file.write(orjson.dumps(record) + b"\n")
        self._file.flush()
        if self._writer is not None:
            self._writer.write(record)
        x = step if step is not None else self._calls
        self._calls += 1
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, x, walltime=record.time)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in values.items() if isinstance(v, (int, float))}, step=x)

    def heartbeat(self, waiting_on: str, **values: Any) -> None:
        """While waiting: say on what, at most every HEARTBEAT_S (the launcher's watchdog
        reports it when the run stalls)."""
        now = time.monotonic()
        if now - self._heartbeat_at >= HEARTBEAT_S:
            self._heartbeat_at = now
            self.log({"waiting_on": waiting_on, **values})

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(run_dir: Path) -> list[dict]:
    """All metrics records of a run, from the JSONL files, in time order (torn lines skipped)."""
    records = []
    for path in sorted((Path(run_dir) / "metrics").glob("*.jsonl")):
        for line in path.read_bytes().splitlines():
            try:
                records.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                continue
    return sorted(records, key=lambda r: r["time"])
