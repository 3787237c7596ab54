"""`python launch.py conf=NAME [key=value ...] [--fresh] [--dry-run]`: start, watch and stop a run;
with `--actors N`, scale the running job of that config to N actors (launch/scaling.py).

On one node the launcher starts every process itself (supervisor.py), with Redis when it
starts one, and stops all of them when the run ends, when any of them fails, on
Ctrl-C/SIGTERM, or at `max_time_s` (run_loop.py). A run of several nodes (world.nodes > 1, or
world.ray_address set) is the Ray driver's (ray_driver.py), from this same one command; only
then is Ray imported.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import cast

from pipeline_rl.config import ConfigError, RunConfig, StepGuidanceMode, load_config, on_ray, parse_overrides
from pipeline_rl.config.model_fit import check_model_fit
from pipeline_rl.config.validate import RAY_WORKER_PORTS, run_ports
from pipeline_rl.core.process import exit_process
from pipeline_rl.launch.budget import budget_lines, checkpoint_timeout
from pipeline_rl.launch.bundles import bundles, describe_bundles
from pipeline_rl.launch.memory_plan import memory_plan
from pipeline_rl.launch.node_checks import driver_lines, socket_lines
from pipeline_rl.launch.placement import Node, ProcessSpec, child_env, describe, plan
from pipeline_rl.launch.redis_server import start_redis, wait_port
from pipeline_rl.launch.restarts import TRAINER_POOL, RestartPolicy
from pipeline_rl.launch.run_loop import Failure, RunLoop, run
from pipeline_rl.launch.scaling import request_actors
from pipeline_rl.launch.supervisor import Supervisor, describe_exit, last_lines
from pipeline_rl.rollouts.domains import load_domain
from pipeline_rl.scorers import check_scorers, step_scorer_class
from pipeline_rl.trainer.loss import load_loss
from pipeline_rl.wire import LAUNCHED_AT_ENV, POOL_MODULES, RUN_NONCE_ENV, ExitCode


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="pipeline-rl", description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument(
        "--fresh", action="store_true", help="delete the run directory (and its Redis keys) and start over"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config, print the placement, the GPU memory plan and the ZeRO sizes, check this "
        "node's NVIDIA driver and network interface, start nothing",
    )
    parser.add_argument(
        "--actors",
        type=int,
        metavar="N",
        help="start nothing: ask the launcher running this config's run_dir to scale the job to N actors",
    )
    return parser.parse_known_args(argv)


class Launcher(RunLoop):
    """One node: every process is a child of this launcher, which restarts lost ones in their
    slots (launch/restarts.py)."""

    heals = True

    def __init__(self, cfg: RunConfig, nonce: str):
        super().__init__(cfg)
        self.run_dir = Path(cfg.run_dir)
        self.specs = plan(cfg)
        self.node = Node(rank=0, nodes=1, master_addr="127.0.0.1")
        self.nonce = nonce
        self.supervisor = Supervisor(self.run_dir / "logs")
        self.services = Supervisor(self.run_dir / "logs")

    def start(self) -> None:
        if self.cfg.streams.backend == "redis":
            if self.cfg.streams.redis.start_server:
                start_redis(self.cfg, self.services)
            else:
                wait_port(self.cfg.streams.redis.host, self.cfg.streams.redis.port, "redis", timeout=120)
        for spec in self.specs:
            self._spawn(spec, self.cfg, self.specs)
        print(f"started {', '.join(s.name for s in self.specs)}; logs in {self.run_dir / 'logs'}", flush=True)

    def _spawn(self, spec: ProcessSpec, cfg: RunConfig, specs: list[ProcessSpec]) -> None:
        """Start `spec`'s process, bound as the plan `specs` of `cfg` places it."""
        argv = [sys.executable, "-m", POOL_MODULES[spec.pool], "--run-dir", str(self.run_dir)]
        env = {**child_env(cfg, self.node, spec, specs), RUN_NONCE_ENV: self.nonce}
        env[LAUNCHED_AT_ENV] = repr(self.launched_at)
        self.supervisor.spawn(spec.name, argv + ["--index", str(spec.index)], env, expected_exit=spec.pool == "trainer")

    def poll(self) -> tuple[Failure | None, bool]:
        failure, done = self.supervisor.poll()
        failure = failure or self.services.poll()[0]
        if failure is None:
            return None, done
        child = failure.child
        reason = describe_exit(failure.code) if child.name != "redis" else "redis-server stopped"
        summary = f"process {child.name} failed: {reason}"
        tail = last_lines(child.log_path)
        peer = failure.code == ExitCode.PEER_GONE
        return Failure(summary, str(child.log_path), tail, peer, child.name, failure.code), False

    def pool_processes(self) -> set[str]:
        return {s.name for s in self.specs}

    def restart(self, what: str) -> None:
        trainers = {s.name for s in self.specs if s.pool == "trainer"}
        self.supervisor.respawn(trainers if what == TRAINER_POOL else {what})

    def prepare_actors(self, actors: int) -> object:
        cfg = copy.deepcopy(self.cfg)
        cfg.world.actors = actors
        specs = plan(cfg)  # where a run of that many actors has them (GPUs: free slots, or ConfigError)
        have = {s.name for s in self.specs}
        return cfg, specs, [s for s in specs if s.pool == "actor" and s.name not in have]

    def start_actors(self, placed: object) -> None:
        cfg, specs, new = cast("tuple[RunConfig, list[ProcessSpec], list[ProcessSpec]]", placed)
        for spec in new:
            self._spawn(spec, cfg, specs)
            self.specs.append(spec)
            print(f"started {spec.name}", flush=True)

    def retire(self, name: str) -> None:
        self.supervisor.children = [c for c in self.supervisor.children if c.name != name]
        self.specs = [s for s in self.specs if s.name != name]

    def stop_all(self, graceful: bool) -> None:
        trainers = {s.name for s in self.specs if s.pool == "trainer"}
        self.supervisor.stop(first=trainers if graceful else None, first_grace_s=self.trainer_stop_grace_s)
        self.services.stop()


def check_plugins(cfg: RunConfig) -> None:
    """Import the domain, the scorers (and the step scorer) and the loss that the config names and
    read their own settings (a domain's settings check what they name, e.g. an agent environment),
    so that a bad one fails here, at launch, rather than in a pool minutes later (raises
    ConfigError)."""
    check_scorers(cfg)
    check_model_fit(cfg)
    load_loss(cfg.trainer.loss)
    load_domain(cfg.actor)
    if cfg.step_guidance.mode != StepGuidanceMode.none:
        step_scorer_class(cfg)


def main(argv: list[str]) -> int:
    args, rest = _parse(argv)
    try:
        name, overrides = parse_overrides(rest)
        cfg = load_config(name or "base", overrides)
        if args.actors is not None:
            ok, answer = request_actors(Path(cfg.run_dir), args.actors)
            print(answer, file=sys.stdout if ok else sys.stderr, flush=True)
            return 0 if ok else 1
        check_plugins(cfg)
        specs = plan(cfg)
        if args.dry_run:
            print("\n".join(describe(cfg, specs)))
            if on_ray(cfg):
                print("\n".join(describe_bundles(cfg, bundles(cfg, specs))))
                lo, hi = RAY_WORKER_PORTS
                ports = ", ".join(f"{key}={port}" for key, port in run_ports(cfg).items())
                print(f"ports: {ports} (outside Ray's worker ports {lo}-{hi})")
            print("\n".join(budget_lines(cfg)))
            print(RestartPolicy(cfg.world.max_restarts, None).describe(on_ray(cfg)))
            failed = []
            if cfg.world.gpus_per_node:
                lines = memory_plan(cfg)
                print("\n".join(lines))
                if any(line.endswith("DOES NOT FIT") for line in lines):
                    failed.append("the memory plan does not fit (world.gpu_memory_gib)")
            for check, what in ((driver_lines, "this node's NVIDIA driver"), (socket_lines, "the network interface")):
                lines, ok = check(cfg)
                if lines:
                    print("\n".join(lines))
                if not ok:
                    failed.append(f"{what} does not fit (above)")
            for failure in failed:
                print(f"config error: {failure}", file=sys.stderr)
            return ExitCode.CONFIG_ERROR if failed else ExitCode.OK
        timeout, margin = checkpoint_timeout(cfg)
        if timeout != cfg.world.collective_timeout_s:
            print(margin, flush=True)
            cfg.world.collective_timeout_s = timeout
        if on_ray(cfg):
            try:
                from pipeline_rl.launch.ray_driver import run_on_ray
            except ModuleNotFoundError as e:
                raise ConfigError(
                    f"world.nodes={cfg.world.nodes} runs on Ray, which is not installed ({e}): "
                    "pip install 'pipeline_rl[cluster]'"
                ) from None
            return run_on_ray(cfg, args.fresh)
        return run(cfg, args.fresh, lambda nonce: Launcher(cfg, nonce))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR


def cli() -> None:
    """The `pipeline-rl` command (and `python launch.py`): same arguments as `main`."""
    exit_process(main(sys.argv[1:]))
