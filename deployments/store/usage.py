"""Usage from session records, by tenant, preset and UTC day: seconds streamed (first chunk out -> end), GPU-seconds
held (a slot given -> end, times the bundle's GPUs) and sessions (made, and started: a first chunk out). A
session still live counts up to its last heartbeat, the same instant a restart ends it at: the figures read the
same before and after a restart. Pure functions over the rows `SessionRows.usage_rows` returns.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

DAY_S = 86400.0
MAX_RANGE_DAYS = 90  # Runway's limit on a usage query's range


@dataclass(frozen=True)
class SessionUsage:
    owner: str | None
    preset: str
    day: datetime.date  # the UTC day it was made
    streamed_s: float
    gpu_s: float
    started: bool
    measured: bool  # ended after streaming: a conversation with a measured duration (Runway's avg)


@dataclass
class DayUsage:
    owner: str | None
    preset: str
    day: datetime.date
    seconds_streamed: int = 0
    gpu_seconds: int = 0
    sessions: int = 0
    sessions_started: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"tenant": self.owner, "preset": self.preset, "date": self.day.isoformat(),
                "secondsStreamed": self.seconds_streamed, "gpuSeconds": self.gpu_seconds,
                "sessions": self.sessions, "sessionsStarted": self.sessions_started}


def utc_day(t: float) -> datetime.date:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).date()


def session_usage(row: Any) -> SessionUsage:
    """One record's usage (a row with owner, preset, created_at, admitted_at, started_at, ended_at, seen_at, gpus)."""
    end = row.ended_at if row.ended_at is not None else row.seen_at
    streamed = max(0.0, end - row.started_at) if row.started_at is not None and end is not None else 0.0
    held = max(0.0, end - row.admitted_at) * row.gpus if row.admitted_at is not None and end is not None else 0.0
    return SessionUsage(row.owner, row.preset, utc_day(row.created_at), streamed, held, row.started_at is not None,
                        row.started_at is not None and row.ended_at is not None)


def by_day(rows: Iterable[Any]) -> list[DayUsage]:
    """Usage per (tenant, preset, day), days in order; seconds summed exactly, then rounded once per bucket."""
    sums: dict[tuple[str | None, str, datetime.date], list[float]] = {}
    for u in map(session_usage, rows):
        s = sums.setdefault((u.owner, u.preset, u.day), [0.0, 0.0, 0, 0])
        s[0] += u.streamed_s
        s[1] += u.gpu_s
        s[2] += 1
        s[3] += u.started
    return [DayUsage(owner, preset, day, round(s[0]), round(s[1]), int(s[2]), int(s[3]))
            for (owner, preset, day), s in sorted(sums.items(), key=lambda kv: (kv[0][2], str(kv[0][0]), kv[0][1]))]


def runway_usage(rows: Iterable[Any], start: datetime.date, end: datetime.date) -> dict[str, Any]:
    """Runway's avatar usage shape for [start, end) (UTC days): totalSeconds, totalSessions, avgDurationSeconds,
    byDay with every day of the range (zeroes included)."""
    seconds: dict[datetime.date, float] = {}
    sessions: dict[datetime.date, int] = {}
    measured, measured_s = 0, 0.0
    for u in map(session_usage, rows):
        seconds[u.day] = seconds.get(u.day, 0.0) + (u.streamed_s if u.measured else 0.0)
        sessions[u.day] = sessions.get(u.day, 0) + 1
        if u.measured:
            measured, measured_s = measured + 1, measured_s + u.streamed_s
    days = [start + datetime.timedelta(days=i) for i in range((end - start).days)]
    by = [{"date": d.isoformat(), "seconds": round(seconds.get(d, 0.0)), "sessions": sessions.get(d, 0)} for d in days]
    return {"totalSeconds": sum(b["seconds"] for b in by), "totalSessions": sum(b["sessions"] for b in by),
            "avgDurationSeconds": round(measured_s / measured) if measured else 0, "byDay": by}
