"""Benchmark: NCCL collectives at the tensor-parallel message sizes, eager and replayed from a CUDA graph.

    python scripts/benchmarks/bench_collectives.py --ranks 2 --device cuda          # nvidia-h200-x2 and up
    python scripts/benchmarks/bench_collectives.py --ranks 2                        # gloo on the CPU (small sizes)

The DiT's tensor parallelism moves one chunk's residual stream, T x D (57b: 2992 x 9216 bf16 = 55 MB),
three times per layer: as an all-reduce (replicated tokens) or as an all-gather plus a reduce-scatter
(sequence parallelism; the same bytes). This times each collective alone at that size and reports
algorithm and bus bandwidth (NCCL's definitions: busbw = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for
all-gather and reduce-scatter), so the per-byte cost of the two layouts can be compared directly.
Writes JSON from rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from characters.process_group import join, leave
from scripts.benchmarks import results
from scripts.benchmarks.common import device_ms, env_info, spawn_ranks, timed


def rank_main(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    n = args.ranks
    join("nccl" if cuda else "gloo", port, rank, n, device=device if cuda else None)
    done = False
    try:
        dtype = torch.bfloat16 if cuda else torch.float32
        rows, width = args.tokens, args.dim
        m = -(-rows // n)
        whole = torch.randn(n * m, width, device=device, dtype=dtype)  # (n*m, D)
        part = torch.randn(m, width, device=device, dtype=dtype)  # (m, D)
        size = whole.numel() * whole.element_size()
        ops: dict[str, tuple[Callable[[], object], float]] = {
            "all_reduce": (lambda: dist.all_reduce(whole), 2 * (n - 1) / n),
            "all_gather": (lambda: dist.all_gather_into_tensor(whole, part), (n - 1) / n),
            "reduce_scatter": (lambda: dist.reduce_scatter_tensor(part, whole), (n - 1) / n),
        }
        result: dict[str, dict[str, float]] = {}
        for name, (fn, factor) in ops.items():
            eager = statistics.median(timed(fn, device, args.iters, warmup=3))
            row = {"eager_ms": eager}
            if cuda:  # captured in a CUDA graph, as the step runs them
                row["graph_ms"] = device_ms(fn, device, argparse.Namespace(iters=args.iters, warmup=2))
            best = min(row.values())
            row["algbw_GBps"] = size / best / 1e6
            row["busbw_GBps"] = row["algbw_GBps"] * factor
            result[name] = row
            dist.barrier()
        if rank == 0:
            Path(out).write_text(json.dumps({
                "command": " ".join(["python", *sys.argv]), **env_info(device), "ranks": n,
                "backend": "nccl" if cuda else "gloo", "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                "tensor": {"rows": n * m, "dim": width, "dtype": str(dtype), "bytes": size}, "ops": result}, indent=1))
        done = True
    finally:
        leave(wait=done)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=2992)
    p.add_argument("--dim", type=int, default=9216)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out = Path(args.out or results.default_path(f"collectives_{args.ranks}_{args.device}", args.device))
    r = spawn_ranks(rank_main, args)
    results.record(out, r)
    print(f"{r['ranks']} ranks over {r['backend']}, {r['device']}, {r['tensor']}")
    print(f"{'op':<15} {'eager ms':>9} {'graph ms':>9} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    for name, row in r["ops"].items():
        print(f"{name:<15} {row['eager_ms']:>9.3f} {row.get('graph_ms', float('nan')):>9.3f} "
              f"{row['algbw_GBps']:>11.1f} {row['busbw_GBps']:>11.1f}")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
