#!/usr/bin/env bash
# One device call: our LiveAvatar DiT per block (whole model, TP2/TP4 rank shares; bf16, FP8) and the authors'
# own loop on the same card (their compile switch and FP8 as they ship them), JSON and logs under $OUT.
#   carry: .whl (pydantic + the oracle's wheels: scripts/liveavatar/README.md), .la (their checkout's .py files)
#   PARTS="ours theirs_fp8 theirs_bf16" scripts/liveavatar/gpu_session.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
for part in ${PARTS:-ours theirs_fp8}; do
  case $part in
    ours) timeout "${OURS_S:-300}" python3 scripts/liveavatar/bench_dit.py --shards "${SHARDS:-1,2,4}" \
            --precisions bf16,fp8 --blocks 8 --out "$out/ours.json" 2>&1 | tee "$out/ours.log" | grep -v Warning ;;
    theirs_fp8) timeout "${THEIRS_S:-300}" python3 scripts/liveavatar/golden.py --authors .la --out "$out/theirs_fp8" \
            --device cuda --layers 40 --time --fp8 --clips 2 --skip-keys 2>&1 | tail -40 | tee "$out/theirs_fp8.log" ;;
    theirs_bf16) timeout "${THEIRS_S:-300}" python3 scripts/liveavatar/golden.py --authors .la --out "$out/theirs_bf16" \
            --device cuda --layers 40 --time --clips 2 --skip-keys 2>&1 | tail -40 | tee "$out/theirs_bf16.log" ;;
  esac
done
for f in "$out"/theirs_*/*.json; do [ -f "$f" ] && cp "$f" "$out/$(basename "$(dirname "$f")").json"; done
true
