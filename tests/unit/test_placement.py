"""Admission policy: exhaustive and randomised checks on plain values (pure CPU, no Ray, no marker)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from itertools import permutations, product

import pytest

from characters.config import TOPOLOGIES, TopologyConfig
from placement import (
    AdmissionQueue,
    Admit,
    Decision,
    Enqueue,
    Expire,
    NodeCapacity,
    PlacementSpec,
    Reject,
    Request,
    apply,
    bundles_for,
    commit,
    decide,
    drain,
    free_bundles,
    release,
)
from placement.bundles import to_units

H100 = "accelerator_type:H100"


def gpu_spec(gpus: int, room_cpus: float = 1.0) -> PlacementSpec:
    """A session of `gpus` H100s: gpus-1 DiT ranks plus a decoder GPU."""
    topo = TopologyConfig(
        name=f"h100x{gpus}", dit_ranks=gpus - 1, decoder_gpus=1, accelerator="H100", room_cpus=room_cpus
    )
    return bundles_for(topo)


def node(
    node_id: str, gpus: float, cpus: float = 16.0, total_gpus: float = 8.0, accel: str | None = "H100"
) -> NodeCapacity:
    """A node with `gpus` of `total_gpus` GPUs free and Ray's accelerator resource for `accel`."""
    free = {"GPU": float(gpus), "CPU": float(cpus)}
    total = {"GPU": float(total_gpus), "CPU": 16.0}
    if accel:
        free[f"accelerator_type:{accel}"] = total[f"accelerator_type:{accel}"] = 1.0
    return NodeCapacity(node_id, free, total, {"ray.io/accelerator-type": accel or ""})


def req(request_id: str, spec: PlacementSpec, arrived_at: float = 0.0, deadline: float = 100.0) -> Request:
    return Request(request_id, spec, arrived_at, deadline)


def gpus_free(nodes: Sequence[NodeCapacity]) -> dict[str, float]:
    return {n.node_id: n.free["GPU"] for n in nodes}


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_admission_exhaustive_small_fleets(k: int) -> None:
    """Every fleet of 1-3 nodes with 0..8 free GPUs: admit iff one node fits all k GPUs, best fit."""
    spec = gpu_spec(k)
    cases = 0
    for n in (1, 2, 3):
        for frees in product(range(9), repeat=n):
            nodes = tuple(node(f"n{i}", g) for i, g in enumerate(frees))
            fitting = sorted((g - k, f"n{i}") for i, g in enumerate(frees) if g >= k)
            for order in (nodes, nodes[::-1]):  # input order never matters
                d = decide(order, AdmissionQueue(4), req("r", spec), now=0.0)
                if not fitting:
                    assert d == Enqueue("r", 1)
                    continue
                assert d == Admit("r", fitting[0][1], {"CPU": 1.0, "GPU": float(k), H100: k / 1000})
                assert isinstance(d, Admit)
                after = apply(order, d)
                want = {f"n{i}": g - (k if f"n{i}" == d.node_id else 0) for i, g in enumerate(frees)}
                assert gpus_free(after) == want
                assert all(v >= 0 for m in after for v in m.free.values())
            cases += 1
    assert cases == 9 + 81 + 729
    assert free_bundles([node("a", 8), node("b", 8)], spec) == 2 * (8 // k)


def test_admission_exhaustive_gpus_and_cpus() -> None:
    """CPU counts too: a node needs 3 GPUs AND 1.5 CPUs free (room_cpus) to host the bundle."""
    spec = gpu_spec(3, room_cpus=1.5)
    per_node = list(product(range(6), (0.0, 0.5, 1.0, 1.5, 2.0)))
    for n in (1, 2):
        for fleet in product(per_node, repeat=n):
            nodes = [node(f"n{i}", g, c) for i, (g, c) in enumerate(fleet)]
            fitting = sorted((g - 3, f"n{i}") for i, (g, c) in enumerate(fleet) if g >= 3 and c >= 1.5)
            d = decide(nodes, AdmissionQueue(1), req("r", spec), now=0.0)
            assert d == (Admit("r", fitting[0][1], spec.demand()) if fitting else Enqueue("r", 1))


def test_accelerator_type_must_match() -> None:
    spec = gpu_spec(2)
    nodes = [node("a100", 8, accel="A100"), node("plain", 8, accel=None)]
    assert decide(nodes, AdmissionQueue(1), req("r", spec), 0.0) == Enqueue("r", 1)
    assert decide([*nodes, node("h100", 2)], AdmissionQueue(1), req("r", spec), 0.0) == Admit(
        "r", "h100", spec.demand()
    )
    any_gpu = bundles_for(TOPOLOGIES["gpu1"])
    assert decide(nodes, AdmissionQueue(1), req("r", any_gpu), 0.0) == Admit("r", "a100", any_gpu.demand())
    cpu_only = bundles_for(TOPOLOGIES["cpu"], use_gpus=False)
    cpu_node = NodeCapacity("cpu", {"CPU": 2.0}, {"CPU": 2.0})
    assert decide([cpu_node], AdmissionQueue(1), req("r", cpu_only), 0.0) == Admit("r", "cpu", {"CPU": 2.0})


def test_fragmentation_4_plus_4_cannot_host_5() -> None:
    nodes = [node("a", 4), node("b", 4)]
    assert decide(nodes, AdmissionQueue(2), req("r", gpu_spec(5)), 0.0) == Enqueue("r", 1)
    assert free_bundles(nodes, gpu_spec(5)) == 0
    assert free_bundles(nodes, gpu_spec(4)) == 2


def test_best_fit_prefers_least_leftover_then_node_id() -> None:
    q = AdmissionQueue(1)
    nodes = [node("c", 5), node("a", 8), node("b", 5)]
    assert decide(nodes, q, req("r", gpu_spec(5)), 0.0) == Admit("r", "b", gpu_spec(5).demand())
    nodes = [node("a", 8), node("b", 3), node("c", 2)]
    assert decide(nodes, q, req("r", gpu_spec(2)), 0.0) == Admit("r", "c", gpu_spec(2).demand())


def test_stale_admit_is_refused_not_overcommitted() -> None:
    """Two decisions made from the same ledger (a race): the second apply raises."""
    nodes = (node("a", 4),)
    first = decide(nodes, AdmissionQueue(2), req("r1", gpu_spec(4)), 0.0)
    second = decide(nodes, AdmissionQueue(2), req("r2", gpu_spec(4)), 0.0)
    assert first == Admit("r1", "a", gpu_spec(4).demand())
    assert isinstance(first, Admit) and isinstance(second, Admit)
    after = apply(nodes, first)
    with pytest.raises(ValueError, match="refusing to over-commit node 'a'"):
        apply(after, second)
    with pytest.raises(ValueError, match="not in the ledger"):
        apply(after, Admit("r3", "zzz", {"GPU": 1.0}))


def test_release_restores_and_refuses_double_release() -> None:
    nodes = (node("a", 8), node("b", 8))
    admit = Admit("r", "a", gpu_spec(5).demand())
    used = apply(nodes, admit)
    assert used[0].free == {"GPU": 3.0, "CPU": 15.0, H100: 0.995}
    assert used[0].used() == {"GPU": 5.0, "CPU": 1.0, H100: 0.005}
    assert release(used, admit) == nodes
    with pytest.raises(ValueError, match="released twice"):
        release(nodes, admit)
    assert release(nodes[1:], admit) == nodes[1:]  # its node left the cluster: nothing to give back


def test_queue_bound_and_retry_after() -> None:
    spec, nodes = gpu_spec(4), apply((node("a", 4),), Admit("s", "a", gpu_spec(4).demand()))
    q = AdmissionQueue(2)
    d1 = decide(nodes, q, req("r1", spec, 0.0, 30.0), 0.0)
    nodes, q = commit(nodes, q, [d1], incoming=req("r1", spec, 0.0, 30.0))
    d2 = decide(nodes, q, req("r2", spec, 1.0, 20.2), 1.0)
    nodes, q = commit(nodes, q, [d2], incoming=req("r2", spec, 1.0, 20.2))
    d3 = decide(nodes, q, req("r3", spec, 2.5, 40.0), 2.5)
    assert (d1, d2, d3) == (Enqueue("r1", 1), Enqueue("r2", 2), Reject("r3", "queue_full", 18.0))
    assert q.ids == ("r1", "r2") and q.full
    assert decide(nodes, AdmissionQueue(0), req("r", spec), 0.0) == Reject("r", "queue_full", 5.0)
    assert decide(nodes, q, req("r4", spec, 20.0, 40.0), 19.9) == Reject("r4", "queue_full", 1.0)
    with pytest.raises(ValueError, match="is full"):
        q.push(req("r5", spec))
    with pytest.raises(ValueError, match="already queued"):
        decide(nodes, q, req("r1", spec), 0.0)
    with pytest.raises(ValueError, match="pass incoming"):
        commit(nodes, q, [Enqueue("r9", 3)])


def test_deadline_expiry() -> None:
    spec = gpu_spec(4)
    q = AdmissionQueue(3, (req("r1", spec, 0.0, 10.0), req("r2", spec, 1.0, 20.0)))
    busy, idle = (node("a", 0),), (node("a", 8),)
    assert drain(busy, q, 9.99) == []
    assert drain(busy, q, 10.0) == [Expire("r1")]
    # Capacity back exactly at r1's deadline: r1 is expired, never admitted; r2 gets it.
    assert drain(idle, q, 10.0) == [Expire("r1"), Admit("r2", "a", spec.demand())]
    nodes, q2 = commit(idle, q, drain(idle, q, 10.0))
    assert q2.ids == () and gpus_free(nodes) == {"a": 4.0}
    assert decide(busy, q, req("late", spec, 5.0, 5.0), 5.0) == Expire("late")
    assert decide(idle, q, req("late", spec, 5.0, 5.0), 5.0) == Expire("late")


def test_fifo_newcomer_never_jumps_fitting_queued_request() -> None:
    spec = gpu_spec(4)
    q = AdmissionQueue(3, (req("r1", spec),))
    nodes = (node("a", 4),)  # capacity just freed, not drained yet: it belongs to r1
    assert decide(nodes, q, req("r2", spec, 1.0), 1.0) == Enqueue("r2", 2)
    assert drain(nodes, q, 1.0) == [Admit("r1", "a", spec.demand())]
    # Room for both: the newcomer may take the rest.
    roomy = (node("a", 8),)
    assert decide(roomy, q, req("r2", spec, 1.0), 1.0) == Admit("r2", "a", spec.demand())


def test_backfill_past_a_queued_request_that_does_not_fit() -> None:
    big, small = gpu_spec(5), gpu_spec(3)
    q = AdmissionQueue(3, (req("big", big),))
    nodes = (node("a", 4),)
    assert decide(nodes, q, req("small", small, 1.0), 1.0) == Admit("small", "a", small.demand())


def test_drain_admits_in_queue_order() -> None:
    spec = gpu_spec(4)
    q = AdmissionQueue(4, tuple(req(f"r{i}", spec, float(i)) for i in (1, 2, 3)))
    nodes = (node("b", 0), node("a", 8))
    decisions = drain(nodes, q, 5.0)
    assert decisions == [Admit("r1", "a", spec.demand()), Admit("r2", "a", spec.demand())]
    nodes2, q2 = commit(nodes, q, decisions)
    assert q2.ids == ("r3",) and gpus_free(nodes2) == {"b": 0.0, "a": 0.0}
    # Mixed sizes: the 5-GPU head waits, later requests that fit go in order.
    q = AdmissionQueue(4, (req("h5", gpu_spec(5)), req("s2", gpu_spec(2)), req("s3", gpu_spec(3))))
    assert drain((node("a", 4),), q, 0.0) == [Admit("s2", "a", gpu_spec(2).demand())]


def test_interleavings_of_arrivals_and_releases() -> None:
    """All 120 orders of 3 arrivals (4 GPUs each) and 2 releases on nodes of 8 and 4 GPUs."""
    spec = gpu_spec(4)
    s1, s2 = Admit("s1", "a", spec.demand()), Admit("s2", "b", spec.demand())
    start = apply(apply((node("a", 8), node("b", 4, total_gpus=4)), s1), s2)
    events = ["r1", "r2", "r3", "s1", "s2"]
    for max_len in (3, 1):
        for order in permutations(events):
            nodes, q = start, AdmissionQueue(max_len)
            admitted: list[str] = []
            rejected: list[str] = []
            for t, event in enumerate(order):
                now = float(t)
                if event.startswith("s"):
                    nodes = release(nodes, s1 if event == "s1" else s2)
                else:
                    r = req(event, spec, now)
                    d = decide(nodes, q, r, now)
                    if isinstance(d, Reject):
                        assert len(q) == max_len and d.retry_after_s >= 1.0
                        rejected.append(event)
                    admitted += [event] if isinstance(d, Admit) else []
                    nodes, q = commit(nodes, q, [d], incoming=r)
                decisions = drain(nodes, q, now)
                admitted += [x.request_id for x in decisions if isinstance(x, Admit)]
                nodes, q = commit(nodes, q, decisions)
                assert all(0 <= n.free["GPU"] <= n.total["GPU"] for n in nodes)
                assert not any(fits_somewhere(nodes, r) for r in q)
            arrived = [e for e in order if e.startswith("r")]
            assert admitted == [e for e in arrived if e not in rejected]  # FIFO
            if max_len == 3:
                assert rejected == [] and gpus_free(nodes) == {"a": 0.0, "b": 0.0}


def fits_somewhere(nodes: Sequence[NodeCapacity], r: Request) -> bool:
    return any(n.fits(r.spec.demand()) for n in nodes)


def test_one_interleaving_exactly() -> None:
    spec = gpu_spec(4)
    s1, s2 = Admit("s1", "a", spec.demand()), Admit("s2", "b", spec.demand())
    nodes = apply(apply((node("a", 8), node("b", 4, total_gpus=4)), s1), s2)
    q = AdmissionQueue(3)
    log: list[Decision] = []
    for t, event in enumerate(["r1", "r2", "s2", "r3", "s1"]):
        if event.startswith("s"):
            nodes = release(nodes, s1 if event == "s1" else s2)
        else:
            d = decide(nodes, q, req(event, spec, t), float(t))
            log.append(d)
            nodes, q = commit(nodes, q, [d], incoming=req(event, spec, t))
        decisions = drain(nodes, q, float(t))
        log += decisions
        nodes, q = commit(nodes, q, decisions)
    assert log == [
        Admit("r1", "a", spec.demand()),
        Enqueue("r2", 1),
        Admit("r2", "b", spec.demand()),
        Enqueue("r3", 1),
        Admit("r3", "a", spec.demand()),
    ]


def test_random_sequences_never_overcommit() -> None:
    rng = random.Random(20261129)
    specs = [gpu_spec(k) for k in (2, 3, 4, 5)] + [bundles_for(TOPOLOGIES["gpu1"])]
    stats = dict.fromkeys(["admit", "enqueue", "reject", "expire", "drained"], 0)
    for _ in range(150):
        totals = [(rng.randint(0, 8), rng.randint(1, 6)) for _ in range(rng.randint(1, 4))]
        nodes = tuple(
            NodeCapacity(f"n{i}", {"GPU": g, "CPU": c, H100: 1.0}, {"GPU": g, "CPU": c, H100: 1.0})
            for i, (g, c) in enumerate(totals)
        )
        q, active, now = AdmissionQueue(rng.randint(0, 4)), dict[str, Admit](), 0.0
        for step in range(60):
            now += rng.uniform(0.0, 3.0)
            if rng.random() < 0.8:  # the actor normally drains first; decide must be fair either way
                decisions = drain(nodes, q, now)
                for d in decisions:
                    check_admit(d, q, now, active)
                    stats["drained" if isinstance(d, Admit) else "expire"] += 1
                nodes, q = commit(nodes, q, decisions)
                assert not any(fits_somewhere(nodes, r) for r in q if not r.expired(now))  # work conserving
            if active and rng.random() < 0.35:
                nodes = release(nodes, active.pop(rng.choice(sorted(active))))
            else:
                r = req(f"r{step}", rng.choice(specs), now, now + rng.uniform(0.0, 10.0))
                owed = {d.request_id for d in drain(nodes, q, now) if isinstance(d, Admit)}
                d = decide(nodes, q, r, now)
                stats[type(d).__name__.lower()] += 1
                if isinstance(d, Admit):
                    assert not r.expired(now) and d.request_id not in active
                    active[r.request_id] = d
                    then = {x.request_id for x in drain(apply(nodes, d), q, now) if isinstance(x, Admit)}
                    assert owed <= then  # FIFO: jumped ahead of no queued request that fit
                elif isinstance(d, Reject):
                    assert q.full and d.reason == "queue_full" and d.retry_after_s >= 1.0
                nodes, q = commit(nodes, q, [d], incoming=r)
            check_ledger(nodes, active)
    assert all(v > 50 for v in stats.values()), stats


def check_admit(d: Decision, q: AdmissionQueue, now: float, active: dict[str, Admit]) -> None:
    if isinstance(d, Admit):
        queued = next(r for r in q if r.request_id == d.request_id)
        assert not queued.expired(now)
        active[d.request_id] = d
    elif isinstance(d, Expire):
        assert next(r for r in q if r.request_id == d.request_id).expired(now)


def check_ledger(nodes: Sequence[NodeCapacity], active: dict[str, Admit]) -> None:
    """free + sum(active demand) == total on every node, and nothing is ever negative."""
    for n in nodes:
        for key, total in n.total.items():
            held = sum(to_units(a.demand.get(key, 0.0)) for a in active.values() if a.node_id == n.node_id)
            assert to_units(n.free[key]) + held == to_units(total)
            assert to_units(n.free[key]) >= 0
