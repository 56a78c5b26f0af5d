"""The watch page: a small web front end served by the ingress, and the routes it calls (no Ray imports).

    GET    /                         -> 307 /watch/
    GET    /watch/                   the page (web/, built by vite into deployments/api/watch_page/)
    GET    /watch/samples/face.png   the bundled sample face; /watch/samples/speech.wav: its sample speech
    GET    /v1/watch/config          WatchConfigOut: is a LiveKit server configured, its URL, the preset's size
    POST   /v1/watch/sessions        WatchSessionIn -> 201 WatchSessionOut: a session publishing into a new
                                     room of the configured LiveKit server, plus a viewer token for that room
    POST   /v1/watch/token           ViewerTokenIn -> ViewerOut: a subscribe-only token for a room of one of
                                     the caller's sessions (404 for another tenant's; an operator: any room)
    POST   /v1/sessions/{id}/audio   agent audio: a WAV file (16-bit PCM) or raw s16le with ?sampleRate=&channels=
                                     -> 204; queued for the next chunks (the HTTP twin of gRPC StreamAudio)
    DELETE /v1/sessions/{id}/audio   drop the queued agent audio (an interruption) -> 204

The page and its static files need no API key (they hold no data); every /v1 route takes the same Bearer
key as the rest of the API, and the page asks for it when the server answers 401.

Rooms: a session whose room the service makes (the watch page's, a Runway session without an integration)
publishes into `watch-<session id>`, so a room names its session and the viewer-token route checks, like
every session route, that the caller owns it. `GET /v1/livekit` answers the development server's public
secret only to a caller who sees every tenant (an operator key, or keys off): a secret mints any token.

LiveKit: the service's own server (`CHARACTERS_LIVEKIT_URL`, `_API_KEY`, `_API_SECRET`; browsers use
`CHARACTERS_LIVEKIT_PUBLIC_URL` when set), e.g. the one `characters serve --livekit-dev` starts. Without
it the page still loads and says what to set. A viewer token grants `roomJoin` + `canSubscribe` on one
room and nothing else (no publishing, no data): a viewer sees and hears, it cannot speak as the agent.
The character leaves (and its session ends) when the room empties: closing the page ends the session.

Interruption over HTTP drops the audio not yet taken by generation; chunks already generated from speech
still play (pipeline depth + the jitter buffer: ~0.5 s on the CPU default). LiveKit agents interrupt
through the avatar protocol's `lk.clear_buffer`, which also blanks those chunks.

The page is built from web/ (`npm ci && npm run build`, which `scripts/setup.sh` runs); the build output
is package data, not committed. Without it `/watch/` answers 503 `watch_page_not_built` with the command.
"""

from __future__ import annotations

import asyncio
import datetime
import io
import secrets
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Query, Request, Response, Security
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.security import HTTPBearer
from fastapi.staticfiles import StaticFiles
from livekit import api as lkapi
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from characters.config import MODEL_PRESETS
from deployments.api.errors import ApiError, ErrorCode, error_responses
from deployments.api.frontend import SessionFrontend
from deployments.api.requests import caller, decode_base64_image
from deployments.api.schemas import AvatarIn, CreateSessionRequest, SessionOut
from deployments.livekit.config import LiveKitConfigError, check_url
from deployments.settings import LIVEKIT_API_KEY, LIVEKIT_API_SECRET, LIVEKIT_DEV, LIVEKIT_PUBLIC_URL, LIVEKIT_URL

PAGE_DIR = Path(__file__).resolve().parent / "watch_page"  # vite's output (web/vite.config.ts)
ASSETS_DIR = Path(__file__).resolve().parents[2] / "characters" / "assets"
SAMPLES = {"face.png": ("sample_face.png", "image/png"), "speech.wav": ("sample_speech.wav", "audio/wav")}
VIEWER_TTL = datetime.timedelta(hours=2)
ROOM_PREFIX = "watch-"
LIVEKIT_NOT_CONFIGURED = "livekit_not_configured"
PAGE_NOT_BUILT = "watch_page_not_built"
_BINARY = {"schema": {"type": "string", "format": "binary"}}
AUDIO_BODY = {"requestBody": {"required": True, "content": {"audio/wav": _BINARY, "application/octet-stream": _BINARY}}}


@dataclass(frozen=True)
class WatchSettings:
    """The LiveKit server of watch-page sessions (empty url: none configured)."""

    url: str = ""
    public_url: str = ""
    api_key: str = ""
    api_secret: str = ""

    dev: bool = False  # the server of `characters serve --livekit-dev`: its secret is the public dev one

    @classmethod
    def from_env(cls) -> WatchSettings:
        url = LIVEKIT_URL.get()
        return cls(url, LIVEKIT_PUBLIC_URL.get() or url, LIVEKIT_API_KEY.get(), LIVEKIT_API_SECRET.get(),
                   LIVEKIT_DEV.get())

    @property
    def configured(self) -> bool:
        return bool(self.url and self.api_key and self.api_secret)

    def check(self, no_retry: bool = False) -> None:
        """Raise ApiError 503 naming the variables when no server is configured, or it is malformed (`no_retry`:
        tell SDK clients, which retry a 5xx, that retrying will not help)."""
        if not self.configured:
            raise ApiError(503, LIVEKIT_NOT_CONFIGURED,
                           "this service has no LiveKit server of its own (the watch page's, and the room of a Runway "
                           "session without an integration); set CHARACTERS_LIVEKIT_URL, CHARACTERS_LIVEKIT_API_KEY "
                           "and CHARACTERS_LIVEKIT_API_SECRET, or run `characters serve --livekit-dev`",
                           no_retry=no_retry)
        try:
            check_url(self.url, "CHARACTERS_LIVEKIT_URL")
            check_url(self.public_url, "CHARACTERS_LIVEKIT_PUBLIC_URL")
        except LiveKitConfigError as e:
            raise ApiError(503, LIVEKIT_NOT_CONFIGURED, str(e), no_retry=no_retry) from e


def service_room(session_id: str) -> str:
    """The room of a session whose room the service makes: named after the session."""
    return f"{ROOM_PREFIX}{session_id}"


def session_of_room(room: str) -> str | None:
    """The session a service room belongs to (None: not one of the service's rooms)."""
    return room.removeprefix(ROOM_PREFIX) if room.startswith(ROOM_PREFIX) and len(room) > len(ROOM_PREFIX) else None


def viewer_token(settings: WatchSettings, room: str, identity: str, ttl: datetime.timedelta = VIEWER_TTL) -> str:
    """A token that may join `room` and subscribe, nothing else (no publishing, no data, no RPC)."""
    grants = lkapi.VideoGrants(room_join=True, room=room, can_subscribe=True, can_publish=False,
                               can_publish_data=False)
    return (lkapi.AccessToken(settings.api_key, settings.api_secret).with_identity(identity).with_name("viewer")
            .with_ttl(ttl).with_grants(grants).to_jwt())


def participant_token(settings: WatchSettings, room: str, identity: str, ttl: datetime.timedelta = VIEWER_TTL) -> str:
    """The token of a Runway session's consumer: join `room`, subscribe, publish (the user's microphone and
    camera, for a voice agent of theirs in the room) and data; the character hears only agent participants."""
    grants = lkapi.VideoGrants(room_join=True, room=room, can_subscribe=True, can_publish=True, can_publish_data=True)
    return (lkapi.AccessToken(settings.api_key, settings.api_secret).with_identity(identity).with_name("user")
            .with_ttl(ttl).with_grants(grants).to_jwt())


def wav_pcm(raw: bytes) -> tuple[bytes, int, int]:
    """A WAV file -> (s16le PCM, sample rate, channels); ApiError 422 unless it is 16-bit PCM."""
    try:
        with wave.open(io.BytesIO(raw)) as w:
            width, rate, channels = w.getsampwidth(), w.getframerate(), w.getnchannels()
            pcm = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as e:
        raise ApiError(422, ErrorCode.INVALID_FIELD, f"is not a readable WAV file ({e}); send 16-bit PCM WAV, or raw "
                       "s16le with ?sampleRate=&channels=", "body") from e
    if width != 2:
        raise ApiError(422, ErrorCode.INVALID_FIELD, f"has {8 * width}-bit samples; send 16-bit PCM "
                       "(e.g. `sox in.wav -b 16 out.wav`)", "body")
    return pcm, rate, channels


# ------------------------------------------------------------------------------------------- schemas


class _In(BaseModel):  # as deployments.api.http's requests: camelCase, strict, no unknown fields
    model_config = ConfigDict(alias_generator=to_camel, extra="forbid", frozen=True, strict=True)


class _Out(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, validate_by_alias=True)


class WatchConfigOut(_Out):
    livekit: bool = Field(description="A LiveKit server is configured: the page can start and show sessions.")
    url: str | None = Field(description="The LiveKit server as browsers reach it.")
    preset: str
    width: int
    height: int
    fps: int
    max_duration: float = Field(description="Largest maxDuration a session may ask for (seconds).")


class WatchSessionIn(_In):
    avatar: AvatarIn
    max_duration: float = Field(default=300.0, gt=0, description="Seconds after which the session ends by itself.")
    seed: int = Field(default=0, ge=0, le=2**63 - 1)


class ViewerTokenIn(_In):
    room_name: str = Field(min_length=1, max_length=256, description="The room to watch.")


class ViewerOut(_Out):
    url: str
    room_name: str
    identity: str
    token: str = Field(description="Join + subscribe on this room only; valid for 2 hours.")


class LiveKitOut(_Out):
    configured: bool = Field(description="The service has a LiveKit server of its own (the watch page's).")
    url: str | None = Field(description="Its URL as clients reach it (ws:// or wss://).")
    api_key: str | None = Field(description="Its API key (to mint tokens for rooms on it).")
    api_secret: str | None = Field(description="Only for `characters serve --livekit-dev`'s development server, "
                                   "whose secret is public; null for any other server (never disclosed).")
    dev: bool = Field(description="It is the development server of `characters serve --livekit-dev`.")


class WatchSessionOut(_Out):
    session: SessionOut
    viewer: ViewerOut


# ------------------------------------------------------------------------------------------- routes


def add_watch_routes(app: FastAPI, frontend: SessionFrontend, settings: WatchSettings | None = None) -> FastAPI:
    """The page, its static files and the routes above, on the native app (same auth and error shape)."""
    settings = settings or WatchSettings.from_env()
    config = frontend.config
    bearer = [Security(HTTPBearer(auto_error=False, description="API key, when the server has keys configured"))]
    route: dict[str, Any] = {"dependencies": bearer, "tags": ["watch"]}

    def viewer(room: str) -> ViewerOut:
        identity = f"viewer-{secrets.token_hex(4)}"
        return ViewerOut(url=settings.public_url, room_name=room, identity=identity,
                         token=viewer_token(settings, room, identity))

    @app.get("/v1/watch/config", response_model=WatchConfigOut, **route, responses=error_responses(401),
             summary="What the watch page needs to know")
    async def watch_config() -> WatchConfigOut:
        preset = frontend.resolve_preset(None)
        g = MODEL_PRESETS[preset].generation
        return WatchConfigOut(livekit=settings.configured, url=settings.public_url or None, preset=preset,
                              width=g.width, height=g.height, fps=g.fps, max_duration=config.max_duration_s)

    @app.get("/v1/livekit", response_model=LiveKitOut, **route, responses=error_responses(401),
             summary="The service's own LiveKit server (URL, key; the secret of a development server)")
    async def livekit(request: Request) -> LiveKitOut:
        disclose = settings.dev and settings.configured and caller(request).sees_all
        return LiveKitOut(configured=settings.configured, url=settings.public_url or None,
                          api_key=settings.api_key or None, api_secret=settings.api_secret if disclose else None,
                          dev=settings.dev)

    @app.post("/v1/watch/sessions", status_code=201, response_model=WatchSessionOut, **route,
              responses=error_responses(400, 401, 413, 422, 503), summary="Start a character in a new LiveKit room")
    async def watch_session(body: WatchSessionIn, request: Request, response: Response) -> WatchSessionOut:
        settings.check()
        session_id = secrets.token_hex(16)
        room = service_room(session_id)
        create = CreateSessionRequest.model_validate({
            "avatar": body.avatar.model_dump(), "maxDuration": body.max_duration, "seed": body.seed,
            "output": {"kind": "livekit", "url": settings.url, "roomName": room, "apiKey": settings.api_key,
                       "apiSecret": settings.api_secret}})
        raw = await asyncio.to_thread(decode_base64_image, create.avatar.image, config)
        trace = {k: v for k in ("traceparent", "tracestate") if (v := request.headers.get(k))}
        info = await frontend.create(create, raw, api_key_id=caller(request).key_id, trace_context=trace,
                                     session_id=session_id)
        response.headers["Location"] = f"/v1/sessions/{info.id}"
        return WatchSessionOut(session=SessionOut.of(info), viewer=viewer(room))

    @app.post("/v1/watch/token", response_model=ViewerOut, **route, responses=error_responses(401, 422, 503),
              summary="A subscribe-only token for a room of the configured LiveKit server")
    async def watch_token(body: ViewerTokenIn, request: Request) -> ViewerOut:
        settings.check()
        who = caller(request)
        if not who.sees_all:  # a tenant watches only its own sessions' rooms
            session_id = session_of_room(body.room_name)
            if session_id is None:
                raise ApiError(404, ErrorCode.SESSION_NOT_FOUND, f"no session has the room {body.room_name[:64]!r}",
                               "roomName")
            try:
                await frontend.check_owner(session_id, who)
            except ApiError as e:
                raise ApiError(404, ErrorCode.SESSION_NOT_FOUND, f"no session has the room {body.room_name[:64]!r}",
                               "roomName") from e
        return viewer(body.room_name)

    @app.post("/v1/sessions/{session_id}/audio", status_code=204, **route, openapi_extra=AUDIO_BODY,
              responses=error_responses(401, 404, 413, 422, 503), summary="Send agent audio (WAV or raw s16le)")
    async def push_audio(session_id: str, request: Request, sample_rate: int | None = Query(None, alias="sampleRate"),
                         channels: int | None = None) -> Response:
        raw = await request.body()
        if not raw:
            raise ApiError(422, ErrorCode.INVALID_FIELD, "is empty; send a 16-bit PCM WAV file or raw s16le", "body")
        if (sample_rate is None) != (channels is None):
            raise ApiError(422, ErrorCode.INVALID_FIELD, "give both sampleRate and channels (raw s16le), or neither "
                           "(a WAV file)", "sampleRate" if sample_rate is None else "channels")
        if sample_rate is None or channels is None:
            pcm, sample_rate, channels = wav_pcm(raw)
        else:
            pcm = raw
        if channels not in (1, 2):  # checked again per piece by the frontend; here the split needs it
            raise ApiError(422, ErrorCode.INVALID_FIELD, f"is {channels}; send mono (1) or stereo (2)", "channels")
        step = config.max_audio_chunk_bytes - config.max_audio_chunk_bytes % (2 * channels)
        who = caller(request)
        for start in range(0, len(pcm), step):
            await frontend.push_audio(session_id, who, pcm[start:start + step], sample_rate, channels)
        return Response(status_code=204)

    @app.delete("/v1/sessions/{session_id}/audio", status_code=204, **route,
                responses=error_responses(401, 404, 422, 503), summary="Drop queued agent audio (interrupt)")
    async def clear_audio(session_id: str, request: Request) -> Response:
        await frontend.clear_audio(session_id, caller(request))
        return Response(status_code=204)

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/watch/", status_code=307)

    @app.get("/watch/samples/{name}", include_in_schema=False)
    async def sample(name: str) -> FileResponse:
        if name not in SAMPLES:
            raise ApiError(404, ErrorCode.NOT_FOUND, f"no sample {name[:64]!r}; there are {sorted(SAMPLES)}")
        filename, media_type = SAMPLES[name]
        return FileResponse(ASSETS_DIR / filename, media_type=media_type)

    if (PAGE_DIR / "index.html").is_file():
        app.mount("/watch", StaticFiles(directory=PAGE_DIR, html=True), name="watch")
    else:
        @app.get("/watch/{path:path}", include_in_schema=False)
        async def not_built(path: str) -> Response:
            raise ApiError(503, PAGE_NOT_BUILT, f"the watch page is not built ({PAGE_DIR} has no index.html); run "
                           "`scripts/setup.sh` or `npm ci && npm run build` in web/, then restart the server")
    return app
