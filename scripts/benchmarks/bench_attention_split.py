"""Benchmark: does split-KV attention (the key range cut into n parts, one launch) beat cuDNN on the 57b shapes?

    python scripts/benchmarks/bench_attention_split.py --out benchmarks/h200/attention_split.json

On the 57b rank (q (1, 18, 2992, 128) over 14960 keys, bf16) cuDNN runs at ~500 TFLOP/s against a ~790
TFLOP/s matmul rate; the suspect is wave quantization (18 heads x ceil(2992 / tile) q-tiles on 132 SMs).
This times, on those shapes (q token-major, k/v prefix views of the cache, as the write-time path has them):

  * SDPA forced to cuDNN / flash, and each kernel's log-sum-exp-returning op alone (n = 1, no merge);
  * each kernel split into n parts for every n in --parts that divides S, q handed over as an `expand`
    (batch stride 0) or a copy, merged by the compiled merge (and once by the eager merge);
  * the named backends (`attention(..., "sdpa_cudnn_split4")`, ...) as `pick_backend` sees them;
  * the merge alone (eager and compiled) for n = 2, 4, 8;
  * cuDNN (and flash, and cuDNN split 4) vs Tq at fixed S, to show any wave staircase.

Per row: device ms per call from CUDA-graph replays (host launch gaps excluded, as in the graph-replayed
step), eager ms per call, TFLOP/s (FLOPs = 4 B Hh Tq S Dh), the floor at the measured matmul rate, and the
max abs / relative error against `attention_ref` (float32). A variant that raises is recorded with its
error (e.g. a kernel that rejects a stride-0 batch). Numbers on CUDA only (--device cpu: a smoke test).
Prints tables last, writes JSON to --out.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.attention import (
    ATTENTION_BACKENDS,
    PARTS,
    AttentionBackend,
    MergeFn,
    attention,
    attention_ref,
    merge_parts,
    split_attention,
)
from kernels.testing import rel_err
from scripts.benchmarks import results
from scripts.benchmarks.common import device_ms, env_info, matmul_rate, sync, timed

BLOCK_M = 128  # q rows per CTA assumed for the wave estimate
SPLIT_BACKENDS: tuple[AttentionBackend, ...] = tuple(b for b in ATTENTION_BACKENDS if "_split" in b)


def first(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], *args: Any) -> torch.Tensor:
    return fn(*args)[0]


def measure(
    fn: Callable[[], torch.Tensor], flops: int, rate: float, args: argparse.Namespace, ref: torch.Tensor | None = None
) -> dict[str, Any]:
    """Graph-replayed and eager ms per call, TFLOP/s and floor ratio, errors vs ref; or the error raised."""
    dev = torch.device(args.device)
    torch._dynamo.reset()  # a fresh compile budget per variant: never time an eager fallback by accident
    try:
        with torch.inference_mode():
            out = fn()
            sync(dev)
            row: dict[str, Any] = {}
            if ref is not None:
                row["max_abs_err"] = (out.float() - ref).abs().max().item()
                row["rel_err"] = rel_err(out, ref)
            row["eager_ms"] = statistics.median(timed(fn, dev, args.iters, args.warmup))
            row["ms"] = device_ms(fn, dev, args)
    except RuntimeError as e:  # a kernel that rejects the inputs, or a failed capture
        sync(dev)
        return {"error": str(e).splitlines()[0] if str(e) else type(e).__name__}
    row["tflops"] = flops / row["ms"] / 1e9
    row["floor_ratio"] = row["ms"] / (flops / rate * 1e3)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=2992, help="Tq: one chunk's tokens")
    p.add_argument("--context", type=int, default=5 * 2992, help="S: keys attended")
    p.add_argument("--cache", type=int, default=None, help="S_max: cache slots (default S, the full ring)")
    p.add_argument("--heads", type=int, default=18, help="Hh: heads on one rank (72 / TP 4)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--parts", default="2,3,4,5,8", help="n to try (those that divide S)")
    p.add_argument("--sweep", default="2048,2304,2560,2816,2992,3072,3328,3584", help="Tq values at fixed S")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=None, help="default: benchmarks/<this GPU>/attention_split.json")
    p.add_argument("--device", default="cuda", help="cpu only to smoke-test the script (small shapes)")
    args = p.parse_args()
    dev, dt = torch.device(args.device), torch.bfloat16
    b, t, s, hh, dh = args.batch, args.tokens, args.context, args.heads, args.head_dim
    scale = 1.0 / math.sqrt(dh)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else os.cpu_count() or 1
    rate = matmul_rate(dev, dt)

    def q_of(tq: int) -> torch.Tensor:
        return torch.randn(b, tq, hh, dh, device=dev, dtype=dt).transpose(1, 2)  # (B, Hh, Tq, Dh) token-major

    q = q_of(t)
    s_max = args.cache or s
    k = torch.randn(b, hh, s_max, dh, device=dev, dtype=dt)[:, :, :s]  # (B, Hh, S, Dh) prefix view of the cache
    v = torch.randn(b, hh, s_max, dh, device=dev, dtype=dt)[:, :, :s]
    flops = 4 * b * hh * t * s * dh
    with torch.inference_mode():
        ref = attention_ref(q, k, v).float()  # (B, Hh, Tq, Dh)
    compiled_merge = torch.compile(merge_parts, dynamic=False)

    def row(fn: Callable[[], torch.Tensor], **extra: Any) -> dict[str, Any]:
        return {**extra, **measure(fn, flops, rate, args, ref)}

    rows: dict[str, dict[str, Any]] = {}
    for name in ("sdpa_cudnn", "sdpa_flash"):
        rows[name] = row(functools.partial(attention, q, k, v, name), n=1)
    for kernel, parts in PARTS.items():  # the log-sum-exp-returning op alone: its cost without a split
        rows[f"{kernel}_lse_n1"] = row(functools.partial(first, parts, q, k, v, scale), n=1)
    ns = [n for n in (int(x) for x in args.parts.split(",")) if s % n == 0]
    for kernel, parts in PARTS.items():
        for n in ns:
            variants: tuple[tuple[Literal["expand", "repeat"], MergeFn, str], ...] = (
                ("expand", compiled_merge, "expand"), ("repeat", compiled_merge, "repeat"),
                ("expand", merge_parts, "expand_eager_merge"),
            )  # fmt: skip
            for fold, merge_fn, suffix in variants:
                split = functools.partial(split_attention, q, k, v, n, parts, scale, fold, merge_fn)
                rows[f"{kernel}_split{n}_{suffix}"] = row(split, n=n)
    for backend in SPLIT_BACKENDS:  # what pick_backend times
        rows[f"backend:{backend}"] = row(functools.partial(attention, q, k, v, backend))

    merge: dict[str, dict[str, Any]] = {}
    for n in (2, 4, 8):
        parts_out = torch.randn(b, n, hh, t, dh, device=dev, dtype=dt)  # (B, n, Hh, Tq, Dh), as cuDNN returns
        lse = 3 * torch.randn(b, n, hh, t, device=dev) + 10  # (B, n, Hh, Tq)
        gbytes = (parts_out.numel() * 2 + lse.numel() * 4 + parts_out.numel() // n * 2) / 1e9
        for kind, merge_fn in (("eager", merge_parts), ("compiled", compiled_merge)):
            # token-major order, as split_attention merges for a token-major q
            r = measure(functools.partial(merge_fn, parts_out.transpose(2, 3), lse.transpose(2, 3)), 1, rate, args)
            merge[f"n{n}_{kind}"] = {key: r.get(key) for key in ("ms", "eager_ms", "error")}
            merge[f"n{n}_{kind}"]["GB_per_s"] = gbytes / r["ms"] * 1e3 if "ms" in r else None

    sweep: list[dict[str, Any]] = []
    for tq in (int(x) for x in args.sweep.split(",")):
        qs, f = q_of(tq), 4 * b * hh * tq * s * dh
        ctas = b * hh * math.ceil(tq / BLOCK_M)
        point: dict[str, Any] = {"Tq": tq, "ctas": ctas, "waves": ctas / sms}
        for label, backend in (("cudnn", "sdpa_cudnn"), ("flash", "sdpa_flash"), ("cudnn_split4", "sdpa_cudnn_split4")):
            r = measure(functools.partial(attention, qs, k, v, backend), f, rate, args)
            point[label] = {key: r.get(key) for key in ("ms", "tflops", "error")}
        sweep.append(point)

    result = {"command": " ".join(["python", *sys.argv]), **env_info(dev), "cudnn": torch.backends.cudnn.version(),
              "sm_count": sms, "shape": {"B": b, "Tq": t, "S": s, "S_max": s_max, "Hh": hh, "Dh": dh,
                                         "dtype": "bfloat16", "q": "token-major", "kv": "prefix views"},
              "matmul_tflops": rate / 1e12, "flops": flops, "floor_ms": flops / rate * 1e3,
              "ms": "device ms per call from CUDA-graph replays; eager_ms per plain call; medians",
              "rows": rows, "merge": merge, "sweep": sweep}  # fmt: skip
    results.record(args.out or results.default_path("attention_split", args.device), result)

    print(f"merge alone (B={b}, Hh={hh}, Tq={t}, Dh={dh}):")
    for name, r in merge.items():
        print(f"  {name:<14} " + (f"{r['ms']:7.4f} ms {r['GB_per_s']:6.0f} GB/s" if r["ms"] else str(r["error"])))
    print(f"cuDNN / flash / cuDNN split4 vs Tq at S={s} ({sms} SMs, {BLOCK_M}-row q tiles):")
    for pt in sweep:
        cells = "  ".join(f"{n} {pt[n]['ms']:.3f} ms {pt[n]['tflops']:4.0f}" if pt[n]["ms"] else f"{n} error"
                          for n in ("cudnn", "flash", "cudnn_split4"))  # fmt: skip
        print(f"  Tq {pt['Tq']:>5} waves {pt['waves']:5.2f}  {cells}")
    print(
        f"{args.out}: B={b} Hh={hh} Tq={t} S={s} Dh={dh} bf16 on {result['device']}; matmul "
        f"{rate / 1e12:.0f} TFLOP/s, floor {result['floor_ms']:.3f} ms"
    )
    print(f"{'variant':<34} {'ms':>7} {'eager':>7} {'TFLOP/s':>8} {'/floor':>7} {'max err':>9} {'rel err':>9}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<34} error: {r['error'][:80]}")
            continue
        print(
            f"{name:<34} {r['ms']:7.3f} {r['eager_ms']:7.3f} {r['tflops']:8.0f} {r['floor_ratio']:7.2f} "
            f"{r['max_abs_err']:9.2e} {r['rel_err']:9.2e}"
        )


if __name__ == "__main__":
    main()
