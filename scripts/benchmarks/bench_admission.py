"""Benchmark: admission decision latency (pure policy) and, on a real local Ray cluster, the time from
`create_session` to the first published chunk for a cold slot and for a warm slot.

    python scripts/benchmarks/bench_admission.py                                   # tiny preset on CPU bundles
    python scripts/benchmarks/bench_admission.py --repeats 5 --out benchmarks/cpu/admission.json

Policy: `decide` + `commit` for one new request against fleets of N nodes (random free GPUs) with a
queue of Q waiting requests that do not fit (each is re-checked: the worst case), timed over many
iterations (at most --iters, at most ~5 s per case; microseconds per decision).

Cluster: the scheduler actor of `deployments.sessions.scheduler` on a local cluster (loopback, logical CPUs).
Cold: warm_slots=0, so every session builds its slot (placement group, worker processes, weights,
warm-up). Warm: warm_slots=1, each session takes the slot the previous one returned (reset state,
encode the reference, compile the chunk graph). Each session's actor is started ahead with its slot
(and again when the slot is returned); a session created right after the previous one ended, as
here, may still wait for that process (`wait_actor_s` in the READY phases). Time to first chunk =
the session's `started_at` (first chunk published) minus the wall time just before `create_session`.
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from characters.config import TopologyConfig
from placement import AdmissionQueue, NodeCapacity, Request, bundles_for, commit, decide
from scripts.benchmarks import results

ROOT = Path(__file__).resolve().parents[2]


def bench_policy(nodes_n: int, queue_n: int, iters: int, budget_s: float = 5.0, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    spec = bundles_for(TopologyConfig(name="h100x5", dit_ranks=4, decoder_gpus=1, accelerator="H100"))
    accel = "accelerator_type:H100"
    nodes = tuple(NodeCapacity(f"n{i:03d}", {"GPU": float(rng.randint(0, 8)), "CPU": 64.0, accel: 1.0},
                               {"GPU": 8.0, "CPU": 64.0, accel: 1.0}) for i in range(nodes_n))
    big = bundles_for(TopologyConfig(name="h100x9", dit_ranks=8, decoder_gpus=1, accelerator="H100"))
    queue = AdmissionQueue(queue_n + 1)
    for i in range(queue_n):  # requests that cannot fit (9 GPUs): the worst case, every one is re-checked
        queue = queue.push(Request(f"q{i}", big, 0.0, 1e9))
    times: list[float] = []
    start = time.perf_counter()
    for i in range(iters):
        request = Request(f"r{i}", spec, 1.0, 1e9)
        t0 = time.perf_counter()
        decision = decide(nodes, queue, request, 1.0)
        commit(nodes, queue, [decision], incoming=request)
        times.append((time.perf_counter() - t0) * 1e6)
        if len(times) >= 100 and time.perf_counter() - start > budget_s:
            break
    times.sort()
    return {"nodes": nodes_n, "queued": queue_n, "iters": len(times), "us_p50": statistics.median(times),
            "us_p99": times[int(0.99 * (len(times) - 1))]}


def time_to_first_chunk(sched: Any, service: Any, session_id: str) -> dict[str, Any]:
    import ray

    from deployments.types import SessionSpec, SessionStatus

    g = service.session_config().model.generation
    image = np.zeros((g.height, g.width, 3), np.uint8)
    t0 = time.time()
    info = ray.get(sched.create_session.remote(SessionSpec(session_id, image, preset=service.preset)))
    assert info.status is SessionStatus.STARTING, info
    seq, ready_at, phases = 0, None, ""
    while True:
        events = ray.get(sched.events.remote(session_id, seq, 120.0))
        if not events:
            raise RuntimeError(f"session {session_id} sent no event for 120 s; status {info.status}")
        for e in events:
            seq = e.seq
            if e.kind == "status" and e.status is SessionStatus.READY:
                ready_at, phases = e.at, e.detail or ""
            if e.kind == "status" and e.status is not None and e.status.terminal:
                raise RuntimeError(f"session {session_id} ended before its first chunk: {e.detail}")
        if any(e.kind == "chunk" for e in events):
            break
    info = ray.get(sched.get_session.remote(session_id))
    slot = next(s for s in ray.get(sched.debug_slots.remote()) if session_id in s["sessions"])
    ray.get(sched.end_session.remote(session_id))
    return {"first_chunk_s": info.started_at - t0, "ready_s": (ready_at or info.started_at) - t0,
            "warm_start": info.warm_start, "ready_phases": phases, "slot_build_s": slot["build_s"],
            "slot_stages": slot["stages"]}


def wait_slots(sched: Any, free: int, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """Wait until the scheduler holds exactly `free` slots, all free (0: none at all)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        slots: list[dict[str, Any]] = ray.get(sched.debug_slots.remote())
        if len(slots) == free and all(s["state"] == "free" for s in slots):
            return slots
        time.sleep(0.2)
    raise RuntimeError(f"the scheduler did not settle on {free} free slots within {timeout_s} s")


def bench_cluster(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from deployments.sessions.cluster import init_local, stop_local
    from deployments.sessions.scheduler import get_or_create_scheduler
    from deployments.settings import ServiceConfig

    init_local(num_cpus=args.cpus)
    out: dict[str, Any] = {}
    try:
        for kind, warm in (("cold", 0), ("warm", 1)):
            service = ServiceConfig(preset=args.preset, topology="cpu", use_gpus=False, warm_slots=warm,
                                    placement_timeout_s=120.0)
            sched = get_or_create_scheduler(service, name=f"bench-{kind}")
            runs, builds = [], []
            for i in range(args.repeats):
                builds += [s["build_s"] for s in wait_slots(sched, warm)]
                runs.append(time_to_first_chunk(sched, service, f"{kind}-{i}"))
            ray.get(sched.shutdown.remote())
            ray.kill(sched)
            out[kind] = {"runs": runs, "first_chunk_s_median": statistics.median(r["first_chunk_s"] for r in runs),
                         "ready_s_median": statistics.median(r["ready_s"] for r in runs),
                         "warm_starts": [r["warm_start"] for r in runs], "warm_slot_build_s": builds}
    finally:
        stop_local()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--iters", type=int, default=20000, help="policy decisions timed per case")
    p.add_argument("--repeats", type=int, default=3, help="sessions per cold / warm case")
    p.add_argument("--cpus", type=int, default=8, help="logical CPUs of the local cluster")
    p.add_argument("--skip-cluster", action="store_true")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "cpu" / "admission.json"))
    args = p.parse_args()

    policy = [bench_policy(n, q, args.iters) for n, q in ((1, 0), (8, 0), (64, 0), (64, 16), (256, 64))]
    print(f"{'nodes':>6} {'queued':>6} {'iters':>6} {'decide+commit p50 us':>21} {'p99 us':>8}")
    for r in policy:
        print(f"{r['nodes']:>6} {r['queued']:>6} {r['iters']:>6} {r['us_p50']:>21.1f} {r['us_p99']:>8.1f}")
    result: dict[str, Any] = {"machine": platform.node(), "processor": platform.processor(),
                              "python": platform.python_version(), "policy": policy}
    if not args.skip_cluster:
        cluster = bench_cluster(args)
        result["cluster"] = {"preset": args.preset, "topology": "cpu", **cluster}
        print(f"\n{'start':>6} {'create -> READY s':>18} {'create -> first chunk s':>24} {'slot build s':>12}  "
              "READY phases, last run (wait for the session actor, prepare, compile)")
        for kind in ("cold", "warm"):
            c = cluster[kind]
            print(f"{kind:>6} {c['ready_s_median']:>18.2f} {c['first_chunk_s_median']:>24.2f} "
                  f"{c['runs'][-1]['slot_build_s']:>12.2f}  {c['runs'][-1]['ready_phases']}")
        ratio = cluster["cold"]["first_chunk_s_median"] / cluster["warm"]["first_chunk_s_median"]
        print(f"cold / warm time to first chunk: {ratio:.1f}x (one run, same machine)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    results.record(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
