#!/usr/bin/env bash
# Setup of the GPU stack (CUDA vLLM, its CUDA torch, DeepSpeed, Ray) into ./.venv, exactly as
# pinned in scripts/gpu-lock.txt (Linux x86-64, Python 3.11).
#   bash scripts/setup_gpu.sh            install the locked versions
#   bash scripts/setup_gpu.sh --relock   resolve the gpu+cluster+dev extras again and rewrite the lock
# The lock is resolved, not installed, where it is made (no GPU is needed to make it); the CPU
# lock (scripts/cpu-lock.txt) is the one the test suite passes with.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v uv >/dev/null || python3 -m pip install --quiet uv
if [ "${1:-}" = "--relock" ]; then
    uv pip compile --quiet pyproject.toml --extra gpu --extra cluster --extra dev \
        --python-version 3.11 --python-platform x86_64-manylinux_2_28 --no-header -o scripts/gpu-lock.txt
    echo "rewrote scripts/gpu-lock.txt"
    exit 0
fi
# The lock's CUDA wheels need a recent enough NVIDIA driver: refuse an older one before installing.
python3 pipeline_rl/launch/gpu_driver.py scripts/gpu-lock.txt
[ -x .venv/bin/python ] || uv venv --quiet --python 3.11 .venv
into=(--compile-bytecode --python .venv/bin/python)
uv pip sync "${into[@]}" scripts/gpu-lock.txt
uv pip install "${into[@]}" --no-deps -e .
echo "setup done: activate with 'source .venv/bin/activate'"
