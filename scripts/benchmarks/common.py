"""What the benchmark scripts share: the machine a number was measured on, timing on CPU and CUDA (events, CUDA-graph
replays), the matmul rate a floor is computed at, and the config of one DiT rank. Results are written through
`scripts.benchmarks.results`."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from characters.config import TOPOLOGIES, TopologyConfig, session_config
from characters.process_group import free_port

TOPOLOGY_FOR_RANKS = {1: "gpu1", 2: "b200x3", 3: "h100x4", 4: "h100x5"}


def env_info(device: torch.device) -> dict[str, str]:
    """What the numbers were measured on: device, driver, torch and Triton versions."""
    info = {"torch": torch.__version__, "device": platform.processor() or "cpu",
            "threads": str(torch.get_num_threads())}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "not installed"
    if device.type == "cuda":
        info["device"] = torch.cuda.get_device_name(device)
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=10).stdout.split()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            info["driver"] = "unknown"
    return info


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, iters: int, warmup: int) -> list[float]:  # type: ignore[no-untyped-def]
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def matmul_rate(device: torch.device, dtype: torch.dtype, trials: int = 5) -> float:
    """The matmul rate the floor is computed at: the best of `trials` medians of a square GEMM (8192 on
    CUDA). The best, not a typical run: one median alone wandered 731..793 TFLOP/s between runs on
    the H200 (clocks, power), and a lower rate would flatter the step's ratio to its floor."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    iters = 10 if device.type == "cuda" else 5
    ms = min(statistics.median(timed(lambda: a @ b, device, iters=iters, warmup=3)) for _ in range(trials))
    return 2 * n**3 / (ms / 1e3)


def device_ms(fn: Callable[[], object], device: torch.device, args: argparse.Namespace, reps: int = 10) -> float:
    """ms per call of `fn`. On CUDA `reps` calls are captured in one graph and the replays timed, so host
    launch gaps (absent from the graph-replayed step) do not count; elsewhere plain wall time."""
    if device.type != "cuda":
        return statistics.median(timed(fn, device, args.iters, args.warmup))
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return statistics.median(timed(graph.replay, device, args.iters, args.warmup)) / reps



def rank_config(preset: str, ranks: int, layout: str, precision: str, attention: str, layers: int | None = None,
                dtype: str = "bfloat16") -> Any:
    """The session config of one DiT rank of a `ranks`-way session: layout `sp`, `spl`, `spa` or `rep`, precision
    and attention as `bench_fp8.py steps` names them (`bf16`, `fp8`, `fp8-triton`, `fp8-cudnn`)."""
    if layout not in ("sp", "spl", "spa", "rep"):
        raise ValueError(f"layout {layout!r}: expected sp, spl, spa or rep")
    topo: TopologyConfig = TOPOLOGIES[TOPOLOGY_FOR_RANKS[ranks]].model_copy(
        update={"sequence_parallel": layout != "rep" and ranks > 1,
                "local_layers": layout in ("spl", "spa") and ranks > 1,
                "local_attention": layout == "spa" and ranks > 1})
    precision_a, _, kernel = attention.partition("-")  # "fp8-cudnn" / "fp8-triton": the FP8 attention kernel
    if precision_a not in ("bf16", "fp8") or kernel not in ("", "triton", "cudnn") or (kernel and precision_a != "fp8"):
        raise ValueError(f"attention {attention!r}: expected bf16, fp8, fp8-triton or fp8-cudnn")
    model: dict[str, Any] = {"precision": precision, "attention_precision": precision_a,
                             "attention_fp8_kernel": kernel or "auto"}
    if layers:
        model["dit"] = {"num_layers": layers}
    return session_config(preset, topo.model_dump(), dtype=dtype, weights="random", model=model)


def spawn_ranks(fn: Callable[[int, argparse.Namespace, int, str], None], args: argparse.Namespace) -> dict[str, Any]:
    """Run `fn(rank, args, port, out)` in `args.ranks` processes (one GPU each on CUDA) and return the JSON that
    rank 0 wrote to `out` (a temporary file; the caller records the result)."""
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        sys.exit(f"--ranks {args.ranks} needs {args.ranks} GPUs; this machine has {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        mp.spawn(fn, args=(args, free_port(), str(out)), nprocs=args.ranks, join=True)
        result: dict[str, Any] = json.loads(out.read_text())
    return result
