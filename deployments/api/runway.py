"""The Runway-compatible routes (`/v1/realtime_sessions`, `/v1/avatars`) beside the native API, and the
Runway Characters API shapes that `livekit-plugins-runway` (1.8.9) speaks.

What the plugin sends (read from its source) and what it needs back:

    POST {RUNWAYML_BASE_URL}/v1/realtime_sessions
      Authorization: Bearer <RUNWAYML_API_SECRET>     X-Runway-Version: 2024-11-06
      {"model": "gwm1_avatars",
       "avatar": {"type": "custom", "avatarId": "..."} | {"type": "runway-preset", "presetId": "..."},
       "livekit": {"url": "wss://...", "token": "<JWT for the avatar>", "roomName": "...",
                   "agentIdentity": "<the agent's identity>"},
       "maxDuration": 300}                               (optional, seconds)
    -> 2xx JSON object with "id" (anything else: plain text is retried as a failure; 4xx fails at once;
       5xx and 429 are retried 3 times, 2 s apart)
    DELETE {base}/v1/realtime_sessions/{id}             only when the room is already gone; the usual
                                                         end is a data message {"type": "END_CALL"}

Unknown request fields are ignored (a newer plugin may add some); errors keep this API's shape
`{"error": {"code", "message", "field"}}`. `POST /v1/avatars` registers a reference image (decoded and
validated at the served preset's resolution) and returns the `avatarId`; preset ids name bundled faces.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal, cast

import numpy as np
from fastapi import FastAPI, Header, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from characters.config import MODEL_PRESETS
from characters.media import load_image
from deployments.api.avatars import AvatarCreateIn, AvatarOut, iso
from deployments.api.errors import ApiError, ErrorCode, error_responses
from deployments.api.frontend import SessionFrontend
from deployments.api.requests import decode_base64_image, key_id, load_avatar, trace_context
from deployments.livekit.config import LiveKitConfigError, LiveKitOutput
from deployments.types import OutputSpec, SessionInfo, SessionSpec, SessionStatus

RUNWAY_VERSION = "2024-11-06"
RUNWAY_MODEL = "gwm1_avatars"
DEFAULT_MAX_DURATION_S = 300
ASSETS = Path(__file__).resolve().parents[2] / "characters" / "assets"
PRESET_FACES = {"sample-face": "sample_face.png"}  # presetId -> bundled reference image
# Published in /openapi.json (tag "runway"), so clients and the schema fuzzer (tests/unit/test_api_fuzz.py) see them.
IN_SCHEMA = True


class _RunwayIn(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, extra="ignore", frozen=True)


class CustomAvatarIn(_RunwayIn):
    type: Literal["custom"]
    avatar_id: str = Field(min_length=1, max_length=128, description="An id returned by POST /v1/avatars.")


class PresetAvatarIn(_RunwayIn):
    type: Literal["runway-preset"]
    preset_id: str = Field(min_length=1, max_length=128, description=f"One of {sorted(PRESET_FACES)}.",
                           examples=sorted(PRESET_FACES))


class RunwayLiveKitIn(_RunwayIn):
    url: str = Field(min_length=1, max_length=2048, description="The LiveKit server (ws:// or wss://).",
                     examples=["wss://livekit.example.com"])
    token: str = Field(min_length=1, max_length=8192, description="Access token for the avatar's participant.",
                       examples=["<header>.<claims>.<signature>"])
    room_name: str = Field(min_length=1, max_length=256, examples=["my-room"])
    agent_identity: str | None = Field(default=None, max_length=128, description="The agent the avatar voices.")


class RealtimeSessionIn(_RunwayIn):
    model: str = Field(description=f"{RUNWAY_MODEL!r}.", examples=[RUNWAY_MODEL])
    avatar: Annotated[CustomAvatarIn | PresetAvatarIn, Field(discriminator="type")]
    livekit: RunwayLiveKitIn
    max_duration: float | None = Field(default=None, gt=0, description="Seconds; default "
                                       f"{DEFAULT_MAX_DURATION_S}.")


class _RunwayOut(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, validate_by_alias=True)


RunwayStatus = Literal["PENDING", "READY", "RUNNING", "COMPLETED", "CANCELLED", "FAILED"]


def runway_status(info: SessionInfo) -> RunwayStatus:
    """QUEUED/STARTING -> PENDING; READY; RUNNING; ENDED by DELETE -> CANCELLED, ended otherwise
    (END_CALL, agent left, max duration) -> COMPLETED; FAILED."""
    s = info.status
    if s in (SessionStatus.QUEUED, SessionStatus.STARTING):
        return "PENDING"
    if s is SessionStatus.READY:
        return "READY"
    if s is SessionStatus.RUNNING:
        return "RUNNING"
    if s is SessionStatus.ENDED:
        return "CANCELLED" if info.reason == "deleted" else "COMPLETED"
    return "FAILED"


class RealtimeSessionOut(_RunwayOut):
    id: str
    status: RunwayStatus
    created_at: str | None
    started_at: str | None = Field(description="When the first frame went out.")
    ended_at: str | None
    failure: str | None = Field(description="Why it failed (FAILED only).")
    end_reason: str | None = Field(description="Why it ended (COMPLETED / CANCELLED).")

    @classmethod
    def of(cls, info: SessionInfo) -> RealtimeSessionOut:
        status = runway_status(info)
        return cls(id=info.id, status=status, created_at=iso(info.created_at), started_at=iso(info.started_at),
                   ended_at=iso(info.ended_at), failure=info.reason if status == "FAILED" else None,
                   end_reason=info.reason if status in ("COMPLETED", "CANCELLED") else None)


def check_request(body: RealtimeSessionIn, version: str | None) -> None:
    if version is not None and version != RUNWAY_VERSION:
        raise ApiError(422, ErrorCode.INVALID_FIELD, f"is {version[:32]!r}; this server speaks {RUNWAY_VERSION}",
                       "X-Runway-Version")
    if body.model != RUNWAY_MODEL:
        raise ApiError(422, ErrorCode.INVALID_FIELD, f"is {body.model[:64]!r}; the model served here is "
                       f"{RUNWAY_MODEL!r}", "model")


def runway_output(lk: RunwayLiveKitIn, identity: str = "runway-avatar-agent") -> LiveKitOutput:
    """The session's LiveKit output from the request's `livekit` object (the token is the plugin's)."""
    try:
        return LiveKitOutput(url=lk.url, room_name=lk.room_name, token=lk.token, identity=identity,
                             agent_identity=lk.agent_identity or None)
    except LiveKitConfigError as e:
        raise ApiError(422, ErrorCode.INVALID_FIELD, str(e), f"livekit.{_field_of(str(e))}") from e


def _field_of(message: str) -> str:
    for name in ("url", "roomName", "token", "agentIdentity", "identity", "apiKey"):
        if message.startswith(name) or f" {name} " in message:
            return name
    return "url"


@cache
def preset_face(preset_id: str, height: int, width: int) -> np.ndarray:
    """A bundled face for a Runway preset id, at (height, width); ApiError 422 for unknown ids."""
    if preset_id not in PRESET_FACES:
        raise ApiError(422, ErrorCode.INVALID_FIELD, f"is {preset_id[:64]!r}; presets here: {sorted(PRESET_FACES)} "
                       "(or register your own image with POST /v1/avatars and use a custom avatar)",
                       "avatar.presetId")
    face = load_image(ASSETS / PRESET_FACES[preset_id], height, width)
    face.setflags(write=False)
    return face


# ----------------------------------------------------------------------------------------- routes


async def realtime_spec(frontend: SessionFrontend, body: RealtimeSessionIn, api_key_id: str | None = None,
                        trace_context: dict[str, str] | None = None) -> SessionSpec:
    """The session a Runway-compatible request asks for: the avatar's image at the served preset's
    resolution, the request's LiveKit room, maxDuration (default 300 s) under the server's limit."""
    preset, limit = frontend.resolve_preset(None), frontend.config.max_duration_s
    gen = MODEL_PRESETS[preset].generation
    if body.avatar.type == "custom":
        image = (await frontend.avatars.get(body.avatar.avatar_id, "avatar.avatarId")).image
    else:
        image = preset_face(body.avatar.preset_id, gen.height, gen.width)
    max_duration = float(body.max_duration or min(DEFAULT_MAX_DURATION_S, limit))
    if max_duration > limit:
        raise ApiError(422, ErrorCode.INVALID_FIELD, f"is {max_duration:g} s, over this server's limit of {limit:g} s",
                       "maxDuration")
    return SessionSpec(session_id=uuid.uuid4().hex, image=image, preset=preset, max_duration_s=max_duration,
                       output=cast(OutputSpec, runway_output(body.livekit)),  # until OutputSpec takes LiveKitOutput
                       api_key_id=api_key_id, trace_context=dict(trace_context or {}))


def add_realtime_routes(app: FastAPI, frontend: SessionFrontend, dependencies: list[Any]) -> None:
    """`/v1/realtime_sessions` (Runway-compatible) and `/v1/avatars` on the native app, same auth and errors."""
    config = frontend.config
    route: dict[str, Any] = {"dependencies": dependencies, "tags": ["runway"], "include_in_schema": IN_SCHEMA}

    @app.post("/v1/realtime_sessions", response_model=RealtimeSessionOut, **route,
              responses=error_responses(400, 401, 413, 422, 429, 503),
              summary="Start an avatar (Runway Characters API)")
    async def create_realtime(body: RealtimeSessionIn, request: Request,
                              x_runway_version: str | None = Header(default=None)) -> RealtimeSessionOut:
        check_request(body, x_runway_version)
        spec = await realtime_spec(frontend, body, key_id(request), trace_context(request))
        return RealtimeSessionOut.of(await frontend.submit(spec))

    @app.get("/v1/realtime_sessions/{session_id}", response_model=RealtimeSessionOut, **route,
             responses=error_responses(401, 404, 422, 503), summary="Get an avatar session")
    async def get_realtime(session_id: str) -> RealtimeSessionOut:
        return RealtimeSessionOut.of(await frontend.get(session_id))

    @app.delete("/v1/realtime_sessions/{session_id}", status_code=204, **route,
                responses=error_responses(401, 404, 422, 503), summary="Cancel an avatar session (idempotent)")
    async def cancel_realtime(session_id: str) -> Response:
        await frontend.end(session_id, "deleted")
        return Response(status_code=204)

    @app.post("/v1/avatars", status_code=201, response_model=AvatarOut, **route,
              responses=error_responses(400, 401, 413, 422), summary="Register a reference image")
    async def create_avatar(body: AvatarCreateIn, response: Response) -> AvatarOut:
        raw = await asyncio.to_thread(decode_base64_image, body.image, config, "image")
        image = await asyncio.to_thread(load_avatar, raw, frontend.resolve_preset(None), config, "image")
        avatar = await frontend.avatars.add(image, body.name, time.time())
        response.headers["Location"] = f"/v1/avatars/{avatar.id}"
        return avatar.out()

    @app.get("/v1/avatars/{avatar_id}", response_model=AvatarOut, **route,
             responses=error_responses(401, 404, 422), summary="Get a registered avatar")
    async def get_avatar(avatar_id: str) -> AvatarOut:
        return (await frontend.avatars.get(avatar_id)).out()

    @app.delete("/v1/avatars/{avatar_id}", status_code=204, **route,
                responses=error_responses(401, 404, 422), summary="Delete a registered avatar")
    async def delete_avatar(avatar_id: str) -> Response:
        await frontend.avatars.delete(avatar_id)
        return Response(status_code=204)
