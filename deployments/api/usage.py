"""Usage routes, from the session records in the service's database (`deployments.store`):

    GET /v1/avatar_usage ?startDate=&endDate=   Runway's shape (the SDKs' `avatars.get_usage`): totalSeconds,
                                                totalSessions, avgDurationSeconds, byDay (every UTC day, zeroes too)
    GET /v1/usage        ?startDate=&endDate=   per tenant, preset and UTC day: secondsStreamed, gpuSeconds,
                                                sessions, sessionsStarted (default: the last 30 days)

Dates are UTC days (`YYYY-MM-DD`, or an ISO 8601 time: its UTC day), the end exclusive, at most 90 days. A key sees
its own sessions; an operator key (or keys off) sees every tenant's.
"""

from __future__ import annotations

import datetime
from typing import Any

from fastapi import FastAPI, Query, Request
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from deployments.api.errors import ApiError, ErrorCode, error_responses
from deployments.api.requests import caller
from deployments.store import UsageQueries
from deployments.store.usage import MAX_RANGE_DAYS

DEFAULT_DAYS = 30


class UsageRegistry:
    """The usage questions as the routes ask them, answered by a `deployments.store.UsageQueries` in this process
    (tests, one replica); `deployments.api.app.SharedUsage` sends them to the service's shared actor instead."""

    def __init__(self, queries: UsageQueries | None = None) -> None:
        self._queries = queries

    async def _call(self, method: str, *args: Any) -> Any:
        if self._queries is None:
            raise ApiError(503, "usage_unavailable", "this server keeps no session records (no database)")
        return getattr(self._queries, method)(*args)

    async def runway(self, owner: str | None, everyone: bool, start: datetime.date,
                     end: datetime.date) -> dict[str, Any]:
        return await self._call("runway", owner, everyone, start, end)

    async def native(self, owner: str | None, everyone: bool, start: datetime.date,
                     end: datetime.date) -> list[dict[str, Any]]:
        return await self._call("native", owner, everyone, start, end)


class _Out(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, validate_by_alias=True)


class UsageDayOut(_Out):
    date: str
    seconds: int = Field(description="Seconds streamed by the sessions made that day that have ended.")
    sessions: int = Field(description="Sessions made that day (failed and unfinished ones too).")


class AvatarUsageOut(_Out):
    total_seconds: int
    total_sessions: int
    avg_duration_seconds: int
    by_day: list[UsageDayOut]


class TenantUsageOut(_Out):
    tenant: str | None = Field(description="The API key id (null: keys off).")
    preset: str
    date: str
    seconds_streamed: int = Field(description="First chunk out -> end, summed over the day's sessions.")
    gpu_seconds: int = Field(description="A slot given -> end, times the bundle's GPUs.")
    sessions: int
    sessions_started: int = Field(description="Sessions that put out a first chunk.")


class UsageOut(_Out):
    start_date: str
    end_date: str
    data: list[TenantUsageOut]


def parse_day(value: str, field: str) -> datetime.date:
    try:
        if len(value) == 10:
            return datetime.date.fromisoformat(value)
        t = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        return (t if t.tzinfo is None else t.astimezone(datetime.UTC)).date()
    except ValueError:
        raise ApiError(422, ErrorCode.INVALID_FIELD, f"is {value[:40]!r}, not a date; give YYYY-MM-DD (UTC) or an "
                       "ISO 8601 time", field) from None


def date_range(start: str | None, end: str | None) -> tuple[datetime.date, datetime.date]:
    """[start, end) as UTC days; defaults: the last DEFAULT_DAYS days through today. 422 names a bad bound."""
    today = datetime.datetime.now(datetime.UTC).date()
    last = parse_day(end, "endDate") if end else today + datetime.timedelta(days=1)
    first = parse_day(start, "startDate") if start else last - datetime.timedelta(days=DEFAULT_DAYS)
    if last <= first:
        raise ApiError(422, ErrorCode.INVALID_FIELD, f"is {last}, not after startDate {first} (endDate is exclusive)",
                       "endDate")
    if (last - first).days > MAX_RANGE_DAYS:
        raise ApiError(422, ErrorCode.INVALID_FIELD, f"{first}..{last} spans {(last - first).days} days; the limit is "
                       f"{MAX_RANGE_DAYS}, ask in parts", "endDate")
    return first, last


def add_usage_routes(app: FastAPI, usage: UsageRegistry, native: dict[str, Any], runway: dict[str, Any]) -> None:
    """The routes above on `app` (`native` / `runway`: the route options of the native and the Runway routes)."""

    @app.get("/v1/avatar_usage", response_model=AvatarUsageOut, **runway, responses=error_responses(401, 422, 503),
             summary="Usage of avatar sessions (Runway)")
    async def avatar_usage(request: Request, start_date: str = Query(alias="startDate", max_length=40),
                           end_date: str = Query(alias="endDate", max_length=40)) -> Any:
        who = caller(request)
        first, last = date_range(start_date, end_date)
        return await usage.runway(who.key_id, who.sees_all, first, last)

    @app.get("/v1/usage", response_model=UsageOut, **native, responses=error_responses(401, 422, 503),
             summary="Usage by tenant, preset and day")
    async def tenant_usage(request: Request, start_date: str | None = Query(None, alias="startDate", max_length=40),
                           end_date: str | None = Query(None, alias="endDate", max_length=40)) -> UsageOut:
        who = caller(request)
        first, last = date_range(start_date, end_date)
        rows = await usage.native(who.key_id, who.sees_all, first, last)
        return UsageOut(start_date=first.isoformat(), end_date=last.isoformat(),
                        data=[TenantUsageOut.model_validate(r) for r in rows])
