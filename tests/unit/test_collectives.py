"""The NCCL environment every pool process gets, and the network interface gloo and NCCL take
across nodes: derived from the route to node 0, or world.socket_ifname, which must exist."""

from __future__ import annotations

import os

import pytest

from pipeline_rl import collectives
from pipeline_rl.collectives import nccl_env, prepare_collectives, socket_env, socket_interface
from pipeline_rl.wire import WEIGHT_SYNC_ADDR_ENV

FOUND = {"lo": ["127.0.0.1"], "eth0": ["10.0.0.5"], "ib0": ["192.168.10.5"], "docker0": ["172.17.0.1"]}


def test_nccl_aborts_the_communicator_without_blocking_the_host():
    """No blocking wait (every ZeRO bucket would hold the host until the device finished it);
    the watchdog aborts the communicator and leaves the process alive, and its monitor, which
    kills the process, waits past the timeout."""
    env = nccl_env(600)
    assert "TORCH_NCCL_BLOCKING_WAIT" not in env
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert int(env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"]) == 600 + collectives.HEARTBEAT_MARGIN_S


def test_the_interface_is_the_one_that_holds_the_route_source():
    assert socket_interface(None, "192.168.10.5", FOUND) == "ib0"
    assert socket_interface(None, "10.0.0.5", FOUND) == "eth0"
    with pytest.raises(ValueError, match=r"no network interface of .* holds 10\.9\.9\.9"):
        socket_interface(None, "10.9.9.9", FOUND)


def test_a_configured_interface_must_exist_on_the_node():
    assert socket_interface("ib0", "10.0.0.5", FOUND) == "ib0"  # the key wins over the route
    with pytest.raises(ValueError, match=r"world.socket_ifname=eth1 is not a network interface .*eth0, ib0, lo"):
        socket_interface("eth1", "10.0.0.5", FOUND)


@pytest.fixture
def node(monkeypatch):
    """This node as FOUND, its route to anything leaving from eth0's address."""
    monkeypatch.setattr(collectives, "interfaces", lambda: FOUND)
    monkeypatch.setattr(collectives, "route_source", lambda peer: "10.0.0.5")


def test_several_nodes_set_gloo_and_nccl_to_the_interface(node):
    assert socket_env(None, "10.0.0.1", {}) == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "=eth0"}
    # What the node's environment sets is kept; the config key overrides it.
    assert socket_env(None, "10.0.0.1", {"NCCL_SOCKET_IFNAME": "ib"}) == {"GLOO_SOCKET_IFNAME": "eth0"}
    given = socket_env("ib0", "10.0.0.1", {"GLOO_SOCKET_IFNAME": "eth0"})
    assert given == {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "=ib0"}


def test_one_node_sets_no_interface(node):
    assert socket_env(None, "127.0.0.1", {}) == {} and socket_env(None, None, {}) == {}


def test_a_pool_process_takes_node_0_from_the_weight_update_address(node, monkeypatch):
    monkeypatch.setattr(os, "environ", {WEIGHT_SYNC_ADDR_ENV: "10.0.0.1:29600"})  # this test's own
    seen = []
    monkeypatch.setattr(collectives, "route_source", lambda peer: seen.append(peer) or "10.0.0.5")
    assert prepare_collectives(30, None).total_seconds() == 30
    assert seen == ["10.0.0.1"]
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth0" and os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    with pytest.raises(ValueError, match=r"world\.socket_ifname=eth7"):
        prepare_collectives(30, "eth7")
