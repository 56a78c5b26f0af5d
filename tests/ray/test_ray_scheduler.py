"""SessionScheduler on a real local cluster: admission, queueing, concurrency, endings and cleanup.

One cluster for the module: 2 logical GPUs, topology gpu1 (one GPU per session bundle), so exactly
two sessions fit. The state API (dashboard) checks that removed slots leave no actor behind.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import ray
from deploy_helpers import (
    actor_ids,
    alive_actor_ids,
    chunk_digests,
    info,
    pg_state,
    reference_digests,
    scheduler,
    slots,
    small_service,
    spec,
    wait_chunks,
    wait_for,
    wait_status,
)

from deployments.sessions.cluster import init_local, stop_local
from deployments.types import NoCapacity, SessionStatus, UnknownSession

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[None]:
    init_local(num_cpus=8, num_gpus=2, dashboard=True)
    yield
    stop_local()


def test_two_run_third_queues_then_takes_the_returned_slot() -> None:
    service = small_service(queue_max=2)
    with scheduler(service, "t-queue") as sched:
        a, b = (ray.get(sched.create_session.remote(spec(s, service))) for s in ("a", "b"))
        assert (a.status, b.status) == (SessionStatus.STARTING, SessionStatus.STARTING)
        c = ray.get(sched.create_session.remote(spec("c", service)))
        assert (c.status, c.queue_position) == (SessionStatus.QUEUED, 1)
        wait_status(sched, "a", SessionStatus.RUNNING)
        wait_status(sched, "b", SessionStatus.RUNNING)
        cap = ray.get(sched.capacity.remote())
        assert (cap.bundles_total, cap.bundles_free, cap.sessions_running, cap.queued) == (2, 0, 2, 1)
        assert info(sched, "c").status is SessionStatus.QUEUED
        ended = ray.get(sched.end_session.remote("a"))
        assert (ended.status, ended.reason) == (SessionStatus.ENDED, "deleted")
        assert ray.get(sched.end_session.remote("a")).status is SessionStatus.ENDED  # idempotent
        c = wait_status(sched, "c", SessionStatus.RUNNING)
        assert c.warm_start is True  # a's slot, reset and handed over without a rebuild
        assert info(sched, "a").stats.chunks > 0


def test_fifty_concurrent_creates_never_over_commit() -> None:
    service = small_service(queue_max=3, queue_timeout_s=10.0)
    with scheduler(service, "t-fifty") as sched:

        async def create(i: int) -> Any:
            try:
                return await sched.create_session.remote(spec(f"s{i}", service))
            except NoCapacity as err:
                return err

        async def all_at_once() -> list[Any]:
            return await asyncio.gather(*(create(i) for i in range(50)))

        results = asyncio.run(all_at_once())
        starting = [r for r in results if not isinstance(r, Exception) and r.status is SessionStatus.STARTING]
        queued = [r for r in results if not isinstance(r, Exception) and r.status is SessionStatus.QUEUED]
        refused = [r for r in results if isinstance(r, NoCapacity)]
        assert (len(starting), len(queued), len(refused)) == (2, 3, 45)
        assert sorted(r.queue_position for r in queued) == [1, 2, 3]
        assert all(r.retry_after_s >= 1 and r.code == "no_capacity" for r in refused)
        cap = ray.get(sched.capacity.remote())
        assert (cap.bundles_free, cap.queued) == (0, 3)
        assert len(slots(sched)) == 2
        t0 = time.monotonic()
        assert ray.get(sched.events.remote(queued[0].id, 1, 0.5)) == []  # long-poll: nothing new
        assert time.monotonic() - t0 >= 0.5
        # nothing frees a bundle: the queued requests fail at their deadline, in order
        for q in queued:
            ended = wait_status(sched, q.id, SessionStatus.FAILED, timeout_s=20)
            assert ended.reason.startswith("queue_timeout: no bundle freed within 10 s")
        assert ray.get(sched.capacity.remote()).queued == 0


def test_draining_refuses_new_and_ends_queued_while_running_sessions_go_on() -> None:
    service = small_service(queue_max=2)
    with scheduler(service, "t-drain") as sched:
        for s in ("a", "b", "c"):
            ray.get(sched.create_session.remote(spec(s, service)))
        wait_status(sched, "a", SessionStatus.RUNNING)
        assert info(sched, "c").status is SessionStatus.QUEUED
        ray.get(sched.set_draining.remote(True))
        ray.get(sched.set_draining.remote(True))  # idempotent: every ingress replica calls it
        assert (info(sched, "c").status, info(sched, "c").reason) == (SessionStatus.ENDED, "draining")
        with pytest.raises(NoCapacity) as refused:
            ray.get(sched.create_session.remote(spec("d", service)))
        assert (refused.value.code, refused.value.retry_after_s) == ("draining", 1.0)
        chunks = info(sched, "a").stats.chunks
        wait_chunks(sched, "a", chunks + 3)  # the running session keeps going
        assert ray.get(sched.capacity.remote()).queued == 0
        ray.get(sched.set_draining.remote(False))
        assert ray.get(sched.create_session.remote(spec("d", service))).status in (
            SessionStatus.QUEUED, SessionStatus.STARTING)
        for s in ("a", "b", "d"):
            ray.get(sched.end_session.remote(s))


def test_queue_max_zero_refuses_with_retry_after() -> None:
    service = small_service(queue_max=0, max_sessions_per_key=1)
    with scheduler(service, "t-refuse") as sched:
        created = ray.get(sched.create_session.remote(spec("a", service, api_key_id="k1")))
        assert created.status is SessionStatus.STARTING
        with pytest.raises(NoCapacity) as quota:
            ray.get(sched.create_session.remote(spec("a2", service, api_key_id="k1")))
        assert quota.value.code == "quota_exceeded"
        created = ray.get(sched.create_session.remote(spec("b", service, api_key_id="k2")))
        assert created.status is SessionStatus.STARTING
        with pytest.raises(UnknownSession):
            ray.get(sched.get_session.remote("nope"))
        with pytest.raises(ValueError, match="needs \\(64, 96, 3\\) uint8"):
            ray.get(sched.create_session.remote(replace(spec("c", service), image=np.zeros((8, 8, 3), np.uint8))))
        with pytest.raises(NoCapacity) as refused:
            ray.get(sched.create_session.remote(spec("c", service)))
        assert refused.value.retry_after_s >= 1
        with pytest.raises(ValueError, match="already exists"):
            ray.get(sched.create_session.remote(spec("a", service)))
        for s in ("a", "b"):  # ended while their slots are still warming
            assert ray.get(sched.end_session.remote(s, "caller_left")).reason == "caller_left"


def test_endings_say_why_and_leave_nothing_behind() -> None:
    service = small_service(warm_slots=1, queue_max=0)
    with scheduler(service, "t-endings") as sched:
        ray.get(sched.create_session.remote(spec("deleted", service)))
        ray.get(sched.create_session.remote(spec("timed", service, max_duration_s=4.0)))
        wait_status(sched, "deleted", SessionStatus.RUNNING)
        wait_status(sched, "timed", SessionStatus.RUNNING)
        by_session = {s["sessions"][0]: s for s in slots(sched)}
        first, second = by_session["deleted"], by_session["timed"]

        # end_session: the pool is above target (2 > 1), so this slot is removed with all its actors.
        assert ray.get(sched.end_session.remote("deleted")).reason == "deleted"
        wait_for(lambda: first["slot_id"] not in {s["slot_id"] for s in slots(sched)}, 30, "slot removal")
        wait_for(lambda: pg_state(first["pg_id"]) == "REMOVED", 10, "placement group removal")
        wait_for(lambda: not actor_ids(first, driver=True) & alive_actor_ids(), 10, "the removed slot's actors")

        # max duration: ends by itself; its slot is reset and kept warm (target 1), actors alive.
        ended = wait_status(sched, "timed", SessionStatus.ENDED, timeout_s=30)
        assert ended.reason == "max_duration" and ended.stats.chunks >= 6
        kept = wait_for(lambda: [s for s in slots(sched) if s["state"] == "free"], 30, "a free warm slot")[0]
        assert kept["slot_id"] == second["slot_id"] and pg_state(kept["pg_id"]) == "CREATED"
        assert actor_ids(kept) <= alive_actor_ids()

        # a killed DiT rank mid-session: FAILED within 2 s, and the slot is removed.
        warm = ray.get(sched.create_session.remote(spec("killed", service)))
        assert warm.status is SessionStatus.STARTING
        wait_chunks(sched, "killed", 3)
        assert info(sched, "killed").warm_start is True
        t0 = time.monotonic()
        ray.kill(kept["actors"][0])  # DiT rank 0
        failed = wait_for(lambda: (i := info(sched, "killed")).status.terminal and i, 10, "the failure")
        assert time.monotonic() - t0 < 2.0
        assert failed.status is SessionStatus.FAILED and failed.reason.startswith("actor_died: DiTWorker")
        wait_for(lambda: kept["slot_id"] not in {s["slot_id"] for s in slots(sched)}, 30, "failed slot removal")
        wait_for(lambda: pg_state(kept["pg_id"]) == "REMOVED", 10, "placement group removal")
        wait_for(lambda: not actor_ids(kept, driver=True) & alive_actor_ids(), 10, "the failed slot's actors")
        assert [e.status for e in ray.get(sched.events.remote("killed", 0, 0.0)) if e.kind == "status"] == [
            SessionStatus.STARTING, SessionStatus.READY, SessionStatus.RUNNING, SessionStatus.FAILED]


def test_warm_slot_carries_no_state_between_sessions() -> None:
    service = small_service(warm_slots=1, queue_max=0)
    with scheduler(service, "t-warm") as sched:
        first = ray.get(sched.create_session.remote(spec("first", service, seed=7)))
        assert first.status is SessionStatus.STARTING
        wait_chunks(sched, "first", 4)
        speech = (np.random.default_rng(0).standard_normal(32000) * 8000).astype("<i2").tobytes()  # 2 s
        ray.get(sched.push_audio.remote("first", speech, 16000, 1))  # dirty the audio history and the cache
        wait_chunks(sched, "first", 20)
        ray.get(sched.end_session.remote("first"))
        wait_for(lambda: [s for s in slots(sched) if s["state"] == "free"], 30, "the slot back in the pool")
        second = ray.get(sched.create_session.remote(spec("second", service, seed=7)))
        assert second.status is SessionStatus.STARTING
        wait_chunks(sched, "second", 4)
        assert info(sched, "second").warm_start is True
        a, b = chunk_digests(sched, "first"), chunk_digests(sched, "second")
        assert [a[k] for k in range(4)] == [b[k] for k in range(4)]
        assert len({a[k] for k in range(20)}) > 1  # the video does change over time
    # and both are what the single-process engine makes: the compiled graph changes nothing
    assert [a[k] for k in range(4)] == reference_digests(service, spec("first", service, seed=7), 4)


def test_audio_is_held_until_the_session_runs_then_goes_to_its_own_actor() -> None:
    service = small_service(queue_max=0)
    speech = (np.random.default_rng(1).standard_normal(8000) * 6000).astype("<i2").tobytes()  # 0.5 s
    with scheduler(service, "t-audio") as sched:
        assert ray.get(sched.create_session.remote(spec("a", service))).status is SessionStatus.STARTING
        assert ray.get(sched.push_audio.remote("a", speech, 16000, 1)) is None  # no actor yet: held
        wait_status(sched, "a", SessionStatus.RUNNING)
        route = ray.get(sched.push_audio.remote("a", speech, 16000, 1))  # forwarded, and the actor named
        assert route is not None and route._actor_id == slots(sched)[0]["driver"]._actor_id
        assert ray.get(route.push_audio.remote("a", speech, 16000, 1)) > 0.0  # the ingress's path from now on
        assert ray.get(route.push_audio.remote("ghost", speech, 16000, 1)) == 0.0  # never another session's
        ray.get(sched.end_session.remote("a"))
        assert ray.get(sched.push_audio.remote("a", speech, 16000, 1)) is None  # ended: nowhere to go
