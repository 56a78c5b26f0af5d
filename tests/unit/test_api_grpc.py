"""The gRPC service without Ray: message conversion, status codes, and StreamAudio's pump and event loop,
driven with an in-memory scheduler and a stand-in for Serve's gRPC context."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from memory_scheduler import MemoryScheduler
from PIL import Image

from deployments.api.auth import ApiKeys
from deployments.api.errors import ApiError
from deployments.api.frontend import SessionFrontend
from deployments.api.grpc_service import CharactersGrpc, GrpcAbort, event_pb, session_options, session_pb
from deployments.api.proto import characters_pb2 as pb
from deployments.api.requests import ApiConfig
from deployments.types import (
    Capacity,
    NoCapacity,
    SessionEvent,
    SessionInfo,
    SessionSpec,
    SessionStatus,
)

KEY = "grpc-key-0123456789abcdef"


class Context:
    """What the servicer uses of ray.serve.grpc_util.RayServegRPCContext."""

    def __init__(self, metadata: list[tuple[str, str]] | None = None) -> None:
        self.metadata = metadata if metadata is not None else [("authorization", f"Bearer {KEY}")]
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailing: list[tuple[str, str]] = []

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.metadata

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, md: list[tuple[str, str]]) -> None:
        self.trailing = md


class Scheduler(MemoryScheduler):
    """The in-memory scheduler that also logs events: create/push_audio/clear_audio/end_session append them;
    events() long-polls them."""

    def __init__(self) -> None:
        super().__init__(created=SessionStatus.STARTING)
        self.log: dict[str, list[SessionEvent]] = {}
        self.pushed: list[tuple[bytes, int, int]] = []
        self.changed = asyncio.Event()

    def emit(self, sid: str, kind: Any, **kw: Any) -> None:
        log = self.log.setdefault(sid, [])
        log.append(SessionEvent(len(log) + 1, sid, kind, **kw))
        self.changed.set()
        self.changed = asyncio.Event()

    async def create_session(self, spec: SessionSpec) -> SessionInfo:
        info = await super().create_session(spec)
        self.emit(spec.session_id, "status", status=SessionStatus.STARTING)
        return info

    async def end_session(self, session_id: str, reason: str = "deleted") -> SessionInfo:
        info = await self.get_session(session_id)
        if not info.status.terminal:
            info.status, info.reason, info.ended_at = SessionStatus.ENDED, reason, 99.0
            self.emit(session_id, "status", status=SessionStatus.ENDED, detail=reason)
        return info

    async def capacity(self) -> Capacity:
        return Capacity(bundles_total=3, bundles_free=2, sessions_running=1, queued=0, warm_slots_free=1)

    async def push_audio(self, session_id: str, pcm: bytes, sample_rate: int, channels: int) -> None:
        await super().push_audio(session_id, pcm, sample_rate, channels)
        self.pushed.append((pcm, sample_rate, channels))
        self.emit(session_id, "chunk", chunk=len(self.pushed) - 1)

    async def clear_audio(self, session_id: str) -> None:
        self.emit(session_id, "playback_finished", detail="interrupted")

    async def events(self, session_id: str, after_seq: int, timeout_s: float = 10.0) -> list[SessionEvent]:
        info = await self.get_session(session_id)
        if len(self.log.get(session_id, [])) <= after_seq and not info.status.terminal:
            try:
                await asyncio.wait_for(self.changed.wait(), timeout_s)
            except TimeoutError:
                return []
        return self.log.get(session_id, [])[after_seq:]


class Service(CharactersGrpc):
    def __init__(self, sched: Scheduler, keys: ApiKeys | None = None) -> None:
        self.frontend = SessionFrontend(sched, ApiConfig(events_wait_s=0.2))
        self.keys = keys or ApiKeys.from_keys([("be", KEY)])


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 40)).save(buf, "PNG")
    return buf.getvalue()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))


# ----------------------------------------------------------------------------------------- conversion


def test_session_and_event_conversion() -> None:
    info = SessionInfo("s", SessionStatus.RUNNING, "tiny", created_at=1.5, started_at=2.5, warm_start=False)
    info.stats.chunks, info.stats.fps = 7, 23.5
    msg = session_pb(info)
    assert (msg.status, msg.created_at, msg.started_at, msg.warm_start) == (pb.SESSION_STATUS_RUNNING, 1.5, 2.5, False)
    assert not msg.HasField("ended_at") and not msg.HasField("queue_position") and msg.reason == ""
    assert (msg.stats.chunks, msg.stats.fps) == (7, 23.5)
    for status in SessionStatus:
        assert pb.SessionStatus.Name(session_pb(SessionInfo("s", status, "tiny")).status) == f"SESSION_STATUS_{status}"
    ev = event_pb(SessionEvent(4, "s", "chunk", chunk=0, detail="d", at=3.0))
    assert (ev.seq, ev.kind, ev.chunk, ev.detail, ev.status) == (4, pb.SessionEvent.KIND_CHUNK, 0, "d", 0)
    assert event_pb(SessionEvent(1, "s", "status", status=SessionStatus.FAILED)).status == pb.SESSION_STATUS_FAILED


def test_session_options_defaults_and_refusals() -> None:
    opts = session_options(pb.CreateSessionRequest(image=b"x"))
    assert (opts.preset, opts.max_duration, opts.seed, opts.output.kind) == (None, 300.0, 0, "null")
    opts = session_options(pb.CreateSessionRequest(max_duration_s=12, seed=5, output=pb.Output(kind="file",
                                                                                                path="a.mp4")))
    assert (opts.max_duration, opts.seed, opts.output.path) == (12.0, 5, "a.mp4")
    with pytest.raises(ApiError) as info:
        session_options(pb.CreateSessionRequest(max_duration_s=-1))
    assert info.value.field == "maxDuration"
    assert info.value.grpc_details({"maxDuration": "max_duration_s"}).startswith("invalid_field: max_duration_s: ")


# ------------------------------------------------------------------------------------------ unary calls


def test_unary_calls_and_their_status_codes() -> None:
    sched = Scheduler()
    svc = Service(sched)

    async def go() -> None:
        created = await svc.CreateSession(pb.CreateSessionRequest(image=png(), seed=2), Context())  # type: ignore[arg-type]
        assert created.status == pb.SESSION_STATUS_STARTING
        got = await svc.GetSession(pb.GetSessionRequest(session_id=created.id), Context())  # type: ignore[arg-type]
        assert got.id == created.id
        cap = await svc.GetCapacity(pb.GetCapacityRequest(), Context())  # type: ignore[arg-type]
        assert (cap.bundles_total, cap.warm_slots_free) == (3, 1)
        assert len((await svc.ListSessions(pb.ListSessionsRequest(), Context())).sessions) == 1  # type: ignore[arg-type]
        ended = await svc.EndSession(pb.EndSessionRequest(session_id=created.id), Context())  # type: ignore[arg-type]
        assert ended.status == pb.SESSION_STATUS_ENDED and ended.reason == "deleted"

        cases: list[tuple[Any, Any, Context, grpc.StatusCode, str]] = [
            (svc.GetSession, pb.GetSessionRequest(session_id="nope"), Context(), grpc.StatusCode.NOT_FOUND,
             "session_not_found: session_id: no session with id 'nope'"),
            (svc.GetSession, pb.GetSessionRequest(session_id=""), Context(), grpc.StatusCode.NOT_FOUND,
             "session_not_found"),
            (svc.GetCapacity, pb.GetCapacityRequest(), Context([]), grpc.StatusCode.UNAUTHENTICATED,
             "missing_api_key"),
            (svc.GetCapacity, pb.GetCapacityRequest(), Context([("authorization", "Bearer wrong-0123456789abc")]),
             grpc.StatusCode.UNAUTHENTICATED, "invalid_api_key"),
            (svc.CreateSession, pb.CreateSessionRequest(image=b"GIF89a"), Context(), grpc.StatusCode.INVALID_ARGUMENT,
             "invalid_image: image: "),
            (svc.CreateSession, pb.CreateSessionRequest(image=png(), preset="57b"), Context(),
             grpc.StatusCode.INVALID_ARGUMENT, "invalid_field: preset: preset '57b' is not served here"),
            (svc.CreateSession, pb.CreateSessionRequest(image=png(), output=pb.Output(kind="rtmp")), Context(),
             grpc.StatusCode.INVALID_ARGUMENT, "invalid_field: output.kind: "),
        ]
        for method, request, ctx, code, details in cases:
            await method(request, ctx)
            assert ctx.code == code and details in ctx.details, (ctx.code, ctx.details)

        sched.refuse = NoCapacity("all bundles busy", 7.2)
        ctx = Context()
        await svc.CreateSession(pb.CreateSessionRequest(image=png()), ctx)  # type: ignore[arg-type]
        assert ctx.code == grpc.StatusCode.RESOURCE_EXHAUSTED and ctx.trailing == [("retry-after", "8")]
        sched.refuse = ApiError(503, "scheduler_unavailable", "down", retry_after_s=5)
        await svc.CreateSession(pb.CreateSessionRequest(image=png()), ctx)  # type: ignore[arg-type]
        assert ctx.code == grpc.StatusCode.UNAVAILABLE

    run(go())


# ----------------------------------------------------------------------------------------- StreamAudio


async def collect(svc: Service, requests: AsyncIterator[pb.AudioChunk], ctx: Context,
                  on_event: Any = None) -> list[pb.SessionEvent]:
    out = []
    async for ev in svc.StreamAudio(requests, ctx):  # type: ignore[arg-type]
        out.append(ev)
        if on_event is not None:
            await on_event(ev)
    return out


def test_stream_audio_pumps_audio_and_streams_events_until_terminal() -> None:
    sched = Scheduler()
    svc = Service(sched)

    async def go() -> None:
        sid = (await svc.CreateSession(pb.CreateSessionRequest(image=png()), Context())).id  # type: ignore[arg-type]
        more = asyncio.Event()

        async def requests() -> AsyncIterator[pb.AudioChunk]:
            yield pb.AudioChunk(session_id=sid, pcm=b"\1\0\2\0", sample_rate=24000)
            await more.wait()
            yield pb.AudioChunk(clear=True, pcm=b"\3\0\4\0", sample_rate=48000, channels=2)
            await asyncio.sleep(3600)  # the client keeps the stream open

        async def on_event(ev: pb.SessionEvent) -> None:
            if ev.seq == 2:
                more.set()
            if ev.seq == 4:
                await sched.end_session(sid, "room empty")

        events = await collect(svc, requests(), Context(), on_event)
        assert [(e.seq, pb.SessionEvent.Kind.Name(e.kind)) for e in events] == [
            (1, "KIND_STATUS"), (2, "KIND_CHUNK"), (3, "KIND_PLAYBACK_FINISHED"), (4, "KIND_CHUNK"), (5, "KIND_STATUS")]
        assert events[-1].status == pb.SESSION_STATUS_ENDED and events[-1].detail == "room empty"
        assert sched.pushed == [(b"\1\0\2\0", 24000, 1), (b"\3\0\4\0", 48000, 2)]  # clear came before its pcm
        await asyncio.sleep(0)
        left = [t.get_coro().__qualname__ for t in asyncio.all_tasks()]  # type: ignore[union-attr]
        assert not {"CharactersGrpc._pump_audio", "SessionFrontend.events"} & set(left), left  # all reaped

    run(go())


def test_stream_audio_half_close_keeps_events_and_after_seq_skips() -> None:
    sched = Scheduler()
    svc = Service(sched)

    async def go() -> None:
        sid = (await svc.CreateSession(pb.CreateSessionRequest(image=png()), Context())).id  # type: ignore[arg-type]

        async def one(after: int = 1) -> AsyncIterator[pb.AudioChunk]:
            yield pb.AudioChunk(session_id=sid, after_seq=after)

        async def end_later() -> None:
            await asyncio.sleep(0.5)  # after the request stream has ended
            await sched.end_session(sid)

        ender = asyncio.create_task(end_later())
        events = await collect(svc, one(), Context())
        await ender
        assert [(e.seq, e.status) for e in events] == [(2, pb.SESSION_STATUS_ENDED)]
        # An ended session whose events are all behind after_seq: the stream ends at once, empty.
        assert await collect(svc, one(2), Context()) == []

    run(go())


@pytest.mark.parametrize(("chunks", "code", "details"), [
    ([], grpc.StatusCode.INVALID_ARGUMENT, "session_id: the first AudioChunk must name the session"),
    ([pb.AudioChunk(pcm=b"\0\0", sample_rate=16000)], grpc.StatusCode.INVALID_ARGUMENT, "session_id"),
    ([pb.AudioChunk(session_id="ghost")], grpc.StatusCode.NOT_FOUND, "no session with id 'ghost'"),
    ([pb.AudioChunk(session_id="S", pcm=b"\0\0\0", sample_rate=16000)], grpc.StatusCode.INVALID_ARGUMENT,
     "invalid_field: pcm: is 3 bytes"),
    ([pb.AudioChunk(session_id="S", pcm=b"\0\0\0\0\0\0", sample_rate=16000, channels=2)],
     grpc.StatusCode.INVALID_ARGUMENT, "not whole 16-bit frames of 2 channel(s)"),
    ([pb.AudioChunk(session_id="S", pcm=b"\0\0", sample_rate=96000)], grpc.StatusCode.INVALID_ARGUMENT,
     "sample_rate: is 96000"),
    ([pb.AudioChunk(session_id="S", pcm=b"\0\0", sample_rate=16000, channels=3)], grpc.StatusCode.INVALID_ARGUMENT,
     "channels: is 3"),
    ([pb.AudioChunk(session_id="S"), pb.AudioChunk(session_id="T")], grpc.StatusCode.INVALID_ARGUMENT,
     "one stream per session"),
], ids=["empty", "no-id", "unknown", "odd-bytes", "partial-frame", "rate", "channels", "switch"])
def test_stream_audio_refusals(chunks: list[pb.AudioChunk], code: grpc.StatusCode, details: str) -> None:
    sched = Scheduler()
    svc = Service(sched, ApiKeys())  # auth off
    svc.frontend.config = ApiConfig(events_wait_s=5)  # a refusal must not wait for the long-poll

    async def go() -> Context:
        sid = (await svc.CreateSession(pb.CreateSessionRequest(image=png()), Context())).id  # type: ignore[arg-type]

        async def requests() -> AsyncIterator[pb.AudioChunk]:
            for c in chunks:
                if c.session_id == "S":
                    c.session_id = sid
                yield c
            if chunks:
                await asyncio.sleep(3600)  # the client keeps the stream open

        ctx = Context([])
        with pytest.raises(GrpcAbort):
            await collect(svc, requests(), ctx)
        return ctx

    ctx = asyncio.run(asyncio.wait_for(go(), 2))
    assert ctx.code == code and details in ctx.details, (ctx.code, ctx.details)


def test_stream_audio_needs_a_key_when_keys_are_on() -> None:
    sched = Scheduler()

    async def requests() -> AsyncIterator[pb.AudioChunk]:
        yield pb.AudioChunk(session_id="x")

    ctx = Context([])
    with pytest.raises(GrpcAbort):
        run(collect(Service(sched), requests(), ctx))
    assert ctx.code == grpc.StatusCode.UNAUTHENTICATED
