"""Fleet simulation: the real admission policy (placement.decide/drain/commit/apply/release) over a fleet of
8-GPU nodes for one simulated day, per topology; prints a table and writes JSON.

    .venv/bin/python scripts/tools/simulate_fleet.py                      # 200 nodes, 24 h, all topologies
    .venv/bin/python scripts/tools/simulate_fleet.py --nodes 50 --hours 2 --peak-sessions 90

Model (event-driven clock, times in seconds):
- Demand: Poisson arrivals whose rate follows a daily sinusoid, peak = 2 x trough, peaking mid-day;
  ``--peak-sessions`` is the offered concurrency at the peak (rate x mean duration). The same demand is
  offered to every topology, so the rows compare what each fleet does with it.
- Sessions last a lognormal time (median 3 min, mean ~4 min), capped at max_session_s (900 s).
- Admission: exactly the scheduler actor's loop from placement.policy's docstring: on every event
  ``drain`` then ``commit``; a new request goes through ``decide`` then ``commit``; an ended session
  through ``release``. Queue and deadline are the manifests' queue_max (32) and queue_timeout_s (30 s).
  Warm-slot start-up time is not modelled (a session holds its bundle from admission to its end).
- Fleets: ``fixed`` (all nodes up all day); ``autoscaled`` (starts at --min-nodes; adds nodes when the
  bundles wanted (running + queued + --headroom warm slots) exceed the nodes up or coming, each ready
  after --provision-s; removes a node idle for --idle-timeout-s, as autoscalerOptions.idleTimeoutSeconds);
  ``pooled``: the same GPUs as ONE node, i.e. bundles could split across nodes: the packing ideal.

Speed: the policy scans every node it is given. Nodes with identical free resources are interchangeable
except for best fit's node_id tie-break, so each call gets, per class of identical nodes, the k smallest
ids, k = min(queue length + 1, free bundles in the fleet): no call admits more than k sessions, so this is
exactly the decision the full ledger gives (tests/unit/test_fleet_sim.py checks it against the full ledger).

Per session (printed first, `per_session` in the JSON): each topology's GPUs, sessions per 8-GPU node, and the
`57b` DiT rank's compute per chunk in bf16 and with FP8 linear layers: the FLOP floor at the H200's measured
rates (`characters.flops`) and the rank step measured on the H200 (benchmarks/h200/step_57b_tp*_fp8.json,
sequence parallel, communication excluded), against the 166.7 ms chunk budget.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import math
import os
import random
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from characters.config import TOPOLOGIES  # noqa: E402
from placement import (  # noqa: E402
    AdmissionQueue,
    Admit,
    Enqueue,
    Expire,
    NodeCapacity,
    PlacementSpec,
    Reject,
    Request,
    accelerator_resource,
    bundles_for,
    commit,
    decide,
    drain,
    free_bundles,
    release,
)
from placement.bundles import to_units  # noqa: E402
from scripts.benchmarks.results import latest, record  # noqa: E402

DAY_S = 86_400.0
TOPOLOGY_NAMES = ("h100x5", "h100x4", "b200x3")


@dataclass(frozen=True)
class Demand:
    peak_sessions: float = 360.0  # offered concurrency at the daily peak
    peak_to_trough: float = 2.0
    median_s: float = 180.0
    sigma: float = 0.75  # lognormal shape: mean = median * exp(sigma^2 / 2) ~ 238 s
    max_session_s: float = 900.0
    horizon_s: float = DAY_S
    warmup_s: float = 3600.0  # simulated before t=0 so the day starts in steady state; not counted
    seed: int = 0

    @property
    def mean_s(self) -> float:
        return self.median_s * math.exp(self.sigma**2 / 2)

    def rate(self, t: float) -> float:
        """Arrivals per second at time t: a sinusoid with its trough at midnight and its peak at noon."""
        a = (self.peak_to_trough - 1) / (self.peak_to_trough + 1)
        peak_rate = self.peak_sessions / self.mean_s
        return peak_rate / (1 + a) * (1 - a * math.cos(2 * math.pi * t / DAY_S))

    @property
    def peak_rate(self) -> float:
        return self.peak_sessions / self.mean_s


@dataclass(frozen=True)
class Fleet:
    topology: str
    mode: str = "fixed"  # fixed | autoscaled | pooled
    nodes: int = 200  # fixed and pooled: the fleet; autoscaled: the maximum
    gpus_per_node: int = 8
    cpus_per_node: int = 96
    min_nodes: int = 10
    headroom: int = 32  # autoscaled: free bundles kept ready (the scheduler's warm slots)
    provision_s: float = 600.0
    idle_timeout_s: float = 600.0
    tick_s: float = 15.0
    queue_max: int = 32
    queue_timeout_s: float = 30.0


@dataclass
class Result:
    topology: str
    mode: str
    arrivals: int = 0
    admitted: int = 0
    rejected: int = 0  # queue full: 503 + Retry-After at once
    expired: int = 0  # waited queue_timeout_s without a bundle
    still_queued: int = 0
    running_at_end: int = 0
    gpu_utilisation: float = 0.0  # busy GPU-seconds / GPU-seconds of nodes up (ready or provisioning)
    mean_nodes: float = 0.0
    max_nodes: int = 0
    peak_running: int = 0
    wait_p50_s: float = 0.0
    wait_p99_s: float = 0.0
    capacity_whole_node: int = 0  # sessions the (maximum) fleet holds, whole bundles per node
    capacity_ideal: int = 0  # sessions the same GPUs hold if bundles could split across nodes
    max_busy_gpus: int = 0
    max_total_gpus: int = 0
    wall_s: float = 0.0
    waits: list[float] = field(default_factory=list, repr=False)

    @property
    def refused_rate(self) -> float:
        return (self.rejected + self.expired) / self.arrivals if self.arrivals else 0.0

    def summary(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "waits"}
        out["refused_rate"] = self.refused_rate
        return out


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# ---------------------------------------------------------------------------------------------- ledger


@dataclass(frozen=True)
class MemoSpec(PlacementSpec):
    """bundles_for's spec, unchanged, with `demand()` summed once: the policy asks for it per queued request."""

    def demand(self) -> dict[str, float]:
        cached = self.__dict__.get("_demand")
        if cached is None:
            cached = super().demand()
            object.__setattr__(self, "_demand", cached)
        return dict(cached)

    @classmethod
    def of(cls, spec: PlacementSpec) -> MemoSpec:
        return cls(**{f.name: getattr(spec, f.name) for f in fields(spec)})



def _key(node: NodeCapacity) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((k, to_units(v)) for k, v in node.free.items()))


class Ledger:
    """The scheduler's node ledger, indexed by classes of identical free resources (see the module docstring)."""

    def __init__(self, spec: PlacementSpec) -> None:
        self.spec = spec
        self.nodes: dict[str, NodeCapacity] = {}
        self._classes: dict[tuple[tuple[str, int], ...], list[str]] = {}
        self._bundles: dict[tuple[tuple[str, int], ...], int] = {}

    def add(self, node: NodeCapacity) -> None:
        self.nodes[node.node_id] = node
        key = _key(node)
        bisect.insort(self._classes.setdefault(key, []), node.node_id)
        if key not in self._bundles:
            self._bundles[key] = free_bundles([node], self.spec)

    def remove(self, node_id: str) -> NodeCapacity:
        node = self.nodes.pop(node_id)
        members = self._classes[_key(node)]
        members.pop(bisect.bisect_left(members, node_id))
        if not members:
            del self._classes[_key(node)]
        return node

    def update(self, node: NodeCapacity) -> None:
        self.remove(node.node_id)
        self.add(node)

    def free_bundles(self) -> int:
        return sum(len(ids) * self._bundles[key] for key, ids in self._classes.items())

    def view(self, admits_at_most: int) -> tuple[NodeCapacity, ...]:
        """Per class, the ``k`` smallest node ids: decides exactly as the whole ledger when <= k admits happen."""
        k = min(admits_at_most, self.free_bundles())
        if k <= 0:
            return ()
        return tuple(self.nodes[i] for ids in self._classes.values() for i in ids[:k])

    def write_back(self, before: Iterable[NodeCapacity], after: Iterable[NodeCapacity]) -> list[NodeCapacity]:
        """Store the nodes a commit changed; returns them."""
        old = {n.node_id: n for n in before}
        changed = [n for n in after if n is not old[n.node_id]]
        for node in changed:
            self.update(node)
        return changed


# ------------------------------------------------------------------------------------------- simulation


class Simulation:
    def __init__(self, fleet: Fleet, demand: Demand, *, check: bool = False) -> None:
        topo = TOPOLOGIES[fleet.topology]
        self.fleet, self.demand, self.check = fleet, demand, check
        self.spec = MemoSpec.of(bundles_for(topo))
        self.session_gpus = int(self.spec.gpus)
        self.node_total = {"GPU": float(fleet.gpus_per_node), "CPU": float(fleet.cpus_per_node)}
        if topo.accelerator:
            self.node_total[accelerator_resource(topo.accelerator)] = 1.0
        self.per_node = free_bundles([NodeCapacity("n", self.node_total, self.node_total)], self.spec)
        self.ledger = Ledger(self.spec)
        self.queue = AdmissionQueue(max_len=fleet.queue_max)
        self.rng = random.Random(demand.seed)
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.now = 0.0
        self.sessions: dict[str, Admit] = {}
        self.durations: dict[str, float] = {}
        self.arrived: dict[str, float] = {}
        self.provisioning = 0
        self.idle_since: dict[str, float] = {}
        self.next_node = 0
        self.ready_gpus = 0  # GPUs of the nodes in the ledger (provisioning ones excluded)
        self.n_requests = 0
        self.busy_gpus = 0
        self.gpu_seconds = 0.0
        self.busy_gpu_seconds = 0.0
        self.node_seconds = 0.0
        self.result = Result(fleet.topology, fleet.mode)
        gpus = fleet.nodes * fleet.gpus_per_node
        self.result.capacity_whole_node = fleet.nodes * self.per_node
        pooled = {k: v * fleet.nodes for k, v in self.node_total.items()}
        self.result.capacity_ideal = free_bundles([NodeCapacity("pool", pooled, pooled)], self.spec)
        assert self.result.capacity_ideal == gpus // int(self.spec.gpus)

    # -------------------------------------------------------------------------------------- plumbing

    def push(self, at: float, kind: str, payload: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, payload))

    def new_node(self, scale: int = 1) -> None:
        total = {k: v * scale for k, v in self.node_total.items()}
        node_id = f"node-{self.next_node:05d}"
        self.next_node += 1
        self.ledger.add(NodeCapacity(node_id, free=dict(total), total=total))
        self.ready_gpus += int(total["GPU"])
        self.idle_since[node_id] = self.now

    def nodes_up(self) -> int:
        return len(self.ledger.nodes) + self.provisioning

    def total_gpus(self) -> int:
        per = self.fleet.gpus_per_node * (self.fleet.nodes if self.fleet.mode == "pooled" else 1)
        return per * self.nodes_up()

    def advance(self, to: float) -> None:
        dt = max(0.0, to - max(self.now, 0.0))  # statistics cover [0, horizon] only
        self.gpu_seconds += dt * self.total_gpus()
        self.busy_gpu_seconds += dt * self.busy_gpus
        self.node_seconds += dt * (self.fleet.nodes if self.fleet.mode == "pooled" else self.nodes_up())
        self.now = to

    def touched(self, nodes: Iterable[NodeCapacity]) -> None:
        for node in nodes:
            idle = all(to_units(node.free.get(k, 0.0)) == to_units(v) for k, v in node.total.items())
            if idle:
                self.idle_since.setdefault(node.node_id, self.now)
            else:
                self.idle_since.pop(node.node_id, None)

    def record(self, decisions: Iterable[Any]) -> None:
        r = self.result
        for d in decisions:
            if isinstance(d, Enqueue):
                self.push(self.now + self.fleet.queue_timeout_s, "deadline")
                continue
            arrived = self.arrived.pop(d.request_id)
            duration = self.durations.pop(d.request_id)
            counted = arrived >= 0.0  # warm-up arrivals are not counted
            if isinstance(d, Admit):
                self.sessions[d.request_id] = d
                self.busy_gpus += self.session_gpus
                self.push(self.now + duration, "end", d.request_id)
                if counted:
                    r.admitted += 1
                    r.waits.append(self.now - arrived)
            elif isinstance(d, Expire):
                r.expired += counted
            elif isinstance(d, Reject):
                r.rejected += counted
        if self.now >= 0.0:
            r.peak_running = max(r.peak_running, len(self.sessions))
            r.max_busy_gpus = max(r.max_busy_gpus, self.busy_gpus)
        if self.check:
            self.assert_consistent()

    def assert_consistent(self) -> None:
        used = sum(to_units(n.total["GPU"]) - to_units(n.free["GPU"]) for n in self.ledger.nodes.values())
        total = sum(to_units(n.total["GPU"]) for n in self.ledger.nodes.values())
        assert used == self.busy_gpus * 10_000 <= total, (used, self.busy_gpus, total)
        assert all(to_units(v) >= 0 for n in self.ledger.nodes.values() for v in n.free.values())

    # --------------------------------------------------------------------------- the scheduler's loop

    def drain_queue(self) -> None:
        if not len(self.queue):
            return
        if self.ledger.free_bundles() == 0 and min(r.deadline for r in self.queue) > self.now:
            return  # drain only Admits or Expires: nothing fits and nothing is due, so it would decide nothing
        view = self.ledger.view(len(self.queue))
        decisions = drain(view, self.queue, self.now)
        after, self.queue = commit(view, self.queue, decisions)
        self.touched(self.ledger.write_back(view, after))
        self.record(decisions)

    def arrive(self) -> None:
        self.result.arrivals += self.now >= 0.0
        self.n_requests += 1
        rid = f"r{self.n_requests:08d}"
        request = Request(rid, self.spec, arrived_at=self.now, deadline=self.now + self.fleet.queue_timeout_s)
        self.arrived[rid] = self.now
        self.durations[rid] = min(self.demand.max_session_s,
                                  self.rng.lognormvariate(math.log(self.demand.median_s), self.demand.sigma))
        self.drain_queue()
        view = self.ledger.view(len(self.queue) + 1)
        decision = decide(view, self.queue, request, self.now)
        after, self.queue = commit(view, self.queue, [decision], incoming=request)
        self.touched(self.ledger.write_back(view, after))
        self.record([decision])
        if isinstance(decision, Enqueue) and self.fleet.mode == "autoscaled":
            self.autoscale()

    def end(self, request_id: str) -> None:
        admit = self.sessions.pop(request_id)
        (node,) = release((self.ledger.nodes[admit.node_id],), admit)
        self.ledger.update(node)
        self.touched([node])
        self.busy_gpus -= self.session_gpus
        self.drain_queue()

    def autoscale(self) -> None:
        """Add nodes for the bundles wanted; remove nodes idle past the timeout that are not needed."""
        wanted = len(self.sessions) + len(self.queue) + self.fleet.headroom
        short = wanted - self.per_node * self.nodes_up()
        add = min(math.ceil(short / self.per_node), self.fleet.nodes - self.nodes_up()) if short > 0 else 0
        for _ in range(add):
            self.provisioning += 1
            self.push(self.now + self.fleet.provision_s, "ready")
        idle = sorted((i for i, t in self.idle_since.items() if self.now - t >= self.fleet.idle_timeout_s),
                      reverse=True)
        for node_id in idle:
            if self.nodes_up() <= self.fleet.min_nodes or self.per_node * (self.nodes_up() - 1) < wanted:
                break
            self.ready_gpus -= int(self.ledger.remove(node_id).total["GPU"])
            del self.idle_since[node_id]

    def run(self) -> Result:
        started = time.perf_counter()
        self.now = -self.demand.warmup_s
        if self.fleet.mode == "pooled":
            self.new_node(scale=self.fleet.nodes)
        else:
            for _ in range(self.fleet.min_nodes if self.fleet.mode == "autoscaled" else self.fleet.nodes):
                self.new_node()
            if self.fleet.mode == "autoscaled":
                self.push(self.now, "tick")
        self.push(self.next_arrival(self.now), "arrival")
        horizon = self.demand.horizon_s
        while self.events and self.events[0][0] <= horizon:
            at, _, kind, payload = heapq.heappop(self.events)
            self.advance(at)
            if kind == "arrival":
                self.arrive()
                self.push(self.next_arrival(at), "arrival")
            elif kind == "end":
                self.end(payload)
            elif kind == "deadline":
                self.drain_queue()
            elif kind == "ready":
                self.provisioning -= 1
                self.new_node()
                self.drain_queue()
            elif kind == "tick":
                self.autoscale()
                self.push(at + self.fleet.tick_s, "tick")
            if at >= 0.0:
                self.result.max_nodes = max(self.result.max_nodes, self.nodes_up())
                self.result.max_total_gpus = max(self.result.max_total_gpus, self.ready_gpus)
        self.advance(horizon)
        r = self.result
        r.still_queued = sum(q.arrived_at >= 0.0 for q in self.queue)
        r.running_at_end = len(self.sessions)
        r.gpu_utilisation = self.busy_gpu_seconds / self.gpu_seconds if self.gpu_seconds else 0.0
        r.mean_nodes = self.node_seconds / horizon
        r.wait_p50_s = percentile(r.waits, 0.50)
        r.wait_p99_s = percentile(r.waits, 0.99)
        r.wall_s = time.perf_counter() - started
        return r

    def next_arrival(self, t: float) -> float:
        """Next arrival of the non-homogeneous Poisson process (Lewis-Shedler thinning)."""
        top = self.demand.peak_rate
        while True:
            t += self.rng.expovariate(top)
            if self.rng.random() * top <= self.demand.rate(t):
                return t


MEASURED = {3: "step_57b_tp3_fp8.json", 4: "step_57b_tp4_fp8.json", 2: "step_57b_tp2_fp8.json"}


def per_session(topologies: Sequence[str], gpus_per_node: int = 8) -> list[dict[str, Any]]:
    """What one 57b session costs on each topology, and whether its DiT rank's compute fits the chunk budget."""
    from characters.config import session_config
    from characters.flops import H200_BF16_RATE, H200_FP8_RATE, chunk_cost

    rows = []
    for name in topologies:
        topo = TOPOLOGIES[name]
        cost = chunk_cost(session_config("57b", name))
        measured: dict[str, float | None] = {"bf16": None, "fp8": None}
        path = REPO / "benchmarks" / "h200" / MEASURED.get(topo.dit_ranks, "-")
        if path.is_file():
            for r in latest(path)["rows"]:
                if r.get("layout") == "sp" and r.get("attention_precision") == "bf16" and "ms_p50" in r:
                    measured[r["precision"]] = r["ms_p50"]
        rows.append({"topology": name, "dit_ranks": topo.dit_ranks, "gpus": topo.gpus,
                     "sessions_per_node": gpus_per_node // topo.gpus,
                     "idle_gpus_per_node": gpus_per_node % topo.gpus,
                     "floor_ms_bf16": cost.floor_ms(H200_BF16_RATE),
                     "floor_ms_fp8": cost.floor_ms(H200_BF16_RATE, H200_FP8_RATE),
                     "measured_ms_bf16": measured["bf16"], "measured_ms_fp8": measured["fp8"],
                     "budget_ms": 1000 * 4 / 24,
                     "measured_from": str(path.relative_to(REPO)) if path.is_file() else None})
    return rows


def print_per_session(rows: list[dict[str, Any]]) -> None:
    def ms(x: float | None) -> str:
        return f"{x:.1f}" if x is not None else "-"

    print("57b per session: DiT rank compute per chunk (ms; floor at H200 rates / measured on the H200, sequence "
          "parallel, communication excluded), budget 166.7 ms")
    print(f"{'topology':8} {'DiT+dec':>7} {'per 8-GPU node':>14} {'floor bf16':>10} {'floor fp8':>9} "
          f"{'meas. bf16':>10} {'meas. fp8':>9}")
    for r in rows:
        print(f"{r['topology']:8} {r['dit_ranks']:>4}+1 {r['sessions_per_node']:>6} ({r['idle_gpus_per_node']} idle) "
              f"{ms(r['floor_ms_bf16']):>10} {ms(r['floor_ms_fp8']):>9} {ms(r['measured_ms_bf16']):>10} "
              f"{ms(r['measured_ms_fp8']):>9}")


def simulate(fleet: Fleet, demand: Demand, *, check: bool = False) -> Result:
    return Simulation(fleet, demand, check=check).run()


def _run(args: tuple[Fleet, Demand]) -> dict[str, Any]:
    return simulate(*args).summary()


# ------------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--nodes", type=int, default=200)
    p.add_argument("--hours", type=float, default=24.0)
    p.add_argument("--peak-sessions", type=float, default=360.0, help="offered concurrent sessions at the peak")
    p.add_argument("--min-nodes", type=int, default=10)
    p.add_argument("--headroom", type=int, default=32, help="autoscaled: free bundles kept (warm slots)")
    p.add_argument("--provision-s", type=float, default=600.0)
    p.add_argument("--idle-timeout-s", type=float, default=600.0)
    p.add_argument("--topologies", nargs="+", default=list(TOPOLOGY_NAMES), choices=TOPOLOGY_NAMES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "estimates" / "fleet_sim.json")
    p.add_argument("--per-session-only", action="store_true", help="print the per-session table and stop")
    a = p.parse_args(argv)
    sessions = per_session(a.topologies)
    print_per_session(sessions)
    if a.per_session_only:
        return 0

    demand = Demand(peak_sessions=a.peak_sessions, horizon_s=a.hours * 3600, seed=a.seed)
    runs = [
        (Fleet(t, mode, nodes=a.nodes, min_nodes=a.min_nodes, headroom=a.headroom, provision_s=a.provision_s,
               idle_timeout_s=a.idle_timeout_s), demand)
        for t in a.topologies for mode in ("fixed", "autoscaled", "pooled")
    ]
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=a.jobs) as pool:
        results = list(pool.map(_run, runs))
    wall = time.perf_counter() - started
    for r in results:  # every request is accounted for, and no more GPUs were busy than were up
        assert r["admitted"] + r["rejected"] + r["expired"] + r["still_queued"] == r["arrivals"], r
        assert r["max_busy_gpus"] <= r["max_total_gpus"], r

    header = (f"{'topology':8} {'fleet':10} {'cap/ideal':>9} {'nodes avg/max':>13} {'GPU util':>8} {'arrivals':>8} "
              f"{'refused':>7} {'(full':>6} {'expired)':>8} {'wait p50':>8} {'wait p99':>8} {'peak run':>8}")
    print(f"{a.nodes} x {8}-GPU nodes, {a.hours:g} h, peak offered {a.peak_sessions:g} concurrent sessions "
          f"(peak/trough 2), mean session {demand.mean_s:.0f} s; wall {wall:.1f} s")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r['topology']:8} {r['mode']:10} {r['capacity_whole_node']:>4}/{r['capacity_ideal']:<4} "
              f"{r['mean_nodes']:>7.1f}/{r['max_nodes']:<5} {r['gpu_utilisation']:>8.1%} {r['arrivals']:>8} "
              f"{r['refused_rate']:>7.2%} {r['rejected']:>6} {r['expired']:>8} {r['wait_p50_s']:>7.1f}s "
              f"{r['wait_p99_s']:>7.1f}s {r['peak_running']:>8}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    record(a.out, {
        "config": {"nodes": a.nodes, "hours": a.hours, "demand": asdict(demand), "mean_session_s": demand.mean_s,
                   "fleet_defaults": asdict(runs[0][0]) | {"topology": None, "mode": None}},
        "wall_s": wall,
        "per_session": sessions,
        "results": results,
    })
    print(f"wrote {a.out.relative_to(REPO) if a.out.is_relative_to(REPO) else a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
