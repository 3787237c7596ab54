"""The Ray driver's cluster (pipeline_rl/launch/ray_driver.py): connecting to it, failing at
once on an address nothing listens on, and reserving the run's placement group, said while the
cluster cannot fit it."""

from __future__ import annotations

import logging
import os
import socket
import sys

import ray
from ray.util.placement_group import PlacementGroup, placement_group

from pipeline_rl.config import ConfigError, RunConfig
from pipeline_rl.launch.bundles import STRATEGY, Bundle
from pipeline_rl.launch.ray_nodes import RAYLET_PROBE_S

PLACEMENT_REPORT_S = 30.0
"""While the cluster cannot fit the placement group, say so this often (it may be scaling up)."""


def ray_address(cfg: RunConfig) -> str:
    return cfg.world.ray_address or os.environ.get("RAY_ADDRESS") or "auto"


def check_reachable(address: str) -> None:
    """Fail at once on a cluster address nothing listens on (ray.init would retry for minutes)."""
    if address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=RAYLET_PROBE_S * 5).close()
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"no Ray cluster at {address} (world.ray_address, else RAY_ADDRESS): {type(e).__name__}: {e}"
        ) from None


def reserve(found: list[Bundle], name: str) -> PlacementGroup:
    pg = placement_group([b.resources for b in found], strategy=STRATEGY, name=name)
    while not pg.wait(timeout_seconds=PLACEMENT_REPORT_S):
        print(
            f"waiting for the Ray cluster to fit the placement group ({len(found)} bundles: "
            f"{', '.join(f'{b.spec.name} {b.resources}' for b in found)}); the cluster has "
            f"{ray.cluster_resources()} in {len(ray.nodes())} nodes (`ray status` says what is in use)",
            file=sys.stderr,
            flush=True,
        )
    return pg


def connect(cfg: RunConfig) -> str:
    """Connect this process to the run's cluster; returns its address."""
    address = ray_address(cfg)
    check_reachable(address)
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except ConnectionError as e:
        raise ConfigError(
            f"no Ray cluster at {address} (world.ray_address, else RAY_ADDRESS, else the one `ray start` "
            f"made on this machine): {e}"
        ) from None
    return address
