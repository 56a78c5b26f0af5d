"""`SessionFrontend`: the logic every front door shares (HTTP, Runway-compatible HTTP, gRPC, the watch
page): validation into a `SessionSpec`, the scheduler's calls, and its refusals mapped to `ApiError`s.

It takes any object with the scheduler's async interface (`Scheduler`), so tests drive it without Ray;
the Serve deployment (`deployments.api.app`) passes the scheduler actor behind that interface.
"""

from __future__ import annotations

import asyncio
import posixpath
import uuid
from typing import Any, Protocol, cast

from deployments.api.avatars import AvatarRegistry
from deployments.api.errors import ApiError, ErrorCode
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


class SessionFrontend:
    """Validation and scheduler calls shared by the HTTP and gRPC front doors."""

    def __init__(self, scheduler: Scheduler, config: ApiConfig, avatars: AvatarRegistry | None = None) -> None:
        self.scheduler, self.config = scheduler, config
        # POST /v1/avatars: in this process by default; Serve passes the service-wide one (deployments.api.avatars)
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
