"""A restarted scheduler rebuilds its books from the cluster: the slots (placement groups and actors)
its predecessor made, and the sessions still streaming on them.

Slots are detached and named (`placement.names`), so they outlive a scheduler crash. On start the
scheduler lists the placement groups (`ray.util.placement_group_table`) and the named actors
(`ray.util.list_named_actors(all_namespaces=True)`) and, for each group named `<slot_id>@<itself>`:

    CREATED, every worker found by name, every DiT/decoder stage done, the room answering,
    and its one session actor (the slot's driver) answering `describe()`  -> adopted (`Found`)
    anything else (pending group, a worker missing or dead, still warming, no session actor
    or more than one)                                                    -> removed (group and actors)

An adopted slot holds its whole bundle in the new ledger before any request is decided, so a
restarted scheduler never admits onto a bundle that a surviving session holds. Its driver says what
it runs: nothing (the slot is free), a live session (the slot is leased to it; the scheduler waits
on `SessionActor.outcome(session_id)`), or an ended one the old scheduler never took (its outcome is
recorded; the slot was never reset, so it is removed). `adopt` enters what was found in the new
scheduler's books.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayError
from ray.util.placement_group import PlacementGroup, placement_group_table

from characters.config import SessionConfig
from deployments.pipeline.workers import STAGES
from deployments.sessions.book import SessionBook, SessionRecord
from deployments.sessions.pool import SlotManager
from deployments.sessions.runner import Outcome
from deployments.sessions.slot import Slot
from deployments.types import NAMESPACE
from placement.actor import node_of, release
from placement.bundles import PlacementSpec, bundles_for
from placement.names import parse_pg_name, session_actors_of, worker_name

log = logging.getLogger(__name__)

ADOPT_TIMEOUT_S = 10.0  # per slot: its actors must answer within this


class Unusable(RuntimeError):
    """A slot found on the cluster that cannot be adopted (the message says why); it is removed."""


@dataclass
class Found:
    """An adopted slot, and what its driver said of the session it runs or ran (`SessionActor.describe()`;
    None: the slot is free)."""

    slot: Slot
    session: dict[str, Any] | None = None


@dataclass
class Discovery:
    found: list[Found]
    removed: dict[str, str]  # slot id -> why it could not be adopted


async def discover(owner: str, cfg: SessionConfig, *, use_gpus: bool,
                   timeout_s: float = ADOPT_TIMEOUT_S) -> Discovery:
    """Every slot of scheduler `owner` on the cluster: adopted, or removed (see the module docstring)."""
    table = await asyncio.to_thread(placement_group_table)
    named = await asyncio.to_thread(ray.util.list_named_actors, True)
    names = [str(a["name"]) for a in named if isinstance(a, dict) and a.get("namespace") == NAMESPACE]
    spec = bundles_for(cfg, use_gpus=use_gpus)
    mine = []
    for pg_id, row in table.items():
        parsed = parse_pg_name(str(row.get("name", "")))
        if parsed is not None and parsed[1] == owner and row.get("state") != "REMOVED":
            mine.append((parsed[0], PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)), str(row.get("state"))))

    async def one(slot_id: str, pg: PlacementGroup, state: str) -> Found | str:
        try:
            return await asyncio.wait_for(_adopt(slot_id, pg, state, spec, names), timeout_s)
        except (Unusable, RayError, ValueError, TimeoutError) as err:
            why = f"{type(err).__name__}: {err}".splitlines()[0]
            log.warning("slot %s of a previous scheduler cannot be adopted (%s); removing it", slot_id, why)
            await asyncio.to_thread(scrap, slot_id, pg, names)
            return why

    results = await asyncio.gather(*(one(*m) for m in mine))
    return Discovery([r for r in results if isinstance(r, Found)],
                     {m[0]: r for m, r in zip(mine, results, strict=True) if isinstance(r, str)})


async def _adopt(slot_id: str, pg: PlacementGroup, state: str, spec: PlacementSpec, names: list[str]) -> Found:
    if state != "CREATED":
        raise Unusable(f"its placement group is {state}, not CREATED (the slot was being reserved)")

    def actor(name: str) -> Any:
        return ray.get_actor(name, namespace=NAMESPACE)  # ValueError: not there

    dits = [actor(worker_name(slot_id, "dit", r)) for r in range(spec.dit_ranks)]
    decoder, room = actor(worker_name(slot_id, "decoder")), actor(worker_name(slot_id, "room"))
    stages = await asyncio.gather(*(w.stages.remote() for w in [*dits, decoder]))
    warming = [i for i, s in enumerate(stages) if set(s) != set(STAGES)]
    if warming:
        raise Unusable(f"workers {warming} had not finished warming up ({stages[warming[0]]})")
    await room.ping.remote()
    drivers = session_actors_of(slot_id, names)
    if len(drivers) != 1:
        raise Unusable(f"it has {len(drivers)} session actors; a slot has one, its driver")
    driver = actor(drivers[0])
    described = await driver.describe.remote()
    slot = Slot(slot_id, spec, pg, dits, decoder, room, node_id=await asyncio.to_thread(node_of, pg),
                device=described["workers"].device, driver=driver,
                stages={f"dit{r}": s for r, s in enumerate(stages[:-1])} | {"decoder": stages[-1]})
    return Found(slot, described if described["spec"] is not None else None)


def scrap(slot_id: str, pg: PlacementGroup, names: list[str]) -> None:
    """Remove a slot that cannot be adopted: kill its named actors, remove its placement group."""
    for name in [n for n in names if n.startswith(f"{slot_id}.")]:
        with contextlib.suppress(RayError, ValueError):
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
    release(pg)


def adopt(found: Discovery, book: SessionBook, slots: SlotManager, owner: str) -> list[SessionRecord]:
    """Enter the slots and sessions a previous scheduler left into the new one's books (its lock held):
    free slots free, running sessions leased to their slots (returned: the scheduler waits on each one's
    end), sessions that ended unobserved recorded, their slots removed."""
    running = []
    for f in found.found:
        slot, d = f.slot, f.session
        if d is None:  # free
            slots.adopt(slot, leased=False)
            continue
        sess = book.add(book.new(d["spec"], d["status"], started_at=d["started_at"], stats=d["stats"]))
        sess.actor = slot.driver
        book.event(sess, "status", status=d["status"], detail="adopted by a restarted scheduler")
        o: Outcome | None = d["outcome"]
        if o is not None:  # ended unobserved: the slot was never reset, so it is removed
            book.terminal(sess, o.status, o.reason, o.stats)
            slots.adopt(slot, leased=False)
            slots.fail(slot.slot_id)
            continue
        sess.lease, sess.adopted = slots.adopt(slot, leased=True), True
        running.append(sess)
    if found.found or found.removed:
        log.warning("scheduler %s adopted %d slots (%d sessions) and removed %d it could not adopt: %s", owner,
                    len(found.found), sum(f.session is not None for f in found.found), len(found.removed),
                    found.removed)
    return running
