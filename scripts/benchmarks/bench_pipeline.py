"""Benchmark: whole sessions through the product path, on a local Ray cluster (the multi-GPU pipeline).

    python scripts/benchmarks/bench_pipeline.py                                    # tiny, 1 DiT rank + decoder, CPU
    python scripts/benchmarks/bench_pipeline.py --dit-ranks 2 --decoder-gpus 1 --seconds 20 \\
        --out benchmarks/cpu/pipeline.json
    python scripts/benchmarks/bench_pipeline.py --preset 57b --dit-ranks 3 --decoder-gpus 1 --sessions 2 \\
        --device cuda --layouts replicated,sp_none,sp_symm_mem --depths 2,1 --out "$OUT/pipeline_57b_3+1x2.json"

Each variant (tensor-parallel layout x pipeline depth) gets its own scheduler (`SessionScheduler`, as
Serve's ingress uses it) on one local cluster that holds every GPU of the machine (`--device cuda`) or
logical GPUs backed by CPUs (`--device cpu`). It builds `--sessions` slots, each its own STRICT_PACK
placement group of `dit_ranks + decoder_gpus` GPU bundles, starts one session per slot at once (null
output, silence), lets them run `--seconds`, and ends them. Nothing of the serving path is bypassed:
the chunk loop is the session actor's, over the slot's compiled graph (NCCL latents to a decoder GPU of
its own, shared memory otherwise). `--pacing unpaced` (the default here; `ServiceConfig.pacing`) submits
chunks back to back, so the interval between chunks is the pipeline's time per chunk even
where it is faster than real time; `realtime` is what a LiveKit viewer gets (a chunk per 166.7 ms at
most).

`--layers N` builds N DiT blocks instead of the preset's: on a machine with fewer GPUs than a topology needs,
`--layers ceil(L/R) --dit-ranks 1` gives one rank the FLOPs of one rank of R (its share of every block's
GEMMs and heads is the same work as ceil(L/R) whole blocks), without the R-rank collectives.

Per session (steady state: the first `--skip` chunks dropped):
- `ms_per_chunk`: median interval between consecutive chunks' reports reaching the session's loop (its wall
  clock; each report comes back once the room has published the chunk); `fps`;
- `stage_ms`: p50 of each chunk stage the workers time (CUDA events on GPUs, host clocks on CPUs):
  `dit` (the DiT step, its all-reduces inside), `handoff` (DiT rank 0's latents -> the decoder),
  `decode`, `publish`; with `depth` 2 the DiT makes chunk k+1 while the decoder decodes chunk k, so
  `ms_per_chunk` approaches max(dit, decode) rather than their sum: the overlap;
- `latency_ms_p50`: submit -> published; late chunks; the GPUs each worker holds (disjoint across
  sessions: each slot is its own placement group); `ready_after_s`: the variant's first request -> this
  session RUNNING (its slot built from nothing: actors, weights, warm-up, the compiled graph); `slot_build_s`:
  the seconds of each start-up stage of DiT rank 0 and of the decoder (`deployments.pipeline.workers.STAGES`).
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.benchmarks.results import record

LAYOUTS: dict[str, dict[str, Any]] = {
    "replicated": {"sequence_parallel": False, "tp_overlap": "none"},
    "sp_none": {"sequence_parallel": True, "tp_overlap": "none"},
    "sp_ring": {"sequence_parallel": True, "tp_overlap": "ring"},
    "sp_symm_mem": {"sequence_parallel": True, "tp_overlap": "symm_mem"},
    "sp_local": {"sequence_parallel": True, "tp_overlap": "none", "local_layers": True},  # token-local layers whole
    "sp_kv": {"sequence_parallel": True, "tp_overlap": "none", "local_layers": True,
              "local_attention": True},  # self-attention whole too, its K/V rows gathered
}
# The tiny preset cut down for 2 cores (as the Ray tests run it): one DiT block, 64x96, no decoder res blocks.
SMALL = {"dit": {"num_layers": 1}, "generation": {"height": 64, "width": 96}, "vae": {"num_res_blocks": 0}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--small", action="store_true", help="the tiny preset cut down (1 block, 64x96): CPU smoke runs")
    p.add_argument("--layers", type=int, default=None,
                   help="DiT blocks to build (default: the preset's). On fewer GPUs than a topology needs, "
                        "ceil(layers / N) blocks on one rank do the FLOPs of one rank of N, without its collectives")
    p.add_argument("--dit-ranks", type=int, default=1)
    p.add_argument("--decoder-gpus", type=int, default=1, choices=(0, 1),
                   help="1: the decoder on a GPU of its own (NCCL handoff); 0: it shares DiT rank 0's GPU")
    p.add_argument("--sessions", type=int, default=1, help="sessions side by side, one slot each")
    p.add_argument("--layouts", default="replicated", help=f"comma list of {sorted(LAYOUTS)}")
    p.add_argument("--graph", choices=["compiled", "actor_calls", "auto"], default="compiled",
                   help="how chunks flow between the workers (ServiceConfig.graph); the compiled graph by default, "
                        "also on CPUs, where the service itself takes actor calls")
    p.add_argument("--depths", default="2", help="comma list of pipeline depths (1: no DiT/decode overlap)")
    p.add_argument("--seconds", type=float, default=20.0, help="how long each variant's sessions run")
    p.add_argument("--pacing", choices=("unpaced", "realtime"), default="unpaced")
    p.add_argument("--skip", type=int, default=4, help="chunks dropped at the start of each session")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--cpus", type=int, default=None, help="Ray's CPU count (default: the machine's)")
    p.add_argument("--start-timeout", type=float, default=1800.0, help="seconds for the slots to build")
    p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                   help="the DiT's linear layers (ServiceConfig.precision; fp8 on GPUs of compute capability >= 8.9)")
    p.add_argument("--attention-precision", choices=("bf16", "fp8"), default="bf16",
                   help="attention over the KV cache (ServiceConfig.attention_precision)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    unknown = [v for v in args.layouts.split(",") if v not in LAYOUTS]
    if unknown:
        p.error(f"--layouts: unknown {unknown}; choose from {sorted(LAYOUTS)}")
    if args.dit_ranks < 1 or args.sessions < 1 or (args.layers is not None and args.layers < 1):
        p.error("--dit-ranks, --sessions and --layers must be >= 1")
    return args


def gpus_needed(args: argparse.Namespace) -> int:
    return args.sessions * (args.dit_ranks + args.decoder_gpus)


def service_for(args: argparse.Namespace, layout: str, depth: int) -> Any:
    from characters.config import TopologyConfig
    from deployments.settings import ServiceConfig

    name = f"{args.dit_ranks}+{args.decoder_gpus}"
    topo = TopologyConfig(name=name, dit_ranks=args.dit_ranks, decoder_gpus=args.decoder_gpus, **LAYOUTS[layout])
    return ServiceConfig(preset=args.preset, topology=topo, model_overrides=model_overrides(args),
                         use_gpus=True, queue_max=0, pipeline_depth=depth, weights="random", pacing=args.pacing,
                         placement_timeout_s=120.0, worker_timeout_s=args.start_timeout, chunk_timeout_s=120.0,
                         graph=args.graph, precision=args.precision, attention_precision=args.attention_precision)


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    over: dict[str, Any] = {k: dict(v) for k, v in SMALL.items()} if args.small else {}
    if args.layers is not None:
        over.setdefault("dit", {})["num_layers"] = args.layers
    return over


def held_gpus(actor: Any) -> list[str]:
    """The GPU ids Ray gave `actor` (logical ids on a CPU cluster, CUDA devices on a GPU one)."""
    import ray

    return [str(g) for g in ray.get(actor.__ray_call__.remote(lambda _self: ray.get_gpu_ids()))]


def worker_stages(actor: Any) -> dict[str, float]:
    """Seconds each start-up stage of a DiT or decoder worker took (`deployments.pipeline.workers.STAGES`)."""
    import ray

    return {k: round(v, 2) for k, v in ray.get(actor.stages.remote()).items()}


def published(events: list[Any], skip: int) -> list[float]:
    """When each chunk's report reached the session's loop (wall clock), in chunk order, the first `skip` dropped."""
    at = sorted((e.chunk, e.at) for e in events if e.kind == "chunk" and e.chunk is not None)
    return [t for k, t in at if k >= skip]


def run_variant(args: argparse.Namespace, layout: str, depth: int) -> dict[str, Any]:
    import ray

    from deployments.sessions.scheduler import get_or_create_scheduler
    from deployments.types import OutputSpec, SessionSpec, SessionStatus

    service = service_for(args, layout, depth)
    g = service.session_config().model.generation
    image = np.random.default_rng(3).integers(0, 256, (g.height, g.width, 3), dtype=np.uint8)
    sched = get_or_create_scheduler(service, name=f"bench-{layout}-d{depth}")
    ids = [f"s{i}" for i in range(args.sessions)]
    try:
        t0 = time.monotonic()
        for sid in ids:  # all at once: the slots build side by side
            spec = SessionSpec(sid, image, preset=args.preset, output=OutputSpec("null"),
                               max_duration_s=args.seconds, seed=int(sid[1:]))
            ray.get(sched.create_session.remote(spec))
        started, gpus, built = {}, {}, {}
        for sid in ids:  # each session's slot is asked as soon as it runs: a short session (and with it its slot,
            # without warm slots) may be gone by the time the next one runs
            started[sid] = wait_until(sched, sid, {SessionStatus.RUNNING}, t0 + args.start_timeout, since=t0)
            for slot in ray.get(sched.debug_slots.remote()):
                if sid in slot["sessions"]:
                    actors = slot["actors"]
                    gpus[sid] = {"dit": [held_gpus(a) for a in actors[:args.dit_ranks]],
                                 "decoder": held_gpus(actors[args.dit_ranks])}
                    built[sid] = {"dit0": worker_stages(actors[0]), "decoder": worker_stages(actors[args.dit_ranks])}
        build_s = max(since for _, since in started.values())  # the last session running: every slot built
        ended = {sid: wait_until(sched, sid, {SessionStatus.ENDED, SessionStatus.FAILED},
                                 time.monotonic() + args.seconds + 300) for sid in ids}
        sessions = []
        for sid in ids:
            info, events = ended[sid], ray.get(sched.events.remote(sid, 0, 0.0))
            times = published(events, args.skip)
            gaps = np.diff(times) * 1e3 if len(times) > 1 else np.array([float("nan")])
            ms = float(np.median(gaps))
            sessions.append({
                "session": sid, "status": info.status.value, "reason": info.reason, "chunks": info.stats.chunks,
                "ms_per_chunk": round(ms, 1), "ms_per_chunk_p95": round(float(np.percentile(gaps, 95)), 1),
                "fps": round(g.frames_per_chunk * 1e3 / ms, 2), "late_chunks": info.stats.late_chunks,
                "latency_ms_p50": round(info.stats.step_ms_p50, 1), "latency_ms_p95": round(info.stats.step_ms_p95, 1),
                "stage_ms": {k: round(v, 2) for k, v in sorted(info.stats.stage_ms.items())},
                "gpus": gpus.get(sid), "ready_after_s": round(started[sid][1], 1), "slot_build_s": built.get(sid)})
        return {"layout": layout, "depth": depth, "build_s": round(build_s, 1), "sessions": sessions}
    finally:
        ray.get(sched.shutdown.remote(), timeout=300)
        ray.kill(sched)


def wait_until(sched: Any, sid: str, want: set[Any], deadline: float, since: float | None = None) -> Any:
    """The session's info once its status is in `want`; with one status wanted, (info, seconds since `since`)."""
    import ray

    t0 = time.monotonic() if since is None else since
    while True:
        info = ray.get(sched.get_session.remote(sid))
        if info.status in want:
            return info if len(want) > 1 else (info, time.monotonic() - t0)
        if info.status.terminal:
            raise RuntimeError(f"session {sid} ended {info.status.value} ({info.reason}) before {sorted(want)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"session {sid} still {info.status.value} at the deadline")
        time.sleep(0.2)


def environment(device: str) -> dict[str, Any]:
    import ray
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__}
    if device == "cuda":
        env |= {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
                "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    return env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from deployments.sessions.cluster import init_local, stop_local

    need = gpus_needed(args)
    have = torch.cuda.device_count() if args.device == "cuda" else need
    if have < need:
        print(f"needs {need} GPUs ({args.sessions} x ({args.dit_ranks} DiT + {args.decoder_gpus} decoder)), "
              f"this machine has {have}", file=sys.stderr)
        return 2
    if args.device == "cpu" and torch.cuda.is_available():
        print("--device cpu gives the workers logical GPUs; on a machine with CUDA they would take real ones",
              file=sys.stderr)
        return 2
    init_local(num_cpus=args.cpus or max(8, 2 * need), num_gpus=have, configure_logging=False)
    results = []
    try:
        for layout in args.layouts.split(","):
            for depth in (int(d) for d in args.depths.split(",")):
                results.append(run_variant(args, layout, depth))
                print(json.dumps(results[-1]), flush=True)
        out = {"bench": "pipeline", "preset": args.preset, "small": args.small, "layers": args.layers,
               "topology": f"{args.dit_ranks}+{args.decoder_gpus}", "sessions": args.sessions,
               "seconds": args.seconds, "skip": args.skip, "pacing": args.pacing, "device": args.device,
               "precision": args.precision, "attention_precision": args.attention_precision,
               "argv": sys.argv, "environment": environment(args.device), "variants": results}
    finally:
        stop_local()
    print(f"\n{'layout':<12} {'depth':>5} {'session':>7} {'ms/chunk':>9} {'fps':>6} {'dit':>8} {'handoff':>8} "
          f"{'decode':>8} {'late':>5}")
    for v in results:
        for s in v["sessions"]:
            st = s["stage_ms"]
            cols = [f"{st.get(k, float('nan')):8.1f}" for k in ("dit", "handoff", "decode")]
            print(f"{v['layout']:<12} {v['depth']:>5} {s['session']:>7} {s['ms_per_chunk']:9.1f} {s['fps']:6.2f} "
                  f"{' '.join(cols)} {s['late_chunks']:>5}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record(args.out, out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
