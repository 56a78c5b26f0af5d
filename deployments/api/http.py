"""The HTTP app: the native routes, the body-size limit, auth, and the Runway-compatible routes mounted
beside them (`deployments.api.runway`). No Ray imports.

Endpoints (JSON everywhere; field names are camelCase in requests and responses; times are Unix seconds):

    POST   /v1/sessions        CreateSessionRequest -> 201 Session (+ Location)   start a character
    GET    /v1/sessions        -> SessionList                                     the caller's sessions (an
                                                                                  operator key: every one)
    GET    /v1/sessions/{id}   -> Session                                         404 if unknown or another's
    DELETE /v1/sessions/{id}   -> Session (ENDED)                                 idempotent; 404 as GET
    GET    /v1/capacity        -> Capacity                                        bundles free/total, queue, warm slots
    GET    /healthz            -> {"status": "ok"}                                never needs a key
    POST   /v1/realtime_sessions, GET / DELETE /v1/realtime_sessions/{id},        the Runway Characters API
           POST /v1/realtime_sessions/{id}/consume                                (deployments.api.runway)
    POST / GET /v1/avatars, GET / PATCH / DELETE /v1/avatars/{id}                 Runway's avatars
                                                                                  (deployments.api.runway_avatars)
    GET    /openapi.json, /docs                                                   the schema, with error bodies

Errors: `deployments.api.errors` (one JSON shape, a code per condition). Limits (`ApiConfig`, per service):
request body `max_body_bytes` (413 body_too_large), `avatar.image` base64 length and decoded bytes
(`max_image_bytes`) and pixels (`max_image_pixels`) (413 image_too_large). The image is decoded and
validated with `characters.media.load_image` at the preset's resolution before the scheduler sees it.

Bodies: `deployments.api.schemas`; validation shared by every route: `deployments.api.requests`; the logic
shared with gRPC and the watch page: `deployments.api.frontend` (`SessionFrontend`). The Serve deployment
that hosts all this: `deployments.api.app`.
"""

from __future__ import annotations

import asyncio

from fastapi import Depends, FastAPI, Request, Response, Security
from fastapi.middleware.cors import CORSMiddleware
from fastapi.security import HTTPBearer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployments.api.auth import ApiKeys, BearerAuthMiddleware
from deployments.api.errors import ApiError, ErrorCode, error_responses, install_error_handlers
from deployments.api.frontend import SessionFrontend
from deployments.api.requests import caller, decode_base64_image, key_id, known_query, trace_context
from deployments.api.runway import add_realtime_routes
from deployments.api.schemas import CapacityOut, CreateSessionRequest, HealthOut, SessionListOut, SessionOut
from deployments.api.watch import WatchSettings


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


def build_http_app(frontend: SessionFrontend, keys: ApiKeys | None = None,
                   livekit: WatchSettings | None = None) -> FastAPI:
    """The FastAPI app over `frontend`. Middleware, outermost first: CORS (if origins), auth, body limit.
    `livekit`: the service's own LiveKit server (the rooms of Runway sessions without an integration)."""
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
                           allow_methods=["GET", "POST", "PATCH", "DELETE"],
                           allow_headers=["authorization", "content-type", "x-runway-version"],
                           expose_headers=["retry-after", "location"])
    bearer = [Security(HTTPBearer(auto_error=False, description="API key, when the server has keys configured")),
              Depends(known_query)]

    @app.post("/v1/sessions", status_code=201, response_model=SessionOut, dependencies=bearer,
              responses=error_responses(400, 401, 413, 422, 429, 503), summary="Start a character")
    async def create_session(body: CreateSessionRequest, request: Request, response: Response) -> SessionOut:
        raw = await asyncio.to_thread(decode_base64_image, body.avatar.image, config)
        info = await frontend.create(body, raw, api_key_id=key_id(request), trace_context=trace_context(request))
        response.headers["Location"] = f"/v1/sessions/{info.id}"
        return SessionOut.of(info)

    @app.get("/v1/sessions", response_model=SessionListOut, dependencies=bearer,
             responses=error_responses(401, 422, 503), summary="List sessions")
    async def list_sessions(request: Request) -> SessionListOut:
        return SessionListOut(sessions=[SessionOut.of(s) for s in await frontend.list_sessions(caller(request))])

    @app.get("/v1/sessions/{session_id}", response_model=SessionOut, dependencies=bearer,
             responses=error_responses(401, 404, 422, 503), summary="Get a session")
    async def get_session(session_id: str, request: Request) -> SessionOut:
        return SessionOut.of(await frontend.get(session_id, caller(request)))

    @app.delete("/v1/sessions/{session_id}", response_model=SessionOut, dependencies=bearer,
                responses=error_responses(401, 404, 422, 503), summary="End a session (idempotent)")
    async def end_session(session_id: str, request: Request) -> SessionOut:
        return SessionOut.of(await frontend.end(session_id, caller(request), "deleted"))

    @app.get("/v1/capacity", response_model=CapacityOut, dependencies=bearer,
             responses=error_responses(401, 422, 503), summary="Free and used GPU bundles")
    async def capacity() -> CapacityOut:
        return CapacityOut.of(await frontend.capacity())

    @app.get("/healthz", response_model=HealthOut, summary="Liveness of the API (no key needed)")
    async def healthz() -> HealthOut:
        return HealthOut()

    add_realtime_routes(app, frontend, bearer, livekit)
    return app
