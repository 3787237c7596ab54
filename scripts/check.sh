#!/usr/bin/env bash
# The lint, layer and type gate (CI's first step; also run by pre-commit): ruff lint, ruff format,
# the layer order (import-linter, contract in pyproject.toml), pyright.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check pipeline_rl tests scripts launch.py
.venv/bin/ruff format --check pipeline_rl tests scripts launch.py
.venv/bin/lint-imports --no-cache --no-logo
.venv/bin/pyright
