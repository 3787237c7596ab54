"""One timeout for every collective of a run (`world.collective_timeout_s`), and NCCL set up so
that a dead or hung peer becomes an exception in the survivors within it.

Where the timeout goes: the trainers' process group (deepspeed.init_distributed), the
weight-update group and its TCPStore (weight_sync/: WeightSender, WeightReceiver, and the TP
workers' receivers through tp_swap.py).

NCCL (PyTorch's ProcessGroupNCCL environment variables): by default
(TORCH_NCCL_ASYNC_ERROR_HANDLING=3) a collective that times out makes NCCL's watchdog thread
kill the whole process, with no Python exception and no message naming anyone. So:
- TORCH_NCCL_ASYNC_ERROR_HANDLING=2: the watchdog only aborts the communicator; the process lives.
- TORCH_NCCL_BLOCKING_WAIT=1 (trainers only): `wait()` blocks the calling thread and raises when
  the timeout passes, so the collective call itself raises (PyTorch gives blocking wait
  precedence over async error handling). Actors leave it off: it would apply to vLLM's own
  groups too, whose steps run in CUDA graphs; the weight receiver waits for each message
  with an explicit timeout instead (`work.wait(timeout)`, which raises the same way).
- TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC above the timeout: the monitoring thread, which kills the
  process when the watchdog itself is stuck, does not act before the exception can.
They are set in the process's environment before its first group is made (they are read when
a ProcessGroupNCCL is built), and reach the processes it starts (vLLM's TP workers).
"""

from __future__ import annotations

import os
from datetime import timedelta

HEARTBEAT_MARGIN_S = 60


def nccl_env(timeout_s: float, blocking_wait: bool) -> dict[str, str]:
    env = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(int(timeout_s) + HEARTBEAT_MARGIN_S),
    }
    if blocking_wait:
        env["TORCH_NCCL_BLOCKING_WAIT"] = "1"
    return env


def prepare_collectives(timeout_s: float, blocking_wait: bool) -> timedelta:
    """Set this process's NCCL environment (before any group exists); returns the timeout."""
    os.environ.update(nccl_env(timeout_s, blocking_wait))
    return timedelta(seconds=timeout_s)
