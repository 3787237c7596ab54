"""Compile DeepSpeed's CPU ops once, ahead of the first process that needs them.

    python scripts/build_deepspeed_ops.py

DeepSpeed compiles on first use, into ~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR), the
CPU Adam op of ZeRO-Offload (trainer.optimizer.offload). Its shared-memory all-reduce op is not
built: CPU trainers leave it out (`leave_out_shm_all_reduce` in pipeline_rl/trainer/model.py).
`.ci/run` runs this on one core while the test models train on the other, so no test's time
limit pays for a compile.
"""

from __future__ import annotations

import time

OPS = ("CPUAdamBuilder",)


def main() -> None:
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    assert accelerator is not None, "DeepSpeed found no accelerator"
    for name in OPS:
        start = time.time()
        builder = accelerator.create_op_builder(name)
        if builder is None:
            raise RuntimeError(f"DeepSpeed's {type(accelerator).__name__} has no op builder {name}")
        builder.load()
        print(f"{name}: ready ({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
