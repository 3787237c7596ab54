"""The driver check of scripts/setup_gpu.sh and --dry-run: the CUDA the lock pins, the driver
nvidia-smi reports, and the comparison."""

from __future__ import annotations

import subprocess
import sys

from fixtures.helpers import ROOT

from pipeline_rl.launch.gpu_driver import LOCK, MIN_DRIVER, check, lock_cuda, parse_driver


def test_the_lock_pins_cuda_13_which_needs_driver_580():
    cuda = lock_cuda(LOCK.read_text())
    assert cuda is not None and cuda[0] == 13 and MIN_DRIVER[13][0] == 580
    assert lock_cuda("torch==2.13.0\nnvidia-cuda-runtime-cu12==12.8.90\n") == (12, 8)
    assert lock_cuda("torch==2.13.0+cpu\n") is None


def test_nvidia_smi_output_is_parsed():
    assert parse_driver("575.57.08\n575.57.08\n") == (575, 57, 8)
    assert parse_driver("580.95.05\n") == (580, 95, 5)
    assert parse_driver("No devices were found\n") is None


def test_an_old_driver_is_refused_a_new_one_passes():
    ok, line = check((13, 0), (575, 57, 8))
    assert not ok and "needs an NVIDIA driver >= 580.65.06" in line and "575.57.08: TOO OLD" in line
    assert check((13, 0), (580, 65, 6))[0] and check((13, 0), (590, 1))[0]
    assert not check((13, 0), (580, 65, 5))[0]
    assert check((12, 8), (575, 57, 8))[0]
    ok, line = check((13, 0), None)  # no driver here (the launcher's node may have no GPU)
    assert ok and "every GPU node needs it" in line
    assert not check((14, 0), (600,))[0]  # a CUDA whose least driver is unknown is not waved through


def test_the_script_runs_on_the_standard_library_alone():
    """setup_gpu.sh runs it with the system's python3 before the environment exists: -I -S
    leaves site-packages out."""
    script = ROOT / "pipeline_rl" / "launch" / "gpu_driver.py"
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(script), str(LOCK)], capture_output=True, text=True, timeout=60
    )
    assert "CUDA 13.0 needs an NVIDIA driver >= 580.65.06" in done.stdout + done.stderr
