"""Soak: sessions started and ended for a long time on a multi-node cluster; memory per process and resources over time.

By default on a `LoopbackCluster` (a head without GPUs and `--nodes` worker nodes of `--gpus-per-node` logical
GPUs, each a real raylet on loopback; `--nodes 0`: the single-node local cluster of `init_local`). Keeps
`--concurrent` sessions running, each `--session-s` long (it ends by itself; a new one starts), with speech
pushed into each, on `--warm-slots` warm slots (sessions reuse their workers), and every `--sample-s`
records: RSS of the driver, the scheduler, every slot's workers (DiT ranks, decoder, room) and session actor,
and each node's raylet and the head's GCS; named actors and live placement groups (and how many of them no
slot holds: leaks); the scheduler's threads and file descriptors; sessions done, chunks and late chunks; on
CUDA workers also `torch.cuda.memory_allocated()` / `memory_reserved()` (read inside each worker, between its
chunks; not run on the CPU machine). Series are per process: `<node>/<role>` (`node1/dit0`, `head/gcs`).
Writes JSON (every sample, and per series the growth first -> last, the trend in MB per hour and in MB per
session over the second half) and a PNG of memory over time.

    python scripts/tools/soak.py                                  # an hour: head + 2 nodes of 2 GPUs, 2 sessions
    nice -n 10 python scripts/tools/soak.py --minutes 5 --sample-s 10
    python scripts/tools/soak.py --nodes 0 --topology gpu1 --concurrent 1 --warm-slots 1 \\
        --out benchmarks/cpu/soak.json --png docs/soak_cpu.png   # one node, as before
    python scripts/tools/soak.py --preset tiny --full --nodes 0 --topology gpu1 --minutes 60   # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import ray

from characters.config import TopologyConfig
from deployments.sessions.cluster import LoopbackCluster, init_local, stop_local
from deployments.sessions.scheduler import get_or_create_scheduler
from deployments.settings import ServiceConfig
from deployments.types import NAMESPACE, OutputSpec, SessionSpec
from placement.names import parse_pg_name
from scripts.benchmarks import results

SMALL = {"dit": {"num_layers": 1}, "generation": {"height": 64, "width": 96}, "vae": {"num_res_blocks": 0}}
NAME = "soak"
CHECKPOINT_SAMPLES = 15  # the JSON is rewritten this often, so a run cut short keeps its samples


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60.0, help="how long to run (default an hour)")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--session-s", type=float, default=15.0, help="length of each session")
    p.add_argument("--nodes", type=int, default=2, help="worker nodes of a loopback cluster (0: one local node)")
    p.add_argument("--gpus-per-node", type=int, default=2, help="logical GPUs of each worker node")
    p.add_argument("--concurrent", type=int, default=2, help="sessions running at once")
    p.add_argument("--warm-slots", type=int, default=2, help="warm slots kept (sessions reuse their workers)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--full", action="store_true", help="the preset as is (default: cut down to 1 layer, 64x96)")
    p.add_argument("--topology", default="1+1", help="a topology name, or DIT+DECODER GPUs per bundle (1+1: a DiT "
                   "GPU and a decoder GPU)")
    p.add_argument("--graph", choices=("compiled", "actor_calls"), default="compiled")
    p.add_argument("--gcs-task-events", type=int, default=None,
                   help="task events the head's GCS keeps (RAY_task_events_max_num_task_in_gcs; Ray's default 100000)")
    p.add_argument("--out", default="benchmarks/cpu/soak_multinode.json")
    p.add_argument("--png", default="docs/soak_multinode_cpu.png")
    p.add_argument("--from-log", default=None, help="rebuild --out and --png from the lines a run printed, "
                   "without running (with that run's --minutes and --sample-s)")
    return p.parse_args()


def topology(arg: str) -> str | TopologyConfig:
    m = re.fullmatch(r"(\d)\+([01])", arg)
    if m is None:
        return arg
    return TopologyConfig(name=f"dit{m.group(1)}+decoder{m.group(2)}", dit_ranks=int(m.group(1)),
                          decoder_gpus=int(m.group(2)))  # type: ignore[arg-type]


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
    """Samples the cluster's processes; each actor's pid is looked up once."""

    def __init__(self, sched: Any, cluster: LoopbackCluster | None) -> None:
        self.sched, self.cluster, self.pids = sched, cluster, {}  # actor id -> (series, pid)
        self.sched_pid = int(ray.get(sched.__ray_call__.remote(_pid)))
        self.node_names: dict[str, str] = {}

    def _daemons(self) -> dict[str, int]:
        """`<node>/raylet` and `head/gcs` -> pid (loopback cluster only)."""
        if self.cluster is None:
            return {}
        out = {}
        for node in [self.cluster.head, *self.cluster.nodes]:
            if node is None:
                continue
            self.node_names[node.node_id] = node.name
            for proc in node.processes():
                try:
                    exe = os.path.basename(proc.cmdline()[0]) if proc.cmdline() else ""
                except psutil.Error:
                    continue
                if exe in ("raylet", "gcs_server"):
                    out[f"{node.name}/{'gcs' if exe == 'gcs_server' else 'raylet'}"] = proc.pid
        return out

    def sample(self, t0: float, done: int) -> dict[str, Any]:
        daemons = self._daemons()
        slots = ray.get(self.sched.debug_slots.remote(), timeout=60)
        workers: dict[str, float] = {}
        cuda: dict[str, list[int]] = {"allocated": [], "reserved": []}
        per_node: dict[str, int] = {}
        for s in slots:
            if not s["actors"]:  # still building
                continue
            node = self.node_names.get(s["node_id"], "node")
            k = per_node[node] = per_node.get(node, 0) + 1
            where = node if k == 1 else f"{node}.{k}"
            roles = [*(f"dit{r}" for r in range(len(s["actors"]) - 2)), "decoder", "room", "session"]
            for role, actor in zip(roles, [*s["actors"], s["driver"]], strict=True):
                key = actor._actor_id.hex()
                if key not in self.pids:
                    self.pids[key] = (f"{where}/{role}", int(ray.get(actor.__ray_call__.remote(_pid), timeout=60)))
                series, pid = self.pids[key]
                workers[series] = rss_mb(pid)
                if role not in ("room", "session"):
                    mem = ray.get(actor.__ray_call__.remote(_cuda_memory), timeout=60)
                    if mem is not None:
                        cuda["allocated"].append(mem[0])
                        cuda["reserved"].append(mem[1])
        sessions = ray.get(self.sched.list_sessions.remote(), timeout=60)
        sched = psutil.Process(self.sched_pid)
        named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]
        pgs = [r for r in ray.util.placement_group_table().values() if r["state"] != "REMOVED"]
        held = {s["slot_id"] for s in slots}
        out = {"t_s": round(time.monotonic() - t0, 1), "driver_rss_mb": rss_mb(os.getpid()),
               "scheduler_rss_mb": rss_mb(self.sched_pid), "scheduler_threads": sched.num_threads(),
               "scheduler_fds": sched.num_fds(), "driver_threads": threading.active_count(),
               "workers_rss_mb": {k: round(v, 1) for k, v in sorted(workers.items())},
               "daemons_rss_mb": {k: round(rss_mb(pid), 1) for k, pid in sorted(daemons.items())},
               "named_actors": len(named), "placement_groups": len(pgs), "slots": len(slots),
               # a slot's actors and group carry its id (placement.names); any other is a leak
               "leaked_actors": sum(1 for n in named if n.split(".")[0] not in held and n != NAME),
               "leaked_placement_groups": sum(1 for r in pgs if (p := parse_pg_name(r["name"])) and p[0] not in held),
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


def per_session_mb(done: list[int], ys: list[float]) -> float:
    """MB per session over the second half: the median slope between every pair of samples (Theil-Sen),
    which one buffer in flight at a sample cannot move much (as `tests/ray/test_leaks.py` measures)."""
    half = len(done) // 2
    pts = [(d, y) for d, y in zip(done[half:], ys[half:], strict=True) if np.isfinite(y)]
    slopes = [(y2 - y1) / (d2 - d1) for i, (d1, y1) in enumerate(pts) for d2, y2 in pts[i + 1:] if d2 != d1]
    return float(np.median(slopes)) if slopes else float("nan")


def _finite(ys: list[float]) -> list[float]:
    return [y for y in ys if np.isfinite(y)] or [float("nan")]


def series(samples: list[dict[str, Any]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"driver": [s["driver_rss_mb"] for s in samples],
                                   "scheduler": [s["scheduler_rss_mb"] for s in samples]}
    for group in ("workers_rss_mb", "daemons_rss_mb"):
        for name in sorted({r for s in samples for r in s.get(group, {})}):
            out[name] = [s.get(group, {}).get(name, float("nan")) for s in samples]
    if any("cuda_allocated_mb" in s for s in samples):
        out["cuda_allocated"] = [s.get("cuda_allocated_mb", float("nan")) for s in samples]
    return out


def plot(samples: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = [s["t_s"] / 60 for s in samples]
    fig, (ax, ax1, ax2) = plt.subplots(3, 1, figsize=(10, 9), sharex=True, height_ratios=[3, 2, 1.2])
    for name, ys in series(samples).items():
        y0 = _finite(ys)[0]
        target = ax1 if name.endswith(("/raylet", "/gcs")) or name in ("driver", "scheduler") else ax
        target.plot(ts, [y - y0 for y in ys], label=f"{name} ({y0:.0f} MB at start)")
    ax.set_title(title)
    ax.set_ylabel("slot processes:\nMB since first sample")
    ax1.set_ylabel("Ray, driver, scheduler:\nMB since first sample")
    for a in (ax, ax1):
        a.grid(alpha=0.3)
        a.legend(fontsize=7, ncol=2)
    ax2.plot(ts, [s["sessions_done"] for s in samples], label="sessions done")
    ax2.plot(ts, [s["named_actors"] for s in samples], label="named actors")
    ax2.plot(ts, [s["placement_groups"] for s in samples], label="placement groups")
    ax2.plot(ts, [s.get("leaked_actors", 0) + s.get("leaked_placement_groups", 0) for s in samples],
             label="leaked actors + groups")
    ax2.set_xlabel("minutes")
    ax2.set_yscale("symlog")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def start(args: argparse.Namespace) -> LoopbackCluster | None:
    if args.nodes == 0:
        init_local(num_cpus=max(8, 4 * args.concurrent), num_gpus=0 if args.topology == "cpu" else
                   max(2, 2 * max(args.concurrent, args.warm_slots)))
        return None
    cluster = LoopbackCluster(head_cpus=2)
    if args.gcs_task_events is not None:
        cluster.env["RAY_task_events_max_num_task_in_gcs"] = str(args.gcs_task_events)
    cluster.start()
    for i in range(args.nodes):
        cluster.add_node(num_gpus=args.gpus_per_node, num_cpus=4, name=f"node{i + 1}")
    return cluster


def main() -> None:
    args = parse()
    if args.from_log:
        from_log(args)
        return
    t_start = time.monotonic()
    cluster = start(args)
    service = ServiceConfig(preset=args.preset, topology=topology(args.topology),
                            model_overrides={} if args.full else SMALL, warm_slots=args.warm_slots,
                            queue_max=args.concurrent, queue_timeout_s=300.0, placement_timeout_s=120.0,
                            graph=args.graph, ended_max=1000, transport="shm" if args.nodes else "auto",
                            use_gpus=None if args.topology == "cpu" else True)
    g = service.session_config().model.generation
    image = np.random.default_rng(0).integers(0, 256, (g.height, g.width, 3), dtype=np.uint8)
    speech = (np.random.default_rng(1).standard_normal(16000 * 2) * 6000).astype("<i2").tobytes()  # 2 s
    sched = get_or_create_scheduler(service, name=NAME, node_id=None if cluster is None or cluster.head is None
                                    else cluster.head.node_id)
    sampler = Sampler(sched, cluster)
    t0 = time.monotonic()
    deadline, next_sample = t0 + args.minutes * 60, t0
    running: list[str] = []
    done, failed, n, samples = 0, 0, 0, []
    left: list[int] = []
    try:
        while time.monotonic() < deadline:
            for sid in list(running):
                info = ray.get(sched.get_session.remote(sid))
                if info.status.terminal:
                    if info.status.value == "FAILED":
                        failed += 1
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
                      f"{s['scheduler_rss_mb']:.0f} MB  workers {s['workers_rss_mb']}  ray {s['daemons_rss_mb']}  "
                      f"actors {s['named_actors']}  pgs {s['placement_groups']}  leaked "
                      f"{s['leaked_actors']}+{s['leaked_placement_groups']}", flush=True)
                next_sample += args.sample_s
                if len(samples) % CHECKPOINT_SAMPLES == 0:
                    write(args, samples, done=done, failed=failed, left=None, wall_s=time.monotonic() - t_start,
                          complete=False)
            time.sleep(0.5)
    finally:
        ray.get(sched.shutdown.remote(), timeout=120)
        ray.kill(sched)
        if cluster is not None:
            pids = [p.pid for node in [cluster.head, *cluster.nodes] if node is not None for p in node.processes()]
            cluster.stop()
            left = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        else:
            stop_local()
    write(args, samples, done=done, failed=failed, left=left, wall_s=time.monotonic() - t_start, complete=True)


def write(args: argparse.Namespace, samples: list[dict[str, Any]], *, done: int, failed: int | None,
          left: list[int] | None, wall_s: float, complete: bool, source: str | None = None) -> None:
    """The JSON (every sample, per-series growth and trends) and the plot of `samples` so far. Written at the
    end and every CHECKPOINT_SAMPLES samples (`complete: false`), so a run cut short keeps what it measured."""
    ts, sessions_done = [s["t_s"] for s in samples], [s["sessions_done"] for s in samples]
    all_series = series(samples)
    result = {
        "command": "python " + " ".join(sys.argv), "device": "cuda" if "cuda_allocated_mb" in samples[-1] else "cpu",
        "complete": complete, "rebuilt_from_log": source,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "ray": ray.__version__,
                    "load_average_at_end": [round(x, 1) for x in os.getloadavg()]},
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "png", "from_log")},
        "sessions_done": done, "sessions_failed": failed,
        "chunks": samples[-1].get("chunks"), "late_chunks": samples[-1].get("late_chunks"),
        "leaked_actors_max": max(s["leaked_actors"] for s in samples),
        "leaked_placement_groups_max": max(s["leaked_placement_groups"] for s in samples),
        "named_actors_range": [min(s["named_actors"] for s in samples), max(s["named_actors"] for s in samples)],
        "placement_groups_range": [min(s["placement_groups"] for s in samples),
                                   max(s["placement_groups"] for s in samples)],
        "processes_left_after_stop": left, "wall_s": round(wall_s, 1),
        "trend_mb_per_hour_second_half": {k: round(trend_mb_per_hour(ts, ys), 1) for k, ys in all_series.items()},
        "mb_per_session_second_half": {k: round(per_session_mb(sessions_done, ys), 3) for k, ys in all_series.items()},
        "growth_mb_first_to_last": {k: round(_finite(ys)[-1] - _finite(ys)[0], 1) for k, ys in all_series.items()},
        "samples": samples,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    results.record(args.out, result)
    if not complete and source is None:
        return  # checkpoint: the plot is drawn at the end
    where = f"{args.nodes} nodes x {args.gpus_per_node} GPUs + head" if args.nodes else "one node"
    cut = "" if complete else f", cut short at {samples[-1]['t_s'] / 60:.0f} min"
    plot(samples, Path(args.png), f"soak: {done} sessions of {args.session_s:.0f} s, {args.concurrent} at once, "
         f"{where}, {args.preset}{'' if args.full else ' (cut down)'}, {result['device']}{cut}")
    print(json.dumps({k: result[k] for k in ("complete", "sessions_done", "sessions_failed", "late_chunks",
                                             "leaked_actors_max", "leaked_placement_groups_max",
                                             "processes_left_after_stop", "mb_per_session_second_half",
                                             "growth_mb_first_to_last")}, indent=1))


LINE = re.compile(r"^\s*(?P<t>[\d.]+) s  sessions\s+(?P<done>\d+)  driver (?P<driver>[\d.]+) MB  scheduler "
                  r"(?P<sched>[\d.]+) MB  workers (?P<workers>\{.*?\})  ray (?P<ray>\{.*?\})  actors (?P<actors>\d+)  "
                  r"pgs (?P<pgs>\d+)  leaked (?P<la>\d+)\+(?P<lp>\d+)$")


def from_log(args: argparse.Namespace) -> None:
    """Rebuild the JSON and plot of a run from the lines it printed (one per sample): for a run whose end was
    never reached (the machine restarted). Chunk counts, threads and fds are not in those lines."""
    import ast

    samples = []
    for line in Path(args.from_log).read_text().splitlines():
        m = LINE.match(line)
        if m is None:
            continue
        samples.append({"t_s": float(m["t"]), "driver_rss_mb": float(m["driver"]),
                        "scheduler_rss_mb": float(m["sched"]), "workers_rss_mb": ast.literal_eval(m["workers"]),
                        "daemons_rss_mb": ast.literal_eval(m["ray"]),
                        "named_actors": int(m["actors"]), "placement_groups": int(m["pgs"]),
                        "leaked_actors": int(m["la"]), "leaked_placement_groups": int(m["lp"]),
                        "sessions_done": int(m["done"])})
    if not samples:
        raise SystemExit(f"no sample lines in {args.from_log}")
    write(args, samples, done=samples[-1]["sessions_done"], failed=None, left=None, wall_s=samples[-1]["t_s"],
          complete=samples[-1]["t_s"] >= args.minutes * 60 - args.sample_s, source=str(args.from_log))


if __name__ == "__main__":
    main()
