"""Benchmark: what the ring overlap costs on one GPU: a rank's GEMMs whole vs cut into n token blocks.

    python scripts/benchmarks/bench_gemm_split.py --preset 57b --device cuda      # one H200 is enough
    python scripts/benchmarks/bench_gemm_split.py --preset tiny                   # CPU

The ring-overlapped collectives of sequence parallelism (`characters.tp.TokenShards`, overlap="ring")
run each tensor-parallel GEMM as n GEMMs over ceil(T/n) tokens, so that the peer-to-peer transfer of one
block hides behind the GEMM of another. Smaller GEMMs run below the rate of the whole one; that loss is
what the overlap has to win back from the communication it hides. This times, for n = 2, 3, 4 ranks, one
DiT block's tensor-parallel GEMMs at one rank's shapes (T tokens of one chunk, the rank's 1/n of the
features), whole and in n blocks (each block written in place, as the ring does), by CUDA events, and
reports both per chunk (x layers x forwards). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from characters.config import model_preset
from scripts.benchmarks import results
from scripts.benchmarks.common import env_info, timed


def layer_shapes(preset: str, n: int) -> dict[str, tuple[int, int]]:
    """(K, N) of one block's token GEMMs on one of n ranks: column layers split N, row layers split K."""
    d = model_preset(preset).dit
    return {"qkv": (d.dim, 3 * d.dim // n), "o": (d.dim // n, d.dim), "cross_q": (d.dim, d.dim // n),
            "cross_o": (d.dim // n, d.dim), "fc1": (d.dim, d.ffn_dim // n), "fc2": (d.ffn_dim // n, d.dim)}


def time_layer(t: int, n: int, k: int, nn_: int, device: torch.device, dtype: torch.dtype,
               iters: int) -> tuple[float, float]:
    """Median ms of linear over T tokens whole, and as n in-place GEMMs over ceil(T/n)-token blocks."""
    m = -(-t // n)
    x = torch.randn(n * m, k, device=device, dtype=dtype)  # (n*m, K) padded tokens
    w = torch.randn(nn_, k, device=device, dtype=dtype)
    b = torch.randn(nn_, device=device, dtype=dtype)
    out = torch.empty(n * m, nn_, device=device, dtype=dtype)

    def whole() -> None:
        F.linear(x[:t], w, b)

    def blocks() -> None:
        for c in range(n):
            torch.addmm(b, x[c * m:(c + 1) * m], w.t(), out=out[c * m:(c + 1) * m])

    return (statistics.median(timed(whole, device, iters, warmup=3)),
            statistics.median(timed(blocks, device, iters, warmup=3)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--ranks", default="2,3,4")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = model_preset(args.preset)
    t = model.tokens_per_chunk
    per_chunk = model.dit.num_layers * model.generation.forwards_per_chunk
    rows = []
    for n in (int(r) for r in args.ranks.split(",")):
        for name, (k, nn_) in layer_shapes(args.preset, n).items():
            ms_whole, ms_blocks = time_layer(t, n, k, nn_, device, dtype, args.iters)
            flops = 2 * t * k * nn_
            rows.append({"ranks": n, "layer": name, "K": k, "N": nn_, "tokens": t, "block_tokens": -(-t // n),
                         "ms_whole": ms_whole, "ms_blocks": ms_blocks,
                         "tflops_whole": flops / ms_whole / 1e9, "tflops_blocks": flops / ms_blocks / 1e9})
    summary = {}
    for n in sorted({r["ranks"] for r in rows}):
        mine = [r for r in rows if r["ranks"] == n]
        whole = sum(r["ms_whole"] for r in mine) * per_chunk
        split = sum(r["ms_blocks"] for r in mine) * per_chunk
        summary[str(n)] = {"ms_per_chunk_whole": whole, "ms_per_chunk_blocks": split, "overhead_ms": split - whole}
    result = {"command": " ".join(["python", *sys.argv]), **env_info(device), "preset": args.preset,
              "dtype": str(dtype), "layers_x_forwards": per_chunk, "rows": rows, "per_chunk": summary}
    out = Path(args.out or results.default_path(f"gemm_split_{args.preset}_{device.type}", device.type))
    out.parent.mkdir(parents=True, exist_ok=True)
    results.record(out, result)
    print(f"{'ranks':>5} {'layer':<8} {'K':>6} {'N':>6} {'whole ms':>9} {'blocks ms':>9} "
          f"{'TF/s whole':>10} {'blocks':>7}")
    for r in rows:
        print(f"{r['ranks']:>5} {r['layer']:<8} {r['K']:>6} {r['N']:>6} {r['ms_whole']:>9.3f} {r['ms_blocks']:>9.3f} "
              f"{r['tflops_whole']:>10.1f} {r['tflops_blocks']:>7.1f}")
    for n, s in summary.items():
        print(f"{n} ranks: GEMMs per chunk whole {s['ms_per_chunk_whole']:.2f} ms, in blocks "
              f"{s['ms_per_chunk_blocks']:.2f} ms (+{s['overhead_ms']:.2f}) -> {out}")


if __name__ == "__main__":
    main()
