"""The DiT step in parts (`topology.step_groups`): what the parts cost, and how long a speech onset waits when the
DiT gives the idle chunk in flight up for it (`DiTWorker.preempt`).

    python scripts/benchmarks/bench_preempt.py --preset 57b --ranks 3 --layout spl --groups 1,8,16 \
        --out benchmarks/h200/preempt_57b_tp3.json
    python scripts/benchmarks/bench_preempt.py --preset tiny --device cpu --groups 1,4 --out /tmp/preempt_tiny_cpu.json

One rank's share (`bench_fp8.py`'s rank: its FLOPs, not its collectives), its step captured as CUDA graphs
(one per part) on CUDA, eager on a CPU. Per group count, after the cache's ring is full:

  * `step_ms`: the step without a stop (every part's graph replayed back to back): the cost of the parts;
  * `paced_ms`: the step as an idle chunk runs it (a stop asked between parts, each part queued behind the one
    running: `DiTRunner.step`'s `stop`), never stopping: the cost of pacing the parts from the host;
  * `wait_ms`: a stop that turns True `offset` after the step began (offsets spread evenly over the step, as speech
    arriving at a random time while the DiT is busy), to the device free for the onset: the wait an onset has
    instead of the rest of the step (without parts, `step - offset`: `wait_whole_ms`).

Prints a table, writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from characters.config import TOPOLOGIES, session_config
from characters.engine import DiTRunner
from scripts.benchmarks import results
from scripts.benchmarks.common import rank_config, timed


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(runner: DiTRunner, windows: np.ndarray, device: torch.device, iters: int, trials: int) -> dict[str, Any]:
    step = timed(lambda: runner.step_windows(windows), device, iters, 2)
    paced = timed(lambda: runner.step_windows(windows, stop=lambda: False), device, iters, 2)
    step_ms = statistics.median(step)
    waits, whole, given_up = [], [], 0
    for i in range(trials):
        offset = step_ms * (i + 0.5) / trials / 1e3
        sync(device)
        t0 = time.perf_counter()
        out = runner.step_windows(windows, stop=lambda: time.perf_counter() - t0 >= offset)  # noqa: B023
        sync(device)  # the device is free for the onset
        waits.append(max(0.0, time.perf_counter() - t0 - offset) * 1e3)  # (done before the offset: no wait)
        whole.append(step_ms - offset * 1e3)
        given_up += out is None
    return {"step_ms": step_ms, "paced_ms": statistics.median(paced), "wait_ms_p50": statistics.median(waits),
            "wait_ms_max": max(waits), "wait_whole_ms_p50": statistics.median(whole), "given_up": given_up,
            "trials": trials, "parts": len(next(iter(runner.graphs.values()))) if runner.graphs else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="57b")
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--layout", default="spl", choices=["sp", "spl", "spa", "rep"])
    p.add_argument("--precision", default="fp8")
    p.add_argument("--attention", default="fp8-cudnn")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--groups", default="1,8,16")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        cfg = rank_config(args.preset, args.ranks, args.layout, args.precision, args.attention, args.layers)
        runner = DiTRunner(cfg, device=device, rank=0, ranks=args.ranks, communicate=False)
    else:
        cfg = session_config(args.preset, TOPOLOGIES["cpu"].model_dump(), weights="random")
        runner = DiTRunner(cfg, device=device)
    h, w = cfg.model.latent_hw
    rows = []
    for groups in (int(g) for g in args.groups.split(",")):
        runner.groups = groups
        if device.type == "cuda":
            runner.capture_graphs()
        runner.start(torch.randn(1, cfg.model.dit.latent_channels, h, w, device=device))
        windows = runner.frontend.push(np.zeros(runner.frontend.expected_samples, dtype=np.float32))
        for _ in range(cfg.model.generation.ring_slots):  # the ring full: every timed chunk sees the whole context
            runner.step_windows(windows)
        rows.append({"groups": groups, **measure(runner, windows, device, args.iters, args.trials)})
        print(json.dumps(rows[-1]), flush=True)
    result = {"command": " ".join(["python", *sys.argv]), "preset": args.preset, "ranks": args.ranks,
              "layout": args.layout, "precision": args.precision, "attention": args.attention,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    results.record(args.out, result)
    print(f"{'groups':>7}{'parts':>6}{'step ms':>9}{'paced ms':>10}{'wait p50':>10}{'max':>8}{'whole p50':>10}")
    for r in rows:
        print(f"{r['groups']:>7}{r['parts'] or '-':>6}{r['step_ms']:>9.1f}{r['paced_ms']:>10.1f}"
              f"{r['wait_ms_p50']:>10.1f}{r['wait_ms_max']:>8.1f}{r['wait_whole_ms_p50']:>10.1f}")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
