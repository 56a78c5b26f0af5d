"""`SlotManager`, the slot lifecycle of the scheduler, constructed directly with plain slot operations (no Ray):
build -> free -> leased -> reset -> free or removed; failed builds, lost and draining nodes, workers dead while idle,
surplus slots, adopted slots, and a shutdown during a build."""

from __future__ import annotations

import asyncio
from typing import Any

from deployments.sessions.pool import SlotManager
from deployments.sessions.slot import Slot
from deployments.settings import TelemetryConfig
from deployments.telemetry import SchedulerTelemetry, Telemetry
from placement import PlacementSpec

DEMAND = {"CPU": 2.0}


class FakeOps:
    """SlotOps over plain objects: builds wait on `gate` (when set) and fail for ids in `broken`."""

    def __init__(self) -> None:
        self.built: list[str] = []
        self.destroyed: list[str] = []
        self.abrupt: list[str] = []  # destroyed without a graceful teardown (their node is lost)
        self.resets: list[tuple[str, str]] = []
        self.broken = False
        self.dead: set[str] = set()
        self.gate: asyncio.Event | None = None
        self.reset_ok = True

    async def build(self, slot_id: str, node_id: str | None, trace_context: Any) -> Slot:
        if self.gate is not None:
            await self.gate.wait()
        if self.broken:
            raise RuntimeError("no GPU answered")
        self.built.append(slot_id)
        return Slot(slot_id, PlacementSpec("cpu", (), ()), None, [], None, None, node_id=node_id)

    async def reset(self, slot: Slot, session_id: str) -> bool:
        self.resets.append((slot.slot_id, session_id))
        return self.reset_ok

    async def ping(self, slot: Slot) -> bool:
        return slot.slot_id not in self.dead

    def destroy(self, slot: Slot, graceful: bool = True) -> None:
        self.destroyed.append(slot.slot_id)
        if not graceful:
            self.abrupt.append(slot.slot_id)

    async def settle(self) -> None:
        return None


class Harness:
    def __init__(self, target: int = 0) -> None:
        self.ops = FakeOps()
        self.lock = asyncio.Lock()
        self.tasks: list[asyncio.Task[Any]] = []
        self.built: list[tuple[str, str | None, bool]] = []  # (slot, error, lock held)
        tele = SchedulerTelemetry(Telemetry(TelemetryConfig(), "scheduler", "test"))
        self.slots = SlotManager(self.ops, target=target, demand=DEMAND, lock=self.lock, spawn=self.spawn,
                                 on_built=lambda s, e: self.built.append((s, e, self.lock.locked())), tele=tele)

    def spawn(self, coro: Any) -> None:
        self.tasks.append(asyncio.get_running_loop().create_task(coro))

    async def settle(self) -> None:
        await asyncio.gather(*self.tasks)
        self.tasks.clear()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_slot_builds_then_is_leased_reset_and_returned():
    async def go() -> None:
        h = Harness()
        slot_id = h.slots.add("node-a")
        assert h.slots.state(slot_id) == "warming" and h.slots.used() == {"node-a": [DEMAND]}
        assert h.slots.acquire() is None  # not ready yet
        await h.settle()
        assert h.built == [(slot_id, None, True)] and h.slots.state(slot_id) == "free"
        lease = h.slots.acquire()
        assert lease is not None and lease.slot_id == slot_id and h.slots.state(slot_id) == "leased"
        slot = h.slots.slot(slot_id)
        assert slot is not None and await h.slots.reset(slot, "s1") is True
        h.slots.release(lease, healthy=True)
        assert h.slots.state(slot_id) == "free" and h.ops.destroyed == [] and h.ops.resets == [(slot_id, "s1")]
    run(go())


def test_an_unhealthy_release_removes_the_slot_once():
    async def go() -> None:
        h = Harness()
        slot_id = h.slots.add("node-a")
        await h.settle()
        lease = h.slots.acquire()
        assert lease is not None
        h.slots.release(lease, healthy=False)
        h.slots.release(lease, healthy=False)  # idempotent
        assert h.ops.destroyed == [slot_id] and slot_id not in h.slots and h.slots.state(slot_id) is None
        assert h.slots.used() == {}
    run(go())


def test_a_slot_removed_before_its_build_began_builds_nothing():
    async def go() -> None:
        h = Harness()
        slot_id = h.slots.add("node-a")
        h.slots.drop_lost_nodes([])
        await h.settle()
        assert h.ops.built == [] and h.ops.destroyed == [] and h.built == [] and slot_id not in h.slots
    run(go())


def test_a_failed_build_frees_its_bundle_and_says_why():
    async def go() -> None:
        h = Harness()
        h.ops.broken = True
        slot_id = h.slots.add("node-a")
        await h.settle()
        assert h.built == [(slot_id, "slot_failed: no GPU answered", True)]
        assert slot_id not in h.slots and h.slots.used() == {} and h.slots.counts()["warming"] == 0
    run(go())


def test_slots_of_a_lost_node_go_but_a_leased_one_waits_for_its_session():
    async def go() -> None:
        h = Harness()
        leased_id, free_id, kept_id = h.slots.add("node-b"), h.slots.add("node-b"), h.slots.add("node-a")
        await h.settle()
        lease = h.slots.acquire()
        assert lease is not None and lease.slot_id == leased_id
        h.ops.gate = asyncio.Event()  # a slot still warming on the lost node
        warming_id = h.slots.add("node-b")
        await asyncio.sleep(0)  # its build is under way
        assert sorted(h.slots.drop_lost_nodes(["node-a"])) == sorted([free_id, warming_id])
        assert h.ops.destroyed == [free_id]  # the warming one had no actors yet
        assert h.slots.state(leased_id) == "leased" and h.slots.state(kept_id) == "free"
        h.slots.release(lease, healthy=True)  # its session ends: a slot that failed is removed all the same
        assert h.ops.destroyed == [free_id, leased_id]
        h.ops.gate.set()
        await h.settle()
        assert warming_id not in h.slots and warming_id in h.ops.destroyed  # built after it was dropped
        assert [b[0] for b in h.built] == [leased_id, free_id, kept_id]  # the dropped build was not announced
    run(go())


def test_a_draining_node_keeps_its_running_session_but_no_slot_returns_to_the_pool_there():
    """The scheduler passes the live nodes only, so a draining node is dropped like a lost one: what is free
    there goes now, the leased slot when its session ends (healthy or not), and `on_node` names them all."""
    async def go() -> None:
        h = Harness(target=3)
        busy_id, idle_id, other_id = h.slots.add("node-d"), h.slots.add("node-d"), h.slots.add("node-a")
        await h.settle()
        assert h.slots.on_node("node-d") == {busy_id, idle_id} and h.slots.on_node("gone") == set()
        lease = h.slots.acquire()
        assert lease is not None and lease.slot_id == busy_id
        for _ in range(3):  # every tick: idempotent
            h.slots.drop_lost_nodes(["node-a"])
        assert h.ops.destroyed == [idle_id] and h.slots.on_node("node-d") == {busy_id}
        assert h.slots.deficit() == 1  # the scheduler may build the replacement on a live node
        h.slots.release(lease, healthy=True)  # the session ran to its end
        assert h.ops.destroyed == [idle_id, busy_id] and h.slots.on_node("node-d") == set()
        assert h.slots.acquire() is not None and h.slots.acquire() is None  # only node-a's slot is handed out
        assert h.slots.used() == {"node-a": [DEMAND]} and other_id in h.slots
        assert h.ops.abrupt == []  # a draining node's slots are torn down gracefully
    run(go())


def test_the_slots_of_a_lost_node_are_destroyed_at_once_without_a_graceful_teardown():
    async def go() -> None:
        h = Harness()
        leased_id, free_id, kept_id = h.slots.add("node-b"), h.slots.add("node-b"), h.slots.add("node-a")
        await h.settle()
        lease = h.slots.acquire()
        assert lease is not None and lease.slot_id == leased_id
        h.slots.node_lost("node-b")
        h.slots.drop_lost_nodes(["node-a"])
        h.slots.release(lease, healthy=False)  # its session failed with the node
        assert sorted(h.ops.abrupt) == sorted([leased_id, free_id]) and kept_id in h.slots
        h.slots.node_lost("node-c")  # a node with nothing on it: node-b, now empty, is forgotten
        assert h.slots.lost == {"node-c"}
    run(go())


def test_a_free_slot_whose_worker_died_is_removed_before_anyone_gets_it():
    async def go() -> None:
        h = Harness()
        dead, alive = h.slots.add("node-a"), h.slots.add("node-a")
        await h.settle()
        h.ops.dead.add(dead)
        assert await h.slots.check_free() == [dead]
        lease = h.slots.acquire()
        assert lease is not None and lease.slot_id == alive and h.ops.destroyed == [dead]
    run(go())


def test_free_slots_above_target_are_retired_and_deficit_counts_up_to_it():
    async def go() -> None:
        h = Harness(target=1)
        assert h.slots.deficit() == 1
        first, second = h.slots.add("node-a"), h.slots.add("node-a")
        assert h.slots.deficit() == 0
        await h.settle()
        h.slots.retire_surplus()
        assert len(h.slots) == 1 and h.ops.destroyed == [second]  # the most recently freed goes
        assert h.slots.state(first) == "free"
    run(go())


def test_adopted_slots_hold_their_bundles_and_leases():
    async def go() -> None:
        h = Harness()
        spec = PlacementSpec("cpu", (), ())
        free = Slot("slot-free", spec, None, [], None, None, node_id="node-a")
        busy = Slot("slot-busy", spec, None, [], None, None, node_id="node-b")
        assert h.slots.adopt(free, leased=False) is None
        lease = h.slots.adopt(busy, leased=True)
        assert lease is not None and lease.slot_id == "slot-busy"
        assert h.slots.used() == {"node-a": [DEMAND], "node-b": [DEMAND]}
        assert h.slots.state("slot-free") == "free" and h.slots.state("slot-busy") == "leased"
    run(go())


def test_shutdown_removes_every_slot_even_leased_and_one_still_building():
    async def go() -> None:
        h = Harness(target=2)
        a = h.slots.add("node-a")
        await h.settle()
        lease = h.slots.acquire()
        assert lease is not None
        h.ops.gate = asyncio.Event()
        b = h.slots.add("node-a")
        await asyncio.sleep(0)  # its build is under way
        h.slots.remove_all()
        assert len(h.slots) == 0 and h.ops.destroyed == [a] and h.slots.deficit() == 0
        h.ops.gate.set()
        await h.settle()
        assert h.ops.destroyed == [a, b] and [x[0] for x in h.built] == [a]
        h.slots.release(lease, healthy=True)  # the ended session's release changes nothing
        assert h.ops.destroyed == [a, b]
    run(go())
