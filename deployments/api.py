"""The HTTP API: request/response schemas, validation, and the FastAPI app (no Ray imports).

Endpoints (JSON everywhere; field names are camelCase in requests and responses; times are Unix seconds):

    POST   /v1/sessions        CreateSessionRequest -> 201 Session (+ Location)   start a character
    GET    /v1/sessions        -> SessionList                                     every known session
    GET    /v1/sessions/{id}   -> Session                                         404 if unknown
    DELETE /v1/sessions/{id}   -> Session (ENDED)                                 idempotent; 404 if unknown
    GET    /v1/capacity        -> Capacity                                        bundles free/total, queue, warm slots
    GET    /healthz            -> {"status": "ok"}                                never needs a key
    POST   /v1/realtime_sessions, GET / DELETE /v1/realtime_sessions/{id}         the Runway Characters API as
                                                                                  livekit-plugins-runway calls it
    POST   /v1/avatars, GET / DELETE /v1/avatars/{id}                             reference images for avatarId
    GET    /openapi.json, /docs                                                   the schema, with error bodies

Errors: `deployments.errors` (one JSON shape, a code per condition). Limits (`ApiConfig`, per service):
request body `max_body_bytes` (413 body_too_large), `avatar.image` base64 length and decoded bytes
(`max_image_bytes`) and pixels (`max_image_pixels`) (413 image_too_large). The image is decoded and
validated with `characters.media.load_image` at the preset's resolution before the scheduler sees it.

`SessionFrontend` holds the logic shared by HTTP and gRPC (validation, scheduler calls, mapping of the
scheduler's refusals); it takes any object with the scheduler's async interface (`Scheduler`), so
tests drive it without Ray. The Serve deployment that hosts all this is in `deployments.app`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import math
import posixpath
import re
import uuid
from typing import Any, Literal, Protocol, cast

import numpy as np
from fastapi import FastAPI, Request, Response, Security
from fastapi.middleware.cors import CORSMiddleware
from fastapi.security import HTTPBearer
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from characters.config import MODEL_PRESETS
from characters.media import MediaError, load_image
from deployments import settings
from deployments.auth import ApiKeys, BearerAuthMiddleware
from deployments.errors import ApiError, ErrorCode, error_responses, install_error_handlers
from deployments.livekit.config import LiveKitConfigError, LiveKitOutput
from deployments.livekit.runway import AvatarRegistry, add_realtime_routes
from deployments.types import (
    Capacity,
    NoCapacity,
    OutputSpec,
    SessionEvent,
    SessionInfo,
    SessionSpec,
    SessionStatus,
    UnknownSession,
)

MiB = 1024 * 1024
MAX_SESSION_ID_CHARS = 128


class ApiConfig(BaseModel):
    """What the API accepts; one per service (the `api` section of the app args)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # The limits' defaults come from CHARACTERS_* variables (deployments.settings), validated like given values.
    presets: tuple[str, ...] = Field(default=("tiny",), description="Presets served; the first is the default.")
    max_duration_s: float = Field(default_factory=settings.MAX_DURATION_S.get, gt=0, validate_default=True,
                                  description="Largest maxDuration a request may ask for.")
    max_body_bytes: int = Field(default_factory=settings.MAX_BODY_BYTES.get, ge=1024, validate_default=True,
                                description="Largest HTTP request body (413 above).")
    max_image_bytes: int = Field(default_factory=settings.MAX_IMAGE_BYTES.get, ge=1, validate_default=True,
                                 description="Largest decoded reference image file.")
    max_image_pixels: int = Field(default_factory=settings.MAX_IMAGE_PIXELS.get, ge=256, validate_default=True,
                                  description="Largest reference image width x height.")
    file_output: bool = Field(default=True, description="Accept output.kind=file (an MP4 under the service's "
                                                        "output directory); False: refuse it.")
    cors_origins: tuple[str, ...] = Field(default_factory=settings.CORS_ORIGINS.get,
                                          description="Origins allowed by CORS; empty: CORS off.")
    max_audio_chunk_bytes: int = Field(default_factory=settings.MAX_AUDIO_CHUNK_BYTES.get, ge=2, validate_default=True,
                                       description="Largest PCM payload of one AudioChunk.")
    events_wait_s: float = Field(default=10.0, gt=0, description="Long-poll wait of one scheduler events() call.")

    @field_validator("presets")
    @classmethod
    def _known(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [p for p in value if p not in MODEL_PRESETS]
        if not value or unknown:
            raise ValueError(f"api.presets={list(value)} must be non-empty presets from {sorted(MODEL_PRESETS)}")
        return value

    @property
    def max_image_b64_chars(self) -> int:
        return 4 * math.ceil(self.max_image_bytes / 3)


# ------------------------------------------------------------------------------------------- schemas


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
    fps: float = Field(description="Delivered frames per second over the last few seconds.")
    late_chunks: int
    step_ms_p50: float
    step_ms_p95: float
    audio_queued_s: float
    buffer_ms: float = Field(default=0.0, description="Media queued ahead of playout (the jitter buffer's depth).")
    av_offset_ms: float = Field(default=0.0, description="Video minus audio play time at the output (positive: "
                                "video behind).")
    stage_ms: dict[str, float] = Field(default_factory=dict, description="Median ms per chunk stage over the last "
                                       "~20 s: dit, cache_write, handoff, decode, publish.")


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


# --------------------------------------------------------------------------------------- the frontend


class Scheduler(Protocol):
    """The scheduler's async interface (`deployments.scheduler`), as the frontend calls it."""

    async def create_session(self, spec: SessionSpec) -> SessionInfo: ...
    async def get_session(self, session_id: str) -> SessionInfo: ...
    async def list_sessions(self) -> list[SessionInfo]: ...
    async def end_session(self, session_id: str, reason: str = "deleted") -> SessionInfo: ...
    async def capacity(self) -> Capacity: ...
    async def push_audio(self, session_id: str, pcm: bytes, sample_rate: int, channels: int) -> None: ...
    async def clear_audio(self, session_id: str) -> None: ...
    async def events(self, session_id: str, after_seq: int, timeout_s: float = 10.0) -> list[SessionEvent]: ...


IMAGE_FIELD = "avatar.image"


def decode_base64_image(data: str, config: ApiConfig, field: str = IMAGE_FIELD) -> bytes:
    """`avatar.image` (base64, optional data URL prefix) -> file bytes, under the size limits."""
    if data.startswith("data:"):
        header, sep, data = data.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ApiError(422, ErrorCode.INVALID_IMAGE, "a data URL must look like 'data:image/png;base64,<data>'",
                           field)
    if len(data) > config.max_image_b64_chars + len(data) // 64 + 2:  # slack for line breaks
        raise ApiError(413, ErrorCode.IMAGE_TOO_LARGE,
                       f"is {len(data)} base64 characters, over the limit of {config.max_image_b64_chars} "
                       f"({config.max_image_bytes} bytes decoded); downscale or recompress the image", field)
    try:
        raw = base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ApiError(422, ErrorCode.INVALID_IMAGE,
                       f"is not valid standard base64 ({e}); encode the image file's bytes with base64", field) from e
    return raw


def load_avatar(raw: bytes, preset: str, config: ApiConfig, field: str = IMAGE_FIELD) -> np.ndarray:
    """Image file bytes -> `(H, W, 3)` uint8 at the preset's resolution; refusals name `field`."""
    if not raw:
        raise ApiError(422, ErrorCode.INVALID_IMAGE, "is empty; send a PNG, JPEG or WebP file", field)
    if len(raw) > config.max_image_bytes:
        raise ApiError(413, ErrorCode.IMAGE_TOO_LARGE,
                       f"is {len(raw)} bytes, over the limit of {config.max_image_bytes}; downscale or recompress it",
                       field)
    try:  # header only: refuse huge dimensions before anything is decoded
        with Image.open(io.BytesIO(raw)) as im:
            width, height = im.size
    except Image.DecompressionBombError as e:
        raise ApiError(413, ErrorCode.IMAGE_TOO_LARGE,
                       f"has too many pixels (limit {config.max_image_pixels}); downscale it", field) from e
    except (OSError, SyntaxError, ValueError, EOFError):
        width = height = 0  # not an image: load_image gives the precise message
    if width * height > config.max_image_pixels:
        raise ApiError(413, ErrorCode.IMAGE_TOO_LARGE,
                       f"is {width}x{height} = {width * height} pixels, over the limit of {config.max_image_pixels}; "
                       "downscale it", field)
    gen = MODEL_PRESETS[preset].generation
    try:
        return load_image(raw, gen.height, gen.width, max_pixels=config.max_image_pixels)
    except MediaError as e:  # Pillow's text may name an in-memory file object: drop that noise
        raise ApiError(422, ErrorCode.INVALID_IMAGE, re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-f]+>", "", str(e)),
                       field) from e


def output_spec(out: OutputIn, config: ApiConfig) -> OutputSpec:
    """Refuse file output when disabled; a file path must stay inside the service's output directory.
    kind=livekit: a `LiveKitOutput` (typed as OutputSpec until deployments.types takes it in)."""
    if out.kind == "null":
        return OutputSpec()
    if out.kind == "livekit":
        assert out.url is not None and out.room_name is not None
        try:
            return cast(OutputSpec, LiveKitOutput(
                url=out.url, room_name=out.room_name, token=out.token, api_key=out.api_key,
                api_secret=out.api_secret, identity=out.identity or "character", agent_identity=out.agent_identity))
        except LiveKitConfigError as e:
            raise ApiError(422, ErrorCode.INVALID_FIELD, str(e), "output") from e
    if not config.file_output:
        raise ApiError(422, ErrorCode.INVALID_FIELD, "file output is disabled on this server; use kind 'null'",
                       "output.kind")
    path = out.path
    if path is not None and (not path.endswith(".mp4") or path.startswith("/") or "\\" in path or len(path) > 255
                             or posixpath.normpath(path) != path or path.startswith("..")):
        raise ApiError(422, ErrorCode.INVALID_FIELD,
                       f"must be a relative path ending in .mp4, normalised and without '..' (got {path[:80]!r}), "
                       "e.g. 'demo/a.mp4'; it is written under the server's output directory", "output.path")
    return OutputSpec(kind="file", path=path)


def check_session_id(session_id: str, field: str = "id") -> str:
    if not session_id or len(session_id) > MAX_SESSION_ID_CHARS:
        raise ApiError(404, ErrorCode.SESSION_NOT_FOUND, f"no session with id {session_id[:MAX_SESSION_ID_CHARS]!r}",
                       field)
    return session_id


class SessionFrontend:
    """Validation and scheduler calls shared by the HTTP and gRPC front doors."""

    def __init__(self, scheduler: Scheduler, config: ApiConfig, avatars: AvatarRegistry | None = None) -> None:
        self.scheduler, self.config = scheduler, config
        # POST /v1/avatars: in this process by default; Serve passes the service-wide one (deployments.avatars)
        self.avatars = avatars or AvatarRegistry()

    def resolve_preset(self, preset: str | None) -> str:
        name = preset or self.config.presets[0]
        if name not in self.config.presets:
            raise ApiError(422, ErrorCode.INVALID_FIELD,
                           f"preset {name!r} is not served here; this service serves {list(self.config.presets)}",
                           "preset")
        return name

    async def create(self, options: SessionOptions, image: bytes, api_key_id: str | None = None,
                     trace_context: dict[str, str] | None = None) -> SessionInfo:
        preset = self.resolve_preset(options.preset)
        if options.max_duration > self.config.max_duration_s:
            raise ApiError(422, ErrorCode.INVALID_FIELD,
                           f"is {options.max_duration:g} s, over this server's limit of {self.config.max_duration_s:g} "
                           "s; ask for less and start a new session when it ends", "maxDuration")
        output = output_spec(options.output, self.config)
        pixels = await asyncio.to_thread(load_avatar, image, preset, self.config)
        spec = SessionSpec(session_id=uuid.uuid4().hex, image=pixels, preset=preset,
                           max_duration_s=float(options.max_duration), output=output, seed=options.seed,
                           recover=options.recover, api_key_id=api_key_id, trace_context=dict(trace_context or {}))
        return await self._call(self.scheduler.create_session(spec))

    async def submit(self, spec: SessionSpec) -> SessionInfo:
        """Hand an already validated spec to the scheduler (the Runway-compatible routes build their own)."""
        return await self._call(self.scheduler.create_session(spec))

    async def get(self, session_id: str) -> SessionInfo:
        return await self._call(self.scheduler.get_session(check_session_id(session_id)))

    async def list_sessions(self) -> list[SessionInfo]:
        return await self._call(self.scheduler.list_sessions())

    async def end(self, session_id: str, reason: str = "deleted") -> SessionInfo:
        return await self._call(self.scheduler.end_session(check_session_id(session_id), reason))

    async def capacity(self) -> Capacity:
        return await self._call(self.scheduler.capacity())

    async def push_audio(self, session_id: str, pcm: bytes, sample_rate: int, channels: int) -> None:
        if not 8000 <= sample_rate <= 48000:
            raise ApiError(422, ErrorCode.INVALID_FIELD, f"is {sample_rate}; send PCM at 8000..48000 Hz",
                           "sample_rate")
        if channels not in (1, 2):
            raise ApiError(422, ErrorCode.INVALID_FIELD, f"is {channels}; send mono (1) or stereo (2)", "channels")
        if len(pcm) > self.config.max_audio_chunk_bytes:
            raise ApiError(422, ErrorCode.INVALID_FIELD,
                           f"is {len(pcm)} bytes, over the limit of {self.config.max_audio_chunk_bytes}; "
                           "send smaller chunks (e.g. 20-100 ms each)", "pcm")
        if len(pcm) % (2 * channels):
            raise ApiError(422, ErrorCode.INVALID_FIELD,
                           f"is {len(pcm)} bytes, not whole 16-bit frames of {channels} channel(s) "
                           f"({2 * channels} bytes each); send signed 16-bit little-endian PCM", "pcm")
        await self._call(self.scheduler.push_audio(session_id, pcm, sample_rate, channels))

    async def clear_audio(self, session_id: str) -> None:
        await self._call(self.scheduler.clear_audio(session_id))

    async def events(self, session_id: str, after_seq: int) -> list[SessionEvent]:
        return await self._call(self.scheduler.events(session_id, after_seq, self.config.events_wait_s))

    @staticmethod
    async def _call(call: Any) -> Any:
        try:
            return await call
        except NoCapacity as e:  # the caller's own quota: 429; the service's capacity: 503
            status = 429 if e.code == ErrorCode.QUOTA_EXCEEDED else 503
            raise ApiError(status, e.code or ErrorCode.NO_CAPACITY, f"{e.args[0] if e.args else e}; retry after "
                           f"{e.retry_after_s:g} s", retry_after_s=e.retry_after_s) from e
        except UnknownSession as e:
            raise ApiError(404, ErrorCode.SESSION_NOT_FOUND, f"no session with id {e.session_id!r}", "id") from e


# ------------------------------------------------------------------------------------------ HTTP app


class BodyLimitMiddleware:
    """ASGI middleware: refuse bodies over `max_bytes` with 413 (declared or streamed), then replay the body."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self, size: int | str) -> ApiError:
        return ApiError(413, ErrorCode.BODY_TOO_LARGE, f"the request body is {size} bytes, over the limit of "
                        f"{self.max_bytes}; send a smaller image (see avatar.image limits in /openapi.json)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), b"")
        if declared.isdigit() and int(declared) > self.max_bytes:  # else: counted as it arrives
            await self._too_large(int(declared)).response()(scope, receive, send)
            return
        parts, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._too_large(f"more than {self.max_bytes}").response()(scope, receive, send)
                return
            parts.append(body)
            more = message.get("more_body", False)
        pending: list[Message] = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)


def _key_id(request: Request) -> str | None:
    return getattr(request.state, "api_key_id", None)


def build_http_app(frontend: SessionFrontend, keys: ApiKeys | None = None) -> FastAPI:
    """The FastAPI app over `frontend`. Middleware, outermost first: CORS (if origins), auth, body limit."""
    config = frontend.config
    app = FastAPI(title="Real-time video characters", version="1.0.0",
                  description="Start, inspect and end real-time video characters. Field names are camelCase; "
                              "times are Unix seconds; every error body is {error: {code, message, field}}. "
                              f"Limits here: request body <= {config.max_body_bytes} bytes; avatar.image <= "
                              f"{config.max_image_b64_chars} base64 characters, <= {config.max_image_bytes} bytes "
                              f"decoded, <= {config.max_image_pixels} pixels; maxDuration <= {config.max_duration_s:g} "
                              f"s; presets served: {', '.join(config.presets)}.")
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    app.add_middleware(BearerAuthMiddleware, keys=keys or ApiKeys())
    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins),
                           allow_methods=["GET", "POST", "DELETE"], allow_headers=["authorization", "content-type"],
                           expose_headers=["retry-after", "location"])
    bearer = [Security(HTTPBearer(auto_error=False, description="API key, when the server has keys configured"))]

    @app.post("/v1/sessions", status_code=201, response_model=SessionOut, dependencies=bearer,
              responses=error_responses(400, 401, 413, 422, 429, 503), summary="Start a character")
    async def create_session(body: CreateSessionRequest, request: Request, response: Response) -> SessionOut:
        raw = await asyncio.to_thread(decode_base64_image, body.avatar.image, config)
        trace = {k: v for k in ("traceparent", "tracestate") if (v := request.headers.get(k))}
        info = await frontend.create(body, raw, api_key_id=_key_id(request), trace_context=trace)
        response.headers["Location"] = f"/v1/sessions/{info.id}"
        return SessionOut.of(info)

    @app.get("/v1/sessions", response_model=SessionListOut, dependencies=bearer,
             responses=error_responses(401, 503), summary="List sessions")
    async def list_sessions() -> SessionListOut:
        return SessionListOut(sessions=[SessionOut.of(s) for s in await frontend.list_sessions()])

    @app.get("/v1/sessions/{session_id}", response_model=SessionOut, dependencies=bearer,
             responses=error_responses(401, 404, 422, 503), summary="Get a session")
    async def get_session(session_id: str) -> SessionOut:
        return SessionOut.of(await frontend.get(session_id))

    @app.delete("/v1/sessions/{session_id}", response_model=SessionOut, dependencies=bearer,
                responses=error_responses(401, 404, 422, 503), summary="End a session (idempotent)")
    async def end_session(session_id: str) -> SessionOut:
        return SessionOut.of(await frontend.end(session_id, "deleted"))

    @app.get("/v1/capacity", response_model=CapacityOut, dependencies=bearer,
             responses=error_responses(401, 503), summary="Free and used GPU bundles")
    async def capacity() -> CapacityOut:
        return CapacityOut.of(await frontend.capacity())

    @app.get("/healthz", response_model=HealthOut, summary="Liveness of the API (no key needed)")
    async def healthz() -> HealthOut:
        return HealthOut()

    add_realtime_routes(app, frontend, bearer)
    return app
