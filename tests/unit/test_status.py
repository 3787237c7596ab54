"""The launcher's status line: progress over the time limit when there is one, else over steps."""

import time

from pipeline_rl.config import RunConfig
from pipeline_rl.launch.status import StatusLine
from pipeline_rl.streams import open_streams
from pipeline_rl.streams.records import Metrics


def status_after(tmp_path, max_time_s: float) -> StatusLine:
    cfg = RunConfig()
    cfg.run_dir = str(tmp_path / "run")
    streams = open_streams(cfg)
    writer = streams.writer("metrics")
    writer.write(Metrics(process="trainer0", time=time.time(), values={"version": 7, "samples_per_s": 100.0}))
    writer.write(Metrics(process="actor0", time=time.time(), values={"eval/reward": 0.5, "lag_mean": 0.25}))
    writer.flush()
    status = StatusLine(100, streams.reader("metrics", Metrics), max_time_s)
    status.start -= 3.2  # as if the run had started 3.2 s ago
    status.update(timeout=1.0)
    status.close()
    streams.close()
    return status


def test_bar_over_steps_without_a_time_limit(tmp_path):
    status = status_after(tmp_path, 0.0)
    assert (status.bar.total, status.bar.n) == (100, 7)
    assert "version" not in status.bar.postfix and "eval=0.5" in status.bar.postfix


def test_bar_over_the_time_limit_shows_the_version(tmp_path):
    status = status_after(tmp_path, 900.0)
    assert (status.bar.total, status.bar.n) == (900, 3)
    assert "version=7" in status.bar.postfix and "lag=0.25" in status.bar.postfix
