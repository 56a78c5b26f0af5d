"""Faults on a real local cluster: processes killed mid-session (SIGKILL of the actor's pid).

One cluster for the module: 3 logical GPUs, topology gpu1 (one GPU per bundle), the cut-down tiny
preset of `deploy_helpers.SMALL`. Expectations (issue 9):

- a dead DiT worker, decoder, room worker or session actor ends *its* session FAILED with a reason
  within 2 s, its placement group is removed, and a bystander session keeps its pace;
- a dead scheduler is restarted by Ray; its sessions stream on, and it adopts their slots from the
  cluster (named, detached placement groups and actors) without booking a bundle twice;
- a dead Serve replica and a redeploy of the application leave running sessions running.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from deploy_helpers import (
    all_events,
    info,
    pg_state,
    scheduler,
    slots,
    small_service,
    spec,
    wait_chunks,
    wait_for,
    wait_status,
)

from deployments.sessions.cluster import init_local, stop_local
from deployments.types import NAMESPACE, SCHEDULER_NAME, NoCapacity, SessionStatus
from placement.names import parse_pg_name, session_actors_of

pytestmark = pytest.mark.ray

CHUNKS_PER_S = 6.0  # 24 fps, 4 frames a chunk
PACE_WINDOW_S = 3.0
MEASURED: dict[str, Any] = {}  # printed at the end of the module (-s)


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[None]:
    init_local(num_cpus=8, num_gpus=3)
    yield
    print("\nfaults measured:", json.dumps(MEASURED, indent=1))
    stop_local()


def pid_of(actor: Any) -> int:
    return int(ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=30))


def session_actor(slot_id: str) -> Any:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]
    (name,) = session_actors_of(slot_id, names)  # while a session runs, its actor is the slot's only one
    return ray.get_actor(name, namespace=NAMESPACE)


def slot_of(sched: Any, session_id: str) -> dict[str, Any]:
    return next(s for s in slots(sched) if session_id in s["sessions"])


def chunk_times(sched: Any, session_id: str) -> list[tuple[int, float]]:
    return [(e.chunk, e.at) for e in all_events(sched, session_id) if e.kind == "chunk" and e.chunk is not None]


def pace(sched: Any, session_id: str, since: float, window_s: float = PACE_WINDOW_S) -> float:
    """Chunks per second `session_id` published in [since, since + window_s] (wall clock)."""
    wait_for(lambda: time.time() > since + window_s + 0.6, window_s + 5, "the pace window")  # + a report
    return sum(since <= at < since + window_s for _, at in chunk_times(sched, session_id)) / window_s


def wait_failed(sched: Any, session_id: str, t0: float, timeout_s: float = 10.0) -> tuple[Any, float]:
    done = wait_for(lambda: (i := info(sched, session_id)).status.terminal and i, timeout_s, f"{session_id} to end",
                    every_s=0.02)
    return done, time.monotonic() - t0


# ------------------------------------------------------------------------------------------ workers


@pytest.fixture(scope="class", params=["compiled", "actor_calls"])
def bystander(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A scheduler with a session that runs through every fault of the class, over the compiled graph (GPUs)
    and over plain actor calls (the default on CPUs)."""
    service = small_service(queue_max=0, warm_slots=0, graph=request.param)
    with scheduler(service, "t-faults") as sched:
        ray.get(sched.create_session.remote(spec("bystander", service, max_duration_s=600)))
        wait_chunks(sched, "bystander", 6, timeout_s=120)
        yield sched, service
        assert info(sched, "bystander").status is SessionStatus.RUNNING


class TestWorkerDeaths:
    @pytest.mark.parametrize(("victim", "culprit"), [("dit", "DiTWorker"), ("decoder", "DecoderWorker"),
                                                     ("room", "RoomWorker"), ("session", "SessionActor")])
    def test_a_dead_actor_fails_its_session_only(self, bystander: Any, victim: str, culprit: str) -> None:
        sched, service = bystander
        sid = f"victim-{victim}"
        ray.get(sched.create_session.remote(spec(sid, service, max_duration_s=600)))
        wait_chunks(sched, sid, 4, timeout_s=120)
        slot = slot_of(sched, sid)
        dit, decoder, room = slot["actors"]
        target = {"dit": dit, "decoder": decoder, "room": room}.get(victim) or session_actor(slot["slot_id"])
        pid = pid_of(target)

        since, t0 = time.time(), time.monotonic()
        os.kill(pid, signal.SIGKILL)
        failed, detect_s = wait_failed(sched, sid, t0)
        assert failed.status is SessionStatus.FAILED, failed
        reason = failed.reason or ""
        if victim == "session":
            assert reason.startswith("session_failed: actor_died"), reason
        else:
            assert reason.startswith(f"actor_died: {culprit}"), reason
        assert detect_s < 2.0, (victim, detect_s, reason)

        wait_for(lambda: pg_state(slot["pg_id"]) == "REMOVED", 10, "the placement group's removal")
        wait_for(lambda: slot["slot_id"] not in {s["slot_id"] for s in slots(sched)}, 10, "the slot's removal")
        rate = pace(sched, "bystander", since)
        by = info(sched, "bystander")
        MEASURED[f"kill_{victim}_{service.graph}"] = {"detect_s": round(detect_s, 3), "reason": reason,
                                      "bystander_chunks_per_s": round(rate, 2), "bystander_fps": round(by.stats.fps, 2)}
        assert by.status is SessionStatus.RUNNING
        assert rate >= 0.75 * CHUNKS_PER_S, (rate, by.stats)  # ~24 fps: a slip, not a stall
        assert ray.get(sched.capacity.remote()).bundles_free == 2  # the victim's bundle is back

    def test_z_a_restarted_scheduler_adopts_running_sessions_without_double_booking(self, bystander: Any) -> None:
        """Last in the class: the scheduler's own process dies; Ray restarts it under the same handle."""
        sched, service = bystander
        ray.get(sched.create_session.remote(spec("b", service, max_duration_s=600)))
        wait_chunks(sched, "b", 4, timeout_s=120)
        b_pg = slot_of(sched, "b")["pg_id"]
        before = {s["slot_id"]: s["pg_id"] for s in slots(sched)}
        pid = pid_of(sched)
        c0, t0 = info(sched, "bystander").stats.chunks, time.monotonic()
        os.kill(pid, signal.SIGKILL)

        def answers() -> bool:
            try:
                return bool(ray.get(sched.list_sessions.remote(), timeout=30))
            except ray.exceptions.RayActorError:  # restarting (ActorUnavailableError)
                return False

        wait_for(answers, 60, "the restarted scheduler", every_s=0.1)
        back_s = time.monotonic() - t0
        assert pid_of(sched) != pid
        time.sleep(2.0)
        rate = (info(sched, "bystander").stats.chunks - c0) / (time.monotonic() - t0)  # across the outage
        after = {s["slot_id"]: s["pg_id"] for s in slots(sched)}
        assert after == before  # the same slots, the same placement groups: adopted, not rebuilt
        for sid in ("bystander", "b"):
            i = info(sched, sid)
            assert i.status is SessionStatus.RUNNING, i
            n = i.stats.chunks
            wait_for(lambda sid=sid, n=n: info(sched, sid).stats.chunks >= n + 6, 30, f"{sid} streaming on")
        mine = [r for r in ray.util.placement_group_table().values()
                if (p := parse_pg_name(r["name"])) and p[1] == "t-faults" and r["state"] != "REMOVED"]
        assert len(mine) == 2
        cap = ray.get(sched.capacity.remote())
        assert (cap.bundles_total, cap.bundles_free, cap.sessions_running) == (3, 1, 2)

        # the one free bundle is booked once: c starts, d is refused
        assert ray.get(sched.create_session.remote(spec("c", service))).status is SessionStatus.STARTING
        with pytest.raises(NoCapacity):
            ray.get(sched.create_session.remote(spec("d", service)))
        wait_status(sched, "c", SessionStatus.RUNNING, timeout_s=120)

        # an adopted session still ends on request, and its slot goes away
        ended = ray.get(sched.end_session.remote("b"))
        assert (ended.status, ended.reason) == (SessionStatus.ENDED, "deleted")
        wait_for(lambda: pg_state(b_pg) == "REMOVED", 30, "b's placement group removal")
        ray.get(sched.end_session.remote("c"))
        statuses = [e.detail for e in all_events(sched, "b") if e.kind == "status"]
        MEASURED[f"kill_scheduler_{service.graph}"] = {"back_s": round(back_s, 3), "adopted_slots": len(after),
                                      "bystander_chunks_per_s_across_the_restart": round(rate, 2)}
        assert "adopted by a restarted scheduler" in statuses
        assert rate >= 0.75 * CHUNKS_PER_S, rate  # the sessions never noticed




# ------------------------------------------------------------------------------------------ Serve


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(base: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        return 0, str(e)


def _replicas() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and a["name"].startswith("SERVE_REPLICA::characters#CharactersIngress#")]


@pytest.mark.slow
def test_serve_replica_death_and_redeploy_leave_sessions_running() -> None:
    from ray import serve

    from characters.media import SAMPLE_IMAGE
    from deployments.api.app import APP_NAME, build_app

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    # the real tiny preset: the HTTP API sizes the avatar to the preset's own resolution
    args: dict[str, Any] = {"service": {"topology": "gpu1", "queue_max": 0, "placement_timeout_s": 60.0}}
    os.environ.pop("CHARACTERS_API_KEYS", None)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(args), name=APP_NAME, route_prefix="/")
        image = base64.b64encode(SAMPLE_IMAGE.read_bytes()).decode()
        status, created = _http(base, "POST", "/v1/sessions", {"avatar": {"image": image}, "maxDuration": 600})
        assert status == 201, created
        sid = created["id"]

        def chunks() -> int:
            code, body = _http(base, "GET", f"/v1/sessions/{sid}")
            assert code in (0, 200, 502, 503, 504), (code, body)  # the proxy may answer 5xx while no replica is up
            if code != 200:
                return -1
            assert body["status"] in ("STARTING", "READY", "RUNNING"), body
            return int(body["stats"]["chunks"])

        wait_for(lambda: chunks() >= 4, 120, "the session running")
        (replica,) = _replicas()
        n0, t0 = chunks(), time.monotonic()
        os.kill(pid_of(ray.get_actor(replica, namespace="serve")), signal.SIGKILL)
        wait_for(lambda: set(_replicas()) - {replica}, 90, "a new replica")
        wait_for(lambda: chunks() >= 0, 60, "the API answering again")
        MEASURED["kill_serve_replica"] = {"api_back_s": round(time.monotonic() - t0, 2)}
        wait_for(lambda: chunks() >= n0 + 12, 60, "the session streaming on after the replica's death")

        n1 = chunks()
        serve.run(build_app(args | {"ingress": {"max_ongoing_requests": 500}}), name=APP_NAME, route_prefix="/")
        wait_for(lambda: chunks() >= n1 + 12, 60, "the session streaming on after the redeploy")
        status, body = _http(base, "GET", f"/v1/sessions/{sid}")
        assert status == 200 and body["status"] == "RUNNING" and body["stats"]["lateChunks"] >= 0, body
        status, ended = _http(base, "DELETE", f"/v1/sessions/{sid}")
        assert status == 200 and ended["status"] == "ENDED" and ended["reason"] == "deleted", ended
    finally:
        try:
            sched = ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE)
            ray.get(sched.shutdown.remote(), timeout=60)
            ray.kill(sched)
        finally:
            serve.shutdown()
