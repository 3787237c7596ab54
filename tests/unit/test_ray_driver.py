"""The Ray driver's own check of its nodes (pipeline_rl/launch/ray_health.py, ray_nodes.py): a
node is gone when Ray says so or when its raylet does not answer a gRPC health check in time
(closed, frozen or cut off), twice in a row."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
from fixtures.helpers import free_port

from pipeline_rl.config import load_config
from pipeline_rl.launch import ray_health, ray_nodes
from pipeline_rl.launch.bundles import bundles
from pipeline_rl.launch.placement import plan
from pipeline_rl.launch.ray_driver import Hosted, RayRun
from pipeline_rl.launch.ray_health import NODE_PROBE_MISSES
from pipeline_rl.launch.ray_nodes import RayNode, node_alive
from pipeline_rl.wire import ExitCode


@dataclass
class Raylet:
    server: grpc.Server
    port: int


@pytest.fixture
def raylet():
    """A real gRPC server with the standard health service, standing in for a raylet."""
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    serving = grpc.unary_unary_rpc_method_handler(
        lambda request, context: b"\x08\x01", request_deserializer=bytes, response_serializer=bytes
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("grpc.health.v1.Health", {"Check": serving}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield Raylet(server, port)
    server.stop(None)


def test_a_frozen_raylet_is_not_alive():
    """A frozen node's kernel still accepts connections (the listening socket's backlog) but
    nothing answers: the health check times out."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        node = RayNode("n1", "127.0.0.1", s.getsockname()[1])
        socket.create_connection(("127.0.0.1", node.raylet_port), timeout=1).close()  # accepted
        start = time.monotonic()
        assert not node_alive(node, {"n1": {"Alive": True}})
        assert time.monotonic() - start < ray_nodes.RAYLET_PROBE_S + 1.0


def test_a_node_is_alive_while_ray_says_so_and_its_raylet_answers(raylet):
    node = RayNode("n1", "127.0.0.1", raylet.port)
    assert node_alive(node, {"n1": {"Alive": True}})
    assert not node_alive(node, {"n1": {"Alive": False}})
    assert not node_alive(node, {})
    raylet.server.stop(None)
    assert not node_alive(node, {"n1": {"Alive": True}})


def test_a_node_that_stops_answering_is_reported_after_consecutive_misses(raylet, monkeypatch, tmp_path):
    cfg = load_config("tiny", [f"run_dir={tmp_path}", "world.nodes=3", "streams.backend=redis"])
    found = bundles(cfg, plan(cfg))
    up = RayNode("up", "127.0.0.1", raylet.port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        down = RayNode("down", "127.0.0.1", s.getsockname()[1])  # bound, not listening: refused
    run = RayRun(cfg, None, found, [up, up, down], nonce="x")  # type: ignore[arg-type]
    monkeypatch.setattr(ray_nodes, "cluster_nodes", lambda: {"up": {"Alive": True}, "down": {"Alive": True}})
    monkeypatch.setattr(ray_health, "NODE_PROBE_EVERY_S", 0.0)
    for _ in range(NODE_PROBE_MISSES - 1):
        assert run.health.probe(run._everyone()) is None
    assert run.health.probe(run._everyone()) == down
    assert run.health.misses == {"up": 0, "down": NODE_PROBE_MISSES}


def test_a_frozen_node_is_probed_until_its_actors_have_moved_away(tmp_path):
    """The driver probes the run's bundle nodes and the nodes of actors placed since; a node
    that froze holding only actors stops being probed (and blamed) once each has moved."""
    cfg = load_config("tiny", [f"run_dir={tmp_path}", "world.nodes=3", "streams.backend=redis"])
    found = bundles(cfg, plan(cfg))
    a, b, f, g = (RayNode(i, "127.0.0.1", 1) for i in "abfg")
    run = RayRun(cfg, None, found, [a, b, f], nonce="x")  # type: ignore[arg-type]
    log = tmp_path / "x.log"
    run.hosted = [Hosted("trainer0", "trainer", a, None, None, log), Hosted("actor0", "actor", f, None, None, log)]
    run.hosted.append(Hosted("actor1", "actor", g, None, None, log))  # added to the running job
    assert [n.id for n in run.health.held(run._everyone())] == ["a", "b", "f", "g"]
    run.health.frozen.add("f")
    assert [n.id for n in run.health.held(run._everyone())] == ["a", "b", "f", "g"]  # actor0 still there
    run.hosted[1] = Hosted("actor0", "actor", g, None, None, log)  # started again elsewhere
    assert [n.id for n in run.health.held(run._everyone())] == ["a", "b", "g"]


def test_a_cluster_address_nothing_listens_on_fails_at_once(tmp_path, capsys):
    from pipeline_rl.launch.launcher import main

    address = f"127.0.0.1:{free_port()}"
    argv = ["conf=tiny", f"run_dir={tmp_path / 'run'}", "world.nodes=2", "streams.backend=redis"]
    assert main([*argv, f"world.ray_address={address}"]) == 2
    assert f"no Ray cluster at {address} (world.ray_address, else RAY_ADDRESS)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_failure_caused_by_a_gone_peer_is_reported_after_its_cause(raylet, monkeypatch, tmp_path):
    """Across nodes as on one (test_failure_report.py): the trainer that noticed a dead actor's
    weight-update ranks first is not the cause when the actor's own failure has come too."""
    cfg = load_config("tiny", [f"run_dir={tmp_path}", "world.nodes=3", "streams.backend=redis"])
    node = RayNode("up", "127.0.0.1", raylet.port)
    run = RayRun(cfg, None, bundles(cfg, plan(cfg)), [node] * 3, nonce="x")  # type: ignore[arg-type]
    monkeypatch.setattr(run, "_collect", lambda timeout: None)
    monkeypatch.setattr(ray_nodes, "cluster_nodes", lambda: {"up": {"Alive": True}})
    trainer = Hosted("trainer0", "trainer", node, None, None, tmp_path / "t.log", (ExitCode.PEER_GONE, "gone: actor0"))
    actor = Hosted("actor0", "actor", node, None, None, tmp_path / "a.log", None)
    run.hosted = [trainer, actor]
    failure, _ = run.poll()
    assert failure is not None and failure.caused_by_peer and "trainer0" in failure.summary
    actor.result = (1, "the vLLM engine failed")
    failure, _ = run.poll()
    assert failure is not None and not failure.caused_by_peer
    assert failure.summary.startswith("process actor0 on") and failure.log_tail == "the vLLM engine failed"
