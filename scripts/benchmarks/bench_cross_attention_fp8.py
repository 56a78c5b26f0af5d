"""Benchmark: the FP8 audio cross-attention kernels against the four steps they replace, at the 57b rank's shapes.

`kernels.cross_attention_fp8_triton` against `AudioCrossAttention.forward`'s steps without it (two compiled
per-head RMSNorms, SDPA, a compiled per-token quantisation), at B=1, nF=1, N=2992 tokens, A=8 audio tokens, Dh=128,
Hh=24 (TP3) and 18 (TP4), bf16.

    python scripts/benchmarks/bench_cross_attention_fp8.py --out benchmarks/h200/cross_attention_fp8.json

us per call from replays of a CUDA graph of 20 calls (the step replays a graph: no launch overhead), for each
(block_t, num_warps), beside the bytes' floor at 4.8 TB/s (q and kv read once, e4m3 values and
scales written once). Each path's error against `cross_attention_fp8_ref`: the largest dequantised difference over
its row's amax, and the share of e4m3 codes that differ. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from characters.dit import ElementwiseOps
from kernels.cross_attention_fp8 import BLOCK_T, NUM_WARPS, cross_attention_fp8_ref, cross_attention_fp8_triton
from scripts.benchmarks import results
from scripts.benchmarks.bench_row_quant import graph_us

SHAPES: list[tuple[int, int, int, int, int, int]] = [(1, 1, 2992, 8, 24, 128), (1, 1, 2992, 8, 18, 128)]
CONFIGS: list[tuple[int, int]] = list(itertools.product((32, 64, 128), (4, 8)))  # (block_t, num_warps)
HBM_BYTES_PER_S = 4.8e12
EPS = 1e-6


def todays_path(ops: ElementwiseOps, q: torch.Tensor, kv: torch.Tensor, qw: torch.Tensor, kw: torch.Tensor,
                hh: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`AudioCrossAttention.forward`'s FP8 path after its q and kv linear layers."""
    b, t, width = q.shape
    nf, a, dh = kv.shape[1], kv.shape[2], width // hh
    kv = kv.view(b * nf, a, 2, hh, dh)  # (B*nF, A, 2, Hh, Dh)
    qn = ops.head_norm(q.view(b * nf, t // nf, hh, dh), qw, EPS)  # (B*nF, N, Hh, Dh)
    k = ops.head_norm(kv[:, :, 0], kw, EPS)  # (B*nF, A, Hh, Dh)
    out = F.scaled_dot_product_attention(qn.transpose(1, 2), k.transpose(1, 2), kv[:, :, 1].transpose(1, 2))
    act = ops.quant(out.transpose(1, 2).reshape(b, t, -1))  # (B, T, Hh*Dh)
    return act.data, act.scale


def errors(got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    """Largest |dequantised difference| over the reference row's amax; share of differing e4m3 codes."""
    deq_got, deq_ref = got[0].float() * got[1], ref[0].float() * ref[1]  # (B, T, Hh*Dh)
    amax = ref[1] * 448.0  # (B, T, 1)
    return {"max_err_over_row_amax": ((deq_got - deq_ref).abs() / amax).max().item(),
            "codes_differing": (got[0].view(torch.uint8) != ref[0].view(torch.uint8)).float().mean().item()}


def probe(b: int, nf: int, n: int, a: int, hh: int, dh: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(hh)
    q = torch.randn(b, nf * n, hh * dh, device="cuda", generator=g, dtype=torch.bfloat16)  # (B, T, Hh*Dh)
    kv = torch.randn(b, nf, a, 2 * hh * dh, device="cuda", generator=g, dtype=torch.bfloat16)  # (B, nF, A, 2*Hh*Dh)
    qw, kw = (1.0 + 0.1 * torch.randn(dh, device="cuda", generator=g, dtype=torch.bfloat16) for _ in "qk")
    ref = cross_attention_fp8_ref(q, kv, qw, kw, EPS, heads=hh)
    ops = ElementwiseOps(True, fp8=True)
    moved = q.numel() * q.element_size() + kv.numel() * kv.element_size() + q.numel() + b * nf * n * 4
    row: dict[str, Any] = {"b": b, "nf": nf, "n": n, "a": a, "heads": hh, "dh": dh,
                           "floor_us": moved / HBM_BYTES_PER_S * 1e6,
                           "today_us": graph_us(lambda: todays_path(ops, q, kv, qw, kw, hh)),
                           "today_err": errors(todays_path(ops, q, kv, qw, kw, hh), ref),
                           "default_config": [BLOCK_T, NUM_WARPS],
                           "default_us": graph_us(lambda: cross_attention_fp8_triton(q, kv, qw, kw, EPS, heads=hh)),
                           "fused_err": errors(cross_attention_fp8_triton(q, kv, qw, kw, EPS, heads=hh), ref),
                           "fused": []}
    for bt, w in CONFIGS:
        def call(bt: int = bt, w: int = w) -> tuple[torch.Tensor, torch.Tensor]:
            return cross_attention_fp8_triton(q, kv, qw, kw, EPS, heads=hh, block_t=bt, num_warps=w)
        row["fused"].append({"block_t": bt, "num_warps": w, "us": graph_us(call), **errors(call(), ref)})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/<this GPU>/cross_attention_fp8.json")
    args = ap.parse_args()
    rows = [probe(*shape) for shape in SHAPES]
    for r in rows:
        print(f"\nB={r['b']} nF={r['nf']} N={r['n']} A={r['a']} Hh={r['heads']} Dh={r['dh']}: floor "
              f"{r['floor_us']:.1f} us, today {r['today_us']:.1f} us "
              f"(err {r['today_err']['max_err_over_row_amax']:.2e}),"
              f" fused default {tuple(r['default_config'])} {r['default_us']:.1f} us "
              f"(err {r['fused_err']['max_err_over_row_amax']:.2e}, codes differing "
              f"{r['fused_err']['codes_differing']:.2e})")
        print(f"{'block_t':>8}{'warps':>7}{'us':>9}{'x floor':>9}{'err/amax':>11}{'codes':>10}")
        for c in sorted(r["fused"], key=lambda c: c["us"]):
            print(f"{c['block_t']:>8}{c['num_warps']:>7}{c['us']:>9.1f}"
                  f"{c['us'] / r['floor_us']:>9.2f}{c['max_err_over_row_amax']:>11.2e}{c['codes_differing']:>10.2e}")
    out = args.out or results.default_path("cross_attention_fp8")
    results.record(out, {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                         "torch": torch.__version__, "triton": _triton_version(),
                         "unit": "us per call, in a CUDA graph", "rows": rows})
    print(f"-> {out}")


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


if __name__ == "__main__":
    main()
