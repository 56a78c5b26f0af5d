"""scripts/tools/simulate_fleet.py: tiny simulations conserve requests and never use more GPUs than exist, and the
reduced ledger it hands the policy decides exactly as the full ledger (pure CPU, no marker)."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest

from characters.config import TOPOLOGIES
from placement import AdmissionQueue, NodeCapacity, Request, bundles_for, decide, drain

REPO = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("simulate_fleet", REPO / "scripts" / "tools" / "simulate_fleet.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["simulate_fleet"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


sim = _load()
TINY = sim.Demand(peak_sessions=14.0, horizon_s=2 * 3600, warmup_s=900, seed=3)


@pytest.mark.parametrize("mode", ["fixed", "autoscaled", "pooled"])
@pytest.mark.parametrize("topology", ["h100x5", "h100x4", "b200x3"])
def test_tiny_simulation_conserves_requests_and_gpus(topology: str, mode: str) -> None:
    fleet = sim.Fleet(topology, mode, nodes=6, min_nodes=2, headroom=1, provision_s=300, idle_timeout_s=300,
                      queue_max=4)
    r = sim.simulate(fleet, TINY, check=True)  # check: every event asserts the ledger against the sessions
    assert r.arrivals > 100
    assert r.admitted + r.rejected + r.expired + r.still_queued == r.arrivals
    assert len(r.waits) == r.admitted
    assert 0 < r.max_busy_gpus <= r.max_total_gpus <= 6 * 8
    assert 0.0 < r.gpu_utilisation <= 1.0
    assert r.peak_running * bundles_for(TOPOLOGIES[topology]).gpus <= r.max_total_gpus
    assert r.peak_running <= (r.capacity_ideal if mode == "pooled" else r.capacity_whole_node)
    assert 0.0 <= r.wait_p50_s <= r.wait_p99_s <= fleet.queue_timeout_s


def test_overload_refuses_and_ideal_packing_holds_more() -> None:
    """6 nodes of h100x5 hold 6 sessions whole, 9 pooled: an offered peak of 14 must refuse, less so pooled."""
    fixed = sim.simulate(sim.Fleet("h100x5", "fixed", nodes=6, queue_max=4), TINY, check=True)
    pooled = sim.simulate(sim.Fleet("h100x5", "pooled", nodes=6, queue_max=4), TINY, check=True)
    assert (fixed.capacity_whole_node, fixed.capacity_ideal) == (6, 9)
    assert fixed.peak_running == 6 and pooled.peak_running == 9
    assert fixed.rejected > 0 and fixed.expired > 0
    assert pooled.refused_rate < fixed.refused_rate
    assert fixed.arrivals == pooled.arrivals  # the same seeded demand


def test_autoscaler_stays_within_bounds() -> None:
    fleet = sim.Fleet("h100x4", "autoscaled", nodes=6, min_nodes=2, headroom=1, provision_s=300, idle_timeout_s=300)
    r = sim.simulate(fleet, TINY, check=True)
    assert 2 <= r.mean_nodes <= r.max_nodes <= 6


def test_demand_curve_peaks_at_twice_the_trough() -> None:
    d = sim.Demand(peak_sessions=300.0)
    assert d.rate(sim.DAY_S / 2) == pytest.approx(2 * d.rate(0.0))
    assert d.rate(sim.DAY_S / 2) == pytest.approx(d.peak_rate)
    assert d.rate(sim.DAY_S / 2) * d.mean_s == pytest.approx(300.0)


@pytest.mark.parametrize("topology", ["h100x5", "h100x4", "b200x3"])
def test_reduced_ledger_decides_exactly_as_the_full_ledger(topology: str) -> None:
    """Random ledgers and queues: decide and drain give identical decisions on Ledger.view and on every node."""
    spec = sim.MemoSpec.of(bundles_for(TOPOLOGIES[topology]))
    accel = f"accelerator_type:{TOPOLOGIES[topology].accelerator}"
    total = {"GPU": 8.0, "CPU": 96.0, accel: 1.0}
    rng = random.Random(7)
    for trial in range(300):
        ledger = sim.Ledger(spec)
        for i in range(rng.randint(0, 25)):
            gpus = rng.choice([0, 1, 3, 4, 5, 8, 8, 8])
            cpus = rng.choice([96.0, 95.0, 1.0, 0.0])
            ledger.add(NodeCapacity(f"node-{rng.randrange(10_000):05d}-{i}", free={"GPU": float(gpus), "CPU": cpus,
                                    accel: 1.0 - (8 - gpus) * 0.001}, total=total))
        now = 100.0
        queue = AdmissionQueue(max_len=6)
        for j in range(rng.randint(0, 6)):
            queue = queue.push(Request(f"q{j}", spec, arrived_at=0.0, deadline=rng.choice([now - 1, now + 30])))
        full = tuple(ledger.nodes.values())
        assert drain(ledger.view(len(queue)), queue, now) == drain(full, queue, now), trial
        incoming = Request("new", spec, arrived_at=now, deadline=now + 30)
        assert decide(ledger.view(len(queue) + 1), queue, incoming, now) == decide(full, queue, incoming, now), trial


def test_memo_spec_is_the_same_spec() -> None:
    spec = bundles_for(TOPOLOGIES["h100x5"])
    memo = sim.MemoSpec.of(spec)
    assert memo.demand() == spec.demand() and memo.bundles == spec.bundles and memo.roles == spec.roles
    memo.demand()["GPU"] = 0.0  # callers get a copy
    assert memo.demand() == spec.demand()
