#!/usr/bin/env bash
# The test suite as CI runs it: lint, type-check, then every test that needs no GPU.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -x).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/python -m pytest -m "not gpu" --durations=30 "$@"
