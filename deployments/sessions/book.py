"""`SessionBook`: the scheduler's records of its sessions: status, numbered events, long-polls, and the
ended ones kept (without their images) for `get` and `list`.

A plain class used under the scheduler's lock (no Ray). Every change to a session goes through `event`,
`status` or `terminal`, which number it and wake whoever waits on the session (`events`, `wait_terminal`).
With `records` (`deployments.store.SessionRows`), every status change is written to the database at once, the
live sessions get a heartbeat, and an ended session no longer in memory is read back from there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from deployments.sessions.recovery import Resume
from deployments.settings import ServiceConfig
from deployments.store import SessionRows, StoreError, database_url, open_engine
from deployments.telemetry import Admission, SchedulerTelemetry
from deployments.types import (
    NoCapacity,
    SessionEvent,
    SessionInfo,
    SessionSpec,
    SessionStats,
    SessionStatus,
    UnknownSession,
)
from placement import Lease

log = logging.getLogger(__name__)

_NO_IMAGE = np.zeros((0, 0, 3), np.uint8)  # an ended session's spec keeps no reference image
HEARTBEAT_S = 1.0  # live sessions' records are touched this often: a restart ends them within this of their end


@dataclass
class SessionRecord:
    info: SessionInfo
    spec: SessionSpec
    events: deque[SessionEvent]
    bell: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) on every change
    seq: int = 0
    own_slot: str | None = None  # the slot its admission created (cold start)
    lease: Lease | None = None
    actor: Any = None
    end_reason: str | None = None
    pending_audio: list[tuple[bytes, int, int]] = field(default_factory=list)
    admission: Admission | None = None  # its admission span and arrival (telemetry)
    adopted: bool = False  # found running by a restarted scheduler: its outcome comes from `outcome()`
    resume: Resume | None = None  # set while it recovers onto a new slot
    recoveries: int = 0

    @property
    def terminal(self) -> bool:
        return self.info.status.terminal


class SessionBook:
    """Sessions by id, live and recently ended (at most `ended_max` of the latter)."""

    def __init__(self, tele: SchedulerTelemetry, *, events_max: int, ended_max: int,
                 records: SessionRows | None = None) -> None:
        self.tele, self.events_max, self.ended_max = tele, events_max, ended_max
        self.sessions: dict[str, SessionRecord] = {}
        self.records = records
        self.gpus = 0  # GPUs of one session's bundle (its records' GPU-seconds), known once the scheduler starts
        self._beat = 0.0  # when the live sessions' heartbeat was last written (monotonic)
        self._admitted: dict[str, float] = {}  # live session id -> when it was given a slot (its GPU time's start)

    @classmethod
    def of_service(cls, tele: SchedulerTelemetry, service: ServiceConfig, scheduler: str) -> SessionBook:
        """The book of scheduler `scheduler`, its records in `service`'s database (opened and migrated now)."""
        records = SessionRows(open_engine(database_url(service.data_dir, service.database_url)), scheduler)
        return cls(tele, events_max=service.events_max, ended_max=service.ended_max, records=records)

    def new(self, spec: SessionSpec, status: SessionStatus, admission: Admission | None = None,
            **fields: Any) -> SessionRecord:
        """A record for `spec` (not yet in the book: `add` it once it is admitted, queued or waiting)."""
        info = SessionInfo(spec.session_id, status, spec.preset, owner=spec.api_key_id, **fields)
        return SessionRecord(info, spec, deque(maxlen=self.events_max), admission=admission)

    def add(self, sess: SessionRecord) -> SessionRecord:
        self.sessions[sess.info.id] = sess
        return sess

    def get(self, session_id: str) -> SessionRecord:
        sess = self.sessions.get(session_id)
        if sess is None and self.records is not None and 0 < len(session_id) <= 128:
            info = self._stored("read", lambda: self.records.get(session_id) if self.records else None)
            if info is not None and info.status.terminal:  # ended, and no longer (or never) in memory
                return SessionRecord(info, SessionSpec(session_id, _NO_IMAGE, info.preset, api_key_id=info.owner),
                                     deque(maxlen=1))
        if sess is None:
            raise UnknownSession(session_id)
        return sess

    def listed(self) -> list[SessionInfo]:
        """The sessions in memory, then the newest ended ones only the database still has (`ended_max` in all)."""
        infos = [s.info for s in self.sessions.values()]
        room = self.ended_max - sum(s.terminal for s in self.sessions.values())
        if self.records is not None and room > 0:  # after a restart, until memory holds `ended_max` again
            records = self.records
            infos += self._stored("list", lambda: records.ended(room, self.sessions)) or []
        return infos

    # ------------------------------------------------------------------------------ the database
    def _stored(self, what: str, call: Any) -> Any:
        """`call()`; a database error is logged (the session goes on; its record is written at its next change)."""
        try:
            return call()
        except StoreError as e:
            log.error("session records: %s failed (%s: %s)", what, type(e).__name__, str(e)[:300])
            return None

    def save(self, sess: SessionRecord) -> None:
        if sess.info.status in (SessionStatus.STARTING, SessionStatus.READY, SessionStatus.RUNNING):
            self._admitted.setdefault(sess.info.id, time.time())
        if self.records is not None:
            records = self.records
            self._stored("write", lambda: records.save(sess.info, self.gpus, time.time()))

    def heartbeat(self) -> None:
        """The live sessions are live now (a restart ends them at the last heartbeat); at most every HEARTBEAT_S."""
        if self.records is not None and time.monotonic() - self._beat >= HEARTBEAT_S:
            self._beat = time.monotonic()
            records, live = self.records, [s.info.id for s in self.live()]
            self._stored("heartbeat", lambda: records.touch(live, time.time()))

    def restored(self, gpus: int) -> list[SessionInfo]:
        """At start, once running sessions are adopted (`gpus`: a bundle's): every other session the database has
        as live ends FAILED `service_restarted` (its process was killed with the service)."""
        self.gpus = gpus
        if self.records is None:
            return []
        records, keep = self.records, [s.info.id for s in self.live()]
        ended: list[SessionInfo] = self._stored("restore", lambda: records.restarted(keep)) or []
        for info in ended:  # their GPU time is in the database only (when they were admitted died with the service)
            self.tele.ended(info.status.value, info.reason or "")
            assert info.ended_at is not None
            self.tele.usage(info.owner, info.preset, max(0.0, info.ended_at - (info.started_at or info.ended_at)),
                            0.0, info.started_at is not None)
        return ended

    def live(self) -> list[SessionRecord]:
        return [s for s in self.sessions.values() if not s.terminal]

    def check_quota(self, spec: SessionSpec, limit: int) -> None:
        """NoCapacity(quota_exceeded) when the spec's API key already has `limit` live sessions (0: no limit)."""
        if not limit or spec.api_key_id is None:
            return
        live = sum(s.spec.api_key_id == spec.api_key_id for s in self.live())
        if live >= limit:
            raise NoCapacity(f"API key has {live} live sessions, the limit is {limit}; end one first", 5.0,
                             code="quota_exceeded")

    # ------------------------------------------------------------------------------ changes
    def event(self, sess: SessionRecord, kind: Any, **fields: Any) -> None:
        if kind == "status":
            self.save(sess)
        sess.seq += 1
        sess.events.append(SessionEvent(sess.seq, sess.info.id, kind, **fields))
        bell, sess.bell = sess.bell, asyncio.Event()
        bell.set()

    def status(self, sess: SessionRecord, status: SessionStatus, detail: str | None = None) -> None:
        sess.info.status = status
        self.event(sess, "status", status=status, detail=detail)

    def terminal(self, sess: SessionRecord, status: SessionStatus, reason: str,
                 stats: SessionStats | None = None) -> None:
        """The session ended (once; later calls change nothing): kept for get/list, without its reference
        image (up to MBs) and held audio; the oldest ended sessions beyond `ended_max` are dropped."""
        if sess.terminal:
            return
        sess.info.reason, sess.info.ended_at = reason, time.time()
        if stats is not None:
            sess.info.stats = stats
        sess.spec, sess.resume = replace(sess.spec, image=_NO_IMAGE), None
        sess.pending_audio.clear()
        self.status(sess, status, reason)
        self.tele.decided(sess.admission, "expired" if reason.startswith("queue_timeout") else
                          "failed" if status is SessionStatus.FAILED else "ended")
        self.tele.ended(status.value, reason)
        self.tele.session_ended(sess.admission, status.value, reason)
        info, admitted = sess.info, self._admitted.pop(sess.info.id, None)
        assert info.ended_at is not None
        self.tele.usage(info.owner, info.preset, max(0.0, info.ended_at - (info.started_at or info.ended_at)),
                        max(0.0, info.ended_at - (admitted or info.ended_at)) * self.gpus, info.started_at is not None)
        ended = [s for s in self.sessions.values() if s.terminal]
        for old in ended[: max(0, len(ended) - self.ended_max)]:
            del self.sessions[old.info.id]

    # ------------------------------------------------------------------------------ waiting
    async def events(self, sess: SessionRecord, after_seq: int, timeout_s: float) -> list[SessionEvent]:
        """Events after `after_seq`, waiting up to `timeout_s` for one (none: an empty list)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout_s)
        while True:
            bell = sess.bell
            out = [e for e in sess.events if e.seq > after_seq]
            remaining = deadline - loop.time()
            if out or sess.terminal or remaining <= 0:
                return out
            try:
                await asyncio.wait_for(bell.wait(), remaining)
            except TimeoutError:
                return []

    async def wait_terminal(self, sess: SessionRecord, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not sess.terminal and time.monotonic() < deadline:
            try:
                await asyncio.wait_for(sess.bell.wait(), deadline - time.monotonic())
            except TimeoutError:
                return
