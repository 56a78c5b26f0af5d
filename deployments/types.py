"""Types shared by the Serve ingress, the scheduler and the session actors (no Ray imports).

The HTTP/gRPC layer validates user input into a `SessionSpec`; the scheduler answers with
`SessionInfo` and `Capacity`. Refusals are exceptions that carry what the caller needs to answer
(`NoCapacity.retry_after_s` becomes HTTP 503 + Retry-After).
"""

from __future__ import annotations

import enum
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from deployments.livekit.config import LiveKitOutput

SCHEDULER_NAME = "characters-scheduler"
NAMESPACE = "characters"


class SessionStatus(enum.StrEnum):
    QUEUED = "QUEUED"  # waiting for a whole bundle
    STARTING = "STARTING"  # bundle held; workers loading / warming, reference being encoded
    READY = "READY"  # every rank ready, sink filled; first chunk not yet out
    RUNNING = "RUNNING"  # chunks flowing
    ENDED = "ENDED"  # ended on request, max duration, or room empty (reason says which)
    FAILED = "FAILED"  # an actor died or an error stopped the session (reason says what)

    @property
    def terminal(self) -> bool:
        return self in (SessionStatus.ENDED, SessionStatus.FAILED)


@dataclass(frozen=True)
class OutputSpec:
    """Where the session's media goes. `file`: an MP4 at `path` (server side). `null`: discarded."""

    kind: Literal["null", "file"] = "null"
    path: str | None = None


@dataclass(frozen=True)
class SessionSpec:
    """A validated request to start a character."""

    session_id: str
    image: np.ndarray  # (H, W, 3) uint8, already resized/cropped to the preset's resolution
    preset: str = "tiny"
    max_duration_s: float = 300.0
    output: OutputSpec | LiveKitOutput = field(default_factory=OutputSpec)
    seed: int = 0
    api_key_id: str | None = None  # which API key made it (for per-key quotas), never the key itself
    recover: bool = False  # resume on a fresh bundle when this one is lost (deployments.sessions.recovery)
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C traceparent/tracestate


@dataclass
class SessionStats:
    chunks: int = 0
    frames: int = 0
    fps: float = 0.0  # generated frames per second over the last few seconds (new frames: a late chunk's held
    #                   repeats are not counted; 24 when nothing is late)
    presented_fps: float = 0.0  # frames the output presented per second, held repeats included (LiveKit rooms)
    late_chunks: int = 0
    step_ms_p50: float = 0.0
    step_ms_p95: float = 0.0
    audio_queued_s: float = 0.0
    buffer_ms: float = 0.0  # media queued ahead of playout (the jitter buffer's depth), as of the last chunk
    av_offset_ms: float = 0.0  # video minus audio play time at the output (positive: video behind)
    stage_ms: dict[str, float] = field(default_factory=dict)  # chunk stage -> p50 ms (dit, handoff, decode, ...)
    speech_ms_p50: float = 0.0  # agent speech handed to the session -> its first frame shown (median, LiveKit)


@dataclass
class SessionInfo:
    id: str
    status: SessionStatus
    preset: str
    reason: str | None = None
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None  # first chunk out
    ended_at: float | None = None
    queue_position: int | None = None
    warm_start: bool | None = None  # took a warm slot (True) or made a new one (False)
    stats: SessionStats = field(default_factory=SessionStats)
    owner: str | None = None  # the id of the API key that made it (its tenant; deployments.api.auth), or None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.value
        return d


@dataclass(frozen=True)
class Capacity:
    bundles_total: int
    bundles_free: int
    sessions_running: int
    queued: int
    warm_slots_free: int = 0

    def to_json(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class SessionEvent:
    """Something that happened to a session (streamed to gRPC clients)."""

    seq: int
    session_id: str
    kind: Literal["status", "chunk", "playback_started", "playback_finished", "error"]
    status: SessionStatus | None = None
    chunk: int | None = None
    detail: str | None = None
    at: float = field(default_factory=time.time)


class NoCapacity(Exception):
    """No whole bundle is free and the queue is full (or the caller's quota is used up)."""

    def __init__(self, message: str, retry_after_s: float, code: str = "no_capacity") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.code = code

    def __reduce__(self) -> tuple[type[NoCapacity], tuple[str, float, str]]:  # survives Ray's pickling
        return (type(self), (str(self.args[0]), self.retry_after_s, self.code))


class UnknownSession(KeyError):
    def __init__(self, session_id: str) -> None:
        super().__init__(session_id)
        self.session_id = session_id

    def __str__(self) -> str:
        return f"no session with id {self.session_id!r}"

    def __reduce__(self) -> tuple[type[UnknownSession], tuple[str]]:
        return (type(self), (self.session_id,))
