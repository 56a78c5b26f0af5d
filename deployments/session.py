"""One session: its audio, its lifecycle and stats (plain classes), and `SessionActor`, the thin Ray
actor that starts it on a slot and drives its chunk loop.

Lifecycle (the scheduler owns QUEUED and STARTING; the session actor the rest):

    QUEUED -> STARTING -> READY -> RUNNING -> ENDED (deleted | max_duration | ...) / FAILED (reason)

READY: every rank started, the reference in the sink, the graph compiled. RUNNING: the first chunk
was published. A failure at any point ends the session FAILED with a machine-readable reason
(actor_died, chunk_timeout, worker_error, start_failed, ...) and the slot is then removed.

Audio: agent PCM is converted to float32 mono 16 kHz on arrival and queued; chunk k takes exactly
the samples of `chunk_sample_range(k)` from the queue, padded with silence when the queue runs dry
(the character idles; generation never stops). `clear_audio` drops the queue (interruption).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from ray.exceptions import RayError

from characters.audio import chunk_sample_range, convert_pcm, pcm16_to_float
from characters.config import SessionConfig
from deployments.pipeline import (
    ActorCallPipeline,
    ChunkFailure,
    CompiledPipeline,
    Pipeline,
    Workers,
    classify,
    run_chunk_loop,
)
from deployments.settings import ServiceConfig
from deployments.types import SessionSpec, SessionStats, SessionStatus
from deployments.workers import ChunkReport

LATENCY_WINDOW = 120  # chunks kept for the latency percentiles (~20 s)


class AudioBuffer:
    """Queued agent audio (float32 mono 16 kHz), taken chunk by chunk with exact sample counts. Thread-safe."""

    def __init__(self, frames_per_chunk: int, sample_rate: int = 16000, fps: int = 24, max_s: float = 120.0) -> None:
        self.frames_per_chunk, self.sample_rate, self.fps = frames_per_chunk, sample_rate, fps
        self.max_samples = int(max_s * sample_rate)
        self._parts: deque[np.ndarray] = deque()
        self._queued = 0
        self._lock = threading.Lock()

    @property
    def queued_s(self) -> float:
        return self._queued / self.sample_rate

    def push(self, pcm: np.ndarray) -> None:
        if pcm.ndim != 1 or pcm.dtype != np.float32:
            raise ValueError(f"audio must be 1-D float32 mono PCM at {self.sample_rate} Hz, "
                             f"got {pcm.shape} {pcm.dtype}")
        with self._lock:
            if self._queued + pcm.size > self.max_samples:
                raise ValueError(
                    f"audio queue would hold {(self._queued + pcm.size) / self.sample_rate:.1f} s, above the limit "
                    f"of {self.max_samples / self.sample_rate:.0f} s; send audio at most as fast as real time"
                )
            self._parts.append(pcm)
            self._queued += pcm.size

    def clear(self) -> int:
        """Drop everything queued (an interruption); returns the samples dropped."""
        with self._lock:
            dropped, self._queued = self._queued, 0
            self._parts.clear()
            return dropped

    def take(self, k: int) -> np.ndarray:
        """Chunk k's samples, exactly `chunk_sample_range(k)` long: queued audio first, then silence."""
        start, end = chunk_sample_range(k, self.frames_per_chunk, self.sample_rate, self.fps)
        out = np.zeros(end - start, np.float32)  # (n,)
        filled = 0
        with self._lock:
            while filled < out.size and self._parts:
                part = self._parts[0]
                n = min(part.size, out.size - filled)
                out[filled:filled + n] = part[:n]
                filled += n
                if n == part.size:
                    self._parts.popleft()
                else:
                    self._parts[0] = part[n:]
            self._queued -= filled
        return out


@dataclass(frozen=True)
class EventDraft:
    """A session event before the scheduler numbers it."""

    kind: str
    status: SessionStatus | None = None
    chunk: int | None = None
    detail: str | None = None
    at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Report:
    """What a session tells the scheduler: new events, current stats, and its end once known."""

    events: list[EventDraft]
    stats: SessionStats
    started_at: float | None = None
    terminal: tuple[SessionStatus, str] | None = None


@dataclass(frozen=True)
class Outcome:
    status: SessionStatus  # ENDED or FAILED
    reason: str
    healthy: bool  # may the slot be reset and reused?
    stats: SessionStats


class SessionRunner:
    """The chunk loop of one started session, its status, events and stats. Runs in one thread
    (`run`); `stop`, `report` and the audio buffer are safe to use from others."""

    def __init__(self, session_id: str, cfg: SessionConfig, *, max_duration_s: float, depth: int,
                 fetch_timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        g = cfg.model.generation
        self.session_id, self.depth, self.fetch_timeout_s = session_id, depth, fetch_timeout_s
        self.chunk_s, self.max_duration_s = g.frames_per_chunk / g.fps, max_duration_s
        self.clock, self.wall = clock, wall
        self.audio = AudioBuffer(g.frames_per_chunk, cfg.model.audio.sample_rate, g.fps)
        self.stats = SessionStats()
        self.started_at: float | None = None
        self.terminal: tuple[SessionStatus, str] | None = None
        self._events: list[EventDraft] = []
        self._latency: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._stop_reason: str | None = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self.on_event: Callable[[], None] = lambda: None  # called (any thread) when a status changes

    # ----------------------------------------------------------------------------- any thread
    def stop(self, reason: str) -> None:
        """End the session (first reason wins); the loop notices within one chunk."""
        with self._lock:
            self._stop_reason = self._stop_reason or reason
        self._stopped.set()

    @property
    def stop_reason(self) -> str | None:
        return self._stop_reason

    def report(self) -> Report:
        """New events since the last report, and a snapshot of the stats."""
        with self._lock:
            events, self._events = self._events, []
            stats = replace(self.stats, audio_queued_s=self.audio.queued_s)
        return Report(events, stats, self.started_at, self.terminal)

    def status(self, status: SessionStatus, detail: str | None = None) -> None:
        with self._lock:
            self._events.append(EventDraft("status", status=status, detail=detail, at=self.wall()))
        self.on_event()

    def finish(self, status: SessionStatus, reason: str) -> Outcome:
        """Record the end (once) and return the outcome."""
        with self._lock:
            if self.terminal is None:
                self.terminal = (status, reason)
                self._events.append(EventDraft("status", status=status, detail=reason, at=self.wall()))
            status, reason = self.terminal
        self.on_event()
        return Outcome(status, reason, status is SessionStatus.ENDED, replace(self.stats))

    # ----------------------------------------------------------------------------- the loop thread
    def run(self, make_pipeline: Callable[[], Pipeline]) -> Outcome:
        """Build the pipeline, announce READY, drive the loop until it stops, tear the pipeline down."""
        try:
            pipeline = make_pipeline()
        except ChunkFailure as failure:
            return self.finish(SessionStatus.FAILED, f"start_failed: {failure}")
        try:
            if self._stop_reason is None:
                self.status(SessionStatus.READY)
            result = run_chunk_loop(
                pipeline, session_id=self.session_id, audio=self.audio.take, chunk_s=self.chunk_s, depth=self.depth,
                max_duration_s=self.max_duration_s, fetch_timeout_s=self.fetch_timeout_s, clock=self.clock,
                wait=self._stopped.wait, stop_reason=lambda: self._stop_reason, on_report=self._on_report)
            if result.failure is not None:
                return self.finish(SessionStatus.FAILED, str(result.failure))
            return self.finish(SessionStatus.ENDED, result.reason)
        finally:
            pipeline.close()

    def _on_report(self, report: ChunkReport, submitted_at: float) -> None:
        """Chunk k was published; its latency is submit -> published (the room stamps it on this
        node's monotonic clock, which the whole slot shares: STRICT_PACK)."""
        first = self.started_at is None
        with self._lock:
            if first:
                self.started_at = self.wall()
                self._events.append(EventDraft("status", status=SessionStatus.RUNNING, at=self.started_at))
            s = self.stats
            self._latency.append((report.published_at - submitted_at) * 1e3)
            lat = np.asarray(self._latency)
            s.chunks, s.frames = s.chunks + 1, s.frames + report.frames
            s.late_chunks += report.late
            s.fps = report.delivered_fps
            s.step_ms_p50, s.step_ms_p95 = float(np.percentile(lat, 50)), float(np.percentile(lat, 95))
            detail = f"digest={report.digest} late={int(report.late)}"
            self._events.append(EventDraft("chunk", chunk=report.chunk, detail=detail, at=self.wall()))
        if first:
            self.on_event()


# ------------------------------------------------------------------------------------------ the actor


class SessionActor:
    """Thin Ray actor for one session on one slot: prepares the workers, runs `SessionRunner` in a
    thread, reports to the scheduler. Created by the scheduler inside the slot's placement group."""

    def __init__(self, spec: SessionSpec, cfg: SessionConfig, service: ServiceConfig, workers: Workers,
                 output_path: str | None, scheduler: Any | None) -> None:
        self.spec, self.cfg, self.service, self.workers = spec, cfg, service, workers
        self.output_path, self.scheduler = output_path, scheduler
        self.runner = SessionRunner(spec.session_id, cfg, max_duration_s=spec.max_duration_s,
                                    depth=service.pipeline_depth, fetch_timeout_s=service.chunk_timeout_s)
        self._wake: asyncio.Event | None = None

    def push_audio(self, pcm16: bytes, sample_rate: int, channels: int) -> float:
        """Queue agent audio (16-bit PCM, any rate and channel count); returns seconds queued."""
        self.runner.audio.push(convert_pcm(pcm16_to_float(pcm16), sample_rate, channels))
        return self.runner.audio.queued_s

    def clear_audio(self) -> int:
        return self.runner.audio.clear()

    def stop(self, reason: str) -> None:
        self.runner.stop(reason)

    async def run(self) -> Outcome:
        """Start the session on the slot, stream until it ends, and return how it ended."""
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        wake = self._wake
        def ring() -> None:
            loop.call_soon_threadsafe(wake.set)

        self.runner.on_event = ring
        reporter = asyncio.create_task(self._report_loop())
        try:
            try:
                await self._prepare()
            except (RayError, ValueError, OSError) as err:
                outcome = self.runner.finish(SessionStatus.FAILED, f"start_failed: {classify(err)}")
            else:
                outcome = await asyncio.to_thread(self.runner.run, self._make_pipeline)
            outcome = await self._close_room(outcome)
        finally:
            reporter.cancel()
            await asyncio.gather(reporter, return_exceptions=True)
        await self._send(self.runner.report())
        return outcome

    async def _prepare(self) -> None:
        w, sid = self.workers, self.spec.session_id
        reference = w.decoder.encode_reference.remote(sid, self.spec.image)
        await asyncio.gather(*(d.start.remote(sid, reference, self.spec.seed) for d in w.dits),
                             w.decoder.start.remote(sid), w.room.open.remote(sid, self.spec.output, self.output_path))

    def _make_pipeline(self) -> Pipeline:
        if self.service.graph == "actor_calls":
            return ActorCallPipeline(self.workers)
        g = self.cfg.model.generation
        frame_bytes = g.frames_per_chunk * g.height * g.width * 3
        return CompiledPipeline(self.workers, depth=self.service.pipeline_depth,
                                buffer_bytes=max(1 << 20, 2 * frame_bytes),
                                teardown_timeout_s=self.service.teardown_timeout_s)

    async def _close_room(self, outcome: Outcome) -> Outcome:
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.workers.room.close.remote().future()),
                                   self.service.chunk_timeout_s)
        except (RayError, TimeoutError, OSError) as err:
            if outcome.healthy:
                return self.runner.finish(SessionStatus.FAILED, f"room_close_failed: {classify(err)}")
            return replace(outcome, healthy=False)
        return outcome

    async def _report_loop(self) -> None:
        assert self._wake is not None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.service.report_interval_s)
            self._wake.clear()
            await self._send(self.runner.report())

    async def _send(self, report: Report) -> None:
        if self.scheduler is None:
            return
        with contextlib.suppress(RayError):  # the scheduler is gone: keep streaming, nobody listens
            await self.scheduler.report.remote(self.spec.session_id, report)
