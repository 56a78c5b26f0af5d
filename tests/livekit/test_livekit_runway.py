"""The unmodified `livekit-plugins-runway` AvatarSession against our API (the real FastAPI app from
deployments.api.http, in-process uvicorn on 127.0.0.1) and a real LiveKit server: its HTTP call starts a
session, the character joins with the plugin's token and publishes video, END_CALL ends it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import uvicorn
from livekit import api, rtc
from livekit.agents import AgentSession, utils
from livekit.plugins import runway
from livekit.plugins.runway import avatar as runway_avatar
from lk_helpers import CHUNK_S, FakeSession, H, W, frames_for, token

from deployments.api.auth import ApiKeys
from deployments.api.frontend import SessionFrontend
from deployments.api.http import build_http_app
from deployments.api.requests import ApiConfig
from deployments.livekit import LiveKitOutput, LiveKitServer, LiveKitSink, MediaFormat
from deployments.livekit.config import ATTRIBUTE_PUBLISH_ON_BEHALF
from deployments.livekit.server import free_port
from deployments.types import Capacity, SessionEvent, SessionInfo, SessionSpec, SessionStatus, UnknownSession

pytestmark = [pytest.mark.livekit, pytest.mark.filterwarnings("ignore::jwt.warnings.InsecureKeyLengthWarning")]

RUNWAY_KEY = "runway-secret-0123456789"


class EndingSession(FakeSession):
    def __init__(self, on_end: Callable[[str], None]) -> None:
        super().__init__()
        self.on_end = on_end

    def end_session(self, reason: str) -> None:
        super().end_session(reason)
        self.on_end(reason)  # called on the room's thread: must not block on the room


class RoomScheduler:
    """The scheduler's interface; a session is a LiveKitSink fed synthetic chunks in real time by a thread
    (the chunk loop's stand-in), ended by the room (END_CALL) or by DELETE."""

    def __init__(self) -> None:
        self.infos: dict[str, SessionInfo] = {}
        self.specs: dict[str, SessionSpec] = {}
        self.sinks: dict[str, LiveKitSink] = {}
        self._stops: dict[str, threading.Event] = {}
        self._threads: list[threading.Thread] = []

    async def create_session(self, spec: SessionSpec) -> SessionInfo:
        assert isinstance(spec.output, LiveKitOutput)
        info = self.infos[spec.session_id] = SessionInfo(spec.session_id, SessionStatus.STARTING, spec.preset)
        self.specs[spec.session_id] = spec
        session = EndingSession(lambda reason: self._end(spec.session_id, reason))
        sink = LiveKitSink(spec.output, MediaFormat(W, H), session, max_duration_s=spec.max_duration_s)
        await asyncio.to_thread(sink.start)
        self.sinks[spec.session_id] = sink
        stop = self._stops[spec.session_id] = threading.Event()
        t = threading.Thread(target=self._feed, args=(sink, session, stop), daemon=True)
        t.start()
        self._threads.append(t)
        info.status = SessionStatus.RUNNING
        return info

    def _feed(self, sink: LiveKitSink, session: FakeSession, stop: threading.Event) -> None:
        t0 = time.monotonic()
        k = 0
        while not stop.wait(max(0.0, t0 + k * CHUNK_S - time.monotonic())):
            pcm = session.take(k)
            sink.write(frames_for(k, pcm), pcm)
            k += 1

    def _end(self, sid: str, reason: str) -> None:
        info = self.infos[sid]
        if not info.status.terminal:
            info.status, info.reason, info.ended_at = SessionStatus.ENDED, reason, time.time()
        self._stops[sid].set()
        threading.Thread(target=self.sinks[sid].close, daemon=True).start()  # not on the room's own loop

    async def get_session(self, session_id: str) -> SessionInfo:
        if session_id not in self.infos:
            raise UnknownSession(session_id)
        return self.infos[session_id]

    async def list_sessions(self) -> list[SessionInfo]:
        return list(self.infos.values())

    async def end_session(self, session_id: str, reason: str = "deleted") -> SessionInfo:
        await self.get_session(session_id)
        self._end(session_id, reason)
        return self.infos[session_id]

    async def capacity(self) -> Capacity:
        return Capacity(1, 1, len(self.infos), 0)

    async def push_audio(self, session_id: str, pcm: bytes, sample_rate: int, channels: int) -> None: ...

    async def clear_audio(self, session_id: str) -> None: ...

    async def events(self, session_id: str, after_seq: int, timeout_s: float = 10.0) -> list[SessionEvent]:
        return []

    def close(self) -> None:
        for stop in self._stops.values():
            stop.set()
        for sink in self.sinks.values():
            sink.close()
        for t in self._threads:
            t.join(5)


@pytest.fixture()
def api_server() -> Iterator[tuple[str, RoomScheduler]]:
    sched = RoomScheduler()
    app = build_http_app(SessionFrontend(sched, ApiConfig()), ApiKeys.from_keys([("runway", RUNWAY_KEY)]))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", sched
    finally:
        sched.close()
        server.should_exit = True
        thread.join(10)


def test_runway_plugin_starts_a_character_that_joins_and_leaves_on_end_call(
        livekit_server: LiveKitServer, api_server: tuple[str, RoomScheduler], monkeypatch: pytest.MonkeyPatch) -> None:
    base, sched = api_server
    # outside a LiveKit Agents worker there is no job context: give the plugin the one thing it reads from it
    monkeypatch.setattr(runway_avatar, "get_job_context", lambda *a, **k: SimpleNamespace(
        local_participant_identity="agent"))

    async def main() -> None:
        room = rtc.Room()
        await room.connect(livekit_server.url, token(livekit_server, "runway", "agent", kind="agent"))
        session: AgentSession[Any] = AgentSession()
        try:
            async with utils.http_context.open():
                avatar = runway.AvatarSession(preset_id="sample-face", api_url=base, api_key=RUNWAY_KEY,
                                              max_duration=60)
                t0 = time.monotonic()
                await avatar.start(session, room, livekit_url=livekit_server.url,
                                   livekit_api_key=livekit_server.api_key,
                                   livekit_api_secret=livekit_server.api_secret)
                sid = avatar._realtime_session_id
                assert sid is not None and sid in sched.specs
                await avatar.wait_for_join(timeout=15)  # the character joined and published its video track
                joined = time.monotonic() - t0
                await asyncio.sleep(1.0)
                character = room.remote_participants[avatar.avatar_identity]
                kinds = {p.kind for p in character.track_publications.values()}
                assert kinds == {rtc.TrackKind.KIND_VIDEO, rtc.TrackKind.KIND_AUDIO}  # camera first, then microphone
                assert character.attributes.get(ATTRIBUTE_PUBLISH_ON_BEHALF) == "agent"
                assert sched.infos[sid].status is SessionStatus.RUNNING
                await avatar.aclose()  # the plugin sends {"type": "END_CALL"} to the character
                deadline = time.monotonic() + 5
                while sched.infos[sid].status is SessionStatus.RUNNING:
                    assert time.monotonic() < deadline, "END_CALL did not end the session"
                    await asyncio.sleep(0.05)
                async with utils.http_context.http_session().get(
                        f"{base}/v1/realtime_sessions/{sid}", headers={"Authorization": f"Bearer {RUNWAY_KEY}"}
                ) as resp:
                    got = await resp.json()
        finally:
            await session.aclose()
            await room.disconnect()
        spec = sched.specs[sid]
        assert isinstance(spec.output, LiveKitOutput) and spec.output.agent_identity == "agent"
        claims = api.TokenVerifier(livekit_server.api_key, livekit_server.api_secret).verify(spec.output.token or "")
        assert claims.identity == "runway-avatar-agent"
        assert (got["id"], got["status"], got["endReason"]) == (sid, "COMPLETED", "end_call")
        assert spec.max_duration_s == 60.0 and spec.image.shape == (H, W, 3)
        print(f"runway plugin: session {sid[:8]} joined and publishing in {joined:.2f} s")

    asyncio.run(main())


def test_runway_delete_ends_the_session(livekit_server: LiveKitServer,
                                        api_server: tuple[str, RoomScheduler]) -> None:
    """The plugin's fallback when the room is already gone: DELETE /v1/realtime_sessions/{id}."""
    import json
    import urllib.request

    base, sched = api_server
    lk = token(livekit_server, "runway-delete", "avatar", kind="agent",
               attributes={ATTRIBUTE_PUBLISH_ON_BEHALF: "agent"})
    req = {"model": "gwm1_avatars", "avatar": {"type": "runway-preset", "presetId": "sample-face"},
           "livekit": {"url": livekit_server.url, "token": lk, "roomName": "runway-delete", "agentIdentity": "agent"}}
    headers = {"Authorization": f"Bearer {RUNWAY_KEY}", "X-Runway-Version": "2024-11-06",
               "Content-Type": "application/json"}
    with urllib.request.urlopen(urllib.request.Request(f"{base}/v1/realtime_sessions", json.dumps(req).encode(),
                                                       headers)) as resp:
        sid = json.loads(resp.read())["id"]
    sink = sched.sinks[sid]
    assert sink.room is not None and sink.room.room is not None and sink.room.room.isconnected()
    with urllib.request.urlopen(urllib.request.Request(f"{base}/v1/realtime_sessions/{sid}", method="DELETE",
                                                       headers=headers)) as resp:
        assert resp.status == 204
    deadline = time.monotonic() + 5
    while sink.room is not None and sink.room.room is not None:
        assert time.monotonic() < deadline, "the character did not leave after DELETE"
        time.sleep(0.05)
    assert sched.infos[sid].status is SessionStatus.ENDED and sched.infos[sid].reason == "deleted"
