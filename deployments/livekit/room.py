"""`LiveKitRoom`: one character in one LiveKit room, speaking the LiveKit Agents avatar protocol.

An async component: `start()` joins (the given token, or one minted from the API key), publishes the
camera and microphone tracks at once and starts its tasks; `aclose()` leaves and cancels and awaits
every task it owns. Everything runs on one event loop (the caller's; `LiveKitSink` runs one in a
thread of its own for synchronous callers).

Agent audio path: each `lk.audio_stream` byte stream is one speech segment; segments are read one at a
time, in arrival order. Their PCM is decoded to 16 kHz mono 16-bit (`AgentAudioDecoder`) and handed to
`handler.push_audio(pcm16, 16000, 1)`; the playout's ledger records it (`Playout.speech_sent`), so
that the frames generated from it start and finish the segment (`lk.playback_started`,
`lk.playback_finished`). Pushes go in batches, a chunk's window at a time (`deployments.livekit.outbox`). A
stream whose trailer was lost ends when idle for `STREAM_IDLE_TIMEOUT_S`,
or for `SUPERSEDED_GRACE_S` once the next stream has begun.

Interruption: RPC `lk.clear_buffer` from the agent -> the rest of the current stream is discarded,
`handler.clear_audio()` drops the session's queued audio (it returns the samples dropped, maybe as an
awaitable), the playout blanks every chunk made from the interrupted speech and the audio source's
queue is flushed, then each unfinished segment is reported `interrupted=true`. Timing (the contract the
tests check): `lk.playback_finished` leaves as soon as `clear_audio` answers (at most `CLEAR_TIMEOUT_S`;
~10 ms on loopback; the agent gives up after 2 s); the character's audio stops at once (the audio source is
flushed and muted on the clear itself, before `clear_audio` answers, and unmuted once the playout has dropped
the interrupted speech); the video holds
the last frame until the first chunk generated after the clear, which plays on its original schedule:
about (chunks in flight + jitter buffer) chunk durations later, ~0.5-0.7 s with 2 in flight.

Leaving: on a reliable data message `{"type": "END_CALL"}`, when the agent participant leaves (or, with
no agent identity, the last remote participant), when the server disconnects us, at `max_duration_s`,
or on `aclose()`. All but `aclose()` call `handler.end_session(reason)` first (reasons: end_call,
agent_left, room_empty, room_disconnected, max_duration). Being removed from the room through the server API
is end_call too: LiveKit Agents' `AvatarSession.aclose()` removes the avatar right after sending END_CALL, and
the removal may reach us first.

`on_playback(event)` observes each segment's start (with its latency: speech handed to the session ->
first frame shown) and finish, e.g. for the session's event log and metrics.

Handler calls run on the room's loop and must not block: return at once (a Ray `.remote()` returns
an ObjectRef, which is awaitable; the room awaits `clear_audio`'s result for at most
`CLEAR_TIMEOUT_S`, and logs failures of the others).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from livekit import rtc
from livekit.rtc.participant import PublishTrackError

from characters.pacing import PacingConfig, PlayoutStats, SegmentEvent
from deployments.livekit.config import LiveKitOutput, MediaFormat
from deployments.livekit.outbox import SpeechOutbox
from deployments.livekit.protocol import (
    AUDIO_STREAM_TOPIC,
    RPC_CLEAR_BUFFER,
    RPC_PLAYBACK_FINISHED,
    RPC_PLAYBACK_STARTED,
    SAMPLE_RATE,
    AgentAudioDecoder,
    ProtocolError,
    is_end_call,
    playback_finished_payload,
    redact,
    redact_livekit_logs,
    stream_format,
)
from deployments.livekit.publisher import MediaPublisher, check_poster

log = logging.getLogger(__name__)
redact_livekit_logs()

STREAM_IDLE_TIMEOUT_S = 10.0
SUPERSEDED_GRACE_S = 0.5
CLEAR_TIMEOUT_S = 1.0
RPC_ATTEMPTS = 3
RPC_DRAIN_S = 1.0  # on leaving, notifications to the agent already queued get this long to be answered
SNAPSHOT_INTERVAL_S = 0.5


class AgentAudioHandler(Protocol):
    """Where agent speech goes (the session's audio queue). Called on the room's loop; never block."""

    def push_audio(self, pcm16: bytes, sample_rate: int, channels: int) -> object: ...

    def clear_audio(self) -> int | Awaitable[int]: ...  # samples dropped from the queue

    def end_session(self, reason: str) -> object: ...


class RoomError(RuntimeError):
    """Joining or publishing failed; the message says where and what to check."""


@dataclass(frozen=True)
class RoomStats:
    connected: bool
    end_reason: str | None
    segments: int  # speech segments received
    speech_s: float  # agent speech handed to the session
    clears: int
    playout: PlayoutStats


class LiveKitRoom:
    def __init__(self, output: LiveKitOutput, media: MediaFormat, handler: AgentAudioHandler | None = None, *,
                 pacing: PacingConfig | None = None, max_duration_s: float | None = None,
                 connect_timeout_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 on_playback: Callable[[SegmentEvent], None] | None = None, poster: np.ndarray | None = None) -> None:
        self.output, self.media, self.handler, self.on_playback = output, media, handler, on_playback
        check_poster(poster, media)
        self.poster = poster  # the video track's first frame (`MediaPublisher`)
        self.max_duration_s, self.connect_timeout_s, self.clock = max_duration_s, connect_timeout_s, clock
        self.pacing = pacing
        self.room: rtc.Room | None = None
        self.publisher: MediaPublisher | None = None
        self.agent_identity = output.agent_identity
        self.end_reason: str | None = None
        self.ended = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()  # workers: cancelled on leave
        self._pending: set[asyncio.Task[Any]] = set()  # awaited handler results: given time to finish on close
        self._leaving: asyncio.Task[None] | None = None
        self._streams: asyncio.Queue[tuple[rtc.ByteStreamReader, str]] = asyncio.Queue()
        self._superseded = asyncio.Event()
        self._current: str | None = None  # segment being read
        self._cleared: set[str] = set()  # segments interrupted (their remaining bytes are discarded)
        self._rpcs: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self._rpcs_idle = asyncio.Event()  # no notification queued or awaiting its answer
        self._rpcs_idle.set()
        self._started_unsupported = False
        self._seen_remote = False
        self._timer: asyncio.TimerHandle | None = None
        self._n = {"segments": 0, "samples": 0, "clears": 0}
        push = None if handler is None else (lambda pcm16: handler.push_audio(pcm16, SAMPLE_RATE, 1))
        self._outbox = SpeechOutbox(push, self._delivered, spawn=lambda c, name: self._spawn(c, name, pending=True),
                                    batch_samples=media.sample_rate * media.frames_per_chunk // media.fps)
        self.snapshot: RoomStats | None = None  # refreshed every SNAPSHOT_INTERVAL_S: read it from any thread

    # ----------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Join, publish both tracks, register the protocol handlers, start the tasks."""
        room = self.room = rtc.Room()
        room.on("data_received", self._on_data)
        room.on("participant_connected", self._on_participant_connected)
        room.on("participant_disconnected", self._on_participant_disconnected)
        room.on("disconnected", self._on_disconnected)
        room.register_byte_stream_handler(AUDIO_STREAM_TOPIC, self._on_stream)
        try:
            await room.connect(self.output.url, self.output.join_token(),
                               rtc.RoomOptions(auto_subscribe=False, connect_timeout=self.connect_timeout_s))
            room.local_participant.register_rpc_method(RPC_CLEAR_BUFFER, self._on_clear_buffer)  # before publishing:
            # the agent sends no audio (so no clear) before the video track is published
            self.publisher = MediaPublisher(room, self.media, self.pacing, on_event=self._on_segment_event,
                                            clock=self.clock, poster=self.poster)
            await self.publisher.start()
        except (rtc.ConnectError, PublishTrackError, TimeoutError, RuntimeError) as e:
            await self.aclose()
            raise RoomError(f"could not join room {self.output.room_name!r} at {self.output.url} and publish "
                            f"({type(e).__name__}: {redact(str(e))}); check the URL, that the token grants roomJoin, "
                            "canPublish and canPublishData for that room, and that it has not expired") from e
        self._seen_remote = bool(room.remote_participants)
        for coro, name in ((self._read_segments(), "segments"), (self._send_rpcs(), "rpcs"),
                           (self._refresh_snapshot(), "stats")):
            self._spawn(coro, f"livekit-{name}")
        if self.max_duration_s is not None:
            self._timer = asyncio.get_running_loop().call_later(self.max_duration_s, self._leave, "max_duration")
        log.info("character joined room %r as %r", self.output.room_name, room.local_participant.identity)

    async def aclose(self) -> None:
        """Leave the room and stop everything (idempotent). The handler is not told: the owner closes."""
        if self.end_reason is None:
            self.end_reason = "closed"
        self.ended.set()
        if self._timer is not None:
            self._timer.cancel()
        self._outbox.close()
        if self._leaving is not None:
            await self._leaving
        await self._disconnect()
        pending, self._pending = list(self._pending), set()
        if pending:
            _, late = await asyncio.wait(pending, timeout=CLEAR_TIMEOUT_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        room, self.room = self.room, None
        if room is not None:
            room.unregister_byte_stream_handler(AUDIO_STREAM_TOPIC)

    def push_chunk(self, frames: np.ndarray, pcm: np.ndarray, speech_samples: int | None = None,
                   submitted_at: float | None = None, onset: bool = False, early_s: float = 0.0,
                   continues: bool = False) -> float:
        """A generated chunk: (F, H, W, 3) uint8 frames and the (n,) float32 16 kHz audio that made them;
        `submitted_at`: when the generator took that audio (the room's clock), for `SegmentEvent.split`; `onset`:
        a speech onset, played at once (`Playout.push`); `continues`: the rest of the chunk pushed last. Returns the
        seconds of idle content cut ahead of it."""
        if self.publisher is not None and not self.ended.is_set():
            return self.publisher.push(frames, pcm, speech_samples, submitted_at, onset, early_s, continues)
        return 0.0

    async def _refresh_snapshot(self) -> None:
        while True:
            self.snapshot = self.stats()
            await asyncio.sleep(SNAPSHOT_INTERVAL_S)

    def stats(self) -> RoomStats:
        assert self.publisher is not None, "stats() before start()"
        return RoomStats(self.room is not None and self.room.isconnected(), self.end_reason,
                         self._n["segments"], self._n["samples"] / SAMPLE_RATE, self._n["clears"],
                         self.publisher.stats())

    # ----------------------------------------------------------------------------- leaving
    def _leave(self, reason: str) -> None:
        """End the session (first reason wins): tell the handler, then leave in the background."""
        if self.ended.is_set():
            return
        self.end_reason = reason
        self.ended.set()
        log.info("character leaves room %r: %s", self.output.room_name, reason)
        if self.handler is not None:
            self._call(self.handler.end_session, reason)
        self._leaving = asyncio.get_running_loop().create_task(self._disconnect(), name="livekit-leave")

    async def _disconnect(self) -> None:
        """Stop the workers and the publisher, leave the room (idempotent; `aclose` awaits it). Notifications
        to the agent already on their way are answered first (at most RPC_DRAIN_S): one cancelled while it
        waits for its answer leaves the answer to arrive for a request nobody holds (the SDK logs it)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._rpcs_idle.wait(), RPC_DRAIN_S)
        tasks, self._tasks = list(self._tasks), set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.publisher is not None:
            await self.publisher.aclose()
        if self.room is not None and self.room.isconnected():
            try:
                await self.room.disconnect()
            except (RuntimeError, OSError) as e:  # leaving must not fail the close
                log.warning("leaving room %r failed: %s", self.output.room_name, e)

    def _on_data(self, packet: rtc.DataPacket) -> None:
        sender = packet.participant.identity if packet.participant is not None else None
        if is_end_call(packet.data) and (self.agent_identity is None or sender == self.agent_identity):
            self._leave("end_call")

    def _on_participant_connected(self, participant: rtc.RemoteParticipant) -> None:
        self._seen_remote = True

    def _on_participant_disconnected(self, participant: rtc.RemoteParticipant) -> None:
        if self.agent_identity is not None:
            if participant.identity == self.agent_identity:
                self._leave("agent_left")
        elif self.room is not None and self._seen_remote and not self.room.remote_participants:
            self._leave("room_empty")

    def _on_disconnected(self, reason: Any) -> None:
        removed = reason == rtc.DisconnectReason.PARTICIPANT_REMOVED  # the agent's end of the call (see above)
        self._leave("end_call" if removed else "room_disconnected")

    # ----------------------------------------------------------------------------- agent audio
    def _is_agent(self, identity: str) -> bool:
        if self.agent_identity is None and self.room is not None:
            p = self.room.remote_participants.get(identity)
            if p is not None and p.kind == rtc.ParticipantKind.PARTICIPANT_KIND_AGENT:
                self.agent_identity = identity  # the first agent that speaks is the one we voice
        return identity == self.agent_identity

    def _on_stream(self, reader: rtc.ByteStreamReader, identity: str) -> None:
        if not self._is_agent(identity):
            log.warning("ignored an audio stream from %r: not the agent this character voices", identity)
            return
        if self._current is not None:
            self._superseded.set()  # a new segment while one is open: finish the open one promptly
        self._streams.put_nowait((reader, identity))

    async def _read_segments(self) -> None:
        while True:
            reader, _ = await self._streams.get()
            segment = reader.info.stream_id
            assert self.publisher is not None
            playout = self.publisher.playout
            try:
                playout.speech_open(segment)
            except ValueError as e:
                log.warning("audio stream %s ignored: %s", segment, e)
                continue
            self._n["segments"] += 1
            self._current = segment
            self._superseded.clear()
            try:
                rate, channels = stream_format(reader.info.attributes or {})
                decoder: AgentAudioDecoder | None = AgentAudioDecoder(rate, channels)
            except ProtocolError as e:
                log.warning("audio stream %s refused: %s", segment, e)
                decoder = None
            async for data in self._iter_stream(reader, segment):
                if decoder is not None and segment not in self._cleared:
                    self._send_speech(segment, decoder.decode(data))
            if decoder is not None and segment not in self._cleared:
                self._send_speech(segment, decoder.flush())
            self._current = None
            self._outbox.end(segment)  # ends after its last samples are handed over

    async def _iter_stream(self, reader: rtc.ByteStreamReader, segment: str) -> AsyncIterator[bytes]:
        """The stream's chunks until it closes, is interrupted, or its trailer is lost: idle for
        STREAM_IDLE_TIMEOUT_S, or for SUPERSEDED_GRACE_S once the next stream began (data is ordered: what
        was sent before the next header is already here, so a trailer that is coming comes at once)."""
        it = reader.__aiter__()
        nxt: asyncio.Future[bytes] | None = None
        try:
            while segment not in self._cleared:
                nxt = nxt or asyncio.ensure_future(it.__anext__())
                grace = self._superseded.is_set()
                waiters: list[asyncio.Future[Any]] = [nxt] if grace else [
                    nxt, asyncio.ensure_future(self._superseded.wait())]
                done, _ = await asyncio.wait(waiters, timeout=SUPERSEDED_GRACE_S if grace else STREAM_IDLE_TIMEOUT_S,
                                             return_when=asyncio.FIRST_COMPLETED)
                for waiter in waiters[1:]:
                    waiter.cancel()
                if nxt in done:
                    try:
                        data = nxt.result()
                    except StopAsyncIteration:
                        return
                    nxt = None
                    yield data
                elif not done:
                    log.warning("audio stream %s ended without its trailer (%s)", segment,
                                "superseded" if grace else "idle")
                    return
        finally:
            if nxt is not None:
                nxt.cancel()

    def _send_speech(self, segment: str, pcm16: bytes) -> None:
        self._outbox.add(segment, pcm16)

    def _delivered(self, items: list[tuple[str, bytes | None]]) -> None:
        """The outbox handed these to the session: the playout's ledger records them, in order."""
        assert self.publisher is not None
        playout = self.publisher.playout
        for segment, pcm in items:
            if pcm is not None:
                playout.speech_sent(segment, len(pcm) // 2)
                self._n["samples"] += len(pcm) // 2
            else:
                for event in playout.speech_ended(segment):
                    self._on_segment_event(event)
        self.publisher.wake()

    async def _on_clear_buffer(self, data: rtc.RpcInvocationData) -> str:
        if not self._is_agent(data.caller_identity):
            raise rtc.RpcError(rtc.RpcError.ErrorCode.APPLICATION_ERROR, "clear_buffer is accepted from the agent only")
        assert self.publisher is not None
        at = time.time()  # the interruption, as the session's events date it (the rule: silent from the next frame)
        self._n["clears"] += 1
        if self._current is not None:
            self._cleared.add(self._current)
            self._superseded.set()  # wake the reader: it stops reading the interrupted stream
        self._outbox.drop_speech()  # never handed over
        queued = 0  # streams sent before the clear and not yet read: interrupted before they started
        while not self._streams.empty():
            self._streams.get_nowait()
            queued += 1
        self.publisher.flush_audio()  # silent now, not after the session's answer (a round trip through Ray)
        self.publisher.mute(True)
        try:
            dropped = await self._clear_handler()
            result = self.publisher.playout.clear(dropped)
        finally:
            self.publisher.mute(False)
        if result.flush_audio:
            self.publisher.flush_audio()
        for event in result.events:
            self._on_segment_event(dataclasses.replace(event, at=at))
        for _ in range(queued):
            self._on_segment_event(SegmentEvent("finished", "", 0.0, interrupted=True, at=at))
        self.publisher.wake()
        return "ok"

    async def _clear_handler(self) -> int:
        """Samples the session dropped; unknown (no handler, error, timeout): assume all not yet generated."""
        if self.handler is None:
            return 1 << 62
        try:
            result = self.handler.clear_audio()
            if inspect.isawaitable(result):
                result = await asyncio.wait_for(asyncio.ensure_future(result), CLEAR_TIMEOUT_S)
            return int(result)
        except Exception as e:  # noqa: BLE001 (any failure of the handler: fall back, keep serving)
            log.warning("clear_audio failed (%s); assuming nothing was in flight", type(e).__name__)
            return 1 << 62

    # ----------------------------------------------------------------------------- notifications
    def _on_segment_event(self, event: SegmentEvent) -> None:
        if self.on_playback is not None:
            try:
                self.on_playback(event)
            except Exception as e:  # noqa: BLE001 (an observer must not stop the playout)
                log.warning("on_playback failed: %s: %s", type(e).__name__, e)
        if event.kind == "started":
            if not self._started_unsupported:
                self._notify(RPC_PLAYBACK_STARTED, "")
        else:
            self._notify(RPC_PLAYBACK_FINISHED, playback_finished_payload(event.position_s, event.interrupted))

    def _notify(self, method: str, payload: str) -> None:
        self._rpcs_idle.clear()
        self._rpcs.put_nowait((method, payload))

    async def _send_rpcs(self) -> None:
        """Notifications to the agent, in order; `lk.playback_started` is dropped if the agent lacks it."""
        while True:
            if self._rpcs.empty():
                self._rpcs_idle.set()
            method, payload = await self._rpcs.get()
            if self.room is None or self.agent_identity is None:
                continue
            if method == RPC_PLAYBACK_STARTED and self._started_unsupported:
                continue
            for attempt in range(RPC_ATTEMPTS):
                try:
                    await self.room.local_participant.perform_rpc(destination_identity=self.agent_identity,
                                                                  method=method, payload=payload)
                    break
                except rtc.RpcError as e:
                    if e.code == rtc.RpcError.ErrorCode.UNSUPPORTED_METHOD and method == RPC_PLAYBACK_STARTED:
                        self._started_unsupported = True  # the agent does not wait for playback starts
                        break
                    if attempt == RPC_ATTEMPTS - 1:
                        log.warning("%s to the agent failed after %d attempts: %s", method, RPC_ATTEMPTS, e.message)
                    else:
                        await asyncio.sleep(0.1)

    # ----------------------------------------------------------------------------- helpers
    def _spawn(self, coro: Any, name: str, pending: bool = False) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        (self._pending if pending else self._tasks).add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("room task %s failed: %r", task.get_name(), task.exception())

    def _call(self, fn: Callable[..., object], *args: Any) -> None:
        """Call a handler method; an awaitable result is awaited in the background, its failure logged."""
        try:
            result = fn(*args)
        except Exception as e:  # noqa: BLE001
            log.warning("handler %s failed: %s: %s", getattr(fn, "__name__", fn), type(e).__name__, e)
            return
        if inspect.isawaitable(result):
            self._spawn(self._await_logged(result, getattr(fn, "__name__", "handler")), "livekit-handler", pending=True)

    @staticmethod
    async def _await_logged(result: Awaitable[object], name: str) -> None:
        try:
            await result
        except Exception as e:  # noqa: BLE001
            log.warning("handler %s failed: %s: %s", name, type(e).__name__, e)
