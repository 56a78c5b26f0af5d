"""Readiness (`deployments.api.health`) over a scheduler stand-in, and the usage routes' date ranges
(`deployments.api.usage`): exact answers, no Ray."""

from __future__ import annotations

import asyncio
import datetime

import pytest

from deployments.api.errors import ApiError
from deployments.api.health import Readiness
from deployments.api.usage import date_range, parse_day
from deployments.types import Capacity


class Scheduler:
    def __init__(self) -> None:
        self.answers: list[Capacity | ApiError] = []

    async def capacity(self) -> Capacity:
        answer = self.answers.pop(0)
        if isinstance(answer, ApiError):
            raise answer
        return answer


def cap(total: int, warm: int, running: int = 0) -> Capacity:
    return Capacity(bundles_total=total, bundles_free=total - running, sessions_running=running, queued=0,
                    warm_slots_free=warm)


def check(ready: Readiness) -> tuple[int, str]:
    try:
        out = asyncio.run(ready.check())
    except ApiError as e:
        assert e.retry_after_s == 2.0
        return e.status, e.message
    return 200, f"{out.warm_slots_free}/{out.warm_slots}"


def test_not_ready_until_the_scheduler_answers_and_every_warm_slot_was_warm_then_ready_while_busy():
    sched = Scheduler()
    ready = Readiness(sched, warm_slots=2)
    sched.answers = [ApiError(503, "scheduler_unavailable", "down"), cap(4, 0), cap(4, 1), cap(4, 2), cap(4, 0, 2),
                     ApiError(503, "scheduler_unavailable", "down"), cap(4, 0, 3)]
    assert check(ready) == (503, "the scheduler does not answer yet (scheduler_unavailable: down)")
    assert check(ready) == (503, "0 of 2 warm slots are warm; the rest are being built (weights, warm-up)")
    assert check(ready)[0] == 503
    assert check(ready) == (200, "2/2")
    assert check(ready) == (200, "0/2")  # both taken by sessions: busy, still ready
    assert check(ready)[0] == 503  # the scheduler gone: not ready again
    assert check(ready) == (200, "0/2")


def test_no_bundle_at_all_has_nothing_to_warm_and_a_session_on_a_warm_slot_counts():
    sched = Scheduler()
    sched.answers = [cap(0, 0)]
    assert check(Readiness(sched, warm_slots=2)) == (200, "0/2")
    sched.answers = [cap(1, 0, 1)]  # the one warm slot already holds a session
    assert check(Readiness(sched, warm_slots=1)) == (200, "0/1")


def test_usage_dates():
    assert parse_day("2026-12-08", "startDate") == datetime.date(2026, 12, 8)
    assert parse_day("2026-12-08T23:30:00-02:00", "endDate") == datetime.date(2026, 12, 9)  # its UTC day
    assert parse_day("2026-12-08T01:00:00Z", "endDate") == datetime.date(2026, 12, 8)
    with pytest.raises(ApiError) as e:
        parse_day("yesterday", "startDate")
    assert (e.value.status, e.value.field) == (422, "startDate")
    assert date_range("2026-12-01", "2026-12-08") == (datetime.date(2026, 12, 1), datetime.date(2026, 12, 8))
    for start, end, message in (("2026-12-08", "2026-12-08", "not after startDate"),
                                ("2026-01-01", "2026-12-01", "spans 334 days; the limit is 90")):
        with pytest.raises(ApiError) as e:
            date_range(start, end)
        assert e.value.field == "endDate" and message in e.value.message
    first, last = date_range(None, None)
    assert (last - first).days == 30 and last == datetime.datetime.now(datetime.UTC).date() + datetime.timedelta(1)
