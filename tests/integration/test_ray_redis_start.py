"""The run's redis-server on Ray (RayRun.start_redis): trainer rank 0's node is checked before the
server starts (the binary on its PATH, the port free there) and the server's first PING is
answered, on a real one-node Ray cluster with a real redis-server; each refusal names the node,
the port and the cause. The port inside Ray's worker range is refused by the config
(tests/unit/test_config.py)."""

from __future__ import annotations

import socket

import pytest
from fixtures.helpers import free_port

from pipeline_rl.config import ConfigError, load_config
from pipeline_rl.launch.redis_server import cannot_start

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def test_the_checks_on_the_node_itself(tmp_path, monkeypatch):
    port = free_port()
    assert cannot_start("127.0.0.1", port) is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        problem = cannot_start("127.0.0.1", port)
    assert problem is not None and f"port {port} on 127.0.0.1 is taken" in problem
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cannot_start("127.0.0.1", port) == "redis-server is not on PATH (streams.redis.start_server)"


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=1, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    yield
    ray.shutdown()


def _ray_run(tmp_path, port: int):
    from ray.util.placement_group import placement_group, remove_placement_group

    from pipeline_rl.launch.bundles import bundles
    from pipeline_rl.launch.placement import plan
    from pipeline_rl.launch.ray_driver import RayRun
    from pipeline_rl.launch.ray_nodes import bundle_nodes

    cfg = load_config(
        "tiny",
        [
            f"run_dir={tmp_path / 'run'}",
            "world.ray_address=auto",
            "streams.backend=redis",
            "streams.redis.start_server=true",
            f"streams.redis.port={port}",
        ],
    )
    found = bundles(cfg, plan(cfg))
    pg = placement_group([{"CPU": 0.01}], strategy="PACK")  # bundle 0 only: trainer rank 0's node
    pg.wait(timeout_seconds=30)
    (tmp_path / "run").mkdir(exist_ok=True)
    return RayRun(cfg, pg, found, bundle_nodes(pg, 1) * len(found), nonce="x"), lambda: remove_placement_group(pg)


def test_redis_on_ray_starts_and_answers(local_ray, tmp_path):
    run, release = _ray_run(tmp_path, free_port())
    try:
        run.start_redis()  # returns once the server answered a PING
        assert run.redis is not None and run.redis.result is None
    finally:
        run.stop_all(graceful=False)
        release()


def test_a_taken_port_is_refused_naming_node_and_port(local_ray, tmp_path):
    port = free_port()
    run, release = _ray_run(tmp_path, port)
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", port))
            taken.listen()
            with pytest.raises(ConfigError) as e:
                run.start_redis()
        message = str(e.value)
        assert f"cannot start on node {run.nodes[0].id} (" in message and "(trainer rank 0's node)" in message
        assert f"port {port} on 127.0.0.1 is taken" in message
        assert run.redis is None  # nothing was started
    finally:
        release()
