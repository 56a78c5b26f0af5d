"""Stress: how often a 2-rank gloo process aborts at exit, with the group joined through
characters.process_group or plainly (the order of imports that aborted CI).

    python scripts/tools/stress_process_group.py --runs 150 --join process_group
    python scripts/tools/stress_process_group.py --runs 60 --join plain

Each run spawns 2 ranks that join a gloo group, import torch._dynamo (as the first meta-device op of a
DiTRunner does), all-reduce 50 times and leave. `plain` is init_process_group/destroy_process_group with
nothing imported first: torch._dynamo then imports torch.distributed.nn.functional after the group exists,
whose defaults keep the group alive until interpreter exit. Writes JSON (runs, aborts, each failure's text).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.benchmarks import results


def rank_main(rank: int, mode: str, port: int) -> None:
    import faulthandler
    import importlib
    import os

    import torch
    import torch.distributed as dist

    faulthandler.enable(all_threads=True)  # an abort prints every thread's Python stack
    if mode == "process_group":
        from characters.process_group import join, leave

        join("gloo", port, rank, 2)
    else:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    importlib.import_module("torch._dynamo")
    x = torch.randn(64, 256)
    for _ in range(50):
        dist.all_reduce(x)
        x /= 2
    if mode == "process_group":
        if not leave():
            raise RuntimeError("the group outlived leave()")
    else:
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--join", choices=["process_group", "plain"], default="process_group")
    p.add_argument("--out", type=Path, help="default: benchmarks/cpu/stress_process_group.json")
    args = p.parse_args()
    args.out = args.out or Path("benchmarks/cpu/stress_process_group.json")
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    from characters.process_group import free_port  # here, not at the top: the ranks re-import this file, and
    #                                                 `plain` ranks must not import characters.process_group

    failures: list[str] = []
    start = time.perf_counter()
    for _ in range(args.runs):
        try:
            mp.spawn(rank_main, args=(args.join, free_port()), nprocs=2, join=True)
        except ProcessException as e:  # a rank's abort or error: counted, the next run goes on
            failures.append(str(e).strip().splitlines()[-1][:300])
    result = {"command": " ".join(["python", *sys.argv]), "join": args.join, "runs": args.runs,
              "failures": len(failures), "aborts": sum("SIGABRT" in f for f in failures),
              "wall_s": round(time.perf_counter() - start, 1), "failure_texts": failures}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results.record(args.out, result)
    print(f"{args.join}: {len(failures)} of {args.runs} runs failed ({result['aborts']} SIGABRT) -> {args.out}")


if __name__ == "__main__":
    main()
