"""Helpers shared by the runtime's Ray tests (a real local cluster on loopback, logical GPUs)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import ray
from waiting import wait_for as _wait_for

from deployments.sessions.scheduler import get_or_create_scheduler
from deployments.settings import ServiceConfig
from deployments.types import OutputSpec, SessionEvent, SessionInfo, SessionSpec, SessionStatus

# A tiny preset cut down for speed on 2 cores: one DiT block, 64x96, a decoder without res blocks.
SMALL = {"dit": {"num_layers": 1}, "generation": {"height": 64, "width": 96}, "vae": {"num_res_blocks": 0}}


def small_service(**fields: Any) -> ServiceConfig:
    # The compiled graph, as on GPUs: these tests are about its failures, leaks and teardown (on CPUs the
    # service's default is plain actor calls, which the LiveKit and client tests run; `graph_mode`).
    base: dict[str, Any] = {"topology": "gpu1", "model_overrides": SMALL, "queue_timeout_s": 120.0,
                            "placement_timeout_s": 60.0, "graph": "compiled"}
    return ServiceConfig(**(base | fields))


def spec(session_id: str, service: ServiceConfig, **fields: Any) -> SessionSpec:
    g = service.session_config().model.generation
    image = np.random.default_rng(3).integers(0, 256, (g.height, g.width, 3), dtype=np.uint8)
    fields.setdefault("output", OutputSpec("null"))
    return SessionSpec(session_id, image, preset=service.preset, **fields)


@contextmanager
def scheduler(service: ServiceConfig, name: str) -> Iterator[Any]:
    """A scheduler actor of its own name; shut down (all slots removed) and killed afterwards."""
    handle = get_or_create_scheduler(service, name=name)
    try:
        yield handle
    finally:
        ray.get(handle.shutdown.remote(), timeout=120)
        ray.kill(handle)


def wait_for(fn: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.05) -> Any:
    """`waiting.wait_for`, polling every 50 ms by default (the scheduler answers at once)."""
    return _wait_for(fn, timeout_s, what, every_s)


def info(sched: Any, session_id: str) -> SessionInfo:
    return ray.get(sched.get_session.remote(session_id))  # type: ignore[no-any-return]


def wait_status(sched: Any, session_id: str, status: SessionStatus, timeout_s: float = 90.0) -> SessionInfo:
    def check() -> SessionInfo | None:
        i = info(sched, session_id)
        if i.status.terminal and i.status is not status:
            raise AssertionError(f"session {session_id} ended {i.status} ({i.reason}) while waiting for {status}")
        return i if i.status is status else None

    return wait_for(check, timeout_s, f"{session_id} {status}", every_s=0.1)  # type: ignore[no-any-return]


def all_events(sched: Any, session_id: str) -> list[SessionEvent]:
    return ray.get(sched.events.remote(session_id, 0, 0.0))  # type: ignore[no-any-return]


def chunk_digests(sched: Any, session_id: str) -> dict[int, str]:
    out = {}
    for e in all_events(sched, session_id):
        if e.kind == "chunk" and e.chunk is not None and e.detail:
            out[e.chunk] = e.detail.split()[0].removeprefix("digest=")
    return out


def wait_chunks(sched: Any, session_id: str, n: int, timeout_s: float = 60.0) -> dict[int, str]:
    return wait_for(lambda: (d := chunk_digests(sched, session_id)) and len(d) >= n and d,  # type: ignore[no-any-return]
                    timeout_s, f"{n} chunks of {session_id}", every_s=0.2)


def slots(sched: Any) -> list[dict[str, Any]]:
    return ray.get(sched.debug_slots.remote())  # type: ignore[no-any-return]


def actor_ids(slot: dict[str, Any], driver: bool = False) -> set[str]:
    """The slot's workers (and its session actor, the slot's driver)."""
    actors = [*slot["actors"], *([slot["driver"]] if driver and slot.get("driver") else [])]
    return {a._actor_id.hex() for a in actors}


def alive_actor_ids() -> set[str]:
    from ray.util.state import list_actors

    address = ray.get_runtime_context().gcs_address  # never another local cluster's
    return {a.actor_id for a in list_actors(address=address, filters=[("state", "=", "ALIVE")], limit=10_000)}


def pg_state(pg_id: str) -> str:
    return str(ray.util.placement_group_table().get(pg_id, {}).get("state", "MISSING"))


def reference_digests(service: ServiceConfig, session: SessionSpec, chunks: int) -> list[str]:
    """The first chunks' frame digests of `session` made in this process, without Ray (silent audio)."""
    from characters.audio import chunk_sample_range
    from deployments.pipeline.output import RoomWorker
    from deployments.pipeline.workers import ChunkInput, DecoderWorker, DiTWorker

    cfg = service.session_config()
    dit, dec, room = DiTWorker(cfg), DecoderWorker(cfg), RoomWorker(cfg)
    for w in (dit, dec):
        w.init_device()
    dit.init_process_group(0)
    dec.init_process_group()
    for w in (dit, dec):
        w.load_weights()
        w.warm_up()
    sid = session.session_id
    dit.start(sid, dec.encode_reference(sid, session.image), session.seed)
    dec.start(sid)
    room.open(sid, OutputSpec("null"))
    out = []
    for k in range(chunks):
        a, b = chunk_sample_range(k, cfg.model.generation.frames_per_chunk)
        inp = ChunkInput(sid, k, np.zeros(b - a, np.float32))
        out.append(room.publish(inp, dec.decode(dit.step(inp))).digest)  # type: ignore[arg-type]
    return out
