"""The native API's request and response bodies (camelCase JSON; pydantic): sessions, capacity, health.

Shared by the HTTP routes (`deployments.api.http`), gRPC (`deployments.api.grpc_service`, which maps its
messages onto `SessionOptions`) and the watch page.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from characters.config import MODEL_PRESETS
from deployments.types import (
    Capacity,
    SessionInfo,
    SessionStatus,
)


class _In(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, extra="forbid", frozen=True, strict=True)


class _Out(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, validate_by_alias=True)


#: A 16x16 PNG: the schema's example of `avatar.image` (the smallest size accepted).
EXAMPLE_IMAGE = ("iVBORw0KGgoAAAANSUhEUgAAABAAAAAQCAIAAACQkWg2AAAAGklEQVR42mM8saCCgRTAxEAiGNUwqmHoaAAA7usCAAX5"
                 "Xl4AAAAASUVORK5CYII=")
IMAGE_SCHEMA: dict[str, Any] = {"format": "byte", "examples": [EXAMPLE_IMAGE]}  # format byte: base64 (OpenAPI)


class AvatarIn(_In):
    image: str = Field(description="The reference image (PNG, JPEG or WebP file) in standard base64; a "
                                   "`data:image/...;base64,` prefix and whitespace are accepted.",
                       json_schema_extra=IMAGE_SCHEMA)


class OutputIn(_In):
    kind: Literal["null", "file", "livekit"] = Field(default="null", description="null: discard media; file: "
                                                     "server-side MP4; livekit: publish into a LiveKit room.")
    path: str | None = Field(default=None, description="kind=file only: a relative .mp4 path under the server's "
                                                       "output directory.")
    url: str | None = Field(default=None, max_length=2048, description="kind=livekit: the server, ws(s)://host.")
    room_name: str | None = Field(default=None, max_length=256, description="kind=livekit: the room to join.")
    token: str | None = Field(default=None, max_length=8192, description="kind=livekit: the character's access "
                                                                         "token (or apiKey + apiSecret).")
    api_key: str | None = Field(default=None, max_length=256, description="kind=livekit: mint a token with this.")
    api_secret: str | None = Field(default=None, max_length=1024)
    identity: str | None = Field(default=None, max_length=128, description="kind=livekit, minted token: identity.")
    agent_identity: str | None = Field(default=None, max_length=128, description="kind=livekit: the LiveKit Agents "
                                       "participant whose speech the character voices (lk.publish_on_behalf).")

    @model_validator(mode="after")
    def _check(self) -> OutputIn:
        if self.kind == "null" and self.path is not None:
            raise ValueError("output.path is only allowed with output.kind='file'")
        livekit = {k: v for k in _LIVEKIT_FIELDS if (v := getattr(self, k)) is not None}
        if self.kind != "livekit" and livekit:
            raise ValueError(f"output.{to_camel(next(iter(livekit)))} is only allowed with output.kind='livekit'")
        if self.kind == "livekit":
            if self.path is not None or self.url is None or self.room_name is None:
                raise ValueError("output.kind='livekit' needs url and roomName (and no path)")
            if (self.token is None) == (self.api_key is None or self.api_secret is None):
                raise ValueError("output.kind='livekit' needs token, or apiKey and apiSecret (not both)")
        return self


_LIVEKIT_FIELDS = ("url", "room_name", "token", "api_key", "api_secret", "identity", "agent_identity")


class SessionOptions(_In):
    """Everything in a create request but the image (shared with gRPC)."""

    preset: str | None = Field(default=None, description=f"Model preset, one of {sorted(MODEL_PRESETS)} served by "
                                                         "this service; null: the service's default.")
    max_duration: float = Field(default=300.0, gt=0, description="Seconds after which the session ends by itself.")
    output: OutputIn = Field(default_factory=OutputIn)
    seed: int = Field(default=0, ge=0, le=2**63 - 1, description="Seed of the session's noise.")
    recover: bool = Field(default=False, description="Resume on a fresh GPU bundle, in the same room, when this "
                          "one is lost (a worker dies); the viewer sees a pause, not an end. Not with a file output.")

    @field_validator("preset")
    @classmethod
    def _preset(cls, value: str | None) -> str | None:
        if value is not None and value not in MODEL_PRESETS:
            raise ValueError(f"{value[:64]!r} is unknown; choose one of {sorted(MODEL_PRESETS)}")
        return value


class CreateSessionRequest(SessionOptions):
    avatar: AvatarIn


class StatsOut(_Out):
    chunks: int
    frames: int
    fps: float = Field(description="Generated frames per second over the last few seconds: new frames only (the "
                       "held repeats of a late chunk do not count); 24 when nothing is late.")
    presented_fps: float = Field(default=0.0, description="Frames the output presented per second, held repeats "
                                 "included (what a viewer counts; LiveKit rooms, else 0).")
    late_chunks: int = Field(description="Chunks that were not there when their audio was due, so the output held "
                             "a frame and played silence until they came (LiveKit rooms: the real playout's count; "
                             "else the room's playout model's).")
    step_ms_p50: float
    step_ms_p95: float
    audio_queued_s: float
    buffer_ms: float = Field(default=0.0, description="Media queued ahead of playout (the jitter buffer's depth).")
    av_offset_ms: float = Field(default=0.0, description="Video minus audio play time at the output (positive: "
                                "video behind).")
    stage_ms: dict[str, float] = Field(default_factory=dict, description="Median ms per chunk stage over the last "
                                       "~20 s: dit, cache_write, handoff, decode, publish.")
    speech_ms_p50: float = Field(default=0.0, description="Agent speech handed to the session -> its first frame "
                                 "shown, median over recent speech segments (LiveKit rooms, else 0).")


class SessionOut(_Out):
    id: str
    status: SessionStatus
    preset: str
    reason: str | None = Field(description="Why the session ended or failed; null while it lives.")
    created_at: float
    started_at: float | None = Field(description="When the first chunk went out.")
    ended_at: float | None
    queue_position: int | None = Field(description="Place in the admission queue while QUEUED.")
    warm_start: bool | None = Field(description="Took a warm slot (true) or started a new one (false).")
    stats: StatsOut

    @classmethod
    def of(cls, info: SessionInfo) -> SessionOut:
        return cls.model_validate(info.to_json())


class SessionListOut(_Out):
    sessions: list[SessionOut]


class CapacityOut(_Out):
    bundles_total: int
    bundles_free: int
    sessions_running: int
    queued: int
    warm_slots_free: int

    @classmethod
    def of(cls, cap: Capacity) -> CapacityOut:
        return cls.model_validate(cap.to_json())


class HealthOut(BaseModel):
    status: Literal["ok"] = "ok"
