#!/usr/bin/env bash
# The one prepared command for a lent GPU: every device figure the GPU path needs, in one run
# that fits the device's time (BUDGET_S, 450 s by default), its output kept under OUT.
#
#   bash scripts/gpu_device_run.sh --wheels   here, before: the Python 3.12 wheels the device's
#                                             image lacks (DeepSpeed, orjson, omegaconf, msgspec,
#                                             redis and what they need), into .gpu-wheels/,
#                                             which .git/info/exclude keeps out of git
#   bash scripts/gpu_device_run.sh [OUT]      on the device (carry .gpu-wheels): installs them,
#                                             prints the driver and the devices, runs the GPU
#                                             test tier (tests/gpu), the TP = 1 swap checks'
#                                             figures (ordered and concurrent), then
#                                             `gpu_check.py --suite` in what time is left
#
# Everything goes to OUT/device_run.log as well as to the terminal; the suite writes its table
# and JSON under OUT/suite.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu-wheels
if [ "${1:-}" = "--wheels" ]; then
    mkdir -p "$WHEELS"
    grep -qxF "/$WHEELS/" .git/info/exclude 2>/dev/null || echo "/$WHEELS/" >>.git/info/exclude
    pins=()
    for name in orjson msgspec omegaconf antlr4-python3-runtime redis hjson ninja py-cpuinfo pydantic \
        pydantic-core annotated-types typing-inspection einops pytest pluggy iniconfig pytest-timeout; do
        pins+=("$(grep -i "^$name==" scripts/cpu-lock.txt)")
    done
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
        -d "$WHEELS" "${pins[@]}"
    src=$(mktemp -d)
    python3 -m pip download --quiet --no-deps --no-binary=:all: -d "$src" "$(grep -i '^deepspeed==' scripts/cpu-lock.txt)"
    command -v uv >/dev/null || python3 -m pip install --quiet uv
    uv build --quiet --wheel "$src"/deepspeed-*.tar.gz --out-dir "$WHEELS"
    ls -1 "$WHEELS"
    exit 0
fi
OUT=${1:-${OUT:-device_out}}
BUDGET_S=${BUDGET_S:-450}
mkdir -p "$OUT"
exec > >(tee "$OUT/device_run.log") 2>&1
start=$SECONDS
left() { echo $((BUDGET_S - (SECONDS - start))); }
python3 -m pip install --quiet --no-deps "$WHEELS"/*.whl
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
echo "== devices"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
echo "== the GPU test tier ($(left) s left)"
timeout 180 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider || echo "gpu tier exit $?"
echo "== TP = 1 swap: the copy ordered before the next forward pass ($(left) s left)"
timeout 60 python3 scripts/gpu_swap_check.py --gib 1.0 --rounds 20 || echo "swap check exit $?"
echo "== TP = 1 swap while the engine runs ($(left) s left)"
timeout 60 python3 scripts/gpu_swap_check.py --concurrent --gib 1.0 --rounds 10 || echo "concurrent swap check exit $?"
echo "== trainer against the bare loop ($(left) s left)"
timeout "$(left)" python3 scripts/gpu_check.py --suite --steps 5 --out "$OUT/suite" || echo "suite exit $?"
echo "== done in $((SECONDS - start)) s"
