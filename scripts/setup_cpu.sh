#!/usr/bin/env bash
# One-command setup of the CPU stack into ./.venv, exactly as pinned in scripts/cpu-lock.txt.
#   bash scripts/setup_cpu.sh            install the locked versions (what the tests passed with)
#   bash scripts/setup_cpu.sh --relock   resolve the cpu+cluster+dev extras again and rewrite the lock
#   bash scripts/setup_cpu.sh --bench    the locked versions plus the `bench` extra (TRL, for
#                                        scripts/bench_learning.py) from scripts/bench-lock.txt
#   bash scripts/setup_cpu.sh --verifiers  the locked versions plus the `verifiers` extra (environments
#                                        of the verifiers library, actor.domain: verifiers) from
#                                        scripts/verifiers-lock.txt; --bench --verifiers installs both
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
if [ "${1:-}" = "--relock" ]; then
    uv pip install --python .venv/bin/python "${torch_src[@]}" \
        --override scripts/cpu-overrides.txt -e ".[cpu,cluster,dev]"
    uv pip freeze --python .venv/bin/python | grep -v -e '^-e ' -e '^pipeline-rl' > scripts/cpu-lock.txt
    echo "rewrote scripts/cpu-lock.txt"
else
    # DeepSpeed builds from source against the locked torch (it is in the lock, so nothing replaces it).
    # Bytecode at install only where Python will not write it on first import: with
    # PYTHONDONTWRITEBYTECODE set every process would compile torch and vLLM from source at each
    # start. Otherwise each module is compiled once, when first imported, and most never are.
    into=(--python .venv/bin/python)
    if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then into+=(--compile-bytecode); fi
    uv pip sync "${into[@]}" "${torch_src[@]}" scripts/cpu-lock.txt
    uv pip install "${into[@]}" --no-deps -e .
    for extra in "$@"; do  # the optional extras' locks, each on top of the CPU lock
        case "$extra" in
            --bench) uv pip install "${into[@]}" --no-deps -r scripts/bench-lock.txt ;;
            --verifiers) uv pip install "${into[@]}" --no-deps -r scripts/verifiers-lock.txt ;;
            *) echo "unknown option $extra" >&2 && exit 2 ;;
        esac
    done
fi
echo "setup done: activate with 'source .venv/bin/activate'"
