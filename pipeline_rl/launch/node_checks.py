"""What `--dry-run` checks on the launcher's own node beside the plan: the NVIDIA driver the GPU
lock needs (gpu_driver.py), and, for a run of several nodes, the network interface gloo and NCCL
will use (collectives.py: world.socket_ifname, or the one each process's route to node 0 leaves
from). Each check returns its lines and whether it passed."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

from pipeline_rl.collectives import interfaces, is_loopback, route_source, socket_interface
from pipeline_rl.config import RunConfig, on_ray
from pipeline_rl.launch import gpu_driver


def driver_lines(cfg: RunConfig) -> tuple[list[str], bool]:
    if not cfg.world.gpus_per_node:
        return [], True
    ok, line = gpu_driver.check(gpu_driver.required_cuda(), gpu_driver.node_driver())
    return [line], ok


def ray_head(cfg: RunConfig, env: dict[str, str]) -> str | None:
    """The host of the Ray cluster's address (world.ray_address, else RAY_ADDRESS; None when
    the run finds the cluster on this machine)."""
    address = cfg.world.ray_address or env.get("RAY_ADDRESS")
    if not address or address == "auto":
        return None
    return urlsplit(address if "//" in address else f"//{address}").hostname


def socket_lines(
    cfg: RunConfig, found: dict[str, list[str]] | None = None, env: dict[str, str] | None = None
) -> tuple[list[str], bool]:
    """The interface gloo and NCCL take on this node, toward the Ray head (the cluster's address,
    which every node reaches: node 0's address is known only once Ray has placed the run), and
    a warning when this node's host name resolves to a loopback address."""
    if not on_ray(cfg):
        return [], True
    found = interfaces() if found is None else found
    env = dict(os.environ) if env is None else env
    given = cfg.world.socket_ifname
    where = "world.socket_ifname" if given else "each process: the interface its route to node 0 leaves from"
    head = ray_head(cfg, env)
    preset = {k: env[k] for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if k in env}
    try:
        source = route_source(head) if head and not is_loopback(head) else None
        if given or source:
            name = socket_interface(given, source or "", found)
            toward = f" toward the Ray head {head}" if source else ""
            here = f"this node{toward}: {name} ({', '.join(found[name]) or 'no IPv4 address'})"
        else:
            here = "this node's interfaces: " + ", ".join(
                f"{n} {' '.join(a)}" for n, a in sorted(found.items()) if a and not is_loopback(a[0])
            )
    except (ValueError, OSError) as e:
        return [f"network: gloo and NCCL sockets ({where}): {e}: DOES NOT FIT"], False
    line = f"network: gloo and NCCL sockets (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) on {where}; {here}"
    if preset and not given:
        line += f"; this node's environment sets {', '.join(f'{k}={v}' for k, v in preset.items())}, which win"
    lines = [line]
    hostname = socket.gethostname()
    try:
        loopback = is_loopback(hostname)
    except OSError:
        loopback = True
    if loopback:
        lines.append(
            f"network: this node's host name {hostname} resolves to a loopback address (or to none): gloo alone "
            "would listen there, out of the other nodes' reach; the run sets GLOO_SOCKET_IFNAME"
        )
    return lines, True
