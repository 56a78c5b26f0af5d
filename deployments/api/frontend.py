"""`SessionFrontend`: the logic every front door shares (HTTP, Runway-compatible HTTP, gRPC, the watch
page): validation into a `SessionSpec`, the scheduler's calls, and its refusals mapped to `ApiError`s.

It takes any object with the scheduler's async interface (`Scheduler`), so tests drive it without Ray;
the Serve deployment (`deployments.api.app`) passes the scheduler actor behind that interface.

Tenancy is applied here, for every front door alike: each call names its `Caller` (deployments.api.auth), a
session belongs to the key that made it (`SessionInfo.owner`), and another tenant's session is answered
exactly as an unknown one (404 `session_not_found`), so ids do not leak; lists hold the caller's own
sessions; an operator key sees every tenant's. A session's owner never changes, so the owners this replica
has seen are kept (bounded) and feeding audio costs no extra scheduler call.
"""

from __future__ import annotations

import asyncio
import posixpath
import uuid
from collections import OrderedDict
from typing import Any, Protocol, cast

from characters.audio import PcmFormatError, check_agent_pcm
from deployments.api.auth import Caller
from deployments.api.avatars import AvatarRegistry
from deployments.api.errors import ApiError, ErrorCode
from deployments.api.realtime import RealtimeRegistry
from deployments.api.requests import ApiConfig, check_session_id, load_avatar
from deployments.api.schemas import OutputIn, SessionOptions
from deployments.livekit.config import LiveKitConfigError, LiveKitOutput
from deployments.types import (
    Capacity,
    NoCapacity,
    OutputSpec,
    SessionEvent,
    SessionInfo,
    SessionSpec,
    UnknownSession,
)


class Scheduler(Protocol):
    """The scheduler's async interface (`deployments.sessions.scheduler`), as the frontend calls it."""

    async def create_session(self, spec: SessionSpec) -> SessionInfo: ...
    async def get_session(self, session_id: str) -> SessionInfo: ...
    async def list_sessions(self) -> list[SessionInfo]: ...
    async def end_session(self, session_id: str, reason: str = "deleted") -> SessionInfo: ...
    async def capacity(self) -> Capacity: ...
    async def push_audio(self, session_id: str, pcm: bytes, sample_rate: int, channels: int) -> None: ...
    async def clear_audio(self, session_id: str) -> None: ...
    async def events(self, session_id: str, after_seq: int, timeout_s: float = 10.0) -> list[SessionEvent]: ...


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


OWNERS_KEPT = 4096  # session id -> owner entries a replica remembers (owners never change)


class SessionFrontend:
    """Validation and scheduler calls shared by the HTTP and gRPC front doors, scoped to the caller."""

    def __init__(self, scheduler: Scheduler, config: ApiConfig, avatars: AvatarRegistry | None = None,
                 realtime: RealtimeRegistry | None = None) -> None:
        self.scheduler, self.config = scheduler, config
        # /v1/avatars and the Runway sessions' keys: in this process by default; Serve passes the service-wide ones
        # (one shared actor: deployments.api.app), so every ingress replica sees the same
        self.avatars = avatars or AvatarRegistry()
        self.realtime = realtime or RealtimeRegistry()
        self._owners: OrderedDict[str, str | None] = OrderedDict()

    def resolve_preset(self, preset: str | None) -> str:
        name = preset or self.config.presets[0]
        if name not in self.config.presets:
            raise ApiError(422, ErrorCode.INVALID_FIELD,
                           f"preset {name!r} is not served here; this service serves {list(self.config.presets)}",
                           "preset")
        return name

    async def create(self, options: SessionOptions, image: bytes, api_key_id: str | None = None,
                     trace_context: dict[str, str] | None = None, session_id: str | None = None) -> SessionInfo:
        """Start a session owned by `api_key_id` (`session_id`: chosen by the caller, e.g. to name its room)."""
        preset = self.resolve_preset(options.preset)
        if options.max_duration > self.config.max_duration_s:
            raise ApiError(422, ErrorCode.INVALID_FIELD,
                           f"is {options.max_duration:g} s, over this server's limit of {self.config.max_duration_s:g} "
                           "s; ask for less and start a new session when it ends", "maxDuration")
        output = output_spec(options.output, self.config)
        pixels = await asyncio.to_thread(load_avatar, image, preset, self.config)
        spec = SessionSpec(session_id=session_id or uuid.uuid4().hex, image=pixels, preset=preset,
                           max_duration_s=float(options.max_duration), output=output, seed=options.seed,
                           recover=options.recover, api_key_id=api_key_id, trace_context=dict(trace_context or {}))
        return await self.submit(spec)

    async def submit(self, spec: SessionSpec) -> SessionInfo:
        """Hand an already validated spec to the scheduler (the Runway-compatible routes build their own)."""
        self._remember(spec.session_id, spec.api_key_id)
        return self._seen(await self._call(self.scheduler.create_session(spec)))

    async def get(self, session_id: str, caller: Caller) -> SessionInfo:
        """The session, if `caller` may see it; another tenant's is 404 as an unknown one is."""
        info = self._seen(await self._call(self.scheduler.get_session(check_session_id(session_id))))
        if not caller.owns(info.owner):
            raise _not_found(session_id)
        return info

    async def list_sessions(self, caller: Caller) -> list[SessionInfo]:
        return [self._seen(s) for s in await self._call(self.scheduler.list_sessions()) if caller.owns(s.owner)]

    async def end(self, session_id: str, caller: Caller, reason: str = "deleted") -> SessionInfo:
        await self.check_owner(session_id, caller)
        return self._seen(await self._call(self.scheduler.end_session(session_id, reason)))

    async def check_owner(self, session_id: str, caller: Caller) -> None:
        """404 unless the session exists and `caller` may act on it (a remembered owner costs no call)."""
        check_session_id(session_id)
        if session_id in self._owners:
            if not caller.owns(self._owners[session_id]):
                raise _not_found(session_id)
            return
        await self.get(session_id, caller)

    def _remember(self, session_id: str, owner: str | None) -> None:
        self._owners[session_id] = owner
        self._owners.move_to_end(session_id)
        while len(self._owners) > OWNERS_KEPT:
            self._owners.popitem(last=False)

    def _seen(self, info: SessionInfo) -> SessionInfo:
        self._remember(info.id, info.owner)
        return info

    async def capacity(self) -> Capacity:
        return await self._call(self.scheduler.capacity())

    async def push_audio(self, session_id: str, caller: Caller, pcm: bytes, sample_rate: int, channels: int) -> None:
        """Validated here, once (`characters.audio.check_agent_pcm`); the scheduler's adapter sends it to the
        session's own actor (`deployments.api.app.ActorScheduler.push_audio`)."""
        try:
            check_agent_pcm(len(pcm), sample_rate, channels)
        except PcmFormatError as err:
            raise ApiError(422, ErrorCode.INVALID_FIELD, err.detail, err.field) from err
        if len(pcm) > self.config.max_audio_chunk_bytes:
            raise ApiError(422, ErrorCode.INVALID_FIELD,
                           f"is {len(pcm)} bytes, over the limit of {self.config.max_audio_chunk_bytes}; "
                           "send smaller chunks (e.g. 20-100 ms each)", "pcm")
        await self.check_owner(session_id, caller)
        await self._call(self.scheduler.push_audio(session_id, pcm, sample_rate, channels))

    async def clear_audio(self, session_id: str, caller: Caller) -> None:
        await self.check_owner(session_id, caller)
        await self._call(self.scheduler.clear_audio(session_id))

    async def events(self, session_id: str, caller: Caller, after_seq: int) -> list[SessionEvent]:
        await self.check_owner(session_id, caller)
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
            raise _not_found(e.session_id) from e


def _not_found(session_id: str) -> ApiError:
    """The one answer for an unknown session and for another tenant's (so ids do not leak)."""
    return ApiError(404, ErrorCode.SESSION_NOT_FOUND, f"no session with id {session_id[:128]!r}", "id")
