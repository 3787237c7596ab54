"""A run from start to end, written once for one node (launcher.py) and for Ray (ray_driver.py):
prepare the run directory, build the demo model when it is missing, start, watch (the status
line, the watchdog, the time limit, Ctrl-C/SIGTERM, the restart or the report of a failed
process: launch/restarts.py), stop, plot.

A backend (a RunLoop subclass) says only how its processes start, are polled, restarted and
stop, and where actors added to a running job go (launch/scaling.py); `run`
and `RunLoop.watch` decide the rest, and with which exit code (wire.ExitCode): OK when the
trainers finished (or max_time_s), FAILED when a process or a node failed, STALLED when the
watchdog found no progress, INTERRUPTED on a signal.
"""

from __future__ import annotations

import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline_rl.config import ConfigError, RunConfig
from pipeline_rl.config.model_fit import check_model_fit
from pipeline_rl.launch.budget import run_limits
from pipeline_rl.launch.restarts import RESTART_WINDOW_S, TRAINER_POOL, RestartPolicy, restart_target
from pipeline_rl.launch.run_dir import prepare_run_dir
from pipeline_rl.launch.scaling import ScaleRequest, ScaleRequests
from pipeline_rl.launch.supervisor import PEER_REPORT_WAIT_S
from pipeline_rl.launch.watchdog import Watchdog
from pipeline_rl.metrics import MetricsLogger
from pipeline_rl.streams.records import ActorCount, Metrics
from pipeline_rl.wire import ExitCode, Topic

if TYPE_CHECKING:
    from pipeline_rl.launch.status import StatusLine
    from pipeline_rl.streams.api import Streams


@dataclass
class Failure:
    summary: str
    """What failed, where and how: "process actor0 on node ... failed: exit code 1"."""
    log_path: str
    log_tail: str
    """The last lines of its log."""
    caused_by_peer: bool = False
    """It failed because a peer is gone (wire.ExitCode.PEER_GONE): that peer's failure, when
    it comes, is the one to report."""
    process: str = ""
    """The process that failed (a pool process's name, or a service's: redis)."""
    exit_code: int | None = None
    """Its exit code (None: killed with its node, or its Ray worker gone)."""


def end_of(streams: Streams, topic: str, record_type: type) -> dict[int, str]:
    """Position after everything an earlier run of this directory left in `topic`."""
    reader = streams.reader(topic, record_type)
    while reader.read(timeout=0.0, max_count=4096):
        pass
    return reader.position()


class StatusFeed:
    """The status line's reads of the metrics stream, on a thread of their own: a stream that
    stops answering (Redis on a frozen node) must not hold up the polling of the processes and
    nodes, which is what finds the cause."""

    def __init__(self, status: StatusLine):
        self.status = status
        self.records: queue.Queue[Metrics] = queue.Queue()
        self.stopping = threading.Event()
        self.error: Exception | None = None
        """What ended the thread, raised again in the watch loop."""
        self.thread = threading.Thread(target=self._run, name="status-feed", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                for record in self.status.update(timeout=0.5):
                    self.records.put(record)
            except Exception as e:
                if not self.stopping.is_set():  # else the stream was closed under a read
                    self.error = e
                return

    def drain(self, timeout: float) -> list[Metrics]:
        """The records read since the last call, waiting up to `timeout` for the first."""
        if self.error is not None:
            raise self.error
        try:
            out = [self.records.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self.records.get_nowait())
            except queue.Empty:
                return out

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=1.0)  # a read blocked on a frozen server is left behind


class RunLoop:
    heals = False
    """Whether this backend restarts lost processes (`restart`); when not, world.max_restarts
    does not apply and any lost process stops the run."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.stop_reason: str | None = None
        self.launched_at = time.time()
        """Passed to the processes (wire.LAUNCHED_AT_ENV): where max_time_s starts for them too."""
        # Sized by the model (launch/budget.py): a 32B checkpoint takes minutes, a tiny one seconds.
        self.trainer_stop_grace_s, self.watchdog_startup_s = run_limits(cfg)
        self.restarts = RestartPolicy(cfg.world.max_restarts if self.heals else 0, Path(cfg.run_dir) / "restarts.jsonl")
        self._metrics: MetricsLogger | None = None
        """The launcher's own metrics (restarts, the actor count), made at the first."""
        self.actors = cfg.world.actors
        """The job's actors now (launch/scaling.py)."""
        self.draining: set[str] = set()
        """Actors scaled away that have not exited yet."""
        self.drained = 0
        """Actors that drained and left (the launcher's metric "actors_drained_total")."""
        self.scale_requests = ScaleRequests(Path(cfg.run_dir))
        self.absent: set[int] = set()
        """The absent actors the pools were last told of (core/actor_count.py)."""

    def start(self) -> None:
        """Start the run's services (Redis) and every process of the plan."""
        raise NotImplementedError

    def poll(self) -> tuple[Failure | None, bool]:
        """(the first failure, whether the trainers have all finished)."""
        raise NotImplementedError

    def stop_all(self, graceful: bool) -> None:
        """Stop every process: when graceful, trainers first, with trainer_stop_grace_s to checkpoint."""
        raise NotImplementedError

    def pool_processes(self) -> set[str]:
        """The names of the run's pool processes (what restarts may replace)."""
        return set()

    def restart(self, what: str) -> None:
        """Start `what` again (a process's name, or restarts.TRAINER_POOL: every trainer rank),
        or, for an actor that nowhere has room for now, start it once there is (`absent_actors`)."""
        raise NotImplementedError

    def absent_actors(self) -> set[int]:
        """The job's actors that are lost and waiting for room to start again (on Ray)."""
        return set()

    def prepare_actors(self, actors: int) -> object:
        """Place actors self.actors..actors-1 (a run of `actors` actors would have them there);
        raises ConfigError or RuntimeError when they do not fit, having started nothing."""
        raise NotImplementedError

    def start_actors(self, placed: object) -> None:
        """Start the actors `prepare_actors` placed."""
        raise NotImplementedError

    def retire(self, name: str) -> None:
        """Forget actor `name`, which drained and exited (not restarted; its slot is free)."""
        raise NotImplementedError

    def request_stop(self, signum, _frame) -> None:
        self.stop_reason = f"received {signal.Signals(signum).name}"

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.request_stop)

    def watch(self, streams: Streams) -> int:
        """Run until the run ends, stop every process, return the exit code."""
        from pipeline_rl.launch.status import StatusLine

        status = StatusLine(
            self.cfg.shared.max_steps,
            streams.reader(Topic.METRICS, Metrics, position=end_of(streams, Topic.METRICS, Metrics)),
            self.cfg.max_time_s,
        )
        feed = StatusFeed(status)
        watchdog = Watchdog(self.cfg.watchdog_s, self.watchdog_startup_s)
        start = time.time()
        # The first failure caused by a peer: reported with the peer's own failure, or alone when
        # that does not come within PEER_REPORT_WAIT_S.
        noticed: Failure | None = None
        noticed_until = 0.0
        try:
            while True:
                failure, done = self.poll()
                if failure is not None and failure.process in self.draining and failure.exit_code == 0:
                    self.draining.discard(failure.process)
                    self.retire(failure.process)
                    self.drained += 1
                    self._log(streams, {"actors_drained_total": self.drained})
                    print(f"\n{failure.process} drained and left the job", flush=True)
                    continue
                if failure is not None and self.heal(failure, streams, watchdog):
                    continue
                if failure is not None and failure.caused_by_peer:
                    if noticed is None:
                        noticed, noticed_until = failure, time.time() + PEER_REPORT_WAIT_S
                        print(
                            f"\n{failure.summary}; waiting up to {PEER_REPORT_WAIT_S:g} s for the peer's own report",
                            file=sys.stderr,
                            flush=True,
                        )
                    if time.time() < noticed_until:
                        failure = None
                if failure is not None:
                    return self.fail(failure, noticed)
                if done:
                    return self.finish("the trainers finished", code=ExitCode.OK)
                if self.stop_reason:
                    return self.finish(self.stop_reason, code=ExitCode.INTERRUPTED)
                if self.cfg.max_time_s and time.time() - start > self.cfg.max_time_s:
                    return self.finish(f"max_time_s={self.cfg.max_time_s:g} reached", code=ExitCode.OK)
                request = self.scale_requests.take()
                if request is not None:
                    self.scale(request, streams)
                if self.absent_actors() != self.absent:
                    self._write_count(streams)
                for record in feed.drain(timeout=0.5):
                    watchdog.observe(record)
                    if self.restarts.pending:
                        self.note_recovery(record)
                stall = watchdog.stalled()
                if stall is not None:
                    print(f"\n{stall}\nstopping the run", file=sys.stderr, flush=True)
                    self.stop_all(graceful=True)
                    return ExitCode.STALLED
        finally:
            feed.stop()
            status.close()

    def heal(self, failure: Failure, streams: Streams, watchdog: Watchdog) -> bool:
        """Restart what `failure` takes down when the policy allows it (True); else False,
        with the restarts already spent added to the failure's summary."""
        what = restart_target(failure.process, self.pool_processes())
        if what is None:
            return False
        if not self.restarts.allows(what):
            failure.summary += self.restarts.spent(what)
            return False
        restart = self.restarts.record(what, failure.process, failure.summary)
        print(
            f"\n{failure.summary}; restarting {what} (restart {restart.number} of "
            f"{self.restarts.max_restarts} within {RESTART_WINDOW_S / 3600:g} h, world.max_restarts). "
            f"Last lines of {failure.log_path}:\n{failure.log_tail}",
            file=sys.stderr,
            flush=True,
        )
        try:
            self.restart(what)
        except RuntimeError as e:  # no place to start it again
            failure.summary += f"; restarting {what} failed: {e}"
            return False
        self.restarts.started(restart)
        if what == TRAINER_POOL:
            watchdog.restarted()  # the versions start again from the checkpoint
        self._log(streams, self.restarts.counts())
        return True

    def scale(self, request: ScaleRequest, streams: Streams) -> None:
        """Take the job to `request.actors` actors (launch/scaling.py) and answer the request."""
        old, new = self.actors, request.actors
        if new < 1:
            self.scale_requests.answer(request, False, f"a job needs at least one actor, not {new}")
            return
        if new == old:
            self.scale_requests.answer(request, True, f"the job already has {new} actors")
            return
        running = {f"actor{i}" for i in range(old, new)} & self.draining  # they just go on
        try:
            placed = self.prepare_actors(new) if new > old else None
        except (ConfigError, RuntimeError) as e:
            self.scale_requests.answer(request, False, f"cannot add actors {old}..{new - 1}: {e}")
            return
        # The count first: an actor started below reads it to know it belongs to the job.
        self.actors = new
        self._write_count(streams)
        self.draining -= running
        what = f"added actors {old}..{new - 1}" if new > old else f"actors {new}..{old - 1} drain and leave"
        print(f"\nscaled the job from {old} to {new} actors: {what}", flush=True)  # off the status line
        if placed is not None:
            self.start_actors(placed)
        self.draining |= {f"actor{i}" for i in range(new, old)}
        self._log(streams, {"actors": new})
        self.scale_requests.answer(request, True, f"the job has {new} actors ({what})")

    def _write_count(self, streams: Streams) -> None:
        """Tell the pools the job's actors and which of them are absent."""
        absent = self.absent_actors()
        if absent - self.absent:
            print(f"\nactors absent, the others share each step: {sorted(absent)}", flush=True)
        writer = streams.writer(Topic.ACTOR_COUNT)
        writer.write(ActorCount(self.actors, time.time(), sorted(absent)))
        writer.close()
        self.absent = absent
        self._log(streams, {"actors_absent": len(absent)})

    def note_recovery(self, record: Metrics) -> None:
        step = record.process == "trainer0" and "version" in record.values and "waiting_on" not in record.values
        restart = self.restarts.recovered(record.process, step, record.time)
        if restart is None:
            return
        print(f"\n{restart.what} is back {restart.recovered_s:g} s after {restart.died} was lost", flush=True)
        assert self._metrics is not None
        self._metrics.log({**self.restarts.counts(), "recovery_s": restart.recovered_s})

    def _log(self, streams: Streams, values: dict) -> None:
        if self._metrics is None:
            self._metrics = MetricsLogger(self.cfg, "launcher", streams)
        self._metrics.log(values)

    def fail(self, failure: Failure, noticed: Failure | None = None) -> int:
        """Stop everyone and report `failure`; `noticed` is an earlier failure caused by a peer
        (the same one when its peer never reported)."""
        self.stop_all(graceful=False)
        before = ""
        if noticed is not None and noticed.summary != failure.summary:
            before = f" (before it: {noticed.summary})"
        print(
            f"\n{failure.summary}{before}; stopped the others. Last lines of {failure.log_path}:\n{failure.log_tail}",
            file=sys.stderr,
            flush=True,
        )
        return ExitCode.FAILED

    def finish(self, reason: str, code: int) -> int:
        print(f"\nstopping: {reason}", flush=True)
        self.stop_all(graceful=True)
        return code


def run(cfg: RunConfig, fresh: bool, backend: Callable[[str], RunLoop], where: str = "") -> int:
    """The whole run on `backend` (made from the run's nonce); returns the exit code. Raises
    ConfigError for what the config or the run directory gets wrong."""
    resumed, nonce = prepare_run_dir(cfg, fresh)
    if fresh and cfg.streams.backend == "redis" and not cfg.streams.redis.start_server:
        wipe_redis(cfg)
    print(f"{'resuming' if resumed else 'starting'} run '{cfg.name}' in {cfg.run_dir}{where}", flush=True)
    ensure_tiny_model(cfg)
    check_model_fit(cfg)  # again: the model may have been built just now
    loop = backend(nonce)
    loop.install_signal_handlers()
    try:
        loop.start()
        from pipeline_rl.streams import open_streams

        streams = open_streams(cfg)
        try:
            code = loop.watch(streams)
        finally:
            streams.close()
    except BaseException:
        loop.stop_all(graceful=False)
        raise
    if cfg.metrics.plot_at_end:
        from pipeline_rl.launch.plots import write_plots

        for path in write_plots(Path(cfg.run_dir)):
            print(f"plot: {path}")
    return code


def wipe_redis(cfg: RunConfig) -> None:
    from pipeline_rl.streams import open_streams
    from pipeline_rl.streams.redis_backend import RedisStreams

    streams = open_streams(cfg)
    assert isinstance(streams, RedisStreams)
    print(f"--fresh: deleted {streams.delete_all()} Redis stream keys of run '{cfg.name}'", flush=True)
    streams.close()


def ensure_tiny_model(cfg: RunConfig) -> None:
    model = Path(cfg.model.path)
    if (model / "config.json").exists() or not cfg.model.make_tiny_if_missing:
        return
    from pipeline_rl.demo import ensure_built

    try:
        ensure_built(model, seed=cfg.seed)
    except ValueError as e:
        raise ConfigError(
            f"model.path={e} (model.make_tiny_if_missing; name the directory so, or turn it off)"
        ) from None
