"""Where one DiT rank's chunk step spends device time, by kernel family (torch.profiler, eager step).

    python scripts/benchmarks/profile_step.py --preset 57b --topology h100x5 --device cuda

Families: GEMM (cuBLAS/CUTLASS), attention (cuDNN/flash/SDPA), cache write (qkv_prep), fused
elementwise (Inductor's Triton kernels), other elementwise/copies. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from characters.config import TOPOLOGIES, session_config
from characters.engine import DiTRunner
from scripts.benchmarks import results
from scripts.benchmarks.common import env_info

FAMILIES = (
    ("cache write", ("qkv_prep",)),
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("gemm", ("gemm", "cutlass", "xmma", "sm90_", "nvjet", "cublas")),
    ("fused elementwise", ("triton_",)),
)


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other elementwise/copy"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="57b")
    p.add_argument("--topology", default="h100x5")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--shapes", action="store_true", help="also list the top aten ops by device time with input shapes")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="profile the sequence-parallel rank (default: the topology's setting)")
    args = p.parse_args()
    device = torch.device(args.device)
    topo = TOPOLOGIES[args.topology]
    if args.sequence_parallel:
        topo = topo.model_copy(update={"sequence_parallel": True})
    cfg = session_config(args.preset, topo.model_dump(), dtype="bfloat16" if device.type == "cuda" else "float32")
    runner = DiTRunner(cfg, device=device, ranks=cfg.topology.dit_ranks, communicate=False)
    h, w = cfg.model.latent_hw
    runner.start(torch.randn(1, cfg.model.dit.latent_channels, h, w, device=device))
    windows = runner.frontend.push(np.zeros(runner.frontend.expected_samples, dtype=np.float32)).copy()
    for _ in range(cfg.model.generation.ring_slots + 1):  # steady state, kernels compiled
        runner.step_windows(windows)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, record_shapes=args.shapes) as prof:
        for _ in range(args.steps):
            runner.step_windows(windows)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    totals: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        us = ev.device_time_total if device.type == "cuda" else ev.cpu_time_total
        if device.type == "cuda" and ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        totals[family(ev.key)] += us / args.steps / 1e3
        top[ev.key] += us / args.steps / 1e3
    total = sum(totals.values())
    ops: dict[str, float] = {}
    if args.shapes:  # which op (and on which shapes) launched the time: aten ops, device time included
        for ev in prof.key_averages(group_by_input_shape=True):
            if ev.device_type == torch.autograd.DeviceType.CPU and ev.key.startswith("aten::") and ev.device_time_total:
                ops[f"{ev.key} {ev.input_shapes} x{ev.count // args.steps}"] = ev.device_time_total / args.steps / 1e3
    result = {"command": " ".join(["python", *sys.argv]), **env_info(device), "preset": args.preset,
              "topology": args.topology, "ms_per_chunk_by_family": dict(totals), "ms_total": total,
              "top_kernels_ms": dict(sorted(top.items(), key=lambda kv: -kv[1])[:25]),
              **({"top_ops_ms": dict(sorted(ops.items(), key=lambda kv: -kv[1])[:30])} if ops else {})}
    out = Path(args.out or results.default_path(f"profile_{args.preset}_{args.topology}"))
    out.parent.mkdir(parents=True, exist_ok=True)
    results.record(out, result)
    print(f"{'family':<24} {'ms/chunk':>9} {'share':>6}")
    for fam, ms in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"{fam:<24} {ms:>9.2f} {100 * ms / total:>5.1f}%")
    print(f"{'total kernel time':<24} {total:>9.2f}")
    for name, ms in list(result["top_kernels_ms"].items())[:12]:
        print(f"  {ms:8.2f}  {name[:100]}")
    for name, ms in list(ops.items() and result["top_ops_ms"].items())[:20]:
        print(f"  {ms:8.2f}  {name[:160]}")


if __name__ == "__main__":
    main()
