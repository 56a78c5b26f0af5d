"""`SlotManager`: the lifecycle of a scheduler's slots, apart from the decisions about sessions.

A slot is one placement group whose workers have loaded and warmed up (`deployments.sessions.slot`). The
manager keeps one record per slot (the bundle it holds in the ledger, the built `Slot` once ready) and the
`WarmPool`'s books, and does every lifecycle step:

    add(node) -> build (reserve, workers through their stages, compile the graph) -> free   (on_built)
    free -> acquire() -> leased -> reset(slot, session) -> release(healthy) -> free | removed
    free / warming on a lost or draining node, a free slot whose worker died idle, a failed build -> removed
    leased on a lost or draining node -> removed when its session releases it (never handed out again)
    adopt(found)   slots a previous scheduler left on the cluster (`deployments.sessions.adoption`)

`SessionScheduler` decides which session gets which slot and when to add or retire one; it calls the
manager under its own lock (every synchronous method here expects that lock held) and hears of finished
builds through `on_built(slot_id, error)`, called with the lock held. The Ray side (`SlotOps`) is injected,
so tests drive the whole lifecycle with plain objects.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from ray.exceptions import RayError

from characters.config import SessionConfig
from deployments.pipeline.graph import classify
from deployments.sessions.slot import Slot, build_slot, destroy_slot, ping_slot, reset_slot, retire_slot
from deployments.settings import ServiceConfig
from deployments.telemetry import Admission, SchedulerTelemetry, SlotTrace
from placement import Admit, Lease, SlotState, WarmPool

log = logging.getLogger(__name__)


class SlotOps(Protocol):
    """The Ray side of a slot's lifecycle (`RaySlotOps`); tests pass plain objects. `destroy` returns at
    once (a graph's teardown may run on; `graceful=False`: none, the slot's node is gone); `settle` waits
    until every destroyed slot is gone."""

    async def build(self, slot_id: str, node_id: str | None, trace_context: Mapping[str, str]) -> Slot: ...
    async def reset(self, slot: Slot, session_id: str) -> bool: ...
    async def ping(self, slot: Slot) -> bool: ...
    def destroy(self, slot: Slot, graceful: bool = True) -> None: ...
    async def settle(self) -> None: ...


class RaySlotOps:
    """`SlotOps` on the cluster: `deployments.sessions.slot`'s functions with the service's settings."""

    def __init__(self, cfg: SessionConfig, service: ServiceConfig, *, owner: str, use_gpus: bool) -> None:
        self.cfg, self.service, self.owner, self.use_gpus = cfg, service, owner, use_gpus
        self._retiring: set[asyncio.Task[None]] = set()

    async def build(self, slot_id: str, node_id: str | None, trace_context: Mapping[str, str]) -> Slot:
        return await build_slot(slot_id, self.cfg, self.service, use_gpus=self.use_gpus, node_id=node_id,
                                trace_context=trace_context, owner=self.owner)

    async def reset(self, slot: Slot, session_id: str) -> bool:
        return await reset_slot(slot, session_id, self.service.chunk_path.chunk_timeout_s)

    async def ping(self, slot: Slot) -> bool:
        return await ping_slot(slot)

    def destroy(self, slot: Slot, graceful: bool = True) -> None:
        """Graph torn down by the driver first, then actors killed and the group removed (`retire_slot`), in
        the background; the slot's bundle is already free in the ledger (its record is gone). Not graceful
        (its node is lost): the group is removed at once, before Ray could place it again elsewhere."""
        if not graceful:
            destroy_slot(slot)
            return
        task = asyncio.get_running_loop().create_task(retire_slot(slot, self.service.teardown_timeout_s + 3.0))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def settle(self) -> None:
        await asyncio.gather(*self._retiring, return_exceptions=True)


@dataclass
class SlotRecord:
    slot_id: str
    admit: Admit  # what the slot holds in the ledger
    slot: Slot | None = None  # None while building
    built_for: str | None = None  # the session whose admission started it (cold start); None: a warm-pool slot
    trace: SlotTrace | None = None  # the slot's own trace (telemetry)


class SlotManager:
    """A scheduler's slots and warm pool (see the module docstring)."""

    def __init__(self, ops: SlotOps, *, target: int, demand: Mapping[str, float], lock: asyncio.Lock,
                 spawn: Callable[[Coroutine[Any, Any, Any]], None], on_built: Callable[[str, str | None], None],
                 tele: SchedulerTelemetry) -> None:
        self.ops, self.demand, self.lock, self.tele = ops, demand, lock, tele
        self.spawn, self.on_built = spawn, on_built
        self.records: dict[str, SlotRecord] = {}
        self.lost: set[str] = set()  # nodes lost with slots on them (`node_lost`)
        self.pool = WarmPool(target)

    # ------------------------------------------------------------------------------ queries (lock held)
    def __contains__(self, slot_id: str) -> bool:
        return slot_id in self.records

    def __len__(self) -> int:
        return len(self.records)

    def state(self, slot_id: str) -> SlotState | None:
        return self.pool.state(slot_id)

    def counts(self) -> dict[SlotState, int]:
        return self.pool.counts()

    def used(self) -> dict[str, list[Mapping[str, float]]]:
        """Node id -> the bundles its slots hold (the ledger's used side)."""
        used: dict[str, list[Mapping[str, float]]] = {}
        for rec in self.records.values():
            used.setdefault(rec.admit.node_id, []).append(rec.admit.demand)
        return used

    def on_node(self, node_id: str) -> set[str]:
        """The ids of the slots held on `node_id` (any state)."""
        return {rec.slot_id for rec in self.records.values() if rec.admit.node_id == node_id}

    def slot(self, slot_id: str) -> Slot | None:
        rec = self.records.get(slot_id)
        return None if rec is None else rec.slot

    def trace(self, slot_id: str) -> SlotTrace | None:
        rec = self.records.get(slot_id)
        return None if rec is None else rec.trace

    def describe(self, sessions_on: Callable[[str], list[str]]) -> list[dict[str, Any]]:
        """Slots and their actors (tests and operators)."""
        return [{"slot_id": rec.slot_id, "state": self.pool.state(rec.slot_id), "node_id": rec.admit.node_id,
                 "sessions": sessions_on(rec.slot_id), **(rec.slot.describe() if rec.slot else {"actors": []})}
                for rec in self.records.values()]

    # ------------------------------------------------------------------------------ changes (lock held)
    def add(self, node_id: str, built_for: Admission | None = None, session_id: str | None = None) -> str:
        """A new slot on `node_id` (its bundle is booked from now on); its build runs in the background and
        ends in `on_built`. `built_for`/`session_id`: the admission that asked for it (a cold start)."""
        slot_id = f"slot-{uuid.uuid4().hex[:10]}"
        trace = self.tele.slot_building(slot_id, built_for)
        self.records[slot_id] = SlotRecord(slot_id, Admit(slot_id, node_id, self.demand), built_for=session_id,
                                           trace=trace)
        self.pool.add(slot_id)
        self.spawn(self._build(slot_id))
        return slot_id

    def acquire(self) -> Lease | None:
        """The slot free longest, leased; None when no warm slot is free."""
        return self.pool.acquire()

    def release(self, lease: Lease, *, healthy: bool) -> None:
        """The lease's session is over (its slot reset when `healthy`): free again, or removed."""
        if self.pool.release(lease, healthy=healthy) == "remove":
            self.remove(lease.slot_id)

    def fail(self, slot_id: str) -> None:
        """The slot is unusable (lost node, dead worker, shutdown): removed now, or when its lease ends."""
        self.pool.fail(slot_id)
        if self.pool.state(slot_id) in ("draining", None):
            self.remove(slot_id)

    def remove(self, slot_id: str) -> None:
        """Kill the slot's actors, remove its placement group, forget it (at once when its node is lost)."""
        rec = self.records.pop(slot_id, None)
        if rec is not None and rec.slot is not None:
            self.ops.destroy(rec.slot, graceful=rec.admit.node_id not in self.lost)
        if self.pool.state(slot_id) == "draining":
            self.pool.forget(slot_id)

    def set_target(self, target: int) -> None:
        self.pool.set_target(target)

    def retire_surplus(self) -> None:
        """Remove free slots above the warm target."""
        for slot_id in self.pool.surplus():
            self.pool.retire(slot_id)
            self.remove(slot_id)

    def deficit(self) -> int:
        """Slots to start to reach the warm target."""
        return self.pool.deficit()

    def node_lost(self, node_id: str) -> None:
        """`node_id` is gone: its slots, removed from now on, are destroyed at once, without a graceful
        teardown that would wait on its dead actors (and let Ray place their group again elsewhere)."""
        self.lost = {n for n in self.lost if any(r.admit.node_id == n for r in self.records.values())} | {node_id}

    def drop_lost_nodes(self, alive: Iterable[str]) -> list[str]:
        """Slots on nodes not in `alive` (lost, or draining): free and warming ones are removed now (their ids
        returned), a leased one when its session releases it (a lost node's session fails with its node; a
        draining node's runs to its end), never to be handed out again. Idempotent."""
        alive = set(alive)
        lost = [rec.slot_id for rec in self.records.values() if rec.admit.node_id not in alive]
        for slot_id in lost:
            self.fail(slot_id)
        return [slot_id for slot_id in lost if slot_id not in self.records]

    def adopt(self, slot: Slot, *, leased: bool) -> Lease | None:
        """A ready slot a previous scheduler left (`deployments.sessions.adoption`): free, or leased to the
        session still running on it (its new lease returned)."""
        self.records[slot.slot_id] = SlotRecord(slot.slot_id, Admit(slot.slot_id, slot.node_id or "", self.demand),
                                                slot=slot)
        return self.pool.adopt(slot.slot_id, leased=leased)

    def remove_all(self) -> None:
        """Remove every slot, leased ones too (shutdown), and keep none warm."""
        self.pool.set_target(0)
        for slot_id in list(self.records):
            self.pool.fail(slot_id)
            self.remove(slot_id)

    # ------------------------------------------------------------------------------ lifecycle (no lock)
    async def settle(self) -> None:
        """Wait until every slot removed so far is gone from the cluster (its teardown runs on after `remove`)."""
        await self.ops.settle()

    async def reset(self, slot: Slot, session_id: str) -> bool:
        """Wipe the session's state from every worker of the slot; False when that failed."""
        return await self.ops.reset(slot, session_id)

    async def check_free(self) -> list[str]:
        """Ping the workers of free slots: one that died idle is removed before a session gets it."""
        free = [rec for rec in self.records.values() if rec.slot is not None and self.pool.state(rec.slot_id) == "free"]
        results = await asyncio.gather(*(self.ops.ping(rec.slot) for rec in free if rec.slot is not None))
        dead = []
        async with self.lock:
            for rec, alive in zip(free, results, strict=True):
                if not alive and self.pool.state(rec.slot_id) == "free":
                    log.warning("warm slot %s lost a worker while idle; removing it", rec.slot_id)
                    self.fail(rec.slot_id)
                    dead.append(rec.slot_id)
        return dead

    async def _build(self, slot_id: str) -> None:
        rec = self.records.get(slot_id)
        if rec is None:  # removed before its build began (a lost node, a shutdown)
            return
        trace = rec.trace or SlotTrace(slot_id, None, {})
        try:
            slot = await self.ops.build(slot_id, rec.admit.node_id, trace.context)
        except Exception as err:  # any failure: the slot is gone, and whoever waits on it must hear why
            log.exception("slot %s failed to build", slot_id)
            self.tele.slot_built(trace, error=type(err).__name__)
            async with self.lock:
                self.fail(slot_id)
                self.on_built(slot_id, f"slot_failed: {classify(err) if isinstance(err, RayError) else err}")
            return
        self.tele.slot_built(trace, node_id=slot.node_id, device=slot.device)
        self.tele.worker_stages(slot.stages)
        async with self.lock:
            if slot_id not in self.records:  # removed meanwhile (shutdown)
                self.ops.destroy(slot)
                return
            rec.slot = slot
            if slot.node_id and slot.node_id != rec.admit.node_id:
                rec.admit = replace(rec.admit, node_id=slot.node_id)
            if not self.pool.ready(slot_id):
                self.remove(slot_id)
            self.on_built(slot_id, None)
