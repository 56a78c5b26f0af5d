"""`UsageQueries`: the usage routes' questions, answered from the session records (`deployments.store.usage`)."""

from __future__ import annotations

import datetime
from typing import Any

from sqlalchemy.engine import Engine

from deployments.store.sessions import SessionRows
from deployments.store.usage import by_day, runway_usage


def _t(day: datetime.date) -> float:
    return datetime.datetime.combine(day, datetime.time(), datetime.UTC).timestamp()


class UsageQueries:
    """Usage across every scheduler that wrote to the database (a RayService upgrade's old and new clusters)."""

    def __init__(self, engine: Engine) -> None:
        self.rows = SessionRows(engine, scheduler="")

    def runway(self, owner: str | None, everyone: bool, start: datetime.date, end: datetime.date) -> dict[str, Any]:
        """Runway's `GET /v1/avatar_usage` body for the caller's sessions made in [start, end)."""
        return runway_usage(self.rows.usage_rows(owner, everyone, _t(start), _t(end)), start, end)

    def native(self, owner: str | None, everyone: bool, start: datetime.date,
               end: datetime.date) -> list[dict[str, Any]]:
        """`GET /v1/usage`: per tenant, preset and day (of the caller; of every tenant with `everyone`)."""
        return [d.to_json() for d in by_day(self.rows.usage_rows(owner, everyone, _t(start), _t(end)))]
