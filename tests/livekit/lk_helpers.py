"""Helpers of the `livekit` tests: the session's audio queue, a real-time chunk generator, a viewer."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Any

import numpy as np
from livekit import api, rtc
from livekit.rtc._ffi_client import FfiClient
from livekit.rtc._proto import ffi_pb2 as proto_ffi
from livekit.rtc._proto import video_frame_pb2 as proto_video_frame

from characters.audio import chunk_sample_range, convert_pcm, pcm16_to_float
from deployments.livekit import LiveKitRoom, LiveKitServer
from deployments.sessions.runner import AudioBuffer

W, H, FPS, F, SR = 272, 176, 24, 4, 16000
CHUNK_S = F / FPS


def token(server: LiveKitServer, room: str, identity: str, *, kind: Any = None,
          attributes: dict[str, str] | None = None) -> str:
    t = (api.AccessToken(server.api_key, server.api_secret).with_identity(identity).with_name(identity)
         .with_grants(api.VideoGrants(room_join=True, room=room)))
    if kind is not None:
        t = t.with_kind(kind)
    if attributes:
        t = t.with_attributes(attributes)
    return t.to_jwt()


class FakeSession:
    """The session's side of the agent audio path, on the session's own `AudioBuffer` (exact samples per
    chunk, silence when dry, clear returns the samples dropped), recording what arrived."""

    def __init__(self) -> None:
        self.buffer = AudioBuffer(F, SR, FPS)
        self.received: list[bytes] = []
        self.ended: list[str] = []
        self.clears: list[tuple[float, int]] = []

    @property
    def queued(self) -> int:
        return round(self.buffer.queued_s * SR)

    def push_audio(self, pcm16: bytes, sample_rate: int, channels: int) -> None:
        self.received.append(pcm16)
        self.buffer.push(convert_pcm(pcm16_to_float(pcm16), sample_rate, channels))

    def clear_audio(self) -> int:
        dropped = self.buffer.clear()
        self.clears.append((time.monotonic(), dropped))
        return dropped

    def end_session(self, reason: str) -> None:
        self.ended.append(reason)

    def take(self, k: int) -> np.ndarray:
        return self.buffer.take(k)


def frames_for(k: int, pcm: np.ndarray) -> np.ndarray:
    """Synthetic frames: a bar moving one column per frame; brightness follows the audio (a 'mouth')."""
    frames = np.full((F, H, W, 3), 40, np.uint8)
    level = int(min(1.0, float(np.abs(pcm).mean()) * 8) * 200)
    for i in range(F):
        x = (k * F + i) % W
        frames[i, :, x:x + 4] = 255
        frames[i, H // 2:, :, 0] = 40 + level
    return frames


class Generator:
    """Stands in for the chunk loop: takes chunk k's audio from the session at t0 + k * T and delivers its
    frames `depth` chunks later (the pipeline's latency), in real time. `tone`: every chunk's window
    is a 440 Hz tone instead (continuous audio without an agent)."""

    def __init__(self, room: LiveKitRoom, session: FakeSession, depth: int = 2, tone: bool = False) -> None:
        self.room, self.session, self.depth, self.tone = room, session, depth, tone
        self.chunks = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        inflight: deque[tuple[int, np.ndarray]] = deque()
        k = 0
        while True:
            if self.tone:
                s0, s1 = chunk_sample_range(k, F)
                pcm = (0.3 * np.sin(2 * np.pi * 440 * np.arange(s0, s1) / SR)).astype(np.float32)
                pcm[pcm == 0] = 1 / 32768
            else:
                pcm = self.session.take(k)
            inflight.append((k, pcm))
            if len(inflight) > self.depth:
                j, p = inflight.popleft()
                self.room.push_chunk(frames_for(j, p), p)
                self.chunks += 1
            k += 1
            await asyncio.sleep(max(0.0, t0 + k * CHUNK_S - loop.time()))


class DeepVideoStream(rtc.VideoStream):
    """A VideoStream whose native receive queue holds 16 frames instead of 1: on these shared 2-core
    machines the viewer's loop can stall for a frame time, and the default queue would drop a frame
    that the server did deliver (the viewer measures delivery, not its own scheduling)."""

    def _create_owned_stream(self) -> Any:
        assert self._track is not None
        req = proto_ffi.FfiRequest()
        new = req.new_video_stream
        new.track_handle = self._track._ffi_handle.handle
        new.type = proto_video_frame.VideoStreamType.VIDEO_STREAM_NATIVE
        new.normalize_stride = True
        new.queue_size_frames = 16
        return FfiClient.instance.request(req).new_video_stream.stream


class Viewer:
    """A participant that subscribes to the character and records what arrives, with arrival times."""

    def __init__(self, server: LiveKitServer, room_name: str, identity: str = "viewer") -> None:
        self.server, self.room_name, self.identity = server, room_name, identity
        self.room = rtc.Room()
        self.video: list[tuple[float, int, int]] = []  # (time, width, height)
        self.audio: list[tuple[float, np.ndarray]] = []  # (time, int16 samples)
        self._streams: list[Any] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.subscribed = asyncio.Event()

    async def start(self) -> None:
        self.room.on("track_subscribed", self._on_track)
        await self.room.connect(self.server.url, token(self.server, self.room_name, self.identity))

    def _on_track(self, track: rtc.Track, *_: Any) -> None:
        if track.kind == rtc.TrackKind.KIND_VIDEO:
            vs = DeepVideoStream(track)
            self._streams.append(vs)
            self._tasks.append(asyncio.create_task(self._video(vs)))
        else:
            aus = rtc.AudioStream(track, sample_rate=SR, num_channels=1)
            self._streams.append(aus)
            self._tasks.append(asyncio.create_task(self._audio(aus)))
        if len(self._tasks) == 2:
            self.subscribed.set()

    async def _video(self, stream: rtc.VideoStream) -> None:
        async for ev in stream:
            self.video.append((time.monotonic(), ev.frame.width, ev.frame.height))

    async def _audio(self, stream: rtc.AudioStream) -> None:
        async for ev in stream:
            self.audio.append((time.monotonic(), np.frombuffer(ev.frame.data, np.int16).copy()))

    def fps(self, t0: float, t1: float) -> float:
        return sum(t0 <= t < t1 for t, _, _ in self.video) / (t1 - t0)

    def rms(self, t0: float, t1: float) -> list[float]:
        """RMS (full scale 1.0) of each received audio frame in [t0, t1)."""
        return [float(np.sqrt(np.mean((a.astype(np.float64) / 32768) ** 2))) for t, a in self.audio if t0 <= t < t1]

    async def aclose(self) -> None:
        for s in self._streams:
            await s.aclose()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.room.disconnect()


def speech_heard(heard: np.ndarray, speech: np.ndarray, head_s: float = 1.0, frame_s: float = 0.01,
                 ) -> tuple[float, float]:
    """How much of `speech` (int16, SR) a viewer heard before it was cut off: (the end of the last voiced
    10 ms frame of `speech` that `heard` carries, the start of the first voiced frame it does not), in seconds
    from the start of `speech`. `heard` is everything the viewer received (int16, SR, idle silence around the
    speech); the two are aligned on their energy envelopes over the first `head_s` of speech, which the
    viewer must have heard (Opus changes samples, not the envelope)."""
    n = int(SR * frame_s)

    def envelope(x: np.ndarray) -> np.ndarray:
        k = x.size // n
        return np.sqrt(np.mean((x[: k * n].reshape(k, n).astype(np.float64) / 32768) ** 2, axis=1))

    eh, es = envelope(heard), envelope(speech)
    head = es[: int(head_s / frame_s)]
    if eh.size < head.size:
        raise AssertionError(f"the viewer heard {heard.size / SR:.2f} s, less than the {head_s} s head of the speech")
    score = np.correlate(eh - eh.mean(), head - head.mean(), mode="valid")
    lag = int(np.argmax(score))
    voiced, loud = es > 0.01, eh > 0.004  # speech is ~0.05-0.2 RMS; the silence after a clear is ~0
    heard_up_to, missing_from = 0, es.size
    for i in np.flatnonzero(voiced):
        if lag + i < eh.size and loud[lag + i]:
            heard_up_to = i + 1
        elif i >= heard_up_to:
            later = [j for j in np.flatnonzero(voiced) if j >= i][:10]
            if not any(lag + j < eh.size and loud[lag + j] for j in later):  # cut here, not a dropout
                missing_from = int(i)
                break
    return heard_up_to * frame_s, missing_from * frame_s
