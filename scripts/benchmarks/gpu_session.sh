#!/usr/bin/env bash
# One GPU-machine session: install carried wheels, run the GPU tests, then the benchmarks.
# Usage (on the GPU machine, repo root): OUT=/path/for/results scripts/benchmarks/gpu_session.sh [tests|bench|profile|pipeline|fp8|all]
#   fp8: FP8_PARTS (default "tests attention tp3 tp4 wan"; also tp2 local kv build lipsync drift drift57) picks the FP8 runs
#   (docs/fp8.md), each under its own timeout; lipsync needs .cache/tiny_data/test.npz carried.
#   or `source scripts/benchmarks/gpu_session.sh setup` to install the wheels and set the environment for commands of your own.
# Carry .whl_pipeline (scripts/setup/device_wheels.sh: Ray and the chunk path's other needs, 43 MB) or an older .whl.
# Each result is a run appended to $OUT/<measurement>.json; file them with
#   python scripts/benchmarks/results.py merge $OUT benchmarks/<h200|h100|h200x2>   (then scripts/benchmarks/page.py)
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/gpu_session}  # file the results with results.py merge (above)
mkdir -p "$OUT"
# .whl_cudnn: nvidia-cudnn-frontend (the optional `cudnn` extra, cuDNN's FP8 attention); .whl_probe: a small set
# (pydantic and the frontend) for kernel and step benchmarks that need no Ray, when the carry limit bites.
for wheels in $( [ -d .whl_pipeline ] && echo .whl_pipeline || echo .whl ) .whl_cudnn .whl_probe; do
  [ -d "$wheels" ] || continue
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
done
# NVLink multicast stays off (the device README): Ray's workers inherit this environment from the driver.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 scripts/benchmarks/bench_step.py --preset 57b --topology h100x5 --device cuda \
    --modes write_time,write_time_replicated,naive --no-decoder --iters 10 --out "$OUT/step_57b_h100x5_rank.json"
  python3 scripts/benchmarks/bench_step.py --preset wan-1.3b --topology gpu1 --device cuda --modes write_time,naive \
    --out "$OUT/step_wan-1.3b_gpu1.json"
  python3 scripts/benchmarks/bench_decoder.py --preset 57b --device cuda --iters 15 \
    --variants concat_compiled_graph,windows_graph_bench --out "$OUT/decoder_57b.json"
  python3 scripts/benchmarks/bench_kernels.py --out "$OUT/kernels.json"
  python3 scripts/benchmarks/bench_attention_split.py --out "$OUT/attention_split.json"
  python3 scripts/benchmarks/bench_gemm_split.py --preset 57b --device cuda --out "$OUT/gemm_split_57b_cuda.json"
  gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
  if [ "$gpus" -ge 2 ]; then  # tensor parallel over NCCL (nvidia-h200-x2 and up)
    python3 -m pytest tests/gpu/test_tp_gpu.py -q -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/gpu_tests_tp.txt"
    python3 scripts/benchmarks/bench_collectives.py --ranks 2 --device cuda --out "$OUT/collectives_2_cuda.json"
    python3 scripts/benchmarks/bench_tp.py --preset 57b --ranks 2 --device cuda --iters 8 \
      --variants sp_left_out,replicated_left_out,replicated,sp_none,sp_symm_mem,sp_ring --out "$OUT/tp_57b_2_all.json"
    python3 scripts/benchmarks/bench_tp.py --preset 57b --ranks 2 --device cuda --iters 8 \
      --variants sp_left_out,sp_none,sp_local_left_out,sp_local,sp_kv_left_out,sp_kv --out "$OUT/tp_57b_2_local.json"
  fi
fi
if [ "$what" = profile ] || [ "$what" = all ]; then
  python3 scripts/benchmarks/profile_step.py --preset 57b --topology h100x5 --device cuda --shapes --sequence-parallel \
    --out "$OUT/profile_57b_h100x5.json"
  python3 scripts/benchmarks/bench_decoder.py --preset 57b --device cuda --iters 15 --variants windows_graph_bench --profile \
    --out "$OUT/decoder_57b_profile.json"
fi
if [ "$what" = fp8 ]; then  # the FP8 path (issue 17): GPU tests, attention kernels, rank steps, drift
  parts=" ${FP8_PARTS:-tests attention tp3 tp4 wan} "
  part() { [[ "$parts" == *" $1 "* ]]; }
  b() { timeout "${FP8_TIMEOUT:-420}" python3 scripts/benchmarks/bench_fp8.py "$@" 2>&1 | grep -v "^  warnings.warn" | tail -40; }
  part tests && timeout 240 python3 -m pytest tests/gpu/test_fp8_gpu.py -q -p no:cacheprovider 2>&1 \
    | grep -v "leaked \|nanobind\|skipped remainder" | tail -25 \
    | tee "$OUT/gpu_tests_fp8.txt"
  part attention && b attention --out "$OUT/attention_fp8.json"
  part tp3 && b steps --preset 57b --ranks 3 --variants "${FP8_TP3:-sp:bf16:bf16,sp:fp8:bf16,sp:fp8:fp8,rep:fp8:fp8}" \
    --profile-variants "${FP8_PROFILE:-}" --out "$OUT/step_57b_tp3_fp8.json"
  part tp4 && b steps --preset 57b --ranks 4 --variants "${FP8_TP4:-sp:fp8:fp8,rep:fp8:fp8}" \
    --profile-variants "${FP8_PROFILE:-}" --out "$OUT/step_57b_tp4_fp8.json"
  part tp2 && b steps --preset 57b --ranks 2 --variants "${FP8_TP2:-sp:fp8:fp8,rep:fp8:fp8}" \
    --profile-variants "${FP8_PROFILE:-}" --out "$OUT/step_57b_tp2_fp8.json"
  part local && b steps --preset 57b --ranks 3 --variants sp:fp8:fp8-cudnn,spl:fp8:fp8-cudnn \
    --profile-variants "${FP8_PROFILE-sp:fp8:fp8-cudnn,spl:fp8:fp8-cudnn}" \
    --out "$OUT/step_57b_tp3_local.json"  # the token-local layers whole: the rank's compute (topology.local_layers)
  part local && b steps --preset 57b --ranks 4 --variants sp:fp8:fp8-cudnn,spl:fp8:fp8-cudnn \
    --profile-variants "${FP8_PROFILE:-}" --out "$OUT/step_57b_tp4_local.json"
  part kv && b steps --preset 57b --ranks 3 --variants spl:fp8:fp8-cudnn,spa:fp8:fp8-cudnn \
    --timeline-variants spa:fp8:fp8-cudnn --out "$OUT/step_57b_tp3_kv.json"  # self-attention whole too
  part kv && b steps --preset 57b --ranks 4 --variants spl:fp8:fp8-cudnn,spa:fp8:fp8-cudnn \
    --timeline-variants spa:fp8:fp8-cudnn --out "$OUT/step_57b_tp4_kv.json"  # (topology.local_attention)
  part build && timeout "${FP8_TIMEOUT:-420}" python3 scripts/benchmarks/bench_dit_build.py --preset 57b --ranks 3 --device cuda \
    --layouts sp,spl,spa --out "$OUT/dit_build_57b_tp3.json" 2>&1 | tail -8  # the build's peak, whole share vs blocks
  part wan && b steps --preset wan-1.3b --ranks 1 --variants "${FP8_WAN:-rep:fp8:bf16,rep:fp8:fp8}" \
    --profile-variants "${FP8_PROFILE:-}" --out "$OUT/step_wan-1.3b_fp8.json"
  part lipsync && b lipsync --variants "${FP8_LIPSYNC:-bf16:bf16,fp8:bf16,fp8:fp8}" --seeds "${FP8_SEEDS:-3}" \
    --out "$OUT/lipsync_tiny_fp8.json"
  part drift && b drift --preset wan-1.3b --chunks 100 --variants fp8:bf16,fp8:fp8 --out "$OUT/drift_wan-1.3b.json"
  part drift57 && b drift --preset 57b --layers "${FP8_DRIFT_LAYERS:-12}" --chunks 100 --variants fp8:bf16,fp8:fp8 \
    --out "$OUT/drift_57b.json"
fi
if [ "$what" = pipeline ]; then  # whole sessions on Ray: compiled graph, NCCL latents to a decoder GPU of its own
  gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
  run() {  # the full log under $OUT, the summary table on the terminal
    local log="$OUT/$(basename "${@: -1}" .json).log"
    timeout "${PIPELINE_TIMEOUT:-560}" python3 scripts/benchmarks/bench_pipeline.py --device cuda --seconds "${PIPELINE_SECONDS:-20}" \
      "$@" > "$log" 2>&1
    echo "== $* (rc=$?)"; grep -A12 "^layout " "$log" || tail -30 "$log"
  }
  if [ "$gpus" -ge 2 ]; then
    run --preset wan-1.3b --dit-ranks 1 --decoder-gpus 1 --depths 2,1 --out "$OUT/pipeline_wan-1.3b_1p1.json"
    # One rank's share of 57b TP4 (15 of 58 blocks: its FLOPs, not its collectives) + the decoder on its own GPU.
    run --preset 57b --layers 15 --dit-ranks 1 --decoder-gpus 1 --depths 2,1 --out "$OUT/pipeline_57b_L15_1p1.json"
    # Two sessions side by side, each its own placement group of one GPU (the decoder beside its DiT).
    run --preset wan-1.3b --dit-ranks 1 --decoder-gpus 0 --sessions 2 --out "$OUT/pipeline_wan-1.3b_1p0_x2.json"
  fi
  if [ "$gpus" -eq 2 ]; then  # 57b TP2, the decoder beside DiT rank 0 (shared memory)
    run --preset 57b --dit-ranks 2 --decoder-gpus 0 --depths 2 --out "$OUT/pipeline_57b_2p0.json"
  fi
  if [ "$gpus" -ge 3 ]; then
    run --preset 57b --dit-ranks 2 --decoder-gpus 1 --layouts replicated,sp_none \
      --out "$OUT/pipeline_57b_2p1.json"
  fi
  if [ "$gpus" -ge 4 ]; then  # 3 + 1 in FP8 with cuDNN's FP8 attention: the latency budget's rows, collectives in place
    run --preset 57b --dit-ranks 3 --decoder-gpus 1 --precision fp8 --attention-precision fp8 \
      --layouts sp_none,sp_local,sp_kv --out "$OUT/pipeline_57b_3p1_fp8.json"
  fi
  if [ "$gpus" -ge 5 ]; then
    run --preset 57b --dit-ranks 4 --decoder-gpus 1 --precision fp8 --attention-precision fp8 \
      --layouts sp_none,sp_local,sp_kv --out "$OUT/pipeline_57b_4p1_fp8.json"
  fi
  if [ "$gpus" -ge 8 ]; then
    run --preset 57b --dit-ranks 3 --decoder-gpus 1 --sessions 2 --out "$OUT/pipeline_57b_3p1_x2.json"
  fi
fi
