"""Slots: one placement group with its workers, built, reset, pinged and destroyed here (Ray calls only).

A slot is built in the worker stages' order (STYLE 6) and is ready only when every worker is:

    reserve placement group (STRICT_PACK, from bundles_for) -> create actors, one per role, in their bundles
    -> init_device (all) -> init_process_group (DiT ranks; rank 0 picks the port) -> load_weights (all)
    -> warm_up (all at once: DiT ranks all-reduce) -> the session actor compiles the chunk graph

Any failure or timeout on the way destroys what was made (actors killed, placement group removed).
The slot's *driver* is a SessionActor (room bundle), started with the slot and kept as long as it:
it holds the slot's compiled chunk graph and drives the slot's sessions one after another, so a
session waits neither for a Python process to start nor for a graph to compile, and no graph is
compiled (and leaked: `deployments.pipeline.graph`) per session.

Slots outlive the scheduler that made them: the placement group and every actor are detached, named
by `placement.names` (group `<slot_id>@<scheduler>`, actors `<slot_id>.<role>`), so a scheduler
that crashes leaves its sessions streaming and, restarted, finds and adopts them.
GPU workers take `num_cpus=0` and their bundle's GPU (half of it each when the decoder shares DiT
rank 0's GPU); on a CPU-only cluster the same code takes the bundle's CPU instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from characters.config import SessionConfig
from deployments import telemetry
from deployments.pipeline.graph import Workers
from deployments.pipeline.handoff import resolve_transport
from deployments.pipeline.output import RoomWorker
from deployments.pipeline.workers import DecoderWorker, DiTWorker
from deployments.settings import ServiceConfig
from deployments.telemetry import names as N
from deployments.types import NAMESPACE, SCHEDULER_NAME
from placement.actor import node_of, release, reserve
from placement.bundles import PlacementSpec, bundles_for
from placement.names import pg_name, session_actor_name, worker_name

log = logging.getLogger(__name__)


@dataclass
class Slot:
    """A placement group whose workers are loaded and warm; it outlives sessions."""

    slot_id: str
    spec: PlacementSpec
    pg: Any  # ray.util.placement_group.PlacementGroup
    dits: list[Any]
    decoder: Any
    room: Any
    node_id: str | None = None
    device: str = "cpu"
    stages: dict[str, dict[str, float]] = field(default_factory=dict)
    build_s: float = 0.0
    driver: Any = None  # the slot's SessionActor: holds its compiled graph, drives its sessions one at a time

    def actors(self) -> list[Any]:
        """The workers (DiT ranks, decoder, room)."""
        return [*self.dits, self.decoder, self.room]

    def describe(self) -> dict[str, Any]:
        return {"pg_id": self.pg.id.hex(), "actors": self.actors(), "driver": self.driver, "stages": self.stages,
                "build_s": self.build_s, "device": self.device}

    def workers(self, service: ServiceConfig) -> Workers:
        transport = resolve_transport(service.transport, self.device, self.spec.decoder_shares_gpu)
        return Workers(self.dits, self.decoder, self.room, transport, self.device)

    def strategy(self, role_bundle: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=role_bundle,
                                                placement_group_capture_child_tasks=False)


def _share(spec: PlacementSpec, bundle: int, use_gpus: bool) -> dict[str, float]:
    """A worker's resources: its bundle's GPU (or CPU), halved when two roles share the bundle."""
    part = 1.0 / len(spec.role_of(bundle))
    return {"num_gpus": part, "num_cpus": 0} if use_gpus else {"num_gpus": 0, "num_cpus": part}


async def _all(calls: Iterable[Awaitable[Any]], timeout_s: float, what: str) -> list[Any]:
    async def gather() -> list[Any]:
        return list(await asyncio.gather(*calls))

    try:
        return await asyncio.wait_for(gather(), timeout_s)
    except TimeoutError as err:
        raise TimeoutError(f"slot stage {what!r} did not finish in {timeout_s:.0f} s (worker_timeout_s); "
                           "raise it for large models, or check the workers' logs") from err


DIT_ACTOR = ray.remote(concurrency_groups={"signal": 1})(DiTWorker)  # type: ignore[call-overload]  # `preempt`: beside the step


async def build_slot(slot_id: str, cfg: SessionConfig, service: ServiceConfig, *, use_gpus: bool,
                     node_id: str | None = None, trace_context: Mapping[str, str] | None = None,
                     owner: str = SCHEDULER_NAME) -> Slot:
    """Reserve, populate and warm one slot (see the module docstring); destroys it on any failure.
    `trace_context`: the slot's build span (W3C carrier): placement and every worker stage go under it.
    `owner`: the scheduler's actor name, in the placement group's name (found again after a restart)."""
    t0 = time.monotonic()
    spec = bundles_for(cfg, use_gpus=use_gpus)
    pg = await _reserve_traced(spec, slot_id, pg_name(slot_id, owner), node_id, service.placement_timeout_s,
                               trace_context or {})
    slot = Slot(slot_id, spec, pg, [], None, None)
    trace = dict(trace_context or {})
    try:
        auto, started_ns = service.dtype is None, time.time_ns()
        ranks = spec.dit_ranks
        for r in range(ranks):
            b = spec.bundle_of("dit", r)
            slot.dits.append(DIT_ACTOR.options(
                name=worker_name(slot_id, "dit", r), namespace=NAMESPACE, lifetime="detached",
                scheduling_strategy=slot.strategy(b),
                **_share(spec, b, use_gpus)).remote(cfg, rank=r, ranks=ranks, use_gpus=use_gpus, auto_dtype=auto,
                                                    trace_context=trace, nice=service.realtime_nice))
        b = spec.bundle_of("decoder")
        slot.decoder = ray.remote(DecoderWorker).options(
            name=worker_name(slot_id, "decoder"), namespace=NAMESPACE, lifetime="detached",
            scheduling_strategy=slot.strategy(b),
            **_share(spec, b, use_gpus)).remote(cfg, use_gpus=use_gpus, auto_dtype=auto, trace_context=trace,
                                                nice=service.realtime_nice,
                                                first_frame=service.chunk_path.onset_first_frame)
        b = spec.bundle_of("room")
        slot.room = ray.remote(RoomWorker).options(
            name=worker_name(slot_id, "room"), namespace=NAMESPACE, lifetime="detached",
            scheduling_strategy=slot.strategy(b),
            num_cpus=cfg.topology.room_cpus / 2).remote(cfg, chunk_path=service.chunk_path,
                                                      nice=service.realtime_nice)
        limit = service.worker_timeout_s
        devices = await _all((w.init_device.remote() for w in [*slot.dits, slot.decoder]), limit, "init_device")
        slot.device = devices[0]
        _span_since(N.SLOT_ACTORS, started_ns, trace, slot_id)  # process start and imports, up to init_device
        slot.driver = session_actor(slot, cfg, service)  # starts while the workers load and warm up
        port = await slot.dits[0].free_port.remote()
        await _all([*(w.init_process_group.remote(port) for w in slot.dits), slot.decoder.init_process_group.remote()],
                   limit, "init_process_group")
        await _all((w.load_weights.remote() for w in [*slot.dits, slot.decoder]), limit, "load_weights")
        await _all((w.warm_up.remote() for w in [*slot.dits, slot.decoder]), limit, "warm_up")
        stages = await _all((w.stages.remote() for w in [*slot.dits, slot.decoder]), limit, "stages")
        await _all((w.settle.remote() for w in slot.actors()), limit, "settle")  # warm: out of the GC's reach
        await _all([slot.driver.warm_up.remote()], limit, "compile")  # the chunk graph, for every session
        slot.stages = {f"dit{r}": s for r, s in enumerate(stages[:ranks])} | {"decoder": stages[-1]}
        slot.node_id = node_of(pg) or node_id
        slot.build_s = time.monotonic() - t0
        return slot
    except BaseException:
        destroy_slot(slot)
        raise


def _span_since(name: str, start_ns: int, trace_context: Mapping[str, str], slot_id: str) -> None:
    tel = telemetry.current()
    if tel.traces and trace_context:
        tel.start_span(name, telemetry.extract(trace_context), start_ns=start_ns,
                       attributes={N.SLOT_ID: slot_id}).end()


async def _reserve_traced(spec: PlacementSpec, slot_id: str, name: str, node_id: str | None, timeout_s: float,
                          trace_context: Mapping[str, str]) -> Any:
    """`reserve`, inside a `slot.placement` span (asked -> ready, or the error) under the slot's build span."""
    tel = telemetry.current()
    if not tel.traces:
        return await reserve(spec, name=name, node_id=node_id, timeout_s=timeout_s, detached=True)
    span = tel.start_span(N.SLOT_PLACEMENT, telemetry.extract(trace_context), attributes={
        N.SLOT_ID: slot_id, N.PLACEMENT_BUNDLES: len(spec.bundles), N.PLACEMENT_STRATEGY: spec.strategy})
    try:
        pg = await reserve(spec, name=name, node_id=node_id, timeout_s=timeout_s, detached=True)
    except BaseException as err:
        telemetry.fail(span, type(err).__name__)
        raise
    finally:
        span.end()
    return pg


# Ray warns of any ray.get in an asyncio actor's process, whatever the thread: the compiled graph's own
# monitor thread waits on its loops that way from the moment it is compiled. The SessionActor calls
# nothing blocking on its event loop (blocking work runs in threads); this keeps Ray's guess out of the log.
SESSION_ACTOR_ENV = {"RAY_WARN_BLOCKING_GET_INSIDE_ASYNC": "0"}


def session_actor(slot: Slot, cfg: SessionConfig, service: ServiceConfig) -> Any:
    """The slot's SessionActor, in its room bundle (its process starts now, in the background); named
    and detached like the workers, so it streams on through a scheduler restart."""
    from deployments.sessions.actor import SessionActor

    return ray.remote(SessionActor).options(
        name=session_actor_name(slot.slot_id, uuid.uuid4().hex[:8]), namespace=NAMESPACE, lifetime="detached",
        num_cpus=cfg.topology.room_cpus / 2, scheduling_strategy=slot.strategy(slot.spec.bundle_of("room")),
        runtime_env={"env_vars": SESSION_ACTOR_ENV},
    ).remote(cfg, service, slot.workers(service), slot_id=slot.slot_id)


async def reset_slot(slot: Slot, session_id: str, timeout_s: float) -> bool:
    """Wipe every worker's session state (KV cache, audio, decoder state; room closed), then have the
    driver forget `session_id` (the slot is free from then on, also to a restarted scheduler).
    False on failure."""
    try:
        await asyncio.wait_for(asyncio.gather(*(w.reset.remote() for w in slot.actors())), timeout_s)
        free: bool = await asyncio.wait_for(asyncio.wrap_future(slot.driver.forget.remote(session_id).future()),
                                            timeout_s)
    except (ray.exceptions.RayError, TimeoutError):
        return False
    return free


async def ping_slot(slot: Slot, timeout_s: float = 5.0) -> bool:
    """False when a worker or the driver of the slot is dead, or the driver's compiled graph broke (busy
    or slow counts as alive)."""
    try:
        answers = await asyncio.wait_for(asyncio.gather(*(a.ping.remote() for a in [*slot.actors(), slot.driver])),
                                         timeout_s)
    except ray.exceptions.RayActorError:
        return False
    except (ray.exceptions.RayError, TimeoutError):
        return True
    return answers[-1] is not False


async def retire_slot(slot: Slot, timeout_s: float) -> None:
    """Remove a slot that may still hold a compiled graph: its driver tears the graph down first (at most
    `timeout_s`; a dead or stuck driver is not waited for), then `destroy_slot`. Every actor's loop ends
    before its peers die, so a slot that served its last session leaves nothing alarming in the log."""
    if slot.driver is not None:
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            await asyncio.wait_for(asyncio.wrap_future(slot.driver.close.remote().future()), timeout_s)
    destroy_slot(slot)


def destroy_slot(slot: Slot, extra_actors: Iterable[Any] = ()) -> None:
    """Kill every actor of the slot, its driver first (and `extra_actors`); remove its placement group.
    (The driver's compiled graph would otherwise see its workers die and log a failed teardown.)"""
    for actor in [slot.driver, *slot.actors(), *extra_actors]:
        if actor is not None:
            with contextlib.suppress(ValueError, ray.exceptions.RayError):  # already dead
                ray.kill(actor, no_restart=True)
    release(slot.pg)
