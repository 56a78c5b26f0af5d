"""Benchmark: one session's DiT in tensor parallel over NCCL (gloo on CPU), with and without its collectives.

    python scripts/benchmarks/bench_tp.py --preset 57b --ranks 2 --device cuda     # needs 2 GPUs (nvidia-h200-x2)
    python scripts/benchmarks/bench_tp.py --preset tiny --ranks 2                  # gloo on the CPU

One process per rank (torch.multiprocessing), each on its own GPU, the model built with exactly that
rank's share (seeded, TP-invariant init). Per rank, in turn (CUDA graphs on GPUs):
- ``replicated``: no sequence parallelism, an all-reduce after each row-parallel layer;
- ``sp_none``: sequence parallel, NCCL's all-gather / reduce-scatter next to the GEMMs;
- ``sp_ring``: sequence parallel, the collectives decomposed into ring steps overlapped with the GEMMs;
- ``sp_symm_mem``: sequence parallel, PyTorch's fused all-gather+matmul / matmul+reduce-scatter (symmetric memory);
- ``sp_left_out``: sequence parallel with the collectives left out (`communicate=False`): compute alone;
- ``sp_local`` / ``sp_local_left_out``: sequence parallel with the token-local layers whole
  (`topology.local_layers`: only self-attention communicates), with and without its collectives;
- ``sp_kv`` / ``sp_kv_left_out``: self-attention whole too (`topology.local_attention`: one gather of the K/V rows
  a block), with and without it.
Exposed communication of a variant = its time minus ``sp_left_out`` (for ``replicated``, ``sp_local`` and ``sp_kv``,
minus its own left-out twin: every token's elementwise work, the whole layers' GEMM shapes). The floor is the
rank's FLOPs at the bf16 matmul rate measured on its GPU. Writes JSON from rank 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from characters.config import session_config
from characters.engine import DiTRunner
from characters.flops import chunk_cost
from characters.process_group import join, leave
from scripts.benchmarks import results
from scripts.benchmarks.common import env_info, matmul_rate, spawn_ranks, timed

# variant -> (sequence parallel, overlap, communicate, token-local layers whole, self-attention whole)
VARIANTS: dict[str, tuple[bool, str, bool, bool, bool]] = {
    "sp_left_out": (True, "none", False, False, False),
    "sp_none": (True, "none", True, False, False),
    "sp_ring": (True, "ring", True, False, False),
    "sp_symm_mem": (True, "symm_mem", True, False, False),
    "sp_local": (True, "none", True, True, False),
    "sp_local_left_out": (True, "none", False, True, False),
    "sp_kv": (True, "none", True, True, True),
    "sp_kv_left_out": (True, "none", False, True, True),
    "replicated": (False, "none", True, False, False),
    "replicated_left_out": (False, "none", False, False, False),
}
TWINS = {"replicated": "replicated_left_out", "sp_local": "sp_local_left_out",
         "sp_kv": "sp_kv_left_out"}  # else sp_left_out


def step_ms(runner: DiTRunner, device: torch.device, iters: int, graphs: bool,
            profile_steps: int = 0) -> tuple[list[float], dict[str, float]]:
    """Step times (ms), and with `profile_steps` the device time per chunk of the top kernels over that
    many more steps (every rank runs them, so the collectives pair up)."""
    if graphs:
        runner.capture_graphs()
    h, w = runner.cfg.model.latent_hw
    runner.start(torch.zeros(1, runner.cfg.model.dit.latent_channels, h, w, device=device))
    windows = runner.frontend.push(np.zeros(runner.frontend.expected_samples, dtype=np.float32)).copy()
    for _ in range(runner.cfg.model.generation.ring_slots):  # steady state: the full context
        runner.step_windows(windows)
    times = timed(lambda: runner.step_windows(windows), device, iters, warmup=2)
    if not profile_steps:
        return times, {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU]) as prof:
        for _ in range(profile_steps):
            runner.step_windows(windows)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    per_kernel = {ev.key: ev.device_time_total / 1e3 / profile_steps for ev in prof.key_averages()
                  if ev.device_time_total > 0}
    return times, dict(sorted(per_kernel.items(), key=lambda kv: -kv[1])[:25])


def rank_main(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (device README)
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # also for the symmetric-memory ops
    join("nccl" if cuda else "gloo", port, rank, args.ranks, device=device if cuda else None)
    done = False
    try:
        rows: dict[str, Any] = {}
        for name in args.variants.split(","):
            sp, overlap, communicate, local, attention = VARIANTS[name]
            topo = {"name": f"tp{args.ranks}", "dit_ranks": args.ranks, "decoder_gpus": 0, "sequence_parallel": sp,
                    "tp_overlap": overlap, "local_layers": local, "local_attention": attention}
            cfg = session_config(args.preset, topo, dtype="bfloat16" if cuda else "float32")
            runner = DiTRunner(cfg, device=device, group=dist.group.WORLD, rank=rank, ranks=args.ranks,
                               communicate=communicate)
            times, kernels = step_ms(runner, device, args.iters, graphs=cuda and not args.no_graphs,
                                     profile_steps=2 if name in args.profile.split(",") else 0)
            rows[name] = {"ms_p50": statistics.median(times), "ms_min": min(times), "ms_max": max(times)}
            if kernels:
                rows[name]["top_kernels_ms_per_chunk"] = kernels
            del runner
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            dist.barrier()
        if rank == 0:
            rate = matmul_rate(device, torch.bfloat16 if cuda else torch.float32)
            cost = chunk_cost(cfg)
            compute = rows.get("sp_left_out", {}).get("ms_p50")
            for name, row in rows.items():
                base = rows.get(TWINS[name], {}).get("ms_p50") if name in TWINS else compute
                if VARIANTS[name][2] and base is not None:
                    row["exposed_communication_ms"] = row["ms_p50"] - base
                    row["exposed_communication_share"] = row["exposed_communication_ms"] / row["ms_p50"]
            result = {"command": " ".join(["python", *sys.argv]), **env_info(device), "preset": args.preset,
                      "ranks": args.ranks, "backend": "nccl" if cuda else "gloo", "graphs": cuda and not args.no_graphs,
                      "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"), "rows": rows,
                      "floor_ms": cost.flops_per_chunk_per_rank / rate * 1e3, "matmul_tflops": rate / 1e12,
                      "reference_ms": {"4xH100 fused (DESIGN.md)": 147.4, "4xH100 unfused": 159.3, "3xB200": 154.3}}
            Path(out).write_text(json.dumps(result, indent=1))
        done = True
    finally:
        leave(wait=done)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--profile", default="", help="comma-separated variants to profile (top kernels per chunk)")
    p.add_argument("--variants", default="sp_left_out,sp_none,sp_ring,replicated",
                   help=f"comma-separated, of {list(VARIANTS)}")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out = Path(args.out or results.default_path(f"tp_{args.preset}_{args.ranks}", args.device))
    r = spawn_ranks(rank_main, args)
    results.record(out, r)
    print(f"{args.preset}, {args.ranks} ranks over {r['backend']}, {r['device']}")
    print(f"{'variant':<20} {'ms/chunk':>9} {'floor':>7} {'ratio':>6} {'exposed comm ms':>16}")
    for name, row in r["rows"].items():
        comm = row.get("exposed_communication_ms")
        comm_s = "" if comm is None else f"{comm:.2f} ({100 * row['exposed_communication_share']:.1f}%)"
        print(f"{name:<20} {row['ms_p50']:9.2f} {r['floor_ms']:7.2f} {row['ms_p50'] / r['floor_ms']:6.2f} {comm_s:>16}")
    for name, row in r["rows"].items():
        for kernel, ms in list(row.get("top_kernels_ms_per_chunk", {}).items())[:12]:
            print(f"  {name:<12} {ms:8.2f} ms  {kernel[:100]}")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
