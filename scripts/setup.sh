#!/usr/bin/env bash
# Create .venv with this project installed (editable). `--dev` adds test and lint tools.
# Idempotent: a second run only installs what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade "pip==26.3"
extra=""
[ "${1:-}" = "--dev" ] && extra="[dev]"
.venv/bin/python -m pip install -q -e ".${extra}"
