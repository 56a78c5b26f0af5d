"""The Runway Characters API (`/v1/realtime_sessions`, and `/v1/avatars` from `deployments.api.runway_avatars`)
beside the native one, in the shapes the official clients read: `runwayml` (PyPI), `@runwayml/sdk`,
`@runwayml/avatars(-react)` and `livekit-plugins-runway`.

    POST   /v1/realtime_sessions       {model: "gwm1_avatars", avatar: {type: "custom", avatarId} |
                                        {type: "runway-preset", presetId}, integration?: {type: "livekit", url, token,
                                        roomName, agentIdentity?}, livekit? (deprecated: the same without type),
                                        maxDuration?, personality?, startScript?, tools?}         -> {id}
    GET    /v1/realtime_sessions/{id}  -> NOT_READY {queued} | READY {sessionKey, expiresAt} | RUNNING |
                                          COMPLETED {duration} | FAILED {failure, failureCode} | CANCELLED
    DELETE /v1/realtime_sessions/{id}  -> 204 (CANCELLED; idempotent)
    POST   /v1/realtime_sessions/{id}/consume   Authorization: Bearer <sessionKey>  -> {url, token, roomName}

With an integration the character joins the caller's room with the caller's token (the plugin's request) and
goes NOT_READY -> RUNNING. Without one it gets a room of the service's own LiveKit server (`watch-<id>`), goes
NOT_READY -> READY (with a session key, valid once until expiresAt) -> RUNNING once the key is consumed; the
consumer's token may join that room, subscribe and publish (the user's microphone, for an agent of theirs).
Such a session's speech comes from `POST /v1/sessions/{id}/audio` or gRPC `StreamAudio` (the same id), or from
a LiveKit Agents participant in that room; it ends when the room empties, at maxDuration, or on DELETE.
`personality`, `startScript` and `tools` are validated and stored; the character only renders (the voice
agent that would use them is the caller's). Every Runway preset id shows the bundled sample face.

Statuses from the scheduler's: QUEUED -> NOT_READY (queued), STARTING -> NOT_READY; READY and RUNNING ->
READY until consumed (no integration), else RUNNING; ENDED by DELETE -> CANCELLED, ended otherwise
(END_CALL, room empty, maxDuration) -> COMPLETED; FAILED (failureCode: the reason's leading word).

Requests: unknown fields are ignored (a newer client may add some); `X-Runway-Version`, when sent, must be
2024-11-06 and is echoed; the client's User-Agent is logged once per key and client. Errors keep this API's
shape `{"error": {code, message, field}}` with the status codes the SDKs map to their exception classes
(400, 401, 404, 409, 422, 429 and 503 with Retry-After); a 5xx that retrying cannot fix says `x-should-retry:
false`, which the SDKs obey. A session without an integration on a server with no LiveKit server of its own
is 422 `livekit_not_configured` naming `integration`.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import Depends, FastAPI, Header, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from characters.config import MODEL_PRESETS
from characters.media import load_image
from deployments.api.auth import ANYONE
from deployments.api.avatars import iso
from deployments.api.errors import ApiError, ErrorCode, error_responses
from deployments.api.frontend import SessionFrontend
from deployments.api.realtime import RealtimeRecord
from deployments.api.requests import caller, trace_context
from deployments.api.runway_avatars import add_avatar_routes
from deployments.api.watch import WatchSettings, participant_token, service_room
from deployments.livekit.config import LiveKitConfigError, LiveKitOutput
from deployments.types import SessionInfo, SessionSpec, SessionStatus

logger = logging.getLogger(__name__)

RUNWAY_VERSION = "2024-11-06"
RUNWAY_MODEL = "gwm1_avatars"
DEFAULT_MAX_DURATION_S = 300
ASSETS = Path(__file__).resolve().parents[2] / "characters" / "assets"
#: Runway's preset avatar ids (the SDKs') and ours; each shows the bundled sample face.
RUNWAY_PRESETS = ("game-character", "music-superstar", "game-character-man", "cat-character", "influencer",
                  "tennis-coach", "human-resource", "fashion-designer", "cooking-teacher")
PRESET_FACES = {"sample-face": "sample_face.png", **{p: "sample_face.png" for p in RUNWAY_PRESETS}}
IN_SCHEMA = True  # published in /openapi.json (tag "runway"): clients and the schema fuzzer see them
CHARACTER_IDENTITY = "character"


class _RunwayIn(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, extra="ignore", frozen=True)


class CustomAvatarIn(_RunwayIn):
    type: Literal["custom"]
    avatar_id: str = Field(min_length=1, max_length=128, description="An id returned by POST /v1/avatars.")


class PresetAvatarIn(_RunwayIn):
    type: Literal["runway-preset"]
    preset_id: str = Field(min_length=1, max_length=128, description=f"One of {sorted(PRESET_FACES)}.",
                           examples=["sample-face"])


class RunwayLiveKitIn(_RunwayIn):
    url: str = Field(min_length=1, max_length=2048, description="The LiveKit server (ws:// or wss://).",
                     examples=["wss://livekit.example.com"])
    token: str = Field(min_length=1, max_length=8192, description="Access token for the avatar's participant.",
                       examples=["<header>.<claims>.<signature>"])
    room_name: str = Field(min_length=1, max_length=256, examples=["my-room"])
    agent_identity: str | None = Field(default=None, max_length=128, description="The agent the avatar voices.")


class LiveKitIntegrationIn(RunwayLiveKitIn):
    type: Literal["livekit"]


class ElevenLabsIntegrationIn(_RunwayIn):
    type: Literal["elevenlabs"]
    signed_url: str | None = Field(default=None, max_length=4096)


class ToolParameterIn(_RunwayIn):
    name: str = Field(min_length=1, max_length=64)
    type: Literal["string", "integer", "number", "boolean", "array", "object"]
    description: str = Field(default="", max_length=2000)
    required: bool | None = None
    enum: list[Annotated[str, Field(max_length=256)]] | None = Field(default=None, max_length=64)
    items: dict[str, str] | None = None
    properties: list[Any] | None = Field(default=None, max_length=64)


class ToolIn(_RunwayIn):
    type: Literal["client_event", "backend_rpc"]
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    description: str = Field(max_length=2000)
    parameters: list[ToolParameterIn] | None = Field(default=None, max_length=32)
    timeout_seconds: float | None = Field(default=None, gt=0, le=600)


class RealtimeSessionIn(_RunwayIn):
    model: str = Field(description=f"{RUNWAY_MODEL!r}.", examples=[RUNWAY_MODEL])
    avatar: Annotated[CustomAvatarIn | PresetAvatarIn, Field(discriminator="type")]
    integration: Annotated[LiveKitIntegrationIn | ElevenLabsIntegrationIn, Field(discriminator="type")] | None = \
        Field(default=None, description="type livekit: join your room with your token. None: a room of this "
                                        "service's own LiveKit server, consumed through the session key.")
    livekit: RunwayLiveKitIn | None = Field(default=None, deprecated=True, description="Deprecated by Runway: "
                                            "integration {type: 'livekit', ...}. Still what livekit-plugins-runway "
                                            "1.8.9 sends.")
    max_duration: float | None = Field(default=None, gt=0, description=f"Seconds; default {DEFAULT_MAX_DURATION_S}.")
    personality: str | None = Field(default=None, max_length=20_000, description="Stored (the agent is yours).")
    start_script: str | None = Field(default=None, max_length=20_000, description="Stored (the agent is yours).")
    tools: list[ToolIn] | None = Field(default=None, max_length=64, description="Stored (the agent is yours).")


# ------------------------------------------------------------------------------------------- shapes


class _RunwayOut(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, validate_by_alias=True)


class RealtimeSessionCreatedOut(_RunwayOut):
    id: str


class _SessionOut(_RunwayOut):
    id: str
    created_at: str


class NotReadyOut(_SessionOut):
    status: Literal["NOT_READY"] = "NOT_READY"
    queued: bool = Field(description="Waiting for capacity (true) or being provisioned (false).")


class ReadyOut(_SessionOut):
    status: Literal["READY"] = "READY"
    session_key: str = Field(description="Bearer of POST .../consume: valid once, until expiresAt.")
    expires_at: str


class RunningOut(_SessionOut):
    status: Literal["RUNNING"] = "RUNNING"


class CompletedOut(_SessionOut):
    status: Literal["COMPLETED"] = "COMPLETED"
    duration: int = Field(description="Seconds from the first frame (or creation) to the end.")


class FailedOut(_SessionOut):
    status: Literal["FAILED"] = "FAILED"
    failure: str = Field(description="What went wrong, for people.")
    failure_code: str = Field(description="A stable machine-readable code (the reason's leading word).")


class CancelledOut(_SessionOut):
    status: Literal["CANCELLED"] = "CANCELLED"


RealtimeSessionOut = Annotated[NotReadyOut | ReadyOut | RunningOut | CompletedOut | FailedOut | CancelledOut,
                               Field(discriminator="status")]
AnySessionOut = NotReadyOut | ReadyOut | RunningOut | CompletedOut | FailedOut | CancelledOut


class ConsumeOut(_RunwayOut):
    url: str = Field(description="The LiveKit server, as browsers reach it.")
    token: str = Field(description="Joins roomName: subscribe, publish (microphone, camera) and data.")
    room_name: str


def failure_code(reason: str | None) -> str:
    match = re.match(r"[a-z][a-z0-9_]*", reason or "")
    return match.group(0) if match else "internal"


def runway_view(info: SessionInfo, record: RealtimeRecord | None) -> AnySessionOut:
    """The Runway status of a session (see the module docstring), with exactly that status's fields."""
    common: dict[str, Any] = {"id": info.id, "created_at": iso(info.created_at)}
    s = info.status
    if s in (SessionStatus.QUEUED, SessionStatus.STARTING):
        return NotReadyOut(**common, queued=s is SessionStatus.QUEUED)
    if s in (SessionStatus.READY, SessionStatus.RUNNING):
        if record is not None and record.session_key is not None and record.consumed_at is None:
            return ReadyOut(**common, session_key=record.session_key, expires_at=iso(record.expires_at))
        return RunningOut(**common)
    if s is SessionStatus.ENDED:
        if info.reason == "deleted":
            return CancelledOut(**common)
        end = info.ended_at or time.time()
        return CompletedOut(**common, duration=max(0, round(end - (info.started_at or info.created_at))))
    return FailedOut(**common, failure=info.reason or "failed", failure_code=failure_code(info.reason))


def runway_output(lk: RunwayLiveKitIn, field: str, identity: str = "runway-avatar-agent") -> LiveKitOutput:
    """The session's LiveKit output from the request's integration (the token is the caller's)."""
    try:
        return LiveKitOutput(url=lk.url, room_name=lk.room_name, token=lk.token, identity=identity,
                             agent_identity=lk.agent_identity or None)
    except LiveKitConfigError as e:
        raise ApiError(422, ErrorCode.INVALID_FIELD, str(e), f"{field}.{_field_of(str(e))}") from e


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
                       "(or create your own with POST /v1/avatars and use a custom avatar)", "avatar.presetId")
    face = load_image(ASSETS / PRESET_FACES[preset_id], height, width)
    face.setflags(write=False)
    return face


def check_request(body: RealtimeSessionIn) -> None:
    if body.model != RUNWAY_MODEL:
        raise ApiError(422, ErrorCode.INVALID_FIELD, f"is {body.model[:64]!r}; the model served here is "
                       f"{RUNWAY_MODEL!r}", "model")
    if body.integration is not None and body.livekit is not None:
        raise ApiError(422, ErrorCode.INVALID_FIELD, "give integration, or the deprecated livekit, not both",
                       "livekit")
    if isinstance(body.integration, ElevenLabsIntegrationIn):
        raise ApiError(422, ErrorCode.INVALID_FIELD, "is 'elevenlabs', which this server does not run; use "
                       "{type: 'livekit', ...} or no integration (a room of this service)", "integration.type")


class RunwayClient:
    """A dependency of every Runway route: `X-Runway-Version` (when sent) must be ours, and is echoed; the
    client's User-Agent is logged once per (key, client) by this replica."""

    def __init__(self, max_seen: int = 1024) -> None:
        self.seen: set[tuple[str | None, str]] = set()
        self.max_seen = max_seen

    def __call__(self, request: Request, response: Response,
                 x_runway_version: str | None = Header(default=None)) -> None:
        if x_runway_version is not None and x_runway_version != RUNWAY_VERSION:
            raise ApiError(422, ErrorCode.INVALID_FIELD, f"is {x_runway_version[:32]!r}; this server speaks "
                           f"{RUNWAY_VERSION}", "X-Runway-Version")
        response.headers["X-Runway-Version"] = RUNWAY_VERSION
        agent = re.sub(r"[^\x20-\x7e]", "?", request.headers.get("user-agent", "")[:120])
        who = getattr(request.state, "api_key_id", None)
        if (who, agent) not in self.seen and len(self.seen) < self.max_seen:
            self.seen.add((who, agent))
            logger.info("runway client %r (key %s) on %s %s", agent, who or "-", request.method, request.url.path)


# ------------------------------------------------------------------------------------------- routes


def add_realtime_routes(app: FastAPI, frontend: SessionFrontend, dependencies: list[Any],
                        livekit: WatchSettings | None = None) -> None:
    """`/v1/realtime_sessions` and `/v1/avatars` on the native app: the same auth, errors and tenancy."""
    settings = livekit or WatchSettings()
    client = RunwayClient()
    route: dict[str, Any] = {"dependencies": [*dependencies, Depends(client)], "tags": ["runway"],
                             "include_in_schema": IN_SCHEMA}
    add_avatar_routes(app, frontend, route)

    @app.post("/v1/realtime_sessions", response_model=RealtimeSessionCreatedOut, **route,
              responses=error_responses(400, 401, 413, 422, 429, 503), summary="Start an avatar session")
    async def create_realtime(body: RealtimeSessionIn, request: Request) -> RealtimeSessionCreatedOut:
        check_request(body)
        who = caller(request)
        preset, limit = frontend.resolve_preset(None), frontend.config.max_duration_s
        gen = MODEL_PRESETS[preset].generation
        max_duration = float(body.max_duration or min(DEFAULT_MAX_DURATION_S, limit))
        if max_duration > limit:
            raise ApiError(422, ErrorCode.INVALID_FIELD, f"is {max_duration:g} s, over this server's limit of "
                           f"{limit:g} s", "maxDuration")
        lk = body.integration if isinstance(body.integration, LiveKitIntegrationIn) else body.livekit
        session_id, now = secrets.token_hex(16), time.time()
        if lk is not None:
            output = runway_output(lk, "integration" if body.integration is not None else "livekit")
            room, key = None, None
        else:
            try:
                settings.check()
            except ApiError as e:  # the request cannot be served as it is: it must bring its room (a 4xx, no retry)
                raise ApiError(422, e.code, f"is needed here: {e.message}; or give integration {{type: 'livekit', "
                               "url, token, roomName}", "integration") from e
            room, key = service_room(session_id), secrets.token_urlsafe(32)
            output = LiveKitOutput(url=settings.url, room_name=room, api_key=settings.api_key,
                                   api_secret=settings.api_secret, identity=CHARACTER_IDENTITY)
        if body.avatar.type == "custom":
            image = await frontend.avatars.image(body.avatar.avatar_id, who, "avatar.avatarId")
        else:
            image = preset_face(body.avatar.preset_id, gen.height, gen.width)
        await frontend.realtime.add(RealtimeRecord(
            session_id, who.key_id, now, room=room, session_key=key,
            expires_at=now + frontend.config.session_key_ttl_s if key else None, personality=body.personality,
            start_script=body.start_script, tools=tuple(t.model_dump(by_alias=True, exclude_none=True)
                                                         for t in body.tools or ())))
        spec = SessionSpec(session_id=session_id, image=image, preset=preset, max_duration_s=max_duration,
                           output=output, api_key_id=who.key_id, trace_context=trace_context(request))
        try:
            await frontend.submit(spec)
        except ApiError:
            await frontend.realtime.discard(session_id)
            raise
        return RealtimeSessionCreatedOut(id=session_id)

    @app.get("/v1/realtime_sessions/{session_id}", response_model=RealtimeSessionOut, **route,
             responses=error_responses(401, 404, 422, 503), summary="Get an avatar session")
    async def get_realtime(session_id: str, request: Request) -> Any:
        info = await frontend.get(session_id, caller(request))
        return runway_view(info, await frontend.realtime.get(session_id))

    @app.delete("/v1/realtime_sessions/{session_id}", status_code=204, **route,
                responses=error_responses(401, 404, 422, 503),
                summary="Cancel an avatar session (idempotent)")
    async def cancel_realtime(session_id: str, request: Request) -> Response:
        await frontend.end(session_id, caller(request), "deleted")
        return Response(status_code=204)

    @app.post("/v1/realtime_sessions/{session_id}/consume", response_model=ConsumeOut,
              dependencies=[Depends(client)], tags=["runway"], include_in_schema=IN_SCHEMA,
              responses=error_responses(401, 409, 422, 503),
              summary="Take a READY session's room (bearer: its sessionKey)")
    async def consume_realtime(session_id: str, authorization: str | None = Header(default=None)) -> ConsumeOut:
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(401, "missing_session_key", "send the session's key: 'Authorization: Bearer <sessionKey>' "
                           "(from GET /v1/realtime_sessions/{id} while READY)")
        key, now = key.strip(), time.time()
        outcome, room = await frontend.realtime.consume(session_id, key, now, False)
        if outcome == "ok":
            info = await frontend.get(session_id, ANYONE)  # the key is the credential: no tenant scope here
            if info.status not in (SessionStatus.READY, SessionStatus.RUNNING):
                raise ApiError(409, "session_not_ready", f"the session is {runway_view(info, None).status}; consume "
                               "it while READY")
            outcome, room = await frontend.realtime.consume(session_id, key, now, True)
        if outcome != "ok" or room is None:
            raise ApiError(401, "invalid_session_key", {
                "used": "this session key was consumed already (it is valid once); start a new session",
                "expired": "this session key has expired; start a new session"}.get(
                outcome, "the session key is not valid for this session"))
        settings.check(no_retry=True)
        identity = f"user-{secrets.token_hex(4)}"
        return ConsumeOut(url=settings.public_url, room_name=room, token=participant_token(settings, room, identity))
