"""The DiT ranks' agreement to give an idle chunk up (`DiTWorker._agree`): one all-reduce of a flag over the ranks'
host-side gloo group between two parts of the step (`topology.step_groups`), what it costs the host.

    python scripts/benchmarks/bench_agree.py --ranks 2,3,4 --out benchmarks/cpu/agree.json

Each rank is a process that joins as a DiT worker does (`characters.process_group.join`, then the `signals` group
beside it) and calls the worker's own `_agree`. Per rank count:

  * `back_to_back_us`: calls one after the other, every rank at once: the call's own latency;
  * `paced_us`: each rank waits a part (`--part-ms`, the 57b rank's 16th of a step: on a GPU the host waits for the
    part it queued anyway) and a random skew (`--skew-ms`: the ranks' hosts never reach a part at the same instant)
    before each call; per call, the last rank out less the last rank in: what the agreement adds to the host's time
    beyond the slowest rank. The GPU idles only when that exceeds the part queued behind the running one.

Every call also checks the agreement: one rank (in turn) says yes on every 10th call, and every rank must hear it.
Prints a table, writes JSON to --out.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from characters.cpu import cpu_model
from scripts.benchmarks import results

YES_EVERY = 10  # one call in this many, one rank (in turn) was asked to give the chunk up


def _rank(rank: int, ranks: int, port: int, calls: int, part_ms: float, skew_ms: float, out: Any) -> None:
    import torch.distributed as dist

    from characters.process_group import join, leave
    from deployments.pipeline.workers import DiTWorker

    join("gloo", port, rank, ranks, timeout_s=60)
    worker = SimpleNamespace(signals=dist.new_group(backend="gloo"))  # as `DiTWorker.init_process_group` makes it
    rng = np.random.default_rng(rank)
    result: dict[str, Any] = {"rank": rank, "wrong": 0}
    for mode, wait_s in (("back_to_back", 0.0), ("paced", part_ms / 1e3)):
        dist.barrier()
        t_in, t_out = np.zeros(calls), np.zeros(calls)
        for i in range(calls):
            if wait_s:
                time.sleep(wait_s + rng.uniform(0, skew_ms / 1e3))
            asked = i % YES_EVERY == 0 and (i // YES_EVERY) % ranks == rank
            t_in[i] = time.perf_counter()  # (CLOCK_MONOTONIC: one clock for every process of the host)
            agreed = DiTWorker._agree(worker, asked)  # type: ignore[arg-type]  # the worker's own method
            t_out[i] = time.perf_counter()
            result["wrong"] += agreed != (i % YES_EVERY == 0)
        result[mode] = (t_in.tolist(), t_out.tolist())
    leave()
    out.put(result)


def measure(ranks: int, calls: int, part_ms: float, skew_ms: float) -> dict[str, Any]:
    from characters.process_group import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, ranks, port, calls, part_ms, skew_ms, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    finally:  # a rank that hangs or dies leaves no process behind
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    row: dict[str, Any] = {"ranks": ranks, "calls": calls, "part_ms": part_ms, "skew_ms": skew_ms,
                           "wrong_answers": sum(r["wrong"] for r in results)}
    for mode in ("back_to_back", "paced"):
        t_in = np.array([r[mode][0] for r in results])  # (ranks, calls)
        t_out = np.array([r[mode][1] for r in results])
        held = (t_out.max(axis=0) - t_in.max(axis=0)) * 1e6  # beyond the last rank's arrival
        row[f"{mode}_us"] = {"p50": float(np.percentile(held, 50)), "p99": float(np.percentile(held, 99)),
                             "max": float(held.max())}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,3,4")
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--part-ms", type=float, default=138.7 / 16,
                    help="the host's wait between calls (default: a 57b rank of 3's step on an H100 over 16 parts)")
    ap.add_argument("--skew-ms", type=float, default=1.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = [measure(int(n), args.calls, args.part_ms, args.skew_ms) for n in args.ranks.split(",")]
    result = {"command": " ".join(["python", *sys.argv]),
              "machine": {"platform": platform.platform(), "cpu": cpu_model(), "cores": len(os.sched_getaffinity(0))},
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    results.record(args.out, result)
    print(f"{'ranks':>5} {'back to back p50 us':>20} {'p99':>8} {'max':>8} {'paced p50 us':>13} {'p99':>8} {'max':>8}"
          f" {'wrong':>6}")
    for r in rows:
        b, p = r["back_to_back_us"], r["paced_us"]
        print(f"{r['ranks']:>5} {b['p50']:>20.0f} {b['p99']:>8.0f} {b['max']:>8.0f} {p['p50']:>13.0f} {p['p99']:>8.0f}"
              f" {p['max']:>8.0f} {r['wrong_answers']:>6}")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
