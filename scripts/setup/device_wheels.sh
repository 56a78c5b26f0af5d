#!/usr/bin/env bash
# Wheels for running sessions (Ray, the chunk path) on the lent GPU machine, within its 64 MiB carry.
#
#   scripts/setup/device_wheels.sh [DIR] [PYTHON_VERSION]      # default .whl_pipeline, 3.12 (the device's python3)
#
# The device image has torch, numpy, grpcio, protobuf, aiohttp, msgpack, pyyaml, ... but not Ray nor our
# other runtime needs. Ray's wheel is 79 MB; what a session never loads is dropped (the Java jars, the
# dashboard's web client, rllib/tune/train/data/llm) and its three native binaries are stripped of
# unneeded symbols, which leaves ~30 MB. The chunk path imports neither PyAV nor LiveKit's native
# client, so neither travels. Versions are this checkout's (.venv). Carry DIR and install it there with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site DIR/*.whl
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:-.whl_pipeline}
pyver=${2:-3.12}
tag=cp${pyver/./}
mkdir -p "$dir"
version() { .venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
needs=(ray pydantic pydantic_core annotated-types typing-inspection jsonschema jsonschema-specifications referencing
       rpds-py opentelemetry-api livekit-api livekit-protocol PyJWT cryptography cffi pycparser)
pins=()
for n in "${needs[@]}"; do pins+=("$n==$(version "$n")"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dir" "${pins[@]}"
ray_whl=$(ls "$dir"/ray-*-"$tag"-*.whl)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
unzip -q "$ray_whl" -d "$work"
rm -rf "$work"/ray/{jars,rllib,tune,train,data,llm} "$work"/ray/dashboard/client/build
for bin in "$work"/ray/_raylet.so "$work"/ray/core/src/ray/gcs/gcs_server "$work"/ray/core/src/ray/raylet/raylet; do
  strip --strip-unneeded "$bin"
done
python3 - "$work" "$ray_whl" <<'EOF'
import base64, csv, hashlib, io, os, sys, zipfile
root, out = sys.argv[1], sys.argv[2]
record = next(os.path.join(d, "RECORD") for d, _, fs in os.walk(root) if d.endswith(".dist-info") and "RECORD" in fs)
rows, paths = [], []
for d, _, fs in os.walk(root):
    for f in fs:
        p = os.path.join(d, f)
        rel = os.path.relpath(p, root)
        paths.append(rel)
        if p != record:
            data = open(p, "rb").read()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append((rel, f"sha256={digest}", str(len(data))))
rows.append((os.path.relpath(record, root), "", ""))
buf = io.StringIO()
csv.writer(buf, lineterminator="\n").writerows(rows)
open(record, "w").write(buf.getvalue())
with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
    for rel in sorted(paths, key=lambda r: r.endswith("RECORD")):  # RECORD last, as wheels have it
        z.write(os.path.join(root, rel), rel)
EOF
du -ch "$dir"/*.whl | tail -1
