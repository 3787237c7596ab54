"""The NVIDIA driver the GPU lock's CUDA needs, against the one this node has.

CUDA's wheels (nvidia-cuda-runtime and the libraries beside it in scripts/gpu-lock.txt) run on
a driver at least as new as their major version's first (CUDA's minor version compatibility);
an older one fails only when the first process touches the GPU. `--dry-run` prints the check
and refuses an old driver; `scripts/setup_gpu.sh` runs this file before it installs anything:

    python3 pipeline_rl/launch/gpu_driver.py scripts/gpu-lock.txt

Standard library only, so that it runs before the environment exists.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

LOCK = Path(__file__).resolve().parents[2] / "scripts" / "gpu-lock.txt"
"""The GPU lock of a checkout (an installed package has none)."""
MIN_DRIVER = {12: (525, 60, 13), 13: (580, 65, 6)}
"""The least Linux driver of each CUDA major version (NVIDIA's CUDA toolkit release notes)."""
RUNTIME = "nvidia-cuda-runtime"


def lock_cuda(lock_text: str) -> tuple[int, int] | None:
    """CUDA (major, minor) of the runtime wheel a lock pins (None: it pins none)."""
    found = re.search(rf"^{RUNTIME}(?:-cu\d+)?==(\d+)\.(\d+)", lock_text, re.MULTILINE)
    return (int(found[1]), int(found[2])) if found else None


def parse_driver(smi_output: str) -> tuple[int, ...] | None:
    """The driver version in `nvidia-smi --query-gpu=driver_version --format=csv,noheader`'s
    output (one line per GPU, all the same); None when it shows none."""
    for line in smi_output.splitlines():
        if re.fullmatch(r"\d+(\.\d+)*", line.strip()):
            return tuple(int(part) for part in line.strip().split("."))
    return None


def node_driver() -> tuple[int, ...] | None:
    """This node's driver version (None: no nvidia-smi, or it found no GPU)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    query = [smi, "--query-gpu=driver_version", "--format=csv,noheader"]
    done = subprocess.run(query, capture_output=True, text=True, timeout=60, check=False)
    return parse_driver(done.stdout) if done.returncode == 0 else None


def _version(v: tuple[int, ...]) -> str:
    return ".".join(f"{part:02d}" if i else str(part) for i, part in enumerate(v))


def check(cuda: tuple[int, int] | None, driver: tuple[int, ...] | None) -> tuple[bool, str]:
    """(whether `driver` can run `cuda`, a line saying so); no driver or no CUDA to check passes,
    saying what every GPU node needs."""
    if cuda is None:
        return True, f"driver: no CUDA to check ({RUNTIME} not pinned in {LOCK.name}, not installed)"
    least = MIN_DRIVER.get(cuda[0])
    if least is None:
        return (
            False,
            f"driver: CUDA {cuda[0]}.{cuda[1]} has no known least driver (MIN_DRIVER knows {sorted(MIN_DRIVER)})",
        )
    need = f"CUDA {cuda[0]}.{cuda[1]} needs an NVIDIA driver >= {_version(least)}"
    if driver is None:
        return True, f"driver: {need}; no driver on this node (nvidia-smi): every GPU node needs it"
    if driver >= least:
        return True, f"driver: {need}; this node has {_version(driver)}: fits"
    return (
        False,
        f"driver: {need}; this node has {_version(driver)}: TOO OLD (update the driver, or relock for an older CUDA)",
    )


def required_cuda() -> tuple[int, int] | None:
    """The CUDA the GPU lock pins (a checkout), else that of the runtime wheel installed here."""
    if LOCK.exists():
        return lock_cuda(LOCK.read_text())
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = version(RUNTIME).split(".")[:2]
    except PackageNotFoundError:
        return None
    return int(major), int(minor)


def main(argv: list[str]) -> int:
    cuda = lock_cuda(Path(argv[0]).read_text()) if argv else required_cuda()
    ok, line = check(cuda, node_driver())
    print(line, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
