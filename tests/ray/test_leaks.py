"""Leaks: many short sessions back to back on a real local cluster leave actors, placement groups,
threads, file descriptors and process memory where they started (`scripts/tools/soak.py` does the same
for an hour and plots it).

One cluster for the module: 2 logical GPUs, topology gpu1, the cut-down tiny preset (`SMALL`), the
state API (dashboard) to see every actor, named or not. One warm slot is kept, so every session but
the first reuses the same workers and the same session actor (the slot's driver, which holds its
compiled graph): state a session leaves in any of them would pile up there.
"""

from __future__ import annotations

import gc
import json
import os
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import psutil
import pytest
import ray
from deploy_helpers import info, scheduler, slots, small_service, spec, wait_chunks, wait_for, wait_status

from deployments.sessions.cluster import init_local, stop_local
from deployments.types import SessionStatus

pytestmark = pytest.mark.ray

SESSIONS = 8
RSS_TOLERANCE_MB = 20.0  # per process, first to last session: allocator arenas move
WORKER_SLOPE_MB = 0.5  # RSS growth per session over the second half: a leak shows as a steady slope


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[None]:
    init_local(num_cpus=8, num_gpus=2, dashboard=True)
    yield
    stop_local()


def alive_actors() -> Counter[str]:
    """Alive actors by class."""
    from ray.util.state import list_actors

    address = ray.get_runtime_context().gcs_address
    return Counter(a.class_name for a in list_actors(address=address, filters=[("state", "=", "ALIVE")],
                                                     limit=10_000))


def live_pgs() -> set[str]:
    return {pg_id for pg_id, row in ray.util.placement_group_table().items() if row["state"] != "REMOVED"}


def pid_of(actor: Any) -> int:
    return int(ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=30))


def frozen(actor: Any) -> int:
    """Objects the actor's process froze out of the garbage collector's reach (`characters.cpu.freeze_heap`)."""
    return int(ray.get(actor.__ray_call__.remote(lambda _self: __import__("gc").get_freeze_count()), timeout=30))


def snapshot(processes: dict[str, int]) -> dict[str, Any]:
    gc.collect()
    me = psutil.Process()
    out: dict[str, Any] = {"driver": {"rss_mb": me.memory_info().rss / 2**20, "threads": threading.active_count(),
                                      "fds": me.num_fds()}}
    for name, pid in processes.items():
        p = psutil.Process(pid)
        out[name] = {"rss_mb": p.memory_info().rss / 2**20, "threads": p.num_threads(), "fds": p.num_fds()}
    return out


def one_session(sched: Any, service: Any, i: int, driver: Any = None) -> None:
    """Session s<i>; with the slot's `driver` (its session actor), the previous session's late calls
    reach it mid-session and must be dropped (the session then ends with its own reason, not "stale")."""
    sid = f"s{i}"
    ray.get(sched.create_session.remote(spec(sid, service, max_duration_s=2.0 if i % 2 else 600.0)))
    wait_chunks(sched, sid, 4, timeout_s=60)
    speech = (np.random.default_rng(i).standard_normal(8000) * 6000).astype("<i2").tobytes()  # 0.5 s
    if driver is not None:
        assert ray.get(driver.push_audio.remote(f"s{i - 1}", speech, 16000, 1)) == 0.0
        ray.get(driver.stop.remote(f"s{i - 1}", "stale"))
    ray.get(sched.push_audio.remote(sid, speech, 16000, 1))
    if i % 2:
        assert wait_status(sched, sid, SessionStatus.ENDED, timeout_s=30).reason == "max_duration"
    else:
        assert ray.get(sched.end_session.remote(sid)).reason == "deleted"
    wait_for(lambda: [s for s in slots(sched) if s["state"] == "free"], 30, "the slot back in the pool")


@pytest.fixture(scope="module")
def run() -> dict[str, Any]:
    """SESSIONS sessions back to back after a warm-up one; what was counted before, after each, and at the end."""
    before_all = (alive_actors(), live_pgs())
    service = small_service(queue_max=0, warm_slots=1)
    out: dict[str, Any] = {}
    with scheduler(service, "t-leaks") as sched:
        one_session(sched, service, 0)  # warm-up: imports, first-use allocations, the slot itself
        (slot,) = slots(sched)
        procs = {"scheduler": pid_of(sched), "dit": pid_of(slot["actors"][0]), "decoder": pid_of(slot["actors"][1]),
                 "room": pid_of(slot["actors"][2]), "session": pid_of(slot["driver"])}
        out["base_actors"], out["base_pgs"], out["trail"] = alive_actors(), live_pgs(), [snapshot(procs)]
        actors = {"dit": slot["actors"][0], "decoder": slot["actors"][1], "room": slot["actors"][2],
                  "session": slot["driver"]}
        out["frozen"] = [{name: frozen(a) for name, a in actors.items()}]
        for i in range(1, SESSIONS + 1):
            one_session(sched, service, i, slot["driver"])
            out["trail"].append(snapshot(procs))
        assert info(sched, f"s{SESSIONS}").stats.chunks >= 4
        out["frozen"].append({name: frozen(a) for name, a in actors.items()})
        (after,) = slots(sched)
        out["same_slot"] = after["slot_id"] == slot["slot_id"]  # the same warm slot served every session
        out["same_driver"] = after["driver"]._actor_id == slot["driver"]._actor_id  # and the same session actor
        wait_for(lambda: alive_actors() == out["base_actors"], 30, f"actors back to {dict(out['base_actors'])}")
        out["end_actors"], out["end_pgs"] = alive_actors(), live_pgs()
    # shut down: every slot, actor and placement group the scheduler made is gone
    wait_for(lambda: alive_actors() == before_all[0], 30, f"actors back to {dict(before_all[0])}")
    out["before_all"], out["shutdown_pgs"] = before_all, live_pgs()
    trail = out["trail"]
    half = trail[len(trail) // 2:]
    out["per_session_mb"] = {name: round(trend([t[name]["rss_mb"] for t in half]), 2) for name in trail[0]}
    print("\nleaks: RSS MB per session over the second half (Theil-Sen):", json.dumps(out["per_session_mb"]),
          "\nRSS MB after each session:", json.dumps({name: [round(t[name]["rss_mb"], 1) for t in trail]
                                                       for name in trail[0]}),
          "\nfirst/last:", json.dumps(trail[0]), json.dumps(trail[-1]))
    return out


def trend(values: list[float]) -> float:
    """Growth per step, robust to a transient: the median of the slopes between every pair of points
    (Theil-Sen). A leak raises every pair's slope; a buffer still in flight at one snapshot moves a few."""
    slopes = [(values[j] - values[i]) / (j - i) for i in range(len(values)) for j in range(i + 1, len(values))]
    return float(np.median(slopes))


def test_the_trend_sees_a_steady_leak_through_a_transient_and_ignores_a_transient_alone() -> None:
    leak = [600.0 + 0.6 * k for k in range(5)]
    leak[2] -= 3.0  # a transient at one snapshot (0.8 MB/session of end-to-end noise was seen in CI)
    assert trend(leak) == pytest.approx(0.6)
    assert trend(leak) > WORKER_SLOPE_MB
    dip = [658.5, 661.3, 661.3, 661.4, 661.4]  # a decoder's second half with a 3 MB dip at its first snapshot
    assert (dip[-1] - dip[0]) / 4 > WORKER_SLOPE_MB  # end to end it read as 0.73 MB/session (a CI failure)
    assert trend(dip) == pytest.approx(0.075)


def test_sessions_back_to_back_leave_no_actor_group_thread_or_fd(run: dict[str, Any]) -> None:
    assert run["same_slot"] and run["same_driver"]
    assert run["end_actors"] == run["base_actors"]
    assert run["end_pgs"] == run["base_pgs"]
    assert run["shutdown_pgs"] == run["before_all"][1]
    first, last = run["trail"][0], run["trail"][-1]
    for name in first:
        assert last[name]["threads"] - first[name]["threads"] <= 2, (name, first[name], last[name])
    for name in ("driver", "scheduler"):
        assert last[name]["fds"] - first[name]["fds"] <= 2, (name, first[name], last[name])


def test_every_slot_process_froze_its_warm_heap_and_nothing_of_a_session(run: dict[str, Any]) -> None:
    """Built, each process of the slot froze what it had (tens of thousands of objects: modules, weights, Ray's
    state); its sessions after froze nothing more (a frozen cycle would never be freed)."""
    first, last = run["frozen"]
    for name, count in first.items():
        assert count >= 50_000, (name, first)
        assert last[name] <= count, (name, first, last)


def test_driver_and_scheduler_memory_stays_flat(run: dict[str, Any]) -> None:
    """The scheduler keeps ended sessions (ended_max) for get/list, but without their images: ~0.1 MB each."""
    for name in ("driver", "scheduler"):
        assert run["per_session_mb"][name] <= WORKER_SLOPE_MB, (name, run["per_session_mb"])
        assert run["trail"][-1][name]["rss_mb"] - run["trail"][0][name]["rss_mb"] <= RSS_TOLERANCE_MB


def test_worker_memory_stays_flat(run: dict[str, Any]) -> None:
    """A compiled graph per session left ~1.4-3.8 MB of channel pages in every worker per session (Ray
    never frees a graph's channels); the slot's one graph, kept across sessions, leaves nothing."""
    for name in ("dit", "decoder", "room", "session"):
        assert run["per_session_mb"][name] <= WORKER_SLOPE_MB, (name, run["per_session_mb"])
        assert run["trail"][-1][name]["fds"] - run["trail"][0][name]["fds"] <= 2, name
