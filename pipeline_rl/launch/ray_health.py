"""The Ray driver's failure classification: which of the run's nodes are gone, what a failed
process or a lost node means for the run, and whether a restart heals it. The driver
(launch/ray_driver.py) starts, restarts and stops the processes; it asks `NodeHealth.failure`
at each poll.

A node that dies takes its Ray workers with it, so their `run` calls fail at once. A node that
vanishes without closing its connections, or freezes with them open, is found by probing every
node's raylet (NODE_PROBE_EVERY_S, NODE_PROBE_MISSES in a row), long before Ray's own health
check gives up on it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pipeline_rl.launch import ray_nodes
from pipeline_rl.launch.ray_nodes import RayNode, node_alive, raylet_gone
from pipeline_rl.launch.run_loop import Failure
from pipeline_rl.launch.supervisor import blame_order, describe_exit, last_lines
from pipeline_rl.wire import ExitCode

if TYPE_CHECKING:
    from pipeline_rl.launch.ray_driver import Hosted

NODE_PROBE_EVERY_S = 5.0
"""How often the driver checks that every node of the run still answers. Ray's own health check
gives up on a node that vanished without closing its connections (a power cut) only after some
5 x (10 s timeout + 3 s period), and until then the calls to its actors just wait."""
NODE_PROBE_MISSES = 2
"""Consecutive probes a node must miss to count as gone."""


class NodeHealth:
    """What the driver knows of the run's nodes. `nodes`: the node of each bundle of the run's
    placement group (node 0 holds trainer rank 0 and Redis), the driver's own list, which a
    restart on another node updates."""

    def __init__(self, nodes: list[RayNode]):
        self.nodes = nodes
        self.misses: dict[str, int] = {}
        """Per node id, the probes it missed in a row."""
        self.probed_at = 0.0
        self.lost: set[str] = set()
        """Ids of the nodes found gone: their processes are neither signalled nor waited for."""
        self.frozen: set[str] = set()
        """Ids of the nodes that stopped answering and held only actors: each is started again
        elsewhere (ray_driver's `_start_elsewhere`)."""

    def failure(self, everyone: list[Hosted]) -> Failure | None:
        """The run's failure, if any: of the processes whose `run` returned (`everyone`'s
        results), the likeliest cause first, a failure caused by a peer last (blame_order); else
        a node that stopped answering its probes."""
        ended = sorted(((h, h.result) for h in everyone if h.result is not None), key=lambda e: blame_order(e[1][0]))
        for h, (code, tail) in ended:
            if h.pool == "trainer" and code == 0:
                continue
            return self._process_failure(h, code, tail, everyone)
        gone = self.probe(everyone)
        if gone is None:
            return None
        held = [h for h in everyone if h.node.id == gone.id]
        first = held[0]
        if gone.id != self.nodes[0].id and all(h.pool == "actor" for h in held):
            self.frozen.add(gone.id)  # its actors are started again elsewhere, one per poll
        process = first.name if gone.id in self.frozen or self.restartable(first, [gone]) else ""
        summary = self._lost(gone, everyone)
        return Failure(summary, str(first.log_path), last_lines(first.log_path), False, process)

    def _process_failure(self, h: Hosted, code: int | None, tail: str, everyone: list[Hosted]) -> Failure:
        """`h` ended with `code` (None: its Ray worker is gone) and `tail`."""
        dead = self.dead(everyone)
        if code is None:
            what = tail
        else:
            what = f"redis-server stopped ({describe_exit(code)})" if h.pool == "redis" else describe_exit(code)
        summary = f"process {h.name} on {h.node} failed: {what}"
        if dead:
            # A dead node explains the failure, on it or elsewhere (a peer's collective or Redis broke).
            lost = "; ".join(self._lost(n, everyone) for n in dead)
            summary = lost if h.node in dead else f"{lost}. Then {summary}"
        # The node's own view of the log when it sent one: the driver's may differ (run_dir not shared).
        log_tail = tail if code is not None else last_lines(h.log_path)
        process = h.name if self.restartable(h, dead) else ""
        peer = code == ExitCode.PEER_GONE and not dead
        return Failure(summary, str(h.log_path), log_tail, peer, process, code)

    def held(self, everyone: list[Hosted]) -> list[RayNode]:
        """The run's nodes: its bundles' and those of the actors placed since; a node that froze
        or was lost drops out once it holds none of the run's processes (its actors moved away
        or wait for room elsewhere; Ray may mark it dead later: that explains no other failure)."""
        holding = {h.node.id for h in everyone}
        nodes = {n.id: n for n in [*self.nodes, *(h.node for h in everyone)]}
        gone = self.frozen | self.lost
        return [n for n in nodes.values() if n.id not in gone or n.id in holding]

    def dead(self, everyone: list[Hosted]) -> list[RayNode]:
        cluster = ray_nodes.cluster_nodes()
        return [n for n in self.held(everyone) if not node_alive(n, cluster)]

    def probe(self, everyone: list[Hosted]) -> RayNode | None:
        """A node that missed NODE_PROBE_MISSES probes in a row, if any (probes every NODE_PROBE_EVERY_S)."""
        if time.monotonic() - self.probed_at < NODE_PROBE_EVERY_S:
            return None
        self.probed_at = time.monotonic()
        cluster = ray_nodes.cluster_nodes()
        for node in self.held(everyone):
            self.misses[node.id] = 0 if node_alive(node, cluster) else self.misses.get(node.id, 0) + 1
            if self.misses[node.id] >= NODE_PROBE_MISSES:
                return node
        return None

    def _lost(self, node: RayNode, everyone: list[Hosted]) -> str:
        """Count `node` lost; what it ran."""
        self.lost.add(node.id)
        held = [h.name for h in everyone if h.node.id == node.id]
        return f"{node} is gone (its raylet does not answer or Ray marked it dead): it ran {', '.join(held)}"

    def restartable(self, h: Hosted, dead: list[RayNode]) -> bool:
        """Whether the failure of `h` is one a restart heals: a pool process on a live node, or
        on a lost node (Ray marked it dead, or its raylet's port refuses connections: the machine
        answers, the raylet is gone) that is not node 0 (trainer rank 0 and Redis: every process
        reaches them at its address). Any other failure next to a lost node, and a node that only
        stopped answering (frozen, or cut off), stop the run (but see `failure`: a frozen node
        that held only actors)."""
        if h.pool == "redis":
            return False
        if not dead:
            return True
        if h.node not in dead or any(n.id == self.nodes[0].id for n in dead):
            return False
        cluster = ray_nodes.cluster_nodes()
        return all(not cluster.get(n.id, {}).get("Alive", False) or raylet_gone(n) for n in dead)
