"""How long a tensor-parallel CPU engine's processes spin on an empty queue before they sleep.

vLLM's tensor-parallel engine talks to its worker processes through shared-memory queues (the
engine core's broadcast of each step to the workers, each worker's reply). A reader that found
its queue empty keeps polling it with `sched_yield` for a second after its last message, and
only then sleeps on a socket until the writer wakes it. On a GPU node that buys latency with
cores nobody else needs. On CPU the cores it spins on are the ones the engine's next step, the
trainer and the preprocessor need: an actor waits for new weights after every few steps, and
while it waits its spinning workers starve the trainer it waits for (measured in
docs/performance.md).
"""

from __future__ import annotations

IDLE_SPIN_S = 0.1
"""Seconds a reader spins after its last message before it sleeps: longer than the gap between
two decode steps, so an engine that is generating never waits for a wake-up."""


def shorten_idle_spin(seconds: float = IDLE_SPIN_S) -> None:
    """Make every reader of vLLM's shared-memory queues that this process creates after this
    call spin `seconds` instead of vLLM's one second. Idempotent; the actor calls it before a
    tensor-parallel CPU engine starts, each spawned worker when it imports tp_worker.py."""
    from vllm.distributed.device_communicators import shm_broadcast

    condition = shm_broadcast.SpinCondition
    original = condition.__init__
    if getattr(original, "_pipeline_rl", False):
        return

    def init(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        if self.is_reader:
            self.busy_loop_s = min(self.busy_loop_s, seconds)

    init._pipeline_rl = True  # pyright: ignore[reportFunctionMemberAccess]
    condition.__init__ = init
