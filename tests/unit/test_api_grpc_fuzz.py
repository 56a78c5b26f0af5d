"""Property-based fuzzing of the gRPC service (deployments.api.grpc_service) without Ray: random CreateSession
requests (real and broken image files, any preset text, NaN/inf/negative durations, any seed, any output)
and random AudioChunk streams (any session id, PCM of any length, any rate and channel count, clears).

Each call must end (no hang) with OK or a refusal whose code is INVALID_ARGUMENT, NOT_FOUND or
UNAUTHENTICATED and whose details read `<code>: <field>: <message>`, never INTERNAL/UNKNOWN; a session is
made exactly when CreateSession answers OK (no lost session); audio reaches the scheduler exactly for
the chunks that are valid, in order, and a refused stream leaves its session alive. The expected outcome
of each stream is computed independently from the proto's documented rules.
"""

from __future__ import annotations

import asyncio
import math
import re
from typing import Any

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_api_fuzz import image_files
from test_api_grpc import KEY, Context, Scheduler

from deployments.api.auth import ApiKeys
from deployments.api.frontend import SessionFrontend
from deployments.api.grpc_service import CharactersGrpc, GrpcAbort
from deployments.api.proto import characters_pb2 as pb
from deployments.api.requests import ApiConfig

MAX_PCM = 4096  # a small max_audio_chunk_bytes, so oversized chunks are cheap to make
DETAILS = re.compile(r"^[a-z_]+: ([A-Za-z_.]+: )?\S")
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED}
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


class Service(CharactersGrpc):
    def __init__(self, sched: Scheduler) -> None:
        self.frontend = SessionFrontend(sched, ApiConfig(events_wait_s=0.05, max_audio_chunk_bytes=MAX_PCM,
                                                         max_duration_s=600))
        self.keys = ApiKeys.from_keys([("be", KEY)])


def run(coro: Any, timeout_s: float = 10.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def assert_refusal(ctx: Context) -> None:
    assert ctx.code in REFUSALS, (ctx.code, ctx.details)
    assert DETAILS.match(ctx.details), ctx.details


# ----------------------------------------------------------------------------------------- CreateSession

durations = st.none() | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -1.0, 1.0, 600.0, 601.0])
outputs = st.none() | st.builds(
    pb.Output, kind=st.sampled_from(["", "null", "file", "livekit", "rtmp"]) | st.text(max_size=20),
    path=st.sampled_from(["", "a.mp4", "../x.mp4", "/etc/x.mp4", "a/./b.mp4"]) | st.text(max_size=40))
creates = st.fixed_dictionaries({
    "image": image_files(), "preset": st.sampled_from(["", "tiny", "57b"]) | st.text(max_size=80),
    "max_duration_s": durations, "output": outputs,
    "seed": st.none() | st.integers(-(2**63), 2**63 - 1)})


@SETTINGS
@given(fields=creates, auth=st.sampled_from(["ok", "none", "wrong"]))
def test_create_session_fuzz(fields: dict[str, Any], auth: str) -> None:
    sched = Scheduler()
    metadata = {"ok": None, "none": [], "wrong": [("authorization", "Bearer wrong-key-0123456789")]}[auth]
    ctx = Context(metadata)
    request = pb.CreateSessionRequest(**{k: v for k, v in fields.items() if v is not None})
    reply = run(Service(sched).CreateSession(request, ctx))  # type: ignore[arg-type]
    if ctx.code is None:
        assert auth == "ok" and set(sched.infos) == {reply.id}, (reply, sched.infos)
        d = fields["max_duration_s"]
        assert d is None or (math.isfinite(d) and 0 < d <= 600), d
    else:
        assert_refusal(ctx)
        assert not sched.infos, ctx.details
        assert auth == "ok" or ctx.code == grpc.StatusCode.UNAUTHENTICATED


# ----------------------------------------------------------------------------------------- StreamAudio

chunks = st.builds(
    pb.AudioChunk,
    session_id=st.sampled_from(["", "s1", "s1", "other"]),
    pcm=st.binary(max_size=64) | st.integers(0, 2 * MAX_PCM).map(lambda n: b"\1" * n),
    sample_rate=st.sampled_from([0, 7999, 8000, 16000, 48000, 48001]) | st.integers(-(2**31), 2**31 - 1),
    channels=st.sampled_from([0, 1, 2, 3]) | st.integers(-(2**31), 2**31 - 1),
    clear=st.booleans(),
    after_seq=st.integers(0, 2**64 - 1))


def expected(stream: list[pb.AudioChunk]) -> tuple[str | None, list[tuple[bytes, int, int]]]:
    """The refusal's field (None: no refusal) and the audio the scheduler must have got, from the proto's rules."""
    if not stream or not stream[0].session_id:
        return "session_id", []
    if stream[0].session_id != "s1":
        return "session_id", []  # NOT_FOUND, named by id
    pushed = []
    for c in stream:
        if c.session_id and c.session_id != "s1":
            return "session_id", pushed
        if c.pcm:
            channels = c.channels or 1
            if not 8000 <= c.sample_rate <= 48000:
                return "sample_rate", pushed
            if channels not in (1, 2):
                return "channels", pushed
            if len(c.pcm) > MAX_PCM or len(c.pcm) % (2 * channels):
                return "pcm", pushed
            pushed.append((c.pcm, c.sample_rate, channels))
    return None, pushed


@SETTINGS
@given(stream=st.lists(chunks, max_size=6))
def test_stream_audio_fuzz(stream: list[pb.AudioChunk]) -> None:
    sched = Scheduler()
    svc = Service(sched)
    ctx = Context()

    async def go() -> tuple[str | None, list[pb.SessionEvent]]:
        await sched.create_session(spec_of("s1"))
        sent = asyncio.Event()

        async def requests() -> Any:
            for c in stream:
                yield c
            sent.set()

        events: list[pb.SessionEvent] = []

        async def consume() -> None:
            async for ev in svc.StreamAudio(requests(), ctx):  # type: ignore[arg-type]
                events.append(ev)

        task = asyncio.create_task(consume())
        waiter = asyncio.create_task(sent.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED, timeout=5.0)
        waiter.cancel()
        await asyncio.sleep(0.01)
        ended_by_us = not task.done()
        if ended_by_us:  # every chunk was taken and the client half-closed: ending the session ends the stream
            assert not sched.infos["s1"].status.terminal
            await sched.end_session("s1")
        refused = None
        try:
            await asyncio.wait_for(task, 2.0)
        except GrpcAbort:
            refused = ctx.details
        if ended_by_us and stream[0].after_seq < len(sched.log["s1"]):
            assert events[-1].status == pb.SESSION_STATUS_ENDED, events
        return refused, events

    refused, _ = run(go())
    field, pushed = expected(stream)
    assert sched.pushed == pushed
    if field is None:
        assert refused is None and ctx.code is None, ctx.details
    else:
        assert refused is not None, (field, stream)
        assert_refusal(ctx)
        assert f": {field}: " in ctx.details or (field == "session_id" and ctx.code == grpc.StatusCode.NOT_FOUND), (
            field, ctx.details)
        assert not sched.infos["s1"].status.terminal  # a bad chunk refuses the stream, not the session


def spec_of(session_id: str) -> Any:
    import numpy as np

    from deployments.types import SessionSpec

    return SessionSpec(session_id, np.zeros((176, 272, 3), np.uint8), api_key_id="be")  # the stream's key owns it
