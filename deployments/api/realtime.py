"""What a Runway realtime session has beyond the scheduler's record: its session key, its room, what it was
asked for (personality, startScript, tools), and whether the key has been consumed.

`RealtimeBook` keeps these in memory (thread-safe, bounded: the oldest records beyond `max_records` go; no
exceptions: it also runs inside the service's one shared actor, `deployments.api.app`). `RealtimeRegistry` is
what the routes call (async; over an in-process book by default, the shared actor under Serve).

The session key of a session without an integration is a random 256-bit secret, shown in the READY status
and valid once, until `expires_at`: `consume` checks it in constant time and marks it used in the same step,
so two browsers cannot both take the room.
"""

from __future__ import annotations

import hmac
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Literal

ConsumeResult = Literal["ok", "invalid", "expired", "used"]


@dataclass(frozen=True)
class RealtimeRecord:
    session_id: str
    owner: str | None
    created_at: float
    room: str | None = None  # the service room (no integration), else None
    session_key: str | None = field(default=None, repr=False)  # no integration only
    expires_at: float | None = None
    consumed_at: float | None = None
    personality: str | None = None
    start_script: str | None = None
    tools: tuple[dict[str, Any], ...] = ()

    @property
    def integration(self) -> bool:
        return self.session_key is None


@dataclass
class RealtimeBook:
    max_records: int = 4096
    _records: OrderedDict[str, RealtimeRecord] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, record: RealtimeRecord) -> None:
        with self._lock:
            self._records[record.session_id] = record
            while len(self._records) > self.max_records:
                self._records.popitem(last=False)

    def get(self, session_id: str) -> RealtimeRecord | None:
        with self._lock:
            return self._records.get(session_id)

    def discard(self, session_id: str) -> None:
        with self._lock:
            self._records.pop(session_id, None)

    def consume(self, session_id: str, key: str, now: float, mark: bool = True) -> tuple[ConsumeResult, str | None]:
        """Check `key` against the session's (constant time); `mark`: use it up. Returns the outcome and, when
        "ok", the session's room. Unknown sessions and wrong keys are alike ("invalid")."""
        with self._lock:
            rec = self._records.get(session_id)
            expected = rec.session_key if rec is not None and rec.session_key is not None else "-" * 43
            matches = hmac.compare_digest(key.encode(), expected.encode())
            if rec is None or rec.session_key is None or not matches:
                return "invalid", None
            if rec.consumed_at is not None:
                return "used", None
            if rec.expires_at is not None and now > rec.expires_at:
                return "expired", None
            if mark:
                self._records[session_id] = replace(rec, consumed_at=now)
            return "ok", rec.room


class RealtimeRegistry:
    """The book as the routes see it: async; `deployments.api.app.SharedRealtime` sends the same calls to the
    service's one shared actor, so a key shown by one ingress replica is consumed through any."""

    def __init__(self, max_records: int = 4096) -> None:
        self._book = RealtimeBook(max_records)

    async def _book_call(self, method: str, *args: Any) -> Any:
        return getattr(self._book, method)(*args)

    async def add(self, record: RealtimeRecord) -> None:
        await self._book_call("add", record)

    async def get(self, session_id: str) -> RealtimeRecord | None:
        return await self._book_call("get", session_id)

    async def discard(self, session_id: str) -> None:
        await self._book_call("discard", session_id)

    async def consume(self, session_id: str, key: str, now: float, mark: bool = True) -> tuple[ConsumeResult,
                                                                                              str | None]:
        return await self._book_call("consume", session_id, key, now, mark)
