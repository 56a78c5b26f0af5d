"""The scheduler's async interface (`deployments.api.frontend.Scheduler`) over dicts, for the front-end tests: it
records what the routes hand it (specs, agent audio, clears); `refuse` makes create_session raise it."""

from __future__ import annotations

from deployments.types import Capacity, SessionEvent, SessionInfo, SessionSpec, SessionStatus, UnknownSession


class MemoryScheduler:
    def __init__(self, created: SessionStatus = SessionStatus.STARTING) -> None:
        self.created = created  # the status a new session is given
        self.specs: dict[str, SessionSpec] = {}
        self.infos: dict[str, SessionInfo] = {}
        self.audio: list[tuple[str, bytes, int, int]] = []
        self.cleared: list[str] = []
        self.refuse: Exception | None = None

    async def create_session(self, spec: SessionSpec) -> SessionInfo:
        if self.refuse is not None:
            raise self.refuse
        self.specs[spec.session_id] = spec
        self.infos[spec.session_id] = SessionInfo(spec.session_id, self.created, spec.preset, owner=spec.api_key_id)
        return self.infos[spec.session_id]

    async def get_session(self, session_id: str) -> SessionInfo:
        if session_id not in self.infos:
            raise UnknownSession(session_id)
        return self.infos[session_id]

    async def list_sessions(self) -> list[SessionInfo]:
        return list(self.infos.values())

    async def end_session(self, session_id: str, reason: str = "deleted") -> SessionInfo:
        info = await self.get_session(session_id)
        info.status, info.reason = SessionStatus.ENDED, reason
        return info

    async def capacity(self) -> Capacity:
        return Capacity(bundles_total=2, bundles_free=2 - len(self.infos), sessions_running=len(self.infos), queued=0)

    async def push_audio(self, session_id: str, pcm: bytes, sample_rate: int, channels: int) -> None:
        await self.get_session(session_id)
        self.audio.append((session_id, pcm, sample_rate, channels))

    async def clear_audio(self, session_id: str) -> None:
        await self.get_session(session_id)
        self.cleared.append(session_id)

    async def events(self, session_id: str, after_seq: int, timeout_s: float = 10.0) -> list[SessionEvent]:
        return []
