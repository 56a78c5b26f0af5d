"""Benchmark: ms per chunk of one DiT rank's step (and the decoder), with the FLOP floor beside it.

    python scripts/benchmarks/bench_step.py --preset tiny --topology cpu                    # CPU, 2 cores
    python scripts/benchmarks/bench_step.py --preset 57b --topology h100x5 --device cuda    # one rank of TP4

One rank of a tensor-parallel session is built with exactly that rank's shapes and share of the
weights; the collectives are left out (communication excluded), so the time is one rank's compute.
A mode without suffix measures the rank with sequence parallelism (its 1/n of the token-wise work);
`_replicated` the rank holding every token (the serving default, `TopologyConfig.sequence_parallel`).
The floor is the rank's FLOPs per chunk at the bf16 (GPU) or fp32 (CPU) matmul rate measured in the
same run. Both cache modes (write-time and naive) are timed in one run. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from characters.config import TOPOLOGIES, session_config
from characters.engine import DecoderRunner, DiTRunner
from characters.flops import chunk_cost
from kernels.attention import attention
from scripts.benchmarks import results
from scripts.benchmarks.common import device_ms, env_info, matmul_rate, timed


def bench_mode(args: argparse.Namespace, mode: str, device: torch.device) -> dict[str, float]:
    """mode: write_time | naive, then optional suffixes: `_unfused` for plain (uncompiled) elementwise
    steps, `_replicated` for tensor parallelism without sequence parallelism (every rank runs the
    token-wise work of all tokens)."""
    cache_mode = mode.split("_unfused")[0].split("_replicated")[0]
    topology = TOPOLOGIES[args.topology].model_copy(update={"sequence_parallel": "_replicated" not in mode})
    cfg = session_config(args.preset, topology.model_dump(), dtype=args.dtype,
                         model={"generation": {"cache_mode": cache_mode}})
    ranks = cfg.topology.dit_ranks
    runner = DiTRunner(cfg, device=device, rank=0, ranks=ranks, communicate=False,
                       fuse=device.type == "cuda" and "_unfused" not in mode)
    graphs = device.type == "cuda" and cache_mode == "write_time" and not args.no_graphs
    if graphs:
        runner.capture_graphs()
    h, w = cfg.model.latent_hw
    runner.start(torch.randn(1, cfg.model.dit.latent_channels, h, w, device=device))
    pcm = np.zeros(runner.frontend.expected_samples, dtype=np.float32)
    windows = runner.frontend.push(pcm)
    # fill the ring so every timed chunk attends the full context (steady state)
    for _ in range(cfg.model.generation.ring_slots):
        runner.step_windows(windows)
    times = timed(lambda: runner.step_windows(windows), device, args.iters, args.warmup)
    cache_ms = cache_management_ms(runner, device, args)
    runner.graphs.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"ms_p50": statistics.median(times), "ms_min": min(times), "ms_max": max(times), "graphs": graphs,
            "attention_backend": runner.attention_backend, "sequence_parallel": topology.sequence_parallel,
            "cache_management_ms": cache_ms, "cache_share": cache_ms / statistics.median(times)}


def cache_management_ms(runner: DiTRunner, device: torch.device, args: argparse.Namespace) -> float:
    """Per-chunk cache work of this mode, measured in isolation at the real shapes: one layer's
    `KVCache.attend` minus the bare attention over the same keys, times layers x forwards (device time:
    graph replays on CUDA)."""
    m, cache = runner.cfg.model, runner.cache
    heads = cache.k.shape[2] if cache.mode == "write_time" else cache.k.shape[3]
    dh, t = m.dit.head_dim, cache.chunk_tokens
    qkv = torch.randn(1, t, 3, heads, dh, device=device, dtype=runner.dtype)
    w = torch.ones(dh, device=device)
    cos, sin = runner.rope.chunk(0)
    offset, valid = cache.chunk_offset(cache.ring_slots - 1), cache.chunk_valid(cache.ring_slots - 1)
    # the bare attention reads the same operands in the same layouts as the cached path: a token-major q
    # and the cache's own K/V prefix (write-time), or already-prepared (B, Hh, S, Dh) keys (naive)
    q = torch.randn(1, t, heads, dh, device=device, dtype=runner.dtype).transpose(1, 2)  # (1, Hh, T, Dh)
    if cache.mode == "write_time":
        k, v = cache.k[0][:, :, :valid], cache.v[0][:, :, :valid]
    else:
        k = v = torch.randn(1, heads, valid, dh, device=device, dtype=runner.dtype)
    with torch.inference_mode():
        full = device_ms(lambda: cache.attend(0, qkv, w, w, cos, sin, offset, valid), device, args)
        bare = device_ms(lambda: attention(q, k, v, runner.attention_backend), device, args)
    return max(full - bare, 0.0) * m.dit.num_layers * m.generation.forwards_per_chunk


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--topology", default="cpu")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--modes", default="write_time,naive")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-decoder", action="store_true", help="skip the decoder timing")
    p.add_argument("--no-graphs", action="store_true", help="eager steps on CUDA (no graph capture)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/<machine>/step_<preset>_<topology>.json)")
    args = p.parse_args()
    device = torch.device(args.device)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = session_config(args.preset, args.topology, dtype=args.dtype)
    cost = chunk_cost(cfg)
    rate = matmul_rate(device, getattr(torch, args.dtype))
    floor_ms = cost.flops_per_chunk_per_rank / rate * 1e3
    rows = {mode: bench_mode(args, mode, device) for mode in args.modes.split(",")}
    dec_ms = None
    if not args.no_decoder:
        dec = DecoderRunner(cfg, device=device)
        if device.type == "cuda":
            dec.capture_graph()
        h, w = cfg.model.latent_hw
        z = torch.randn(1, cfg.model.dit.latent_channels, cfg.model.generation.latent_frames_per_chunk, h, w,
                        device=device)
        dec.start()
        dec_ms = statistics.median(timed(lambda: dec.decode(z), device, args.iters, args.warmup))
    result = {
        "command": " ".join(["python", *sys.argv]),
        "preset": args.preset, "topology": args.topology, "ranks": cfg.topology.dit_ranks,
        "communication": "excluded (one rank's share: no all-gather / reduce-scatter / all-reduce)",
        **env_info(device), "dtype": args.dtype,
        "matmul_tflops": rate / 1e12, "flops_per_chunk_per_rank": cost.flops_per_chunk_per_rank,
        "floor_ms": floor_ms, "modes": rows, "decoder_ms_p50": dec_ms,
        "chunk_budget_ms": 1000 * cfg.model.generation.frames_per_chunk / 24,
    }
    out = Path(args.out or results.default_path(f"step_{args.preset}_{args.topology}", device.type))
    out.parent.mkdir(parents=True, exist_ok=True)
    results.record(out, result)
    print(f"{args.preset} / {args.topology}: one rank of {cfg.topology.dit_ranks}, {args.dtype}, {result['device']}")
    print(f"{'mode':<22} {'ms/chunk':>9} {'floor ms':>9} {'ratio':>6} {'cache ms':>9} {'cache %':>8}  attention")
    for mode, r in rows.items():
        print(f"{mode:<22} {r['ms_p50']:>9.2f} {floor_ms:>9.2f} {r['ms_p50'] / floor_ms:>6.2f} "
              f"{r['cache_management_ms']:>9.2f} {100 * r['cache_share']:>7.1f}%  {r['attention_backend']}")
    if dec_ms is not None:
        print(f"{'decoder':<11} {dec_ms:>9.2f}")
    print(f"budget per chunk {result['chunk_budget_ms']:.1f} ms; matmul rate {rate / 1e12:.2f} TFLOP/s; -> {out}")


if __name__ == "__main__":
    main()
