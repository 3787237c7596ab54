"""Several nodes on Ray: the tiny run on a Ray cluster simulated on this machine (Ray's own
`cluster_utils.Cluster`: one raylet per "node", each with 1 CPU, so the placement group's
PACK strategy puts trainer0, preprocessor0 and actor0 on three different nodes; one cluster
serves the module's tests of one actor, the nodes a test lost replaced before the next), with
the run's own Redis and gloo. A node removed mid-run (its raylet, its Ray workers and its pool
processes killed) must stop the run within 45 s without restarts, naming the node and what ran
on it; running again resumes from the last checkpoint and trains no group twice. With
restarts, a pool process killed on a node that stays is started again there, and the actor of a
lost node on the node added in its place; the run goes on. A process whose node does
not see the driver's run directory is refused."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import psutil
import pytest
from fixtures.helpers import ROOT, free_port
from fixtures.launches import scale_actors

from pipeline_rl.core.checkpoint_layout import latest_checkpoint
from pipeline_rl.metrics import read_metrics
from pipeline_rl.preprocess.packing import PAD_GROUP_ID
from pipeline_rl.streams.records import MicroBatch, decode
from pipeline_rl.wire import ExitCode

ray_cluster_utils = pytest.importorskip("ray.cluster_utils")

pytestmark = pytest.mark.slow

NODE_LOSS_STOP_S = 45.0
"""The promise: a node that dies stops the run within this long."""
OBJECT_STORE = 100 * 2**20
"""Per raylet: nothing of the run goes through Ray's object store."""
CARRIED_S = 30.0
"""How long a run carried by one of its two actors is watched."""
BACK_WITHIN_S = 180.0
"""A liveness bound: an absent actor generates again within this long of its node waking (alone on
the machine it is back in some 20 s; CI runs another lane of tests beside this one)."""

QUICK = [
    "actor.attempts=4",
    "shared.groups_per_step=4",
    "actor.max_groups_in_flight=8",
    "actor.eval_every_s=0",
    "actor.metrics_every_s=1",
    "shared.max_lag=2",
    "metrics.tensorboard=false",
    "metrics.plot_at_end=false",
    "max_time_s=0",
    "trainer.checkpoint_every=2",
    "world.nodes=3",
    "streams.backend=redis",
    "streams.redis.start_server=true",
]


def simulated_cluster(nodes: int, **system_config):
    """A head without CPUs (no process of the run lands on it) and `nodes` 1-CPU nodes."""
    head = {"num_cpus": 0, "include_dashboard": False, "object_store_memory": OBJECT_STORE}
    if system_config:
        head["_system_config"] = system_config
    c = ray_cluster_utils.Cluster(initialize_head=True, head_node_args=head)
    for _ in range(nodes):
        c.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
    c.wait_for_nodes()
    return c


NODES = 3
"""One node for each process of a run of one actor."""


@pytest.fixture(scope="module")
def module_cluster():
    """The cluster the module's tests of one actor share: starting one costs a head and three
    raylets, more than a test's own work on some of them."""
    c = simulated_cluster(NODES)
    yield c
    c.shutdown()


@pytest.fixture
def cluster(module_cluster):
    """Three live 1-CPU nodes with nothing running on them: the module's cluster, the nodes an
    earlier test removed replaced and those it added removed, every CPU free again (the earlier
    run's Ray workers end with its driver's job)."""
    return fresh_nodes(module_cluster)


def fresh_nodes(c):
    """`c` with NODES live nodes, every CPU free: the nodes lost replaced, those added removed."""
    while len(c.worker_nodes) > NODES:
        c.remove_node(next(iter(c.worker_nodes)))
    while len(c.worker_nodes) < NODES:
        c.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
    # A node removed without its GCS being told stays live to it until its health checks fail.
    c.wait_for_nodes(timeout=120)
    deadline = time.time() + 120
    while (free := sum(r.get("CPU", 0) for r in c.global_state.available_resources_per_node().values())) < NODES:
        assert time.time() < deadline, f"{free:g} of {NODES} CPUs free 120 s after the earlier test ended"
        time.sleep(0.5)
    return c


@pytest.fixture
def full_cluster():
    """Four nodes, one for each process of a run of two actors: no node has room for anything
    more. Ray's GCS gives up on a node only after minutes (a frozen node here wakes up before it
    would be marked dead)."""
    c = simulated_cluster(4, health_check_failure_threshold=100)
    yield c
    c.shutdown()


class Driver:
    """`launch.py` on the cluster, its output collected line by line as it comes."""

    def __init__(self, cluster, run_dir: Path, redis_port: int, *overrides: str):
        self.redis_port = redis_port
        argv = [sys.executable, "launch.py", "conf=tiny", f"run_dir={run_dir}", *QUICK]
        argv += [f"world.ray_address={cluster.address}", f"streams.redis.port={redis_port}"]
        argv += [f"world.trainer_port={free_port()}", f"world.weight_sync_port={free_port()}", *overrides]
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def placed(self) -> dict[str, str]:
        """Process name -> the Ray node id the driver says it placed it on, or started it again on."""
        found = re.finditer(r"^(?:placed (\w+)|started (\w+) again) on node (\w+) ", self.out, re.M)
        return {m[1] or m[2]: m[3] for m in found}

    def wait_until(self, check, timeout: float, what: str, poll_s: float = 1.0) -> None:
        """Until `check()`, failing with the driver's output when it ended first or `timeout` passed."""
        deadline = time.time() + timeout
        while not check():
            assert self.proc.poll() is None, (
                f"the driver ended before {what}:\n{without_raylet_dumps(self.out)[-4000:]}"
            )
            assert time.time() < deadline, f"no {what} in {timeout:.0f} s:\n{without_raylet_dumps(self.out)[-4000:]}"
            time.sleep(poll_s)

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the driver did not end within {timeout:.0f} s; it printed:\n{self.out[-4000:]}")
        self.reader.join(timeout=10)
        return code

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def run_processes(run_dir: Path, redis_port: int) -> dict[int, str]:
    """Live processes of the run: its pool processes and its redis-server (which shows
    "redis-server HOST:PORT" as its command line): pid -> command."""
    found = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        args = " ".join(p.info["cmdline"] or []).strip()  # redis-server pads its title with empty args
        ours = str(run_dir) in args and "pipeline_rl." in args
        if ours or (args.startswith("redis-server") and args.endswith(f":{redis_port}")):
            found[p.info["pid"]] = args
    return found


def without_raylet_dumps(out: str) -> str:
    """The driver's output without the state dumps a killed raylet's log adds (pages of them)."""
    return "\n".join(line for line in out.splitlines() if "[state-dump]" not in line)


def went_on(driver: Driver, run_dir: Path, code: int, final: int, killed_at: float) -> None:
    """The run whose actor0 was lost at `killed_at` ended well: exit 0, max_steps reached, the
    replacement generated on weights it was sent, no process left."""
    assert code == 0, without_raylet_dumps(driver.out)[-4000:]
    assert trainer_versions(run_dir)[-1] == final
    assert generated_since(run_dir, killed_at), "actor0 wrote no group on sent weights after its loss"
    assert run_processes(run_dir, driver.redis_port) == {}


def generated_since(run_dir: Path, since: float) -> bool:
    """Whether actor0 reported, after `since`, groups written on weights the trainer sent it."""
    after = [r["values"] for r in read_metrics(run_dir) if r["process"] == "actor0" and r["time"] > since]
    return any(r["version"] > 0 and r["groups_written_total"] > 0 for r in after)


def trainer_versions(run_dir: Path) -> list[int]:
    return [
        r["values"]["version"]
        for r in read_metrics(run_dir)
        if r["process"] == "trainer0" and "version" in r["values"] and "waiting_on" not in r["values"]
    ]


def actor_version(run_dir: Path) -> int:
    """The latest policy version actor0 has swapped in (weights that came from trainer rank 0)."""
    return max((r["values"].get("version", 0) for r in read_metrics(run_dir) if r["process"] == "actor0"), default=0)


def run_until(driver: Driver, run_dir: Path, versions: int, timeout: float) -> None:
    """Until the trainer has made `versions` versions and a checkpoint, and the actor runs on new weights."""
    driver.wait_until(
        lambda: (
            len(trainer_versions(run_dir)) >= versions
            and latest_checkpoint(run_dir) is not None
            and bool(actor_version(run_dir))
        ),
        timeout,
        f"{versions} versions, a checkpoint and a swap",
    )


def kill_node(cluster, driver: Driver, run_dir: Path, process: str):
    """Power off the node that holds `process`: its raylet (and with it its Ray workers) and
    every pool process (and redis-server) of the run on it, all with SIGKILL. Returns the
    node, the names of the processes it held and the time of the kill."""
    placed = driver.placed()
    node_id = placed[process]
    node = next(n for n in cluster.list_all_nodes() if n.node_id == node_id)
    held = sorted(name for name, on in placed.items() if on == node_id)
    modules = {"trainer": "trainer", "preprocessor": "preprocess", "actor": "actor"}
    victims = []
    for name in held:
        pool, index = re.match(r"([a-z]+)(\d+)", name).groups()  # type: ignore[union-attr]
        for pid, args in run_processes(run_dir, driver.redis_port).items():
            if f"-m pipeline_rl.{modules[pool]} " in args and args.endswith(f"--index {index}"):
                p = psutil.Process(pid)
                victims += [p, *p.children(recursive=True)]
    if process == "trainer0":
        redis = [pid for pid, args in run_processes(run_dir, driver.redis_port).items() if "redis-server" in args]
        assert len(redis) == 1, run_processes(run_dir, driver.redis_port)
        victims.append(psutil.Process(redis[0]))
    assert len(victims) >= len(held), (held, run_processes(run_dir, driver.redis_port))
    killed_at = time.time()
    cluster.remove_node(node, allow_graceful=False)
    for p in victims:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return node_id, held, killed_at


def freeze_node(cluster, driver: Driver, process: str):
    """Freeze the node that holds `process` as a hung kernel would: its raylet and every process
    under it (its Ray workers, the run's processes they started, a redis-server among them)
    stopped with SIGSTOP, their sockets left open. Returns the node, its id, the names of the
    run's processes it held, the frozen processes and the time of the freeze."""
    placed = driver.placed()
    node_id = placed[process]
    node = next(n for n in cluster.list_all_nodes() if n.node_id == node_id)
    held = sorted(name for name, on in placed.items() if on == node_id)
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    frozen: dict[psutil.Process, str] = {}
    for p in [raylet, *raylet.children(recursive=True)]:
        try:
            frozen[p] = " ".join(p.cmdline())
        except psutil.NoSuchProcess:  # a short-lived child that ended meanwhile
            pass
    commands = " | ".join(frozen.values())
    assert all(f"--index {name[-1]}" in commands for name in held), (held, commands)
    frozen_at = time.time()
    for p in frozen:
        p.suspend()
    return node, node_id, held, frozen, frozen_at


def wake(frozen: dict) -> list[psutil.Process]:
    """The frozen node wakes up: its processes resumed. Returns the actor processes it held, found
    by the command lines they had when frozen (a stopped process may still be killed meanwhile:
    SIGKILL reaches a stopped process, so it is gone, not resumed)."""
    old = [p for p, command in frozen.items() if "pipeline_rl.actor" in command]
    assert len(old) == 1, list(frozen.values())
    for p in frozen:
        try:
            p.resume()
        except psutil.NoSuchProcess:
            pass
    return old


def take_out(cluster, node, frozen) -> None:
    """The frozen node "comes back" only to be taken out: its processes killed, the node removed."""
    for p in frozen:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    if node is not None:
        cluster.remove_node(node, allow_graceful=False)


def aof_commands(path: Path):
    """The commands of one of Redis's append-only files (RESP arrays of bulk strings)."""
    data, i = path.read_bytes(), 0
    while i < len(data):
        assert data[i : i + 1] == b"*", f"not a RESP array at byte {i} of {path}"
        end = data.index(b"\r\n", i)
        count, i = int(data[i + 1 : end]), end + 2
        args = []
        for _ in range(count):
            end = data.index(b"\r\n", i)
            length, i = int(data[i + 1 : end]), end + 2
            args.append(data[i : i + length])
            i += length + 2
        yield args


def groups_in_steps(run_dir: Path) -> tuple[set[int], dict[str, set[int]]]:
    """(every step the preprocessor ever sent, group id -> every step it sent the group in), from
    the append-only files of the run's Redis: every XADD to the trainer topic is there, though
    the topic itself is trimmed as the trainers go (the runs are far too small for Redis to
    rewrite the file)."""
    files = sorted((run_dir / "redis" / "appendonlydir").glob("*.incr.aof"), key=lambda p: int(p.name.split(".")[2]))
    assert files, f"no append-only file under {run_dir / 'redis'}"
    steps, steps_of = set(), {}
    for path in files:
        for args in aof_commands(path):
            if args[0].upper() == b"XADD" and args[1].startswith(b"pipeline_rl:tiny:trainer:"):
                batch = decode(args[-1], MicroBatch)
                # A step whose groups were all filtered out (zero advantage) is padding alone.
                steps.add(batch.step)
                for gid in batch.group_ids:
                    if gid != PAD_GROUP_ID:
                        steps_of.setdefault(gid, set()).add(batch.step)
    return steps, steps_of


LOSSES = [("actor0", "killed"), ("actor0", "frozen"), ("trainer0", "frozen"), ("trainer0", "killed")]
"""The node losses that stop a run without restarts, one run each: the node that holds actor0, then
the one that holds trainer rank 0 and the run's Redis, each killed (raylet, workers and the run's
processes SIGKILLed) and frozen (all of them SIGSTOPped, sockets left open: what a hung kernel or a
partition looks like from the other nodes)."""


class Loss(NamedTuple):
    """What a node's loss did to a run."""

    node: str
    held: list[str]
    """The run's processes on the node."""
    stopped_in: float
    """Seconds from the loss to the driver's exit."""
    code: int
    left: set[int]
    """The run's processes left on the other nodes."""


def run_and_lose(cluster, run_dir: Path, redis_port: int, process: str, how: str) -> tuple[Driver, Loss]:
    """A run of `run_dir` (world.max_restarts=0) until it has made 3 versions more than the runs
    before it, a checkpoint and groups on sent weights, then `process`'s node "killed" (kill_node)
    or "frozen" (freeze_node); the node is taken out and replaced once the driver has stopped."""
    before, started = len(trainer_versions(run_dir)), time.time()
    driver = Driver(cluster, run_dir, redis_port, "shared.max_steps=1000", "world.max_restarts=0")
    node, frozen = None, {}
    try:
        driver.wait_until(
            lambda: len(trainer_versions(run_dir)) >= before + 3 and generated_since(run_dir, started),
            300,
            "3 versions and a swap",
        )
        if how == "killed":
            node_id, held, lost_at = kill_node(cluster, driver, run_dir, process)
        else:
            node, node_id, held, frozen, lost_at = freeze_node(cluster, driver, process)
        code = driver.wait(timeout=NODE_LOSS_STOP_S + 30)
        stopped_in = time.time() - lost_at
        left = set(run_processes(run_dir, redis_port)) - {p.pid for p in frozen}
    finally:
        driver.stop()
        take_out(cluster, node if frozen else None, frozen)
    fresh_nodes(cluster)
    return driver, Loss(node_id, held, stopped_in, code, left)


def add_and_drain_an_actor(cluster, driver: Driver, run_dir: Path) -> dict[str, str]:
    """`--actors 2` on the running job whose cluster just got a node: the driver places actor1
    there, in a placement group of its own, and it generates on the current weights; `--actors 1`
    drains it (it leaves, is not restarted) and the run goes on. Returns the state of each
    placement group by name once it has."""
    first_nodes = set(driver.placed().values())
    cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
    cluster.wait_for_nodes()
    at_scale = len(trainer_versions(run_dir))
    up = scale_actors(run_dir, 2)
    assert up.returncode == 0 and "added actors 1..1" in up.stdout, up.stdout + up.stderr
    deadline = time.time() + 10  # the driver's output arrives through a pipe
    while "actor1" not in driver.placed() and time.time() < deadline:
        time.sleep(0.2)
    assert driver.placed().get("actor1") not in first_nodes | {None}, driver.out[-3000:]

    def generating() -> bool:
        written = [r["values"] for r in read_metrics(run_dir) if r["process"] == "actor1"]
        return any(r["version"] >= at_scale and r["groups_written_total"] > 0 for r in written)

    driver.wait_until(generating, 120, "group from actor1")
    down = scale_actors(run_dir, 1)
    assert down.returncode == 0 and "actors 1..1 drain and leave" in down.stdout, down.stdout + down.stderr
    driver.wait_until(lambda: "actor1 drained and left the job" in driver.out, 120, "actor1 draining")
    after = len(trainer_versions(run_dir))
    driver.wait_until(lambda: len(trainer_versions(run_dir)) >= after + 5, 60, "5 versions after the drain")
    import ray
    from ray.util import placement_group_table

    ray.init(address=cluster.address, log_to_driver=False)
    try:
        return {g["name"]: g["state"] for g in placement_group_table().values()}
    finally:
        ray.shutdown()


@pytest.mark.redis
@pytest.mark.vllm
@pytest.mark.deepspeed
@pytest.mark.timeout(1200)
def test_each_lost_or_frozen_node_stops_the_run_and_the_next_run_resumes(cluster, tmp_path, tiny_model):
    """Five runs of one run directory in turn. Each of the first four (no restarts) loses a node of
    LOSSES and stops within 45 s, exit 1, naming the node and what it held (actor0; trainer0 and
    redis), with no process of the run left on the other nodes. Each next run, on a replacement
    node, resumes from the last checkpoint and trains the versions after it again, once each. The
    fifth is stopped by a SIGTERM of its driver: trainers first, with a checkpoint of the version
    reached, after an actor was added to it on a node added to the cluster and drained again
    (add_and_drain_an_actor). Over the five, every step trained is in Redis's append-only file and
    no group was given to two steps."""
    run_dir = tmp_path / "run"
    redis_port = free_port()
    checkpointed = None
    for process, how in LOSSES:
        trained_before = trainer_versions(run_dir)
        driver, loss = run_and_lose(cluster, run_dir, redis_port, process, how)
        out = driver.out
        assert loss.code == 1, f"{how} {process}:\n{without_raylet_dumps(out)[-4000:]}"
        assert loss.stopped_in < NODE_LOSS_STOP_S, f"{how} {process}: stopped {loss.stopped_in:.0f} s after"
        assert loss.held == [process], (how, loss.held)
        named = "trainer0, redis" if process == "trainer0" else "actor0"
        assert f"node {loss.node} (" in out and "is gone" in out and f"it ran {named}" in out, out[-3000:]
        assert not loss.left, f"{how} {process}: processes on the other nodes outlived the run: {loss.left}"
        if checkpointed is not None:
            assert "resuming" in out, out[-3000:]
            new = trainer_versions(run_dir)[len(trained_before) :]
            assert new == list(range(checkpointed + 1, checkpointed + 1 + len(new))), (checkpointed, new)
        saved = latest_checkpoint(run_dir)
        assert saved is not None
        checkpointed = saved[1]
        print(f"\nnode of {named} {how} -> run stopped in {loss.stopped_in:.1f} s; the driver said:")
        print("\n".join(line for line in out.splitlines() if "is gone" in line))

    trained_before = trainer_versions(run_dir)
    driver = Driver(cluster, run_dir, redis_port, "shared.max_steps=1000")
    try:
        driver.wait_until(lambda: len(trainer_versions(run_dir)) >= len(trained_before) + 3, 240, "3 versions")
        groups = add_and_drain_an_actor(cluster, driver, run_dir)
        driver.proc.send_signal(signal.SIGTERM)
        code = driver.wait(timeout=120)
    finally:
        driver.stop()
    assert code == ExitCode.INTERRUPTED, driver.out[-4000:]
    assert "resuming" in driver.out
    assert "restarting" not in without_raylet_dumps(driver.out), driver.out[-4000:]
    (added,) = [name for name in groups if name.endswith(":actor1")]
    assert groups[added] == "REMOVED", groups
    versions = trainer_versions(run_dir)
    assert versions[len(trained_before) :] == list(range(checkpointed + 1, versions[-1] + 1)), versions
    saved = latest_checkpoint(run_dir)
    assert saved is not None and saved[1] == versions[-1], (saved, versions)
    steps, steps_of = groups_in_steps(run_dir)
    # Every step trained in any run is in the file (step s makes version s + 1)...
    assert set(range(versions[-1])) <= steps, sorted(set(range(versions[-1])) - steps)
    # ...and no group was given to two steps, in one run or across them.
    twice = {gid: steps for gid, steps in steps_of.items() if len(steps) > 1}
    assert not twice, f"groups in more than one step: {twice}"
    assert run_processes(run_dir, driver.redis_port) == {}


def replaced_after(driver: Driver, run_dir: Path, since: float, timeout: float) -> float:
    """Wait until actor0 generates, after `since`, on weights the trainer sent it; returns how long
    after `since` that was seen."""
    driver.wait_until(lambda: generated_since(run_dir, since), timeout - (time.time() - since), "actor0 back")
    return time.time() - since


@pytest.mark.redis
@pytest.mark.vllm
@pytest.mark.deepspeed
def test_an_actor_killed_lost_with_its_node_and_frozen_with_it_is_started_again_each_time(
    cluster, tmp_path, tiny_model
):
    """One run (world.max_restarts=3), actor0 lost three times in turn, each healed before the
    next: (1) kill -9 of its process, its node staying: the driver starts it again in its bundle;
    (2) its node lost and a new node added: Ray places its bundle there and the driver starts
    actor0 on it; (3) its node frozen (raylet and processes stopped, sockets open) and a new node
    added: without waiting minutes for Ray to mark the node dead, the driver starts actor0 in a
    placement group of its own on the new node; woken, the old actor0 is killed (its SIGKILL was
    queued). Each replacement generates on weights sent after its loss, and the run reaches
    max_steps with no process left."""
    run_dir = tmp_path / "run"
    # The trainer waits for the replacement's samples after each loss; the versions made between
    # a replacement's first groups and the next loss are few, so the run ends after the third.
    final = 90
    driver = Driver(cluster, run_dir, free_port(), f"shared.max_steps={final}", "world.max_restarts=3")
    node, frozen = None, {}
    try:
        run_until(driver, run_dir, versions=3, timeout=300)
        (pid,) = [
            pid
            for pid, args in run_processes(run_dir, driver.redis_port).items()
            if "-m pipeline_rl.actor " in args and args.endswith("--index 0")
        ]
        psutil.Process(pid).kill()
        replaced_after(driver, run_dir, time.time(), 180)

        lost_id, held, lost_at = kill_node(cluster, driver, run_dir, "actor0")
        assert held == ["actor0"]
        cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
        replaced_after(driver, run_dir, lost_at, 240)

        node, frozen_id, held, frozen, frozen_at = freeze_node(cluster, driver, "actor0")
        assert held == ["actor0"]
        cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
        replaced_in = replaced_after(driver, run_dir, frozen_at, 180)
        old = wake(frozen)
        _, alive = psutil.wait_procs(old, timeout=30)
        assert not alive, "the woken actor0 of the frozen node still runs"
        at_wake = trainer_versions(run_dir)[-1]
        assert at_wake < final, "the run ended before the third loss was healed"
        code = driver.wait(timeout=400)
    finally:
        driver.stop()
        take_out(cluster, node if frozen else None, frozen)
    out = driver.out
    went_on(driver, run_dir, code, final, frozen_at)
    assert "failed: killed by SIGKILL; restarting actor0 (restart 1 of 3" in out, out[-4000:]
    assert f"node {lost_id} (" in out and "restarting actor0 (restart 2 of 3" in out, out[-4000:]
    assert f"node {frozen_id} (" in out and "restarting actor0 (restart 3 of 3" in out, out[-4000:]
    moved = re.findall(r"^started actor0 again on node (\w+) ", out, re.M)
    assert len(moved) == 3 and moved[1] != lost_id and moved[2] != frozen_id, out[-3000:]
    print(
        f"\nactor0's node frozen -> actor0 generating again on node {moved[2]} after {replaced_in:.1f} s "
        f"(version {at_wake} of {final} when its old node woke)"
    )


@pytest.mark.redis
@pytest.mark.vllm
@pytest.mark.deepspeed
def test_with_no_node_free_the_run_goes_on_without_a_frozen_actor_and_takes_it_back_when_its_node_wakes(
    full_cluster, tmp_path, tiny_model
):
    """Two actors, every node busy: actor0's node freezes. No node has room for actor0, so the
    driver counts it absent and actor1 takes every step's share: the trainer's versions keep
    rising. The node wakes: the old actor0 is killed (fenced), actor0 starts again in its own
    bundle there and generates again; the run goes on with both."""
    run_dir = tmp_path / "run"
    driver = Driver(
        full_cluster,
        run_dir,
        free_port(),
        "world.actors=2",
        "world.nodes=4",
        "shared.max_steps=100000",
        "world.max_restarts=1",
    )
    frozen = {}
    try:
        run_until(driver, run_dir, versions=3, timeout=300)
        node, node_id, held, frozen, frozen_at = freeze_node(full_cluster, driver, "actor0")
        assert held == ["actor0"]
        driver.wait_until(lambda: "no node has room for actor0" in driver.out, 90, "actor0 counted absent", 0.5)
        absent_at, at_absent = time.time(), len(trainer_versions(run_dir))
        time.sleep(CARRIED_S)
        carried = len(trainer_versions(run_dir)) - at_absent
        old = wake(frozen)
        woke_at = time.time()
        _, alive = psutil.wait_procs(old, timeout=30)
        assert not alive, "the woken actor0 of the frozen node still runs"

        def back() -> bool:
            after = [r["values"] for r in read_metrics(run_dir) if r["process"] == "actor0" and r["time"] > woke_at]
            return len({r["groups_written_total"] for r in after}) > 1  # it writes groups

        driver.wait_until(back, BACK_WITHIN_S - (time.time() - woke_at), "actor0 back after its node woke")
        back_in = time.time() - woke_at
        at_back = len(trainer_versions(run_dir))
        driver.wait_until(lambda: len(trainer_versions(run_dir)) >= at_back + 5, 60, "5 versions with actor0 back")
    finally:
        driver.stop()
        take_out(full_cluster, node if frozen else None, frozen)
    out = driver.out
    assert driver.proc.returncode == ExitCode.INTERRUPTED, without_raylet_dumps(out)[-4000:]
    assert "actors absent, the others share each step: [0]" in out, out[-4000:]
    assert re.search(rf"^started actor0 again on node {node_id} ", out, re.M), out[-3000:]
    # A liveness bound: the one actor left makes steps of 4 groups of 4 samples, on a 2-core
    # machine that also runs the trainer, the preprocessor and Ray.
    assert carried >= 5, carried
    # Shown, not bounded: groups overtaken by later ones land a step after admission's
    # prediction, and at the bound of max_lag the trainer's gate drops them (actor/admission.py).
    dropped = [
        (r["time"], r["values"]["dropped_total"])
        for r in read_metrics(run_dir)
        if r["process"] == "trainer0" and "dropped_total" in r["values"]
    ]
    during = [d for t, d in dropped if absent_at <= t <= woke_at]
    print(
        f"\nactor0 absent {absent_at - frozen_at:.0f} s after its node froze, for {woke_at - absent_at:.0f} s: "
        f"{carried} versions in {CARRIED_S:g} s, {during[-1] - during[0] if during else 0} samples dropped; "
        f"back {back_in:.1f} s after its node woke"
    )
    launcher = [
        r["values"] for r in read_metrics(run_dir) if r["process"] == "launcher" and "actors_absent" in r["values"]
    ]
    assert [r["actors_absent"] for r in launcher] == [1, 0], launcher


def test_a_process_that_does_not_see_the_run_directory_is_refused(tmp_path):
    """(e) A pool process started on a Ray node, as the driver starts it, but whose run_dir is
    not the driver's (another run's nonce there, as on a node-local disk that an older run left):
    it exits 1 before reading the config, and the node sends back the reason."""
    import ray

    from pipeline_rl.config import load_config
    from pipeline_rl.launch.process_host import ProcessHost
    from pipeline_rl.launch.run_dir import prepare_run_dir
    from pipeline_rl.wire import RUN_NONCE_ENV

    head = {"num_cpus": 1, "include_dashboard": False, "object_store_memory": OBJECT_STORE}
    c = ray_cluster_utils.Cluster(initialize_head=True, head_node_args=head)
    try:
        _, stale = prepare_run_dir(load_config("tiny", [f"run_dir={tmp_path}"]), fresh=False)
        ray.init(address=c.address, log_to_driver=False)
        argv = [sys.executable, "-m", "pipeline_rl.preprocess", "--run-dir", str(tmp_path), "--index", "0"]
        host = ray.remote(ProcessHost).remote(
            "preprocessor0", argv, {RUN_NONCE_ENV: "0" * 32}, str(ROOT), str(tmp_path / "logs" / "p.log")
        )
        code, tail = ray.get(host.run.remote(), timeout=120)
    finally:
        ray.shutdown()
        c.shutdown()
    assert stale != "0" * 32
    assert code == 1, tail
    assert "preprocessor0 failed: RunDirNotShared" in tail and "holds another run's nonce" in tail
    assert "must be on a file system every node shares" in tail
