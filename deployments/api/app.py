"""The Serve application: `build_app(args)`, import path `deployments.api.app:build_app`.

One ingress deployment, `CharactersIngress`, serves the HTTP API (`deployments.api.http`, FastAPI through
`@serve.ingress`) and the gRPC service (`deployments.api.grpc_service`, through Serve's gRPC proxy); both
call the scheduler actor (`deployments.sessions.scheduler`, a named detached actor) through `ActorScheduler`.

`args` (all optional, YAML-able; `serve run`, `characters serve` and KubeRay's RayService pass it):

    service:  ServiceConfig fields (deployments.settings), applied over the CHARACTERS_* environment
    api:      ApiConfig fields (deployments.api.http): size limits, maxDuration cap, CORS origins, file output
    ingress:  {num_replicas: 1, max_ongoing_requests: 1000, num_cpus: 0}
    preset, topology, warm_slots: shorthand for the same keys under `service`

The gRPC proxy is cluster-wide, so it is configured beside the application, e.g. in a RayService:

    serveConfigV2: |
      grpc_options:
        port: 9000
        grpc_servicer_functions: ["deployments.api.proto.characters_pb2_grpc.add_CharactersServicer_to_server"]
      applications:
        - name: characters
          route_prefix: /
          import_path: deployments.api.app:build_app
          args: {service: {preset: 57b, topology: h100x5, warm_slots: 1}}
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from contextvars import ContextVar
from typing import Any

import ray
from fastapi import Depends, FastAPI, Security
from fastapi.security import HTTPBearer
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayTaskError
from ray.serve import Application
from ray.serve.deployment import Deployment

from deployments import telemetry
from deployments.api.auth import ApiKeys
from deployments.api.avatars import Avatar, AvatarRegistry
from deployments.api.errors import ApiError, ErrorCode
from deployments.api.frontend import SessionFrontend
from deployments.api.grpc_service import GRPC_SERVICER_FUNCTIONS, CharactersGrpc
from deployments.api.health import Readiness, add_health_routes
from deployments.api.http import build_http_app
from deployments.api.realtime import RealtimeBook, RealtimeRegistry
from deployments.api.requests import ApiConfig, known_query
from deployments.api.runway import RunwayClient
from deployments.api.usage import UsageRegistry, add_usage_routes
from deployments.api.watch import WatchSettings, add_watch_routes
from deployments.settings import ServiceConfig
from deployments.store import AvatarRows, UsageQueries, database_url, describe, open_engine
from deployments.telemetry import http as telemetry_http
from deployments.types import (
    NAMESPACE,
    SCHEDULER_NAME,
    Capacity,
    NoCapacity,
    SessionEvent,
    SessionInfo,
    SessionSpec,
    UnknownSession,
)

__all__ = ["APP_NAME", "GRPC_SERVICER_FUNCTIONS", "ActorScheduler", "CharactersIngress", "build_app", "parse_args"]

logger = logging.getLogger(__name__)

APP_NAME = "characters"
SCHEDULER_RETRY_AFTER_S = 5.0
#: The W3C trace headers of the HTTP request being served (its server span's), for calls that carry them on
REQUEST_TRACE: ContextVar[dict[str, str]] = ContextVar("request_trace", default={})  # noqa: B039 (never mutated)
_TRACE_HEADERS = (b"traceparent", b"tracestate")


class RememberTrace:
    """ASGI middleware, inside the tracing one: REQUEST_TRACE holds the request's trace headers while it is served
    (the DELETE of a session is then a link in the session's own trace)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = REQUEST_TRACE.set({k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])
                                   if k in _TRACE_HEADERS})
        try:
            await self.app(scope, receive, send)
        finally:
            REQUEST_TRACE.reset(token)


def connect_scheduler(service: ServiceConfig) -> ActorHandle:
    """The scheduler actor: the running one of that name (whatever created it), else a new detached one."""
    from deployments.sessions.scheduler import get_or_create_scheduler  # heavy (torch); only where it is called

    return get_or_create_scheduler(service)


AUDIO_ROUTES_KEPT = 4096  # sessions whose audio route an ingress replica remembers


class ActorScheduler:
    """The scheduler actor behind the `deployments.api.frontend.Scheduler` interface.

    Re-raises the scheduler's refusals (NoCapacity, UnknownSession) as themselves and its ValueErrors
    as ApiError 422 `rejected`; an unreachable or dead actor becomes ApiError 503 `scheduler_unavailable`,
    and the next call looks the actor up again.
    """

    def __init__(self, service: ServiceConfig) -> None:
        self.service = service
        self._handle: ActorHandle | None = None
        self._routes: OrderedDict[str, ActorHandle] = OrderedDict()  # session -> its actor, for agent audio

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            if self._handle is None:
                self._handle = await asyncio.to_thread(connect_scheduler, self.service)
            return await getattr(self._handle, method).remote(*args)
        except RayTaskError as e:
            if isinstance(e.cause, NoCapacity | UnknownSession):
                raise e.cause from None
            if isinstance(e.cause, ValueError):  # the scheduler refused the request's content
                raise ApiError(422, ErrorCode.REJECTED, str(e.cause)) from None
            raise
        except (RayActorError, ImportError, ValueError) as e:
            self._handle = None
            logger.warning("scheduler %r unreachable in %s(): %s", SCHEDULER_NAME, method, type(e).__name__)
            raise ApiError(503, ErrorCode.SCHEDULER_UNAVAILABLE,
                           f"the session scheduler is not reachable ({type(e).__name__}); retry in "
                           f"{SCHEDULER_RETRY_AFTER_S:g} s", retry_after_s=SCHEDULER_RETRY_AFTER_S) from e

    async def create_session(self, spec: SessionSpec) -> SessionInfo:
        return await self._call("create_session", spec)

    async def get_session(self, session_id: str) -> SessionInfo:
        return await self._call("get_session", session_id)

    async def list_sessions(self) -> list[SessionInfo]:
        return await self._call("list_sessions")

    async def end_session(self, session_id: str, reason: str = "deleted") -> SessionInfo:
        carried = REQUEST_TRACE.get()  # passed only when there is one: any scheduler takes (id, reason)
        return await self._call("end_session", session_id, reason, *([carried] if carried else []))

    async def capacity(self) -> Capacity:
        return await self._call("capacity")

    async def push_audio(self, session_id: str, pcm: bytes, sample_rate: int, channels: int) -> None:
        """To the session's own actor, not through the scheduler: the scheduler takes a session's audio only until
        its answer names that actor (it holds audio of a session not yet running). Validated by the frontend."""
        route = self._routes.get(session_id)
        if route is None:
            if (route := await self._call("push_audio", session_id, pcm, sample_rate, channels)) is not None:
                self._routes[session_id] = route
                while len(self._routes) > AUDIO_ROUTES_KEPT:
                    self._routes.popitem(last=False)
            return
        try:  # (the actor drops audio naming a session it no longer runs)
            await route.push_audio.remote(session_id, pcm, sample_rate, channels)
        except RayActorError:  # the slot is gone: the session is ending, its run reports how
            self._routes.pop(session_id, None)
        except RayTaskError as e:
            if isinstance(e.cause, ValueError):  # the session's queue is full
                raise ApiError(422, ErrorCode.REJECTED, str(e.cause)) from None
            raise

    async def clear_audio(self, session_id: str) -> None:
        await self._call("clear_audio", session_id)

    async def events(self, session_id: str, after_seq: int, timeout_s: float = 10.0) -> list[SessionEvent]:
        return await self._call("events", session_id, after_seq, timeout_s)

    async def set_draining(self, draining: bool) -> None:
        await self._call("set_draining", draining)


# ----------------------------------------------------------------------------------- shared state
# What every ingress replica must see alike: the avatars (`/v1/avatars`), usage and the Runway sessions' keys,
# through one detached, named Ray actor. Every replica's `SessionFrontend.avatars` / `.realtime` send their calls
# to it, so an avatar created, or a session key shown, through one replica is found through every other. Avatars
# (with their processed images) and usage live in the service's database (`deployments.store`: SQLite in the data
# directory, or PostgreSQL by URL), so they outlive the actor, a restart and an upgrade's new cluster; the session
# keys are still held in its memory. Unreachable, calls answer 503 with Retry-After.

SHARED_ACTOR = "runway-state"
SHARED_RETRY_AFTER_S = 2.0


@ray.remote(num_cpus=0, max_restarts=-1)
class SharedStateActor:
    def __init__(self, max_avatars: int, url: str) -> None:
        engine = open_engine(url)
        logger.info("service state in %s", describe(url))
        self.parts: dict[str, Any] = {"avatars": AvatarRows(engine, Avatar, max_avatars), "realtime": RealtimeBook(),
                                      "usage": UsageQueries(engine)}

    def call(self, part: str, method: str, *args: Any) -> Any:
        if method.startswith("_"):
            raise ValueError(f"{method!r} is not a method of the shared {part}")
        return getattr(self.parts[part], method)(*args)


class SharedState:
    """This replica's handle to the service's one `SharedStateActor` (created by the first replica to ask)."""

    def __init__(self, url: str, max_avatars: int = 256) -> None:
        self.url, self.max_avatars = url, max_avatars
        self._actor: Any = None

    def _handle(self) -> Any:
        if self._actor is None:
            self._actor = SharedStateActor.options(  # type: ignore[attr-defined]
                name=SHARED_ACTOR, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
            ).remote(self.max_avatars, self.url)
        return self._actor

    async def call(self, part: str, method: str, *args: Any) -> Any:
        try:
            return await self._handle().call.remote(part, method, *args)
        except RayTaskError as e:
            if isinstance(e.cause, ApiError):
                raise e.cause from None
            raise
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            self._actor = None  # look it up (or create it) again next time
            raise ApiError(503, "shared_state_unavailable", f"the service's shared {part} registry is not reachable "
                           f"({type(e).__name__}); retry in {SHARED_RETRY_AFTER_S:g} s",
                           retry_after_s=SHARED_RETRY_AFTER_S) from e


class SharedAvatars(AvatarRegistry):
    """`AvatarRegistry` over the shared actor."""

    def __init__(self, shared: SharedState) -> None:
        super().__init__(shared.max_avatars)
        self._shared = shared

    async def _store_call(self, method: str, *args: Any) -> Any:
        return await self._shared.call("avatars", method, *args)


class SharedUsage(UsageRegistry):
    """`UsageRegistry` over the shared actor."""

    def __init__(self, shared: SharedState) -> None:
        super().__init__()
        self._shared = shared

    async def _call(self, method: str, *args: Any) -> Any:
        return await self._shared.call("usage", method, *args)


class SharedRealtime(RealtimeRegistry):
    """`RealtimeRegistry` over the shared actor."""

    def __init__(self, shared: SharedState) -> None:
        super().__init__()
        self._shared = shared

    async def _book_call(self, method: str, *args: Any) -> Any:
        return await self._shared.call("realtime", method, *args)


def log_like_serve() -> None:
    """Our `deployments.*` INFO lines (e.g. the Runway clients' User-Agents) go where Serve's own go: the
    replica's log file and, through Ray, the driver's output. Without this they stop at Python's default."""
    ours, serve_log = logging.getLogger("deployments"), logging.getLogger("ray.serve")
    if serve_log.handlers and not ours.handlers:
        for handler in serve_log.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


class _Ingress(CharactersGrpc):
    """HTTP routes (built per replica by `__serve_build_asgi_app__`) and the gRPC methods, over one frontend."""

    def __init__(self, service: ServiceConfig, api: ApiConfig) -> None:
        log_like_serve()
        self.telemetry = telemetry.setup("ingress")  # OTEL_* of this replica's process (off by default)
        self.keys = ApiKeys.from_env()
        self.scheduler = ActorScheduler(service)
        shared = SharedState(database_url(service.data_dir, service.database_url))  # one for all replicas
        self.frontend = SessionFrontend(self.scheduler, api, SharedAvatars(shared), SharedRealtime(shared))
        self.usage = SharedUsage(shared)
        self.readiness = Readiness(self.scheduler, service.warm_slots)
        self.livekit = WatchSettings.from_env()  # the service's own LiveKit server
        logger.info("characters ingress: preset %s, API keys %s", service.preset,
                    f"on ({len(self.keys.ids)} ids)" if self.keys.enabled else "off")

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = add_watch_routes(build_http_app(self.frontend, self.keys, self.livekit), self.frontend, self.livekit)
        bearer = [Security(HTTPBearer(auto_error=False, description="API key, when the server has keys configured")),
                  Depends(known_query)]
        add_health_routes(app, self.readiness)
        app.add_middleware(RememberTrace)  # added before the tracing middleware: inside it
        add_usage_routes(app, self.usage, {"dependencies": bearer, "tags": ["usage"]},
                         {"dependencies": [*bearer, Depends(RunwayClient())], "tags": ["runway"]})
        return telemetry_http.install(app)  # request spans, outermost

    async def reconfigure(self, config: dict[str, Any]) -> None:
        """Serve `user_config`: `{draining: bool}`. Draining (an upgrade to a new cluster) makes the
        scheduler refuse new creates with 503 `draining` + Retry-After and end queued requests, while
        running sessions go on; changing only user_config restarts no replica."""
        unknown = sorted(set(config) - {"draining"})
        if unknown:
            raise ValueError(f"unknown user_config keys {unknown}; the ingress takes only 'draining'")
        draining = config.get("draining", False)
        if not isinstance(draining, bool):
            raise ValueError(f"user_config.draining={draining!r} must be true or false")
        await self.scheduler.set_draining(draining)
        logger.info("characters ingress: draining %s", "on" if draining else "off")


CharactersIngress: Deployment = serve.deployment(
    name="CharactersIngress", max_ongoing_requests=1000, graceful_shutdown_wait_loop_s=0.5)(serve.ingress()(_Ingress))


class IngressOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    num_replicas: int = Field(default=1, ge=1, description="Ingress replicas (HTTP + gRPC).")
    max_ongoing_requests: int = Field(default=1000, ge=1, description="Per replica; audio streams count too.")
    num_cpus: float = Field(default=0.0, ge=0, description="CPUs reserved per replica; 0 leaves every core to "
                            "session bundles (the CPU default needs the whole machine).")


def parse_args(args: dict[str, Any] | None = None) -> tuple[ServiceConfig, ApiConfig, IngressOptions]:
    """Split and validate app args (see the module docstring); ValueError names a bad key."""
    args = dict(args or {})
    service_args = dict(args.pop("service", None) or {})
    for key in ("preset", "topology", "warm_slots"):
        if key in args:
            service_args[key] = args.pop(key)
    api_args = dict(args.pop("api", None) or {})
    ingress = IngressOptions.model_validate(args.pop("ingress", None) or {})
    if args:
        raise ValueError(f"unknown app args {sorted(args)}; expected service, api, ingress, preset, topology, "
                         "warm_slots (see deployments/api/app.py)")
    service = ServiceConfig.from_env(**service_args)
    if list(api_args.setdefault("presets", [service.preset])) != [service.preset]:
        raise ValueError(f"api.presets={api_args['presets']} differs from service.preset={service.preset!r}; "
                         "the API serves exactly the scheduler's preset, leave api.presets out")
    return service, ApiConfig.model_validate(api_args), ingress


def build_app(args: dict[str, Any] | None = None) -> Application:
    """The bound Serve application for `args` (see the module docstring); ValueError names a bad key."""
    service, api, ingress = parse_args(args)
    deployment = CharactersIngress.options(num_replicas=ingress.num_replicas,
                                           max_ongoing_requests=ingress.max_ongoing_requests,
                                           ray_actor_options={"num_cpus": ingress.num_cpus})
    return deployment.bind(service, api)
