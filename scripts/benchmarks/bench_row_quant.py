"""Benchmark: `kernels.row_quant`'s single-pass row kernels against Inductor's compiled FP8 steps, at the 57b rank's
shapes (TP3 sequence parallel: 998 rows of 9216 for the norms, the GELU over 2992 x 8192; TP4: 748 and 6144; with
`topology.local_layers` the GELU over the rank's rows at the whole width, 998 and 748 x 24576).

    python scripts/benchmarks/bench_row_quant.py --out benchmarks/h200/row_quant.json

us per call from replays of a CUDA graph of 20 calls (the step replays a graph: no launch overhead), for each
num_warps, beside the bytes' floor at 4.8 TB/s (inputs read once, outputs written once). Prints a table, writes
JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from characters.dit import ElementwiseOps
from kernels.row_quant import Mode, row_quant_triton
from scripts.benchmarks import results

SHAPES: list[tuple[str, int, int]] = [("add_modulate", 998, 9216), ("gated_add_norm", 998, 9216),
                                      ("modulate", 998, 9216), ("gelu", 2992, 8192), ("add_modulate", 748, 9216),
                                      ("gelu", 2992, 6144), ("gated_add_modulate", 998, 9216),
                                      ("gelu", 998, 24576), ("gelu", 748, 24576)]  # the last two: local_layers
WARPS = (4, 8, 16, 32)
HBM_BYTES_PER_S = 4.8e12


def graph_us(fn: Callable[[], object], calls: int = 20, reps: int = 10) -> float:
    """Median us per call over `reps` replays of a CUDA graph of `calls` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and autotune outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def probe(mode: Mode, rows: int, d: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(rows + d)
    x, y = (torch.randn(1, rows, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in "xy")
    mod = 0.1 * torch.randn(1, 1, 6, d, device="cuda", generator=g, dtype=torch.bfloat16)  # the block's rows: views
    w, b = (torch.randn(d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in "wb")
    kw: dict[str, Any] = {"modulate": {"shift": mod[:, :, 0], "scale": mod[:, :, 1]},
                          "add_modulate": {"y": y, "shift": mod[:, :, 0], "scale": mod[:, :, 1]},
                          "gated_add_norm": {"y": y, "gate": mod[:, :, 2], "weight": w, "bias": b}, "gelu": {},
                          "gated_add_modulate": {"y": y, "gate": mod[:, :, 5], "shift": mod[:, :, 0],
                                                 "scale": mod[:, :, 1]}}[mode]
    ops = ElementwiseOps(True, fp8=True, row_kernels=False)
    compiled: Callable[[], object] = {
        "modulate": lambda: ops.modulate(x, mod[:, :, 0], mod[:, :, 1], 1e-6),
        "add_modulate": lambda: ops.add_modulate(x, y, mod[:, :, 0], mod[:, :, 1], 1e-6),
        "gated_add_norm": lambda: ops.gated_add_norm(x, y, mod[:, :, 2], w, b, 1e-6),
        "gelu": lambda: ops.gelu(x),
        "gated_add_modulate": lambda: ops.gated_add_modulate(x, y, mod[:, :, 5], mod[:, :, 0], mod[:, :, 1],
                                                             1e-6)}[mode]
    row: dict[str, Any] = {"mode": mode, "rows": rows, "d": d, "inductor_us": graph_us(compiled)}
    for warps in WARPS:
        row[f"row_kernel_w{warps}_us"] = graph_us(lambda n=warps: row_quant_triton(mode, x, num_warps=n, **kw))
    row["row_kernel_default_us"] = graph_us(lambda: row_quant_triton(mode, x, **kw))
    residual = mode in ("add_modulate", "gated_add_norm", "gated_add_modulate")
    moved = x.numel() * (2 * (2 if residual else 1) + (2 if residual else 0) + 1) + rows * 4  # bf16 in/out, e4m3
    row["floor_us"] = moved / HBM_BYTES_PER_S * 1e6
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/<this GPU>/row_quant.json")
    args = ap.parse_args()
    rows = [probe(mode, m, d) for mode, m, d in SHAPES]  # type: ignore[arg-type]
    print(f"{'step':<28}{'inductor':>9}" + "".join(f"{'w' + str(w):>8}" for w in WARPS) + f"{'default':>9}{'floor':>8}")
    for r in rows:
        print(f"{r['mode'] + ' ' + str(r['rows']) + 'x' + str(r['d']):<28}{r['inductor_us']:>9.1f}"
              + "".join(f"{r[f'row_kernel_w{w}_us']:>8.1f}" for w in WARPS)
              + f"{r['row_kernel_default_us']:>9.1f}{r['floor_us']:>8.1f}")
    out = args.out or results.default_path("row_quant")
    results.record(out, {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                         "torch": torch.__version__, "unit": "us per call, in a CUDA graph", "rows": rows})
    print(f"-> {out}")


if __name__ == "__main__":
    main()
