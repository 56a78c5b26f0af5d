"""`LiveKitSink`: the `deployments.pipeline.workers.MediaSink` protocol (`write(frames, pcm)` / `close()`) over a
`LiveKitRoom`, for synchronous callers such as the `RoomWorker` actor.

The sink owns a thread that runs the room's asyncio event loop. `start()` blocks until the room is
joined and both tracks are published (or raises `RoomError`); `write()` never blocks: it hands the
chunk to the loop and returns (the chunk loop must not wait on media I/O); `close()` leaves the room,
stops the loop and joins the thread (idempotent; never call it from a handler callback, which runs on
that thread). `ended` / `end_reason` tell whether the room left by itself; `latest_stats` is a
non-blocking snapshot (fps, late chunks, buffer depth, A/V offset) for ChunkReport / telemetry.

Wiring into the session (the lead integrates; nothing here imports Ray):

- `RoomWorker.open(session_id, output, path, session=None)`: for `output.kind == "livekit"` build
  `LiveKitSink(output, MediaFormat(g.width, g.height, g.fps, g.frames_per_chunk), handler,
  max_duration_s=spec.max_duration_s + 5, on_playback=...)` and `start()` it (RoomError -> the
  session fails `start_failed`). `handler` forwards to the `SessionActor` (pass its handle from
  `SessionActor._prepare`: `ray.get_runtime_context().current_actor`):
      push_audio(pcm16, rate, ch) -> session.push_audio.remote(sid, pcm16, rate, ch)  (always 16000, 1)
      clear_audio()               -> session.clear_audio.remote(sid)   (an ObjectRef[int]: awaited, <= 1 s)
      end_session(reason)         -> session.stop.remote(sid, reason)  (end_call, agent_left, room_empty, ...)
  The chunk loop then ends with that reason and `SessionActor._close_room` closes the sink.
- `RoomWorker.publish`: `self.sink.write(frames.frames, inp.pcm)` as for the other sinks. Exact segment
  accounting needs no change (agent speech never contains exact zeros, padding does); if ChunkInput
  gains the count of queued samples `AudioBuffer.take` used, pass it as `speech_samples=`.
- DELETE / max duration / failure: the session ends as today and `RoomWorker.close()` -> `sink.close()`.
- `on_playback(SegmentEvent)` (on the room's thread): forward as SessionEvent kinds "playback_started"
  / "playback_finished"; `event.latency_s` on starts is agent speech -> first frame published.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

import numpy as np

from characters.pacing import PacingConfig, SegmentEvent
from deployments.livekit.config import LiveKitOutput, MediaFormat
from deployments.livekit.room import AgentAudioHandler, LiveKitRoom, RoomError, RoomStats

log = logging.getLogger(__name__)
T = TypeVar("T")
ONSET_WAIT_S = 0.2  # an onset write waits this long for the room's loop to say what it cut


class LiveKitSink:
    """Publishes a session's chunks into a LiveKit room from any thread."""

    def __init__(self, output: LiveKitOutput, media: MediaFormat, handler: AgentAudioHandler | None = None, *,
                 pacing: PacingConfig | None = None, max_duration_s: float | None = None,
                 start_timeout_s: float = 15.0, close_timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_playback: Callable[[SegmentEvent], None] | None = None, poster: np.ndarray | None = None) -> None:
        self.output, self.media, self.handler, self.on_playback = output, media, handler, on_playback
        self.poster = poster  # the video track's first frame, until the first chunk (`MediaPublisher`)
        self.pacing, self.max_duration_s, self.clock = pacing, max_duration_s, clock
        self.start_timeout_s, self.close_timeout_s = start_timeout_s, close_timeout_s
        self.room: LiveKitRoom | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self.dropped_writes = 0

    def start(self) -> None:
        """Start the loop thread, join the room and publish; raises RoomError (after cleaning up) on failure."""
        if self._thread is not None:
            raise RuntimeError("LiveKitSink.start() called twice; create a new sink per session")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=f"livekit-{self.output.room_name[:32]}",
                                        daemon=True)
        self._thread.start()
        try:
            self._call(self._start_room(), self.start_timeout_s)
        except FutureTimeout as e:
            self.close()
            raise RoomError(f"joining room {self.output.room_name!r} at {self.output.url} took over "
                            f"{self.start_timeout_s:g} s; check that the server is reachable") from e
        except BaseException:
            self.close()
            raise

    def write(self, frames: np.ndarray, pcm: np.ndarray, speech_samples: int | None = None,
              submitted_at: float | None = None, onset: bool = False, early_s: float = 0.0,
              continues: bool = False) -> float:
        """Queue chunk k's (F, H, W, 3) uint8 frames and its (n,) float32 audio for playout (copied).
        `speech_samples`: how many leading samples are agent speech (inferred when None); `submitted_at`: when
        the chunk loop took that audio (monotonic, this node), for segment starts; `early_s`: how long before its
        boundary (`Playout.push`). Never blocks, but for an
        `onset` (`Playout.push`): that one waits for the room's loop to queue it (at most `ONSET_WAIT_S`) and
        returns the seconds of idle content cut ahead of it, which the chunk loop must follow."""
        h, w = self.media.height, self.media.width
        if frames.ndim != 4 or frames.shape[1:] != (h, w, 3) or frames.dtype != np.uint8 or pcm.ndim != 1 \
                or pcm.dtype != np.float32:
            raise ValueError(f"LiveKitSink.write takes (F, {h}, {w}, 3) uint8 frames and (n,) float32 16 kHz audio, "
                             f"got {frames.shape} {frames.dtype} and {pcm.shape} {pcm.dtype}")
        loop, room = self._loop, self.room
        if loop is None or room is None or self._closed or loop.is_closed():
            self.dropped_writes += 1
            return 0.0
        # copies (~0.6 MB per tiny chunk): a compiled graph's channel may reuse the buffers the arrays view
        args = (room, np.array(frames), np.array(pcm), speech_samples, submitted_at, early_s, continues, onset)
        if not onset:
            loop.call_soon_threadsafe(self._push, *args)
            return 0.0
        done: Future[float] = Future()

        def push() -> None:
            if done.set_running_or_notify_cancel():
                done.set_result(self._push(*args))
            else:  # the writer stopped waiting: it will not follow a cut, so there must be none
                self._push(*args[:-1], False)

        loop.call_soon_threadsafe(push)
        try:
            return done.result(ONSET_WAIT_S)
        except FutureTimeout:
            if not done.cancel():  # it is being pushed right now: its answer comes at once
                return done.result()
            log.warning("room %r: an onset chunk waited over %g s for the room's loop; played as a plain chunk",
                        self.output.room_name, ONSET_WAIT_S)
            return 0.0

    @property
    def ended(self) -> bool:
        return self.room is not None and self.room.ended.is_set()

    @property
    def end_reason(self) -> str | None:
        return None if self.room is None else self.room.end_reason

    @property
    def latest_stats(self) -> RoomStats | None:
        """The room's stats as of at most 0.5 s ago; never blocks (use it from the chunk loop)."""
        return None if self.room is None else self.room.snapshot

    def stats(self, timeout_s: float = 2.0) -> RoomStats | None:
        """A snapshot taken on the loop (None before start or after close)."""
        room = self.room
        if room is None or room.publisher is None or self._closed:
            return None

        async def snap() -> RoomStats:
            return room.stats()

        return self._call(snap(), timeout_s)

    def close(self) -> None:
        """Leave the room, stop the loop, join the thread. Idempotent; safe after a failed start."""
        if self._closed:
            return
        if self._thread is not None and threading.current_thread() is self._thread:
            raise RuntimeError("LiveKitSink.close() called on the room's own thread (from a handler callback?); "
                               "that would deadlock: close it from another thread")
        self._closed = True
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if self.room is not None:
            try:
                self._call(self.room.aclose(), self.close_timeout_s)
            except (FutureTimeout, RuntimeError, OSError) as e:
                log.warning("closing room %r: %s", self.output.room_name, type(e).__name__)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(self.close_timeout_s)
        if not thread.is_alive():
            loop.close()

    # ----------------------------------------------------------------------------- loop thread
    def _run_loop(self) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        pending = asyncio.all_tasks(self._loop)  # tasks of the rtc SDK that outlive the room
        for task in pending:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))

    async def _start_room(self) -> None:
        room = self.room = LiveKitRoom(self.output, self.media, self.handler, pacing=self.pacing,
                                       max_duration_s=self.max_duration_s, clock=self.clock,
                                       on_playback=self.on_playback, poster=self.poster)
        try:
            await room.start()
        except BaseException:  # a failure or the start timeout's cancellation: leave nothing behind
            await room.aclose()
            raise

    def _push(self, room: LiveKitRoom, frames: np.ndarray, pcm: np.ndarray, speech_samples: int | None,
              submitted_at: float | None, early_s: float, continues: bool, onset: bool) -> float:
        try:
            return room.push_chunk(frames, pcm, speech_samples, submitted_at, onset, early_s, continues)
        except ValueError as e:
            self.dropped_writes += 1
            log.error("chunk refused by the playout: %s", e)
            return 0.0

    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        assert self._loop is not None
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout_s)
        except FutureTimeout:
            fut.cancel()
            raise
