"""`SessionRows`: the scheduler's session records in the database, one row per session, written at every status
change (so a SIGKILL loses nothing that was decided), plus a heartbeat of the live ones (`seen_at`).

A scheduler that starts finds the rows its predecessor left live (a crash, a restart, an upgrade's new cluster)
and did not adopt again: it ends them `FAILED` with reason `service_restarted` at their last heartbeat, so their
durations and usage are what was measured, never silently gone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from deployments.store.schema import sessions as table
from deployments.types import SessionInfo, SessionStats, SessionStatus

log = logging.getLogger(__name__)

SERVICE_RESTARTED = "service_restarted"
LIVE = tuple(s.value for s in SessionStatus if not s.terminal)
HOLDING = (SessionStatus.STARTING, SessionStatus.READY, SessionStatus.RUNNING)  # a slot is theirs


def info_from_json(d: dict[str, Any]) -> SessionInfo:
    d = dict(d)
    d["status"] = SessionStatus(d["status"])
    d["stats"] = SessionStats(**(d.get("stats") or {}))
    return SessionInfo(**d)


class SessionRows:
    """The records of the sessions of scheduler `scheduler` (the actor's name: one service) in `engine`'s database."""

    def __init__(self, engine: Engine, scheduler: str) -> None:
        self.engine, self.scheduler = engine, scheduler

    def save(self, info: SessionInfo, gpus: int, now: float) -> None:
        """Write `info` as the session's record (insert or update); the first status that holds a slot sets
        `admitted_at` (GPU-seconds count from there)."""
        values: dict[str, Any] = {
            "owner": info.owner, "preset": info.preset, "status": info.status.value, "reason": info.reason,
            "created_at": info.created_at, "started_at": info.started_at, "ended_at": info.ended_at,
            "info": info.to_json()}
        with self.engine.begin() as conn:
            row = conn.execute(sa.select(table.c.admitted_at).where(table.c.id == info.id)).first()
            admitted = row.admitted_at if row is not None else None
            if admitted is None and info.status in HOLDING:
                values["admitted_at"] = now
            if info.status.terminal or info.status in HOLDING:
                values["seen_at"] = now
            if row is None:
                conn.execute(sa.insert(table).values(id=info.id, scheduler=self.scheduler, gpus=gpus, **values))
            else:
                conn.execute(sa.update(table).where(table.c.id == info.id).values(**values))

    def touch(self, ids: Iterable[str], now: float) -> None:
        """The heartbeat of live sessions: they were live at `now`."""
        ids = list(ids)
        if ids:
            with self.engine.begin() as conn:
                conn.execute(sa.update(table).where(table.c.id.in_(ids), table.c.status.in_(LIVE)).values(seen_at=now))

    def restarted(self, keep: Iterable[str]) -> list[SessionInfo]:
        """End as FAILED `service_restarted` every live record of this scheduler but those in `keep` (adopted
        again), each at its last heartbeat; returns them as ended."""
        keep = set(keep)
        ended = []
        with self.engine.begin() as conn:
            rows = conn.execute(sa.select(table.c.id, table.c.info, table.c.created_at, table.c.admitted_at,
                                          table.c.started_at, table.c.seen_at).where(
                table.c.scheduler == self.scheduler, table.c.status.in_(LIVE)).with_for_update()).all()
            for row in rows:
                if row.id in keep:
                    continue
                at = max(t for t in (row.created_at, row.admitted_at, row.started_at, row.seen_at) if t is not None)
                info = info_from_json(row.info)
                info.status, info.reason, info.ended_at, info.queue_position = (
                    SessionStatus.FAILED, SERVICE_RESTARTED, at, None)
                conn.execute(sa.update(table).where(table.c.id == row.id).values(
                    status=info.status.value, reason=info.reason, ended_at=at, seen_at=at, info=info.to_json()))
                ended.append(info)
        if ended:
            log.warning("%d sessions were live when the service stopped: ended FAILED %s", len(ended),
                        SERVICE_RESTARTED)
        return ended

    def get(self, session_id: str) -> SessionInfo | None:
        with self.engine.connect() as conn:
            d = conn.execute(sa.select(table.c.info).where(table.c.id == session_id)).scalar_one_or_none()
        return None if d is None else info_from_json(d)

    def ended(self, limit: int, exclude: Iterable[str] = ()) -> list[SessionInfo]:
        """The newest `limit` ended sessions of this scheduler, but those in `exclude`."""
        exclude = set(exclude)
        query = (sa.select(table.c.id, table.c.info).where(table.c.scheduler == self.scheduler,
                                                           table.c.status.not_in(LIVE))
                 .order_by(table.c.created_at.desc()).limit(limit + len(exclude)))
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        return [info_from_json(r.info) for r in rows if r.id not in exclude][:limit]

    def usage_rows(self, owner: str | None, everyone: bool, start: float, end: float) -> list[Any]:
        """The records created in [start, end) (of `owner`, or all with `everyone`) that usage is counted from."""
        query = sa.select(table.c.owner, table.c.preset, table.c.status, table.c.created_at, table.c.admitted_at,
                          table.c.started_at, table.c.ended_at, table.c.seen_at, table.c.gpus).where(
            table.c.created_at >= start, table.c.created_at < end)
        if not everyone:
            query = query.where(table.c.owner.is_(None) if owner is None else table.c.owner == owner)
        with self.engine.connect() as conn:
            return list(conn.execute(query.order_by(table.c.created_at)).all())
