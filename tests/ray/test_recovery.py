"""Session recovery (`recover: true`) on a real local cluster: a session whose bundle is lost resumes
on a fresh one, its chunks numbered on without a gap or a repeat, and the gap the viewer sees
(last chunk before the kill -> first chunk after) is measured.

One cluster for the module: 3 logical GPUs, topology gpu1, the cut-down tiny preset (`SMALL`).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray
from deploy_helpers import all_events, info, pg_state, scheduler, slots, small_service, spec, wait_chunks, wait_for

from deployments.sessions.cluster import init_local, stop_local
from deployments.types import NAMESPACE, SessionStatus
from placement.names import session_actors_of

pytestmark = pytest.mark.ray

MEASURED: dict[str, Any] = {}


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[None]:
    init_local(num_cpus=8, num_gpus=3)
    yield
    print("\nrecovery measured:", json.dumps(MEASURED, indent=1))
    stop_local()


def pid_of(actor: Any) -> int:
    return int(ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=30))


def chunk_times(sched: Any, session_id: str) -> list[tuple[int, float]]:
    return [(e.chunk, e.at) for e in all_events(sched, session_id) if e.kind == "chunk" and e.chunk is not None]


def kill_and_recover(sched: Any, sid: str, target: Any, slot: dict[str, Any], what: str) -> dict[str, Any]:
    """SIGKILL `target` (an actor of `sid`'s slot); wait until `sid` streams again on another slot."""
    pid = pid_of(target)
    before = chunk_times(sched, sid)
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: any(at > killed_at for _, at in chunk_times(sched, sid)), 120, f"{sid} back after the {what}",
             every_s=0.05)
    wait_chunks(sched, sid, len(before) + 12, timeout_s=60)
    times = chunk_times(sched, sid)
    events = all_events(sched, sid)
    lost_at = max(e.at for e in events if e.kind == "status" and (e.detail or "").startswith("recovering"))
    last_before = max(at for _, at in times if at <= lost_at)  # the old slot's last chunk
    first_after = min(at for _, at in times if at > lost_at)  # the new slot's first
    chunks = [c for c, _ in times]
    assert chunks == list(range(len(chunks))), chunks  # numbered on: no chunk lost from the count, none twice
    i = info(sched, sid)
    assert i.status is SessionStatus.RUNNING, i
    wait_for(lambda: pg_state(slot["pg_id"]) == "REMOVED", 10, "the lost slot's placement group removal")
    assert slot["slot_id"] not in {s["slot_id"] for s in slots(sched)}
    new = next(s for s in slots(sched) if sid in s["sessions"])
    assert new["slot_id"] != slot["slot_id"]
    return {"gap_s": round(first_after - last_before, 3), "kill_to_first_chunk_s": round(first_after - killed_at, 3),
            "kill_to_recovering_s": round(lost_at - killed_at, 3),
            "chunks_before": len(before), "late_chunks": i.stats.late_chunks}


def test_a_recover_session_resumes_on_a_fresh_bundle() -> None:
    service = small_service(queue_max=0, warm_slots=2)
    with scheduler(service, "t-recover") as sched:
        wait_for(lambda: sum(s["state"] == "free" for s in slots(sched)) == 2, 120, "two warm slots")
        ray.get(sched.create_session.remote(spec("r", service, recover=True, max_duration_s=600)))
        wait_chunks(sched, "r", 8, timeout_s=60)
        speech = (np.random.default_rng(0).standard_normal(16000 * 3) * 6000).astype("<i2").tobytes()  # 3 s
        ray.get(sched.push_audio.remote("r", speech, 16000, 1))
        wait_chunks(sched, "r", 14, timeout_s=60)

        # 1. a DiT worker dies: the session actor kept its history; the warm spare takes over
        slot = next(s for s in slots(sched) if "r" in s["sessions"])
        MEASURED["warm_dit_killed"] = kill_and_recover(sched, "r", slot["actors"][0], slot, "DiT worker's death")
        details = [e.detail or "" for e in all_events(sched, "r") if e.kind == "status"]
        assert any(d.startswith("recovering: actor_died: DiTWorker") and d.endswith("(attempt 1)") for d in details)
        statuses = [e.status for e in all_events(sched, "r") if e.kind == "status"]
        assert SessionStatus.FAILED not in statuses
        assert statuses[-3:] == [SessionStatus.STARTING, SessionStatus.READY, SessionStatus.RUNNING], statuses

        # 2. the session actor itself dies (its history with it): resumed from the reference alone
        wait_for(lambda: any(s["state"] == "free" for s in slots(sched)), 120, "the pool's replacement slot")
        slot = next(s for s in slots(sched) if "r" in s["sessions"])
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]
        (actor,) = session_actors_of(slot["slot_id"], names)
        target = ray.get_actor(actor, namespace=NAMESPACE)
        MEASURED["warm_session_actor_killed"] = kill_and_recover(sched, "r", target, slot, "session actor's death")
        ended = ray.get(sched.end_session.remote("r"))
        assert (ended.status, ended.reason) == (SessionStatus.ENDED, "deleted")


def test_with_no_warm_slot_it_resumes_on_a_cold_one() -> None:
    """(Without `recover` a session fails instead: tests/ray/test_faults.py.)"""
    service = small_service(queue_max=0, warm_slots=0)
    with scheduler(service, "t-recover-cold") as sched:
        ray.get(sched.create_session.remote(spec("cold", service, recover=True, max_duration_s=600)))
        wait_chunks(sched, "cold", 8, timeout_s=120)
        slot = next(s for s in slots(sched) if "cold" in s["sessions"])
        MEASURED["cold_decoder_killed"] = kill_and_recover(sched, "cold", slot["actors"][1], slot, "decoder's death")
        details = [e.detail or "" for e in all_events(sched, "cold") if e.kind == "status"]
        assert any(d.startswith("recovering: actor_died: DecoderWorker") for d in details), details
        ended = ray.get(sched.end_session.remote("cold"))
        assert (ended.status, ended.reason) == (SessionStatus.ENDED, "deleted")
