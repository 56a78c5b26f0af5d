"""Benchmark: cuDNN's FP8 attention (cudnn-frontend `sdpa_fp8`) on the 57b rank shapes, against cuDNN bf16.

    python scripts/benchmarks/bench_attention_cudnn_fp8.py --out benchmarks/h200/attention_cudnn_fp8.json

Our Triton FP8 attention (`kernels.attention_fp8`) reaches ~530 TFLOP/s at best, no faster than cuDNN's bf16
kernel (docs/fp8.md). cuDNN ships a Hopper FP8 forward of its own; torch's SDPA does not expose it, the
cudnn-frontend Python package (`nvidia-cudnn-frontend`, the optional `cudnn` extra) does. This times it on
q (1, Hh, 2992, 128) over S = 14960 keys for Hh = 24 (TP3) and 18 (TP4):

  * per-tensor scales (what cuDNN's FP8 SDPA takes): q, K, V in e4m3 with one float32 descale each, P scaled
    by 448 before its cast, O written in e4m3 with scale_o = 1 / descale_v (|O| <= max|V|: O is a convex
    combination of V's rows, so that scale cannot overflow) or in bf16 where the engine allows it;
  * layouts: head-major (B, Hh, S, Dh) and token-major (B, S, Hh, Dh) memory, K and V as prefix views of a
    larger cache (S_max = S + 2992) and, where S is not a multiple of 64, S padded up with a padding mask;
  * every execution plan the heuristics offer (`--all-plans`), else the first that builds.

Each graph is the model's own (`kernels.attention_cudnn_fp8.CudnnFp8Graph`), with its mask and plan options.

Per row: device ms per call (CUDA events around 10 back-to-back calls, median), TFLOP/s (4 B Hh Tq S Dh / t),
the error against exact float32 attention over the dequantised inputs (the kernel's own error) and against
bf16 attention over the unquantised inputs (what switching the model to it costs). A variant that fails to
build is recorded with its error. CUDA only. Prints a table last, writes JSON to --out.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.attention import attention_ref
from kernels.attention_cudnn_fp8 import CudnnFp8Graph, cudnn_handle
from kernels.testing import rel_err
from scripts.benchmarks import results
from scripts.benchmarks.common import env_info

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0


def events_ms(fn: Callable[[], object], reps: int = 10, trials: int = 15) -> float:
    """Median over `trials` of (CUDA-event time of `reps` back-to-back calls) / reps."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / reps)
    return statistics.median(out)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor e4m3: (x8, descale) with x ~= x8 * descale. x dense (any memory order): x8 keeps its strides."""
    descale = (x.float().abs().amax() / FP8_MAX).clamp_min(1e-12)
    x8 = torch.empty_like(x, dtype=E4M3)
    x8.copy_((x.float() / descale).clamp(-FP8_MAX, FP8_MAX))
    return x8, descale.reshape(1, 1, 1, 1)


def layout(b: int, hh: int, s_max: int, dh: int, token_major: bool) -> torch.Tensor:
    """A (B, Hh, S_max, Dh) view of a (B, Hh, S_max, Dh) or (B, S_max, Hh, Dh) bf16 buffer, filled N(0, 1)."""
    if token_major:
        return torch.randn(b, s_max, hh, dh, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    return torch.randn(b, hh, s_max, dh, device="cuda", dtype=torch.bfloat16)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2992)
    p.add_argument("--context", type=int, default=5 * 2992)
    p.add_argument("--heads", default="24,18", help="Hh per rank to try (72 / TP)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--all-plans", action="store_true", help="time every execution plan, not only the first")
    p.add_argument("--out", default=None, help="default: benchmarks/<this GPU>/attention_cudnn_fp8.json")
    args = p.parse_args()
    import cudnn  # the optional `cudnn` extra: nvidia-cudnn-frontend

    torch.manual_seed(0)
    t0 = time.perf_counter()
    tq, s, dh, b = args.tokens, args.context, args.head_dim, 1
    handle = cudnn_handle(torch.cuda.current_device())
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    rows: list[dict[str, Any]] = []
    for hh in (int(x) for x in args.heads.split(",")):
        flops = 4 * b * hh * tq * s * dh
        for token_major in (True, False):
            q = layout(b, hh, tq, dh, True)  # token-major, as the qkv GEMM writes it
            k_full, v_full = layout(b, hh, s + tq, dh, token_major), layout(b, hh, s + tq, dh, token_major)
            k, v = k_full[:, :, :s], v_full[:, :, :s]  # prefix views of the cache
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), torch.inference_mode():
                bf16 = F.scaled_dot_product_attention(q, k, v)
                exact = attention_ref(q, k, v).float()
                ms = events_ms(functools.partial(F.scaled_dot_product_attention, q, k, v))
            base = {"heads": hh, "kv": "token-major" if token_major else "head-major"}
            rows.append({**base, "kernel": "sdpa_cudnn bf16", "ms": ms, "tflops": flops / ms / 1e9,
                         "rel_err_vs_exact": rel_err(bf16, exact)})
            q8, dq = quantize(q)
            k8, dk = quantize(k_full)
            v8, dv = quantize(v_full)
            k8, v8 = k8[:, :, :s], v8[:, :, :s]
            deq = attention_ref(q8.float() * dq, k8.float() * dk, v8.float() * dv).float()
            qk_scale, v_scale = torch.cat([dq.reshape(1), dk.reshape(1)]), dv.reshape(1)
            pads: list[int | None] = [None] if s % 64 == 0 else [None, -(-s // 64) * 64]
            for out_dtype in (E4M3, torch.bfloat16):
                for padded in pads:
                    kk, vv = k8, v8
                    if padded is not None:  # the same cache with S rounded up; the padding mask hides the rest
                        kk = k8.as_strided((b, hh, padded, dh), k8.stride())
                        vv = v8.as_strided((b, hh, padded, dh), v8.stride())
                    out = torch.empty(b, tq, hh, dh, device="cuda", dtype=out_dtype).transpose(1, 2)
                    name = f"cudnn_fp8 o={'e4m3' if out_dtype == E4M3 else 'bf16'}" + (
                        f" S->{padded}+mask" if padded else "")
                    plans: list[int | None] = [None]
                    try:
                        first = CudnnFp8Graph(cudnn, handle, q8, kk, vv, out, s if padded else None)
                        if args.all_plans:
                            plans = list(range(first.plans))
                    except Exception as e:  # noqa: BLE001 - a configuration the engine rejects is a result
                        rows.append({**base, "kernel": name, "error": str(e).strip().splitlines()[-1][:300]})
                        continue
                    for plan in plans:
                        try:
                            g = first if plan is None else CudnnFp8Graph(cudnn, handle, q8, kk, vv, out,
                                                                         s if padded else None, plan)
                            fn = functools.partial(g.run, handle, q8, kk, vv, qk_scale, v_scale, 1 / v_scale, out)
                            fn()
                            torch.cuda.synchronize()
                            got = out.float() * (dv if out_dtype == E4M3 else 1.0)
                            ms = events_ms(fn)
                            rows.append({**base, "kernel": name + ("" if plan is None else f" plan {plan}"),
                                         "ms": ms, "tflops": flops / ms / 1e9,
                                         "rel_err_vs_exact": rel_err(got, deq), "rel_err_vs_bf16": rel_err(got, exact),
                                         "amax_s": g.amax_buf[0].item(), "amax_o": g.amax_buf[1].item(),
                                         "plans": first.plans})
                        except Exception as e:  # noqa: BLE001
                            rows.append({**base, "kernel": name + ("" if plan is None else f" plan {plan}"),
                                         "error": str(e).strip().splitlines()[-1][:300]})
            del q, k, v, k_full, v_full, q8, k8, v8, bf16, exact, deq
            torch.cuda.empty_cache()
    info = {**env_info(torch.device("cuda")), "cudnn": torch.backends.cudnn.version(),
            "cudnn_frontend": getattr(cudnn, "__version__", "?"),
            "backend_version": getattr(cudnn, "backend_version", lambda: "?")()}
    result = {"command": " ".join(["python", *sys.argv]), **info,
              "shapes": {"tq": tq, "keys": s, "head_dim": dh}, "floor_note": "tflops = 4*Tq*S*Dh*Hh / time",
              "rows": rows, "wall_s": time.perf_counter() - t0}
    results.record(args.out or results.default_path("attention_cudnn_fp8"), result)
    print(f"{'heads':>5} {'kv':>11} {'kernel':<40} {'ms':>7} {'TFLOP/s':>8} {'err/exact':>9} {'err/bf16':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['heads']:>5} {r['kv']:>11} {r['kernel']:<40} error: {r['error'][:90]}")
            continue
        print(f"{r['heads']:>5} {r['kv']:>11} {r['kernel']:<40} {r['ms']:>7.3f} {r['tflops']:>8.0f} "
              f"{r['rel_err_vs_exact']:>9.4f} {r.get('rel_err_vs_bf16', 0):>9.4f}")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
