#!/usr/bin/env bash
# The lint and type gate (CI's first step; also run by pre-commit): ruff lint, ruff format, pyright.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check pipeline_rl tests scripts launch.py
.venv/bin/ruff format --check pipeline_rl tests scripts launch.py
.venv/bin/pyright
