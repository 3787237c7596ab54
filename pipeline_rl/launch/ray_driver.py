"""A run of several nodes: one driver on a running Ray cluster places, starts, watches and
stops every process of the plan.

`pipeline-rl conf=X` with world.nodes > 1 (or world.ray_address set) connects to the cluster
(world.ray_address, else RAY_ADDRESS, else the cluster `ray start` made on this machine), and
reserves one placement group, one bundle per process (bundles.py). It then prepares the run
directory alone (run_dir.py), starts Redis (when streams.redis.start_server) as an actor in
trainer rank 0's bundle, and every process as an actor (process_host.py) that runs the same
`python -m pipeline_rl.<pool> --run-dir D --index I` as on one node.

Supervision is Ray's: each actor's `run` returns its child's exit code, and a node that dies
takes its workers with it, so their `run` calls fail at once when the worker's sockets close.
A node that vanishes without closing them (a power cut, a partition) or freezes with its sockets
open (a hung kernel: connections are still accepted, nothing answers) is found by the driver's
own probe of every node's raylet (ray_health.py): a gRPC health check that must be answered
within RAYLET_PROBE_S, long before Ray's own health check gives up on the node. A lost
process is restarted in its bundle (launch/restarts.py) until world.max_restarts is spent: on
its node, or, when its node is lost (Ray marked it dead, or its raylet refuses connections),
where Ray places the bundle again (a node with room). The actors of a node that stopped
answering (frozen, or cut off) and held nothing else start again at once, each in a placement
group of its own, the old ones fenced (`restart`). An actor no node has room for yet is absent
(`Waiting`): the run goes on with the other actors, and the actor starts again once its old
bundle's node answers or a node has room. A lost node 0 (trainer rank 0 and Redis), or
any other node that stopped answering, stops the run; the report names the process, its node
(Ray node id and address) and every process the node held. The start, watch and stop sequence is the one-node launcher's
(run_loop.py); this module supplies how processes start, are polled and stop, and where actors
added to the running job go (launch/scaling.py): each in a placement group of its own (the
run's cannot grow), removed when the actor drains.
"""

from __future__ import annotations

import copy
import os
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

import ray
import redis
from ray import ObjectRef
from ray.actor import ActorHandle, ActorProxy
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pipeline_rl.config import ConfigError, RunConfig
from pipeline_rl.launch import ray_nodes
from pipeline_rl.launch.bundles import STRATEGY, Bundle, bundles
from pipeline_rl.launch.placement import Node, ProcessSpec, child_env, plan
from pipeline_rl.launch.process_host import ProcessHost
from pipeline_rl.launch.ray_cluster import connect, reserve
from pipeline_rl.launch.ray_health import NODE_PROBE_EVERY_S, NodeHealth
from pipeline_rl.launch.ray_nodes import RayNode, bundle_nodes, node_alive
from pipeline_rl.launch.restarts import TRAINER_POOL
from pipeline_rl.launch.run_loop import Failure, RunLoop, run
from pipeline_rl.launch.supervisor import STOP_GRACE_S, describe_exit
from pipeline_rl.wire import LAUNCHED_AT_ENV, POOL_MODULES, RUN_NONCE_ENV

NODE_MOVE_S = 120.0
"""How long a restart waits for Ray to place a lost node's bundle on another node (the cluster
may be adding one)."""
SCALE_PLACE_S = 60.0
"""How long adding actors to a running job waits for the cluster to fit them (the run's
processes are not polled meanwhile)."""
REDIS_START_S = 30.0
"""How long the run's redis-server may take to answer its first PING."""
RAY_WORKER_ONLY = ("OMP_NUM_THREADS",)
"""Variables Ray sets in its workers (OMP_NUM_THREADS to the actor's CPU count, 1 here) that
the processes must not inherit: they get the driver's, as on one node (child_env)."""


@dataclass
class Hosted:
    name: str
    pool: str
    """actor, preprocessor, trainer, or redis."""
    node: RayNode
    actor: ActorProxy[ProcessHost]
    """Its ProcessHost (launch/process_host.py), a Ray actor."""
    run: ObjectRef
    """Its `run` call: (exit code, log tail)."""
    log_path: Path
    result: tuple[int | None, str] | None = None
    """Once `run` has returned: (exit code, or None when the Ray worker itself is gone; log tail
    or what became of the worker)."""
    bundle: int = 0
    """Its bundle of the placement group (a restart starts it there again)."""
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    gpus: float = 0.0
    pg: PlacementGroup | None = None
    """The placement group of an actor added to the running job (its bundle 0); None: the run's."""
    cpus: float = 1.0


@dataclass
class Waiting:
    """An actor of a frozen node that no node had room for when it was restarted: the run goes
    on without it (the launcher counts it absent) until it can start again."""

    old: Hosted
    pg: PlacementGroup | None
    """For a frozen node's actor, a placement group of its own, asked for on any node: Ray places
    it once one has room. None for a lost node's: Ray places its bundle again once one has."""
    probed_at: float = 0.0
    """When its own bundle's node was last probed (it may wake, or Ray may place the bundle anew)."""


def _kill(h: Hosted) -> None:
    """End `h`'s Ray actor for good. (Ray's stubs type what `ray.remote` makes an ActorProxy and
    what `ray.kill` takes an ActorHandle: the same object.)"""
    ray.kill(cast("ActorHandle", h.actor), no_restart=True)


class RayRun(RunLoop):
    heals = True

    def __init__(self, cfg: RunConfig, pg: PlacementGroup, found: list[Bundle], nodes: list[RayNode], nonce: str):
        super().__init__(cfg)
        self.pg, self.found, self.nodes, self.nonce = pg, found, nodes, nonce
        self.run_dir = Path(cfg.run_dir).resolve()
        self.remote_host = ray.remote(ProcessHost)
        self.hosted: list[Hosted] = []
        self.redis: Hosted | None = None
        self.health = NodeHealth(self.nodes)
        """Which nodes are gone and which failures a restart heals (launch/ray_health.py)."""
        self.waiting: dict[str, Waiting] = {}
        """Actors of frozen nodes waiting for room, by name."""

    def _start(
        self,
        name: str,
        pool: str,
        bundle: int,
        argv: list[str],
        env: dict[str, str],
        gpus: float = 0.0,
        added: tuple[PlacementGroup, float, RayNode] | None = None,
    ) -> Hosted:
        """Start a process in `bundle` of the run's placement group, or, for an actor `added` to
        the running job, in its own (placement group, CPUs, node)."""
        log_path = self.run_dir / "logs" / f"{name}.log"
        pg, cpus, node = added or (self.pg, self.found[bundle].resources["CPU"], self.nodes[bundle])
        actor = self.remote_host.options(
            # Redis rides on trainer rank 0's bundle without taking its CPU.
            num_cpus=0 if pool == "redis" else cpus,
            num_gpus=gpus,
            max_restarts=0,
            max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
        ).remote(name, argv, env, os.getcwd(), str(log_path), RAY_WORKER_ONLY)
        run = actor.run.remote()
        h = Hosted(name, pool, node, actor, run, log_path, bundle=bundle, argv=argv, env=env, gpus=gpus, cpus=cpus)
        h.pg = added[0] if added else None
        return h

    def start_redis(self) -> None:
        """Check trainer rank 0's node first (binary, port), start the server there, and wait for
        its answer to a PING, or for its exit: errors name the node, the port and the cause."""
        from pipeline_rl.launch.redis_server import cannot_start, redis_command
        from pipeline_rl.streams import open_streams
        from pipeline_rl.streams.redis_backend import RedisStreams

        r, node = self.cfg.streams.redis, self.nodes[0]
        where = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=0)
        check = ray.remote(cannot_start).options(num_cpus=0, scheduling_strategy=where)
        problem = ray.get(check.remote(r.host, r.port), timeout=REDIS_START_S)
        if problem is not None:
            raise ConfigError(f"the run's redis-server cannot start on {node} (trainer rank 0's node): {problem}")
        self.redis = self._start("redis", "redis", 0, redis_command(self.cfg), {})
        streams = open_streams(self.cfg)
        assert isinstance(streams, RedisStreams)
        deadline = time.monotonic() + REDIS_START_S
        try:
            while True:
                self._collect(timeout=0.0)
                if self.redis.result is not None:
                    code, tail = self.redis.result
                    what = tail if code is None else f"{describe_exit(code)}; its last lines:\n{tail}"
                    raise RuntimeError(f"the run's redis-server on {node}, port {r.port}, ended at start: {what}")
                try:
                    streams.client.ping()
                    return
                except redis.RedisError as e:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"the run's redis-server on {node}, port {r.port}, does not answer after "
                            f"{REDIS_START_S:.0f} s: {type(e).__name__}: {e}"
                        ) from None
                    time.sleep(0.2)
        finally:
            streams.close()

    def start(self) -> None:
        if self.cfg.streams.backend == "redis" and self.cfg.streams.redis.start_server:
            self.start_redis()
        distinct = list(dict.fromkeys(n.id for n in self.nodes))
        # The plan's node indices, made true: where Ray placed each bundle (trainer rank 0's node is 0).
        placed = [replace(b.spec, node=distinct.index(n.id)) for b, n in zip(self.found, self.nodes)]
        for i, (spec, node) in enumerate(zip(placed, self.nodes)):
            env = self._process_env(self.cfg, spec, placed, Node(spec.node, len(distinct), self.nodes[0].ip, node.cpus))
            self.hosted.append(self._start(spec.name, spec.pool, i, self._argv(spec), env, float(len(spec.gpus))))
            print(f"placed {spec.name} on {node}", flush=True)
        print(f"started {len(self.hosted)} processes on {len(distinct)} nodes; logs in {self.run_dir / 'logs'}")

    def _process_env(
        self, cfg: RunConfig, spec: ProcessSpec, sharing: list[ProcessSpec], where: Node
    ) -> dict[str, str]:
        """The environment of pool process `spec` on node `where` (`sharing`: every process of
        the run, for the node-local settings), as on one node (child_env) but for what Ray sets
        in its workers, and with this start's nonce."""
        driver_env = {k: os.environ[k] for k in RAY_WORKER_ONLY if k in os.environ}
        env = child_env(cfg, where, spec, sharing, env=driver_env)
        if spec.gpus:
            del env["CUDA_VISIBLE_DEVICES"]  # Ray sets it to the GPUs it gave the actor
        env[RUN_NONCE_ENV] = self.nonce
        env[LAUNCHED_AT_ENV] = repr(self.launched_at)
        return env

    def _argv(self, spec: ProcessSpec) -> list[str]:
        return [
            sys.executable,
            "-m",
            POOL_MODULES[spec.pool],
            "--run-dir",
            str(self.run_dir),
            "--index",
            str(spec.index),
        ]

    def _everyone(self) -> list[Hosted]:
        return self.hosted + ([self.redis] if self.redis is not None else [])

    def _collect(self, timeout: float) -> None:
        """Take the results of the `run` calls that have ended (within `timeout`)."""
        pending = {h.run: h for h in self._everyone() if h.result is None}
        if not pending:
            return
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=timeout)
        for ref in ready:
            h = pending[ref]
            try:
                h.result = ray.get(ref)
            except RayActorError as e:
                # The worker is gone, with its node or alone: no exit code.
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                h.result = (None, f"its Ray worker is gone ({type(e).__name__}: {first})")

    def poll(self) -> tuple[Failure | None, bool]:
        for waiting in list(self.waiting.values()):
            if self._start_waiting(waiting):
                del self.waiting[waiting.old.name]
        self._collect(timeout=0.0)
        failure = self.health.failure(self._everyone())
        if failure is not None:
            return failure, False
        trainers = [h for h in self.hosted if h.pool == "trainer"]
        return None, bool(trainers) and all(h.result is not None for h in trainers)

    def pool_processes(self) -> set[str]:
        return {h.name for h in self.hosted}

    def absent_actors(self) -> set[int]:
        return {int(name.removeprefix("actor")) for name in self.waiting}

    def restart(self, what: str) -> None:
        """Start `what` again in its bundle: on the same node, or where Ray placed the bundle
        again after its node was lost (NODE_MOVE_S)."""
        targets = [h for h in self.hosted if (h.pool == "trainer" if what == TRAINER_POOL else h.name == what)]
        self._signal(targets, signal.SIGKILL)
        self._wait(targets, STOP_GRACE_S)
        for old in targets:
            if old.node.id in self.health.frozen:
                # Fenced: should the node wake, the kill reaches the process before it does more
                # than a step or two (its groups carry its own incarnation: none is taken twice).
                old.actor.signal.remote(signal.SIGKILL)
                _kill(old)
                self.hosted.remove(old)
                self._wait_for_room(Waiting(old, self._ask_elsewhere(old)))
                continue
            _kill(old)
            node = old.node
            if node.id in self.health.lost and old.pool == "actor":
                self.hosted.remove(old)
                self._wait_for_room(Waiting(old, None))
                continue
            if node.id in self.health.lost:
                node = self._moved(old.pg or self.pg, old.bundle)
                if old.pg is None:
                    self.nodes[old.bundle] = node
            added = (old.pg, old.cpus, node) if old.pg is not None else None
            new = self._start(old.name, old.pool, old.bundle, old.argv, old.env, old.gpus, added)
            self.hosted[self.hosted.index(old)] = new
            print(f"started {new.name} again on {new.node}", flush=True)

    def _wait_for_room(self, waiting: Waiting) -> None:
        """Start a lost actor now if there is room, else once there is (`poll`): the run goes on
        without it meanwhile."""
        if self._start_waiting(waiting):
            return
        name = waiting.old.name
        self.waiting[name] = waiting
        print(
            f"\nno node has room for {name} now: the run goes on with the other actors, and {name} "
            "starts again once its node is back or another has room",
            flush=True,
        )

    def _ask_elsewhere(self, old: Hosted) -> PlacementGroup:
        """A placement group of its own for `old` (an actor whose node froze), on any node: Ray
        places the frozen node's bundle again only once it marks the node dead, minutes later."""
        resources = self.found[old.bundle].resources if old.pg is None else {"CPU": old.cpus, "GPU": old.gpus}
        return placement_group([{k: v for k, v in resources.items() if v}], strategy=STRATEGY)

    def _start_waiting(self, waiting: Waiting) -> bool:
        """Start a waiting actor where there is room now: in its own placement group once Ray
        placed it, or in its old bundle once that bundle's node answers again (the node woke,
        or Ray placed the bundle on another node). False: no room yet."""
        old = waiting.old
        if waiting.pg is not None and placement_group_table(waiting.pg)["state"] == "CREATED":
            if old.pg is not None:
                remove_placement_group(old.pg)  # an added actor's own, on the frozen node
            node = bundle_nodes(waiting.pg, 1)[0]
            new = self._start(old.name, old.pool, 0, old.argv, old.env, old.gpus, (waiting.pg, old.cpus, node))
        else:
            node = self._bundle_back(waiting)
            if node is None:
                return False
            if waiting.pg is not None:
                remove_placement_group(waiting.pg)
            if node.id in self.health.frozen:  # it woke: its processes are signalled and waited for again
                self.health.frozen.discard(node.id)
                self.health.lost.discard(node.id)
                self.health.misses.pop(node.id, None)
            if old.pg is None:
                self.nodes[old.bundle] = node
            added = (old.pg, old.cpus, node) if old.pg is not None else None
            new = self._start(old.name, old.pool, old.bundle, old.argv, old.env, old.gpus, added)
        self.hosted.append(new)
        print(f"\nstarted {new.name} again on {new.node}", flush=True)  # off the status line
        return True

    def _bundle_back(self, waiting: Waiting) -> RayNode | None:
        """The node of the waiting actor's old bundle, if it answers now (probed at most every
        NODE_PROBE_EVERY_S: a frozen node takes RAYLET_PROBE_S to miss a probe)."""
        if time.monotonic() - waiting.probed_at < NODE_PROBE_EVERY_S:
            return None
        waiting.probed_at = time.monotonic()
        old = waiting.old
        node_id = placement_group_table(old.pg or self.pg)["bundles_to_node_id"].get(old.bundle)
        cluster = ray_nodes.cluster_nodes()
        info = cluster.get(node_id or "")
        # A frozen node counts as lost too (nothing on it is signalled) until it answers again.
        lost = node_id in self.health.lost and node_id not in self.health.frozen
        if not node_id or lost or info is None or not info["Alive"]:
            return None
        node = RayNode.of(node_id, info)
        return node if node_alive(node, cluster) else None

    def _moved(self, pg: PlacementGroup, bundle: int) -> RayNode:
        """The live node Ray placed `bundle` of `pg` on after its node was lost (Ray places a dead
        node's bundles again once the cluster has room), waiting up to NODE_MOVE_S."""
        deadline = time.monotonic() + NODE_MOVE_S
        while True:
            node_id = placement_group_table(pg)["bundles_to_node_id"].get(bundle)
            info = ray_nodes.cluster_nodes().get(node_id or "")
            if node_id and node_id not in self.health.lost and info is not None and info["Alive"]:
                return RayNode.of(node_id, info)
            if time.monotonic() > deadline:
                raise RuntimeError(f"Ray placed bundle {bundle} on no live node within {NODE_MOVE_S:.0f} s")
            time.sleep(1.0)

    def prepare_actors(self, actors: int) -> object:
        """A placement group of its own for each new actor (the run's cannot grow), waiting up to
        SCALE_PLACE_S for the cluster to fit them all; none is kept when one does not fit."""
        cfg = copy.deepcopy(self.cfg)
        cfg.world.actors = actors
        have = {h.name for h in self.hosted}
        new = [b for b in bundles(cfg, plan(cfg)) if b.spec.pool == "actor" and b.spec.name not in have]
        pgs = [
            placement_group([b.resources], strategy=STRATEGY, name=f"pipeline_rl:{cfg.name}:{b.spec.name}") for b in new
        ]
        for b, pg in zip(new, pgs):
            if not pg.wait(timeout_seconds=SCALE_PLACE_S):
                for made in pgs:
                    remove_placement_group(made)
                raise RuntimeError(
                    f"the Ray cluster did not fit {b.spec.name} ({b.resources}) within {SCALE_PLACE_S:g} s; it has "
                    f"{ray.available_resources()} free (`ray status` says what is in use)"
                )
        return cfg, list(zip(new, pgs))

    def start_actors(self, placed: object) -> None:
        cfg, new = cast("tuple[RunConfig, list[tuple[Bundle, PlacementGroup]]]", placed)
        for b, pg in new:
            node = bundle_nodes(pg, 1)[0]
            distinct = list(dict.fromkeys([*(h.node.id for h in self.hosted), node.id]))
            spec = replace(b.spec, node=distinct.index(node.id))
            sharing = [ProcessSpec(h.name, h.pool, 0, distinct.index(h.node.id)) for h in self.hosted]
            where = Node(spec.node, len(distinct), self.nodes[0].ip, node.cpus)
            env = self._process_env(cfg, spec, [*sharing, spec], where)
            added = (pg, b.resources["CPU"], node)
            self.hosted.append(self._start(spec.name, "actor", 0, self._argv(spec), env, float(len(spec.gpus)), added))
            print(f"placed {spec.name} on {node}", flush=True)

    def retire(self, name: str) -> None:
        h = next(h for h in self.hosted if h.name == name)
        self.hosted.remove(h)
        _kill(h)
        if h.pg is not None:
            remove_placement_group(h.pg)

    def _signal(self, targets: list[Hosted], sig: int) -> None:
        for h in targets:
            if h.result is None and h.node.id not in self.health.lost:
                h.actor.signal.remote(sig)

    def _wait(self, targets: list[Hosted], timeout: float) -> None:
        """Until every target on a node still there has ended, at most `timeout` (a frozen node's
        processes would never say so)."""
        deadline = time.time() + timeout
        while any(h.result is None and h.node.id not in self.health.lost for h in targets) and time.time() < deadline:
            self._collect(timeout=min(0.5, max(0.0, deadline - time.time())))

    def stop_all(self, graceful: bool) -> None:
        for waiting in self.waiting.values():
            if waiting.pg is not None:
                remove_placement_group(waiting.pg)
        self.waiting.clear()
        trainers = [h for h in self.hosted if h.pool == "trainer"]
        if graceful:
            self._signal(trainers, signal.SIGTERM)
            self._wait(trainers, self.trainer_stop_grace_s)
        self._signal(self.hosted, signal.SIGTERM)
        self._wait(self.hosted, STOP_GRACE_S)
        self._signal(self.hosted, signal.SIGKILL)
        self._wait(self.hosted, 2.0)
        # Redis last: the processes stopping above still write to it.
        if self.redis is not None:
            self._signal([self.redis], signal.SIGTERM)
            self._wait([self.redis], STOP_GRACE_S)
        for h in self._everyone():
            # A worker killed takes its child with it (PR_SET_PDEATHSIG), whatever is left.
            _kill(h)
            if h.pg is not None:
                remove_placement_group(h.pg)


def run_on_ray(cfg: RunConfig, fresh: bool) -> int:
    """The whole run of several nodes, from this one driver; returns the exit code."""
    specs = plan(cfg)
    found = bundles(cfg, specs)
    address = connect(cfg)
    pg = reserve(found, name=f"pipeline_rl:{cfg.name}")
    try:
        nodes = bundle_nodes(pg, len(found))
        if cfg.streams.backend == "redis" and cfg.streams.redis.start_server:
            cfg.streams.redis.host = nodes[0].ip
        return run(cfg, fresh, lambda nonce: RayRun(cfg, pg, found, nodes, nonce), where=f" on Ray ({address})")
    finally:
        remove_placement_group(pg)
        ray.shutdown()
