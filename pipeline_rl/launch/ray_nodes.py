"""The Ray driver's view of the cluster's nodes (pipeline_rl/launch/ray_driver.py): where Ray
placed a bundle, and whether a node still answers. A raylet that died refuses connections at
once; a node that froze or was cut off accepts them (its kernel does) or lets them hang, and
does not answer the gRPC health check that Ray's own control plane uses, within RAYLET_PROBE_S."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import grpc
import ray
from ray.util.placement_group import PlacementGroup, placement_group_table

RAYLET_PROBE_S = 2.0
"""How long a node's raylet may take to answer a health check before the probe counts a miss."""
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
"""The standard gRPC health service, which every raylet serves (Ray's own GCS checks raylets
through it). The request for the whole server is an empty message; the reply b"\x08\x01" is
status SERVING."""
SERVING = b"\x08\x01"


@dataclass
class RayNode:
    id: str
    """Ray's node id (hex), as `ray list nodes` shows it."""
    ip: str
    raylet_port: int
    cpus: int = 1
    """The node's CPU cores, as Ray counts them."""

    @classmethod
    def of(cls, node_id: str, info: dict[str, Any]) -> RayNode:
        """From Ray's record of the node (`cluster_nodes`)."""
        cpus = int(info.get("Resources", {}).get("CPU", 1))
        return cls(node_id, info["NodeManagerAddress"], int(info["NodeManagerPort"]), cpus)

    def __str__(self) -> str:
        return f"node {self.id} ({self.ip})"


def cluster_nodes() -> dict[str, dict[str, Any]]:
    """Ray's view of the cluster's nodes, by node id."""
    return {n["NodeID"]: n for n in ray.nodes()}


def bundle_nodes(pg: PlacementGroup, count: int) -> list[RayNode]:
    """The nodes Ray placed bundles 0..count-1 of `pg` on."""
    where = placement_group_table(pg)["bundles_to_node_id"]
    nodes = cluster_nodes()
    out = []
    for i in range(count):
        out.append(RayNode.of(where[i], nodes[where[i]]))
    return out


def node_alive(node: RayNode, cluster: dict[str, dict[str, Any]]) -> bool:
    """Ray (`cluster`: its nodes by id) still counts the node alive and its raylet answers a
    health check within RAYLET_PROBE_S. A raylet that died refuses the connection at once; a
    frozen or cut-off one accepts it (the kernel does) or lets it hang, and does not answer."""
    info = cluster.get(node.id)
    if info is None or not info["Alive"]:
        return False
    channel = grpc.insecure_channel(f"{node.ip}:{node.raylet_port}")
    try:
        check = channel.unary_unary(HEALTH_CHECK, request_serializer=bytes, response_deserializer=bytes)
        return check(b"", timeout=RAYLET_PROBE_S) == SERVING
    except grpc.RpcError:
        return False
    finally:
        channel.close()


def raylet_gone(node: RayNode) -> bool:
    """Whether the node's raylet port refuses connections: its process died and the machine
    still answers (a lost raylet, as opposed to a frozen or cut-off node, whose connections
    hang and whose processes may still run)."""
    try:
        socket.create_connection((node.ip, node.raylet_port), timeout=RAYLET_PROBE_S).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False
