"""`python launch.py conf=NAME [key=value ...] [--fresh]`: start, watch and stop one node's share of a run.

One launcher runs per node. Each computes the same placement (pipeline_rl/launch/placement.py),
starts its node's processes, and stops all of them when the run ends, when any of them
fails, on Ctrl-C/SIGTERM, or at `max_time_s`. Node 0 also owns Redis (when it starts it)
and shows the status line. Launchers of several nodes tell each other about the end of the
run through the `control` stream.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline_rl.config import ConfigError, RunConfig, load_config, parse_overrides, save_config
from pipeline_rl.launch.budget import budget_lines, run_limits
from pipeline_rl.launch.memory_plan import memory_plan
from pipeline_rl.launch.placement import Node, child_env, describe, plan, this_node
from pipeline_rl.launch.redis_server import start_redis, wait_port
from pipeline_rl.launch.supervisor import ChildFailed, Supervisor, describe_exit, last_lines
from pipeline_rl.launch.watchdog import Watchdog
from pipeline_rl.scorers import check_scorers
from pipeline_rl.streams.records import Control, Metrics
from pipeline_rl.trainer.loss import load_loss
from pipeline_rl.wire import POOL_MODULES, Topic

if TYPE_CHECKING:
    from pipeline_rl.streams.api import Streams

NODES_LEAVE_TIMEOUT_S = 30.0
"""How long node 0 keeps its Redis up for the other nodes to stop and say so."""


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="pipeline-rl", description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument(
        "--fresh", action="store_true", help="delete the run directory (and its Redis keys) and start over"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config, print the placement and the GPU memory plan, start nothing",
    )
    return parser.parse_known_args(argv)


def prepare_run_dir(cfg: RunConfig, fresh: bool) -> bool:
    """Create or reuse the run directory; True when this is a resume."""
    run_dir = Path(cfg.run_dir)
    saved = run_dir / "config.yaml"
    if fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    elif run_dir.exists() and not saved.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"run_dir {run_dir} exists and is not a pipeline_rl run; choose another run_dir")
    resumed = saved.exists()
    save_config(cfg, saved)
    return resumed


def _wipe_redis(cfg: RunConfig) -> None:
    from pipeline_rl.streams import open_streams
    from pipeline_rl.streams.redis_backend import RedisStreams

    streams = open_streams(cfg)
    assert isinstance(streams, RedisStreams)
    print(f"--fresh: deleted {streams.delete_all()} Redis stream keys of run '{cfg.name}'", flush=True)
    streams.close()


def _ensure_tiny_model(cfg: RunConfig) -> None:
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


def _end_of(streams: Streams, topic: str, record_type: type) -> dict[int, str]:
    """Position after everything an earlier run of this directory left in `topic`."""
    reader = streams.reader(topic, record_type)
    while reader.read(timeout=0.0, max_count=4096):
        pass
    return reader.position()


class Launcher:
    def __init__(self, cfg: RunConfig, node: Node):
        self.cfg, self.node = cfg, node
        self.run_dir = Path(cfg.run_dir)
        self.specs = plan(cfg)
        self.local = [s for s in self.specs if s.node == node.rank]
        self.supervisor = Supervisor(self.run_dir / "logs")
        self.services = Supervisor(self.run_dir / "logs")
        self.streams: Streams | None = None
        self.stop_reason: str | None = None
        # Sized by the model (launch/budget.py): a 32B checkpoint takes minutes, a tiny one seconds.
        self.trainer_stop_grace_s, self.watchdog_startup_s = run_limits(cfg)

    def _request_stop(self, signum, _frame) -> None:
        self.stop_reason = f"received {signal.Signals(signum).name}"

    def start(self) -> None:
        if self.cfg.streams.backend == "redis":
            if self.cfg.streams.redis.start_server and self.node.rank == 0:
                start_redis(self.cfg, self.services)
            else:
                wait_port(self.cfg.streams.redis.host, self.cfg.streams.redis.port, "redis", timeout=120)
        from pipeline_rl.streams import open_streams

        self.streams = streams = open_streams(self.cfg)
        self.control_writer = streams.writer(Topic.CONTROL)
        self.control_reader = streams.reader(Topic.CONTROL, Control, position=_end_of(streams, Topic.CONTROL, Control))
        for spec in self.local:
            argv = [
                sys.executable,
                "-m",
                POOL_MODULES[spec.pool],
                "--run-dir",
                str(self.run_dir),
                "--index",
                str(spec.index),
            ]
            self.supervisor.spawn(
                spec.name, argv, child_env(self.cfg, self.node, spec, self.specs), expected_exit=spec.pool == "trainer"
            )
        print(
            f"node {self.node.rank}/{self.node.nodes}: started {', '.join(s.name for s in self.local)}; "
            f"logs in {self.run_dir / 'logs'}",
            flush=True,
        )

    def watch(self) -> int:
        status = None
        if self.node.rank == 0:
            from pipeline_rl.launch.status import StatusLine

            streams = self.streams
            assert streams is not None, "watch() before start()"
            status = StatusLine(
                self.cfg.trainer.max_steps,
                streams.reader(Topic.METRICS, Metrics, position=_end_of(streams, Topic.METRICS, Metrics)),
                self.cfg.max_time_s,
            )
        watchdog = Watchdog(self.cfg.watchdog_s, self.watchdog_startup_s)
        start = time.time()
        try:
            while True:
                failure, done = self.supervisor.poll()
                service_failure, _ = self.services.poll()
                failure = failure or service_failure
                if failure is not None:
                    return self._fail(failure)
                if done:
                    return self._finish("the trainers finished", code=0)
                for entry in self.control_reader.read(timeout=0.0):
                    if entry.record.event == "failed":
                        return self._finish(
                            f"{entry.record.source} failed on another node: {entry.record.reason}", code=1
                        )
                    if entry.record.event == "stop":
                        return self._finish(f"node 0 ended the run: {entry.record.reason}", code=0)
                if self.stop_reason:
                    return self._finish(self.stop_reason, code=130)
                if self.cfg.max_time_s and time.time() - start > self.cfg.max_time_s:
                    return self._finish(f"max_time_s={self.cfg.max_time_s:g} reached", code=0)
                if status is not None:
                    for record in status.update(timeout=0.5):
                        watchdog.observe(record)
                    stall = watchdog.stalled()
                    if stall is not None:
                        return self._stalled(stall)
                else:
                    time.sleep(0.5)
        finally:
            if status is not None:
                status.close()

    def _fail(self, failure: ChildFailed) -> int:
        child = failure.child
        reason = describe_exit(failure.code) if child.name != "redis" else "redis-server stopped"
        self.control_writer.write(Control(event="failed", source=child.name, reason=reason))
        self._stop_all(graceful=False)
        print(
            f"\nprocess {child.name} (node {self.node.rank}) failed: {reason}; stopped the others. "
            f"Last lines of {child.log_path}:\n{last_lines(child.log_path)}",
            file=sys.stderr,
            flush=True,
        )
        return 1

    def _stalled(self, report: str) -> int:
        """The watchdog fired (node 0): stop every node and say who waited on what."""
        self.control_writer.write(Control(event="failed", source="watchdog", reason=report.splitlines()[0]))
        print(f"\n{report}\nstopping the run", file=sys.stderr, flush=True)
        self._stop_all(graceful=True)
        return 3

    def _finish(self, reason: str, code: int) -> int:
        if self.node.rank == 0 and code != 1:
            self.control_writer.write(Control(event="stop", source="launcher0", reason=reason))
        print(f"\nstopping: {reason}", flush=True)
        self._stop_all(graceful=code != 1)
        return code

    def _stop_all(self, graceful: bool) -> None:
        trainers = {s.name for s in self.local if s.pool == "trainer"}
        self.supervisor.stop(first=trainers if graceful else None, first_grace_s=self.trainer_stop_grace_s)
        if self.streams is not None:
            if self.node.rank > 0:
                self.control_writer.write(Control(event="left", source=f"node{self.node.rank}"))
            self.control_writer.flush()
            if self.node.rank == 0 and self.services.children:
                self._wait_for_nodes_to_leave()
        self.services.stop()
        if self.streams is not None:
            self.streams.close()

    def _wait_for_nodes_to_leave(self) -> None:
        """Processes on other nodes need Redis to stop cleanly: keep it up until they have left."""
        waiting = {f"node{r}" for r in range(1, self.node.nodes)}
        deadline = time.time() + NODES_LEAVE_TIMEOUT_S
        while waiting and time.time() < deadline:
            for entry in self.control_reader.read(timeout=0.5):
                if entry.record.event == "left":
                    waiting.discard(entry.record.source)
        if waiting:
            print(
                f"{', '.join(sorted(waiting))} did not report leaving within {NODES_LEAVE_TIMEOUT_S:.0f} s; "
                "stopping Redis anyway",
                file=sys.stderr,
                flush=True,
            )


def check_plugins(cfg: RunConfig) -> None:
    """Import the scorers and the loss the config names and check them, so that a bad one
    fails here, at launch, rather than in a pool minutes later (raises ConfigError)."""
    check_scorers(cfg)
    load_loss(cfg.trainer.loss)


def main(argv: list[str]) -> int:
    args, rest = _parse(argv)
    try:
        name, overrides = parse_overrides(rest)
        cfg = load_config(name or "base", overrides)
        check_plugins(cfg)
        specs = plan(cfg)
        if args.dry_run:
            print("\n".join(describe(cfg, specs)))
            print("\n".join(budget_lines(cfg)))
            if cfg.world.gpus_per_node:
                lines = memory_plan(cfg)
                print("\n".join(lines))
                if any(line.endswith("DOES NOT FIT") for line in lines):
                    print("config error: the memory plan does not fit (world.gpu_memory_gib)", file=sys.stderr)
                    return 2
            return 0
        node = this_node(cfg)
        if node.nodes > 1 and cfg.streams.redis.start_server:
            cfg.streams.redis.host = node.master_addr
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    resumed = prepare_run_dir(cfg, args.fresh)
    if args.fresh and cfg.streams.backend == "redis" and node.rank == 0 and not cfg.streams.redis.start_server:
        _wipe_redis(cfg)
    print(f"{'resuming' if resumed else 'starting'} run '{cfg.name}' in {cfg.run_dir}", flush=True)
    _ensure_tiny_model(cfg)
    launcher = Launcher(cfg, node)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, launcher._request_stop)
    try:
        launcher.start()
        code = launcher.watch()
    except BaseException:
        launcher._stop_all(graceful=False)
        raise
    if node.rank == 0 and cfg.metrics.plot_at_end:
        from pipeline_rl.launch.plots import write_plots

        for path in write_plots(Path(cfg.run_dir)):
            print(f"plot: {path}")
    return code


def cli() -> None:
    """The `pipeline-rl` command (and `python launch.py`): same arguments as `main`."""
    sys.exit(main(sys.argv[1:]))
