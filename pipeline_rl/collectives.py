"""One timeout for every collective of a run (`world.collective_timeout_s`), NCCL set up so that
a dead or hung peer ends in an error instead of a silent hang, and the network interface gloo
and NCCL use across nodes.

Where the timeout goes: the trainers' process group (deepspeed.init_distributed) and their gloo
group for the stop agreement, the weight-update group and its TCPStore (weight_sync/:
WeightSender, WeightReceiver, and the TP workers' receivers through tp_swap.py).

NCCL (PyTorch's ProcessGroupNCCL environment variables): by default
(TORCH_NCCL_ASYNC_ERROR_HANDLING=3) a collective that times out makes NCCL's watchdog thread
kill the whole process. So:
- TORCH_NCCL_ASYNC_ERROR_HANDLING=2: the watchdog aborts the timed-out collective's communicator
  and the process lives; the aborted collective's kernels end, so nothing waits on them, and the
  process's next collective on that communicator raises (DistBackendError), in Python, from the
  call. Every trainer step ends in collectives (the gradients' reduction, the norm, the stop
  agreement) before its update, its weight broadcast or its checkpoint, so no update is made
  from an aborted transfer: the rank exits with the error, and the launcher restarts the trainer
  pool from the last checkpoint, naming first the rank that was killed, if one was
  (launch/supervisor.py blame_order), else the first to fail.
- No TORCH_NCCL_BLOCKING_WAIT: it would make every `wait()` block the host until the device has
  finished the collective, in every group of the process. ZeRO waits on every bucket of its
  reduce-scatters and every layer's gather, so the host could not queue work ahead of the
  device (docs/gpu.md measured its cost at one rank only, where collectives are trivial). The
  weight transfers bound their own waits instead (the sender and the receivers poll
  `is_completed()` within weight_sync.transfer_timeout_s: weight_sync/group.py), and vLLM's own
  groups run in CUDA graphs.
- TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC above the timeout: the monitoring thread, which kills the
  process when the watchdog itself is stuck (an abort that hangs), acts only after the
  watchdog had its chance; a process it kills is named by the launcher as killed by a signal.
Whatever still hangs without a process ending is the run watchdog's (launch/watchdog.py): no
new version for its limit stops the run, printing what each process waits on.

Sockets across nodes (`socket_env`): gloo listens on the address its host name resolves to, and
a host name that resolves to a loopback address (127.0.1.1, a Debian default) leaves the other
nodes unable to reach it: the trainers' first stop agreement hangs. NCCL picks an interface of
its own, perhaps one the other nodes cannot reach. On several nodes every process therefore
sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (exact match) to `world.socket_ifname`, or to the
interface that holds the address its route to node 0 leaves from (the address node 0 is known
by, which every node reaches), unless the node's environment already sets them.
They are set in the process's environment before its first group is made (they are read when
a group is built), and reach the processes it starts (vLLM's TP workers).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta

import psutil

from pipeline_rl.wire import WEIGHT_SYNC_ADDR_ENV

HEARTBEAT_MARGIN_S = 60
SOCKET_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def nccl_env(timeout_s: float) -> dict[str, str]:
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(int(timeout_s) + HEARTBEAT_MARGIN_S),
    }


def interfaces() -> dict[str, list[str]]:
    """This node's network interfaces and their IPv4 addresses."""
    return {
        name: [a.address for a in addrs if a.family == socket.AF_INET] for name, addrs in psutil.net_if_addrs().items()
    }


def route_source(peer: str) -> str:
    """The local address this node's route to `peer` leaves from (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(peer), 9))
        return s.getsockname()[0]


def is_loopback(host: str) -> bool:
    return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback


def socket_interface(ifname: str | None, source: str, found: dict[str, list[str]]) -> str:
    """The interface for gloo and NCCL: `ifname` (world.socket_ifname) when it is one of this
    node's (`found`), else the one that holds `source`, the address the route to node 0 leaves from."""
    if ifname is not None:
        if ifname not in found:
            raise ValueError(
                f"world.socket_ifname={ifname} is not a network interface of {socket.gethostname()} "
                f"(it has {', '.join(sorted(found))})"
            )
        return ifname
    for name, addresses in found.items():
        if source in addresses:
            return name
    raise ValueError(f"no network interface of {socket.gethostname()} holds {source}, its address toward node 0")


def socket_env(ifname: str | None, node0: str | None, env: dict[str, str]) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME for a process whose node 0 is `node0` (None or
    a loopback address: one node, nothing to set); those `env` already has are kept."""
    if node0 is None or is_loopback(node0):
        return {}
    name = socket_interface(ifname, route_source(node0), interfaces())
    wanted = {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": f"={name}"}  # "=": NCCL's exact match
    return {k: v for k, v in wanted.items() if ifname is not None or k not in env}


def prepare_collectives(timeout_s: float, socket_ifname: str | None) -> timedelta:
    """Set this process's NCCL and socket environment (before any group exists); returns the
    timeout. Node 0 is the host of the weight-update address the launcher gives every process."""
    os.environ.update(nccl_env(timeout_s))
    addr = os.environ.get(WEIGHT_SYNC_ADDR_ENV)
    node0 = addr.rsplit(":", 1)[0] if addr else None
    os.environ.update(socket_env(socket_ifname, node0, dict(os.environ)))
    return timedelta(seconds=timeout_s)
