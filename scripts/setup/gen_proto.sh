#!/usr/bin/env bash
# Regenerate the Python gRPC code for deployments/api/proto/characters.proto (grpcio-tools, a dev extra).
# The generated *_pb2*.py / *.pyi files are committed; ruff and mypy skip them (pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
"$PY" -m grpc_tools.protoc -I . \
    --python_out=. --pyi_out=. --grpc_python_out=. \
    deployments/api/proto/characters.proto
# The stub is for mypy; ruff's extend-exclude covers only *_pb2*.py, so mark the stub as generated too.
STUB=deployments/api/proto/characters_pb2.pyi
{ echo "# ruff: noqa"; cat "$STUB"; } > "$STUB.tmp" && mv "$STUB.tmp" "$STUB"
echo "generated: $(ls deployments/api/proto/characters_pb2*.py* | tr '\n' ' ')"
