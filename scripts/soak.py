"""Soak: sessions back to back for a long time on a local cluster; memory and resources over time.

Keeps `--concurrent` sessions running, each `--session-s` long (it ends by itself; a new one starts),
with speech pushed into each, and every `--sample-s` records: RSS of the driver, the scheduler,
every slot worker (DiT ranks, decoder, room) and each slot's session actor (it drives every session
on its slot, over one compiled graph), named actors, live placement groups, the scheduler's
threads and file descriptors, sessions done, chunks and late chunks; on CUDA workers also
`torch.cuda.memory_allocated()` / `memory_reserved()` per worker (read inside each worker, between
its chunks; not run on the CPU machine). Writes JSON (every sample plus a per-series trend in MB per
hour over the second half) and a PNG of memory over time.

    python scripts/soak.py                                  # an hour, CPU, the cut-down tiny preset
    nice -n 10 python scripts/soak.py --minutes 6 --sample-s 5
    python scripts/soak.py --preset tiny --full --topology gpu1 --minutes 60   # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import ray

from deployments.sessions.cluster import init_local
from deployments.sessions.scheduler import get_or_create_scheduler
from deployments.settings import ServiceConfig
from deployments.types import NAMESPACE, OutputSpec, SessionSpec

SMALL = {"dit": {"num_layers": 1}, "generation": {"height": 64, "width": 96}, "vae": {"num_res_blocks": 0}}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60.0, help="how long to run (default an hour)")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--session-s", type=float, default=15.0, help="length of each session")
    p.add_argument("--concurrent", type=int, default=1, help="sessions running at once")
    p.add_argument("--warm-slots", type=int, default=1, help="warm slots kept (sessions reuse their workers)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--full", action="store_true", help="the preset as is (default: cut down to 1 layer, 64x96)")
    p.add_argument("--topology", default="gpu1")
    p.add_argument("--graph", choices=("compiled", "actor_calls"), default="compiled")
    p.add_argument("--out", default="benchmarks/soak_cpu.json")
    p.add_argument("--png", default="docs/soak_cpu.png")
    return p.parse_args()


def rss_mb(pid: int) -> float:
    try:
        return float(psutil.Process(pid).memory_info().rss) / 2**20
    except psutil.Error:
        return float("nan")


def _pid(_self: Any) -> int:
    return os.getpid()


def _cuda_memory(_self: Any) -> tuple[int, int] | None:
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.memory_allocated()), int(torch.cuda.memory_reserved())


class Sampler:
    """Samples the cluster's processes; the worker pids are looked up once per actor."""

    def __init__(self, sched: Any) -> None:
        self.sched, self.pids = sched, {}  # actor id -> (role, pid)
        self.sched_pid = int(ray.get(sched.__ray_call__.remote(_pid)))

    def sample(self, t0: float, done: int) -> dict[str, Any]:
        slots = ray.get(self.sched.debug_slots.remote(), timeout=60)
        workers: dict[str, float] = {}
        cuda: dict[str, list[int]] = {"allocated": [], "reserved": []}
        for s in slots:
            if not s["actors"]:  # still building
                continue
            roles = [*(f"dit{r}" for r in range(len(s["actors"]) - 2)), "decoder", "room", "session"]
            for role, actor in zip(roles, [*s["actors"], s["driver"]], strict=True):
                key = actor._actor_id.hex()
                if key not in self.pids:
                    self.pids[key] = (role, int(ray.get(actor.__ray_call__.remote(_pid), timeout=60)))
                workers[role] = workers.get(role, 0.0) + rss_mb(self.pids[key][1])
                if role not in ("room", "session"):
                    mem = ray.get(actor.__ray_call__.remote(_cuda_memory), timeout=60)
                    if mem is not None:
                        cuda["allocated"].append(mem[0])
                        cuda["reserved"].append(mem[1])
        sessions = ray.get(self.sched.list_sessions.remote(), timeout=60)
        sched = psutil.Process(self.sched_pid)
        named = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]
        pgs = [r for r in ray.util.placement_group_table().values() if r["state"] != "REMOVED"]
        out = {"t_s": round(time.monotonic() - t0, 1), "driver_rss_mb": rss_mb(os.getpid()),
               "scheduler_rss_mb": rss_mb(self.sched_pid), "scheduler_threads": sched.num_threads(),
               "scheduler_fds": sched.num_fds(), "driver_threads": threading.active_count(),
               "workers_rss_mb": {k: round(v, 1) for k, v in workers.items()},
               "named_actors": len(named), "placement_groups": len(pgs), "slots": len(slots),
               "sessions_done": done, "chunks": sum(s.stats.chunks for s in sessions),
               "late_chunks": sum(s.stats.late_chunks for s in sessions)}
        if cuda["allocated"]:
            out["cuda_allocated_mb"] = round(sum(cuda["allocated"]) / 2**20, 1)
            out["cuda_reserved_mb"] = round(sum(cuda["reserved"]) / 2**20, 1)
        return out


def trend_mb_per_hour(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope over the second half of the run (the first half holds warm-up growth)."""
    half = len(ts) // 2
    x, y = np.asarray(ts[half:]), np.asarray(ys[half:])
    ok = np.isfinite(y)
    if ok.sum() < 2:
        return float("nan")
    return float(np.polyfit(x[ok], y[ok], 1)[0] * 3600)


def _finite(ys: list[float]) -> list[float]:
    return [y for y in ys if np.isfinite(y)] or [float("nan")]


def series(samples: list[dict[str, Any]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"driver": [s["driver_rss_mb"] for s in samples],
                                   "scheduler": [s["scheduler_rss_mb"] for s in samples]}
    for role in sorted({r for s in samples for r in s["workers_rss_mb"]}):
        out[role] = [s["workers_rss_mb"].get(role, float("nan")) for s in samples]
    if any("cuda_allocated_mb" in s for s in samples):
        out["cuda_allocated"] = [s.get("cuda_allocated_mb", float("nan")) for s in samples]
    return out


def plot(samples: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = [s["t_s"] / 60 for s in samples]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True, height_ratios=[3, 1])
    for name, ys in series(samples).items():
        y0 = _finite(ys)[0]
        ax.plot(ts, [y - y0 for y in ys], label=f"{name} ({y0:.0f} MB at start)")
    ax.set_ylabel("memory growth since the first sample (MB)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax2.plot(ts, [s["sessions_done"] for s in samples], label="sessions done")
    ax2.plot(ts, [s["named_actors"] for s in samples], label="named actors")
    ax2.plot(ts, [s["placement_groups"] for s in samples], label="placement groups")
    ax2.set_xlabel("minutes")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def main() -> None:
    args = parse()
    init_local(num_cpus=max(8, 4 * args.concurrent), num_gpus=0 if args.topology == "cpu" else
               max(2, args.concurrent + args.warm_slots))
    service = ServiceConfig(preset=args.preset, topology=args.topology, model_overrides={} if args.full else SMALL,
                            warm_slots=args.warm_slots, queue_max=args.concurrent, queue_timeout_s=120.0,
                            placement_timeout_s=120.0, graph=args.graph, ended_max=1000)
    g = service.session_config().model.generation
    image = np.random.default_rng(0).integers(0, 256, (g.height, g.width, 3), dtype=np.uint8)
    speech = (np.random.default_rng(1).standard_normal(16000 * 2) * 6000).astype("<i2").tobytes()  # 2 s
    sched = get_or_create_scheduler(service, name="soak")
    sampler = Sampler(sched)
    t0 = time.monotonic()
    deadline, next_sample = t0 + args.minutes * 60, t0
    running: list[str] = []
    done, n, samples = 0, 0, []
    try:
        while time.monotonic() < deadline:
            for sid in list(running):
                info = ray.get(sched.get_session.remote(sid))
                if info.status.terminal:
                    if info.status.value == "FAILED":
                        print(f"session {sid} FAILED: {info.reason}", file=sys.stderr)
                    running.remove(sid)
                    done += 1
                elif info.status.value == "RUNNING" and info.stats.audio_queued_s < 0.5:
                    ray.get(sched.push_audio.remote(sid, speech, 16000, 1))
            while len(running) < args.concurrent:
                sid = f"soak-{n}"
                n += 1
                ray.get(sched.create_session.remote(SessionSpec(sid, image, preset=args.preset, seed=n,
                                                                max_duration_s=args.session_s,
                                                                output=OutputSpec("null"))))
                running.append(sid)
            if time.monotonic() >= next_sample:
                samples.append(sampler.sample(t0, done))
                s = samples[-1]
                print(f"{s['t_s']:7.0f} s  sessions {done:4d}  driver {s['driver_rss_mb']:.0f} MB  scheduler "
                      f"{s['scheduler_rss_mb']:.0f} MB  workers {s['workers_rss_mb']}  actors {s['named_actors']}  "
                      f"pgs {s['placement_groups']}", flush=True)
                next_sample += args.sample_s
            time.sleep(0.5)
    finally:
        ray.get(sched.shutdown.remote(), timeout=120)
        ray.kill(sched)
    ts = [s["t_s"] for s in samples]
    trends = {name: round(trend_mb_per_hour(ts, ys), 1) for name, ys in series(samples).items()}
    result = {
        "command": "python " + " ".join(sys.argv), "device": "cuda" if "cuda_allocated_mb" in samples[-1] else "cpu",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "ray": ray.__version__},
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "png")},
        "sessions_done": done, "trend_mb_per_hour_second_half": trends,
        "growth_mb_first_to_last": {name: round(_finite(ys)[-1] - _finite(ys)[0], 1)
                                    for name, ys in series(samples).items()},
        "samples": samples,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    plot(samples, Path(args.png), f"soak: {done} sessions of {args.session_s:.0f} s, {args.preset}"
         f"{'' if args.full else ' (cut down)'}, graph={args.graph}, {result['device']}")
    print(json.dumps({k: result[k] for k in ("sessions_done", "trend_mb_per_hour_second_half",
                                             "growth_mb_first_to_last")}, indent=1))


if __name__ == "__main__":
    main()
