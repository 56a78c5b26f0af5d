"""One session's chunk loop, audio, lifecycle and stats: plain classes, driven by the slot's `SessionActor`
(`deployments.sessions.actor`).

Lifecycle (the scheduler owns QUEUED and STARTING; the session actor the rest):

    QUEUED -> STARTING -> READY -> RUNNING -> ENDED (deleted | max_duration | ...) / FAILED (reason)

READY: every rank started, the reference in the sink, the slot's graph at hand (compiled with the
slot). RUNNING: the first chunk was published. A failure at any point ends the session FAILED with a
machine-readable reason (actor_died, chunk_timeout, worker_error, start_failed, ...) and the slot is
then removed; a session created with `recover` instead goes back to STARTING (detail `recovering:
<reason>`) and resumes on a fresh slot (`deployments.sessions.recovery`).

Audio: agent PCM is converted to float32 mono 16 kHz on arrival and queued; chunk k takes exactly
the samples of `chunk_sample_range(k)` from the queue, padded with silence when the queue runs dry
(the character idles; generation never stops). `clear_audio` drops the queue (interruption). Chunk k
is taken at its boundary, or earlier, as soon as the queue fills its window (`run_chunk_loop`'s early
chunks and speech onsets: the loop waits on the queue, which wakes it on every push).

Stats: `step_ms_p50/p95` are chunk latencies, submit -> published by the room (DiT step, handoff,
decode, publish; pipelined, so up to `pipeline_depth` chunks overlap); `fps` is the room's playout
model's (`deployments.pipeline.output.PlayoutMeter`); `late_chunks`, `buffer_ms` and `av_offset_ms` are the
output's (a LiveKit room's real playout, where a late chunk is a held frame at the viewer; else the
meter's); `stage_ms` the median of each chunk stage (`StageWindow`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from characters.audio import chunk_sample_range
from characters.chunk_policy import ChunkPathConfig, ChunkPolicy
from characters.config import SessionConfig
from characters.pacing import SegmentEvent
from characters.stage_times import CHUNK_STAGES, StageTime
from deployments.pipeline.graph import ChunkFailure, Pipeline
from deployments.pipeline.loop import LoopIO, drive
from deployments.pipeline.messages import ChunkReport
from deployments.sessions.recovery import History, Resume
from deployments.telemetry.session import GpuHandoffs, handoff
from deployments.types import SessionStats, SessionStatus

LATENCY_WINDOW = 120  # chunks kept for the latency percentiles (~20 s)

log = logging.getLogger(__name__)


class AudioBuffer:
    """Queued agent audio (float32 mono 16 kHz), taken chunk by chunk with exact sample counts. Thread-safe."""

    FAST = 2.0  # audio arriving at least this many times faster than real time is a burst (a TTS's)

    def __init__(self, frames_per_chunk: int, sample_rate: int = 16000, fps: int = 24, max_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.frames_per_chunk, self.sample_rate, self.fps, self.clock = frames_per_chunk, sample_rate, fps, clock
        self._since: float | None = None  # when the queue last went from empty to not (the audio's arrival began)
        self._arrived = 0  # samples pushed since then
        self.max_samples = int(max_s * sample_rate)
        self._parts: deque[np.ndarray] = deque()
        self._queued = 0
        self._lock = threading.Lock()
        self.pushed = threading.Event()  # set by every push; cleared by `windows_ready` (the chunk loop waits on it)

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
            if self._queued == 0:
                self._since, self._arrived = self.clock(), 0
            self._parts.append(pcm)
            self._queued += pcm.size
            self._arrived += pcm.size
        self.pushed.set()

    def windows_ready(self, k: int) -> int:
        """Is chunk k's window full? 0: no; 1: yes; 2: yes, and the next one is full too or follows at once (the
        audio arrives at least `FAST` times faster than real time). Clears `pushed` first, so a push after this
        call wakes whoever waits on it."""
        self.pushed.clear()
        with self._lock:
            queued, since, arrived = self._queued, self._since, self._arrived
        n0, n1 = (end - start for start, end in (
            chunk_sample_range(j, self.frames_per_chunk, self.sample_rate, self.fps) for j in (k, k + 1)))
        if queued < n0:
            return 0
        if queued >= n0 + n1:
            return 2
        elapsed = self.clock() - since if since is not None else 0.0
        return 2 if arrived >= self.FAST * elapsed * self.sample_rate else 1

    def drain(self) -> np.ndarray:
        """Take everything queued, as one (n,) float32 array (a recovering session carries it over)."""
        with self._lock:
            parts, self._queued = list(self._parts), 0
            self._parts.clear()
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def clear(self) -> int:
        """Drop everything queued (an interruption); returns the samples dropped."""
        with self._lock:
            dropped, self._queued = self._queued, 0
            self._parts.clear()
            self._since = None
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


class StageWindow:
    """Median ms of each chunk stage over the last `window` chunks, from the times chunks carry
    (`ChunkReport.stages`): a stage's GPU times (CUDA events) when it has any, else its host times;
    `handoff` is DiT end -> decoder start (`deployments.telemetry.session.handoff`), from GPU times on GPUs."""

    def __init__(self, window: int = LATENCY_WINDOW) -> None:
        self.window = window
        self._ms: dict[tuple[str, str], deque[float]] = {}  # (stage, source) -> durations
        self._gpu_handoffs = GpuHandoffs()

    def add(self, stages: Sequence[StageTime], chunk: int) -> None:
        for t in stages:
            self._put(t.stage, t.source, t.duration_ns / 1e6)
        if (h := handoff({t.stage: t for t in stages if t.chunk == chunk and t.source == "host"})) is not None:
            self._put("handoff", "host", (h[1] - h[0]) / 1e6)
        for _, a, b in self._gpu_handoffs.add(stages):
            self._put("handoff", "cuda", (b - a) / 1e6)

    def p50(self) -> dict[str, float]:
        """Stage -> median ms, in pipeline order (CHUNK_STAGES)."""
        out = {stage: float(np.median(ms)) for (stage, source), ms in self._ms.items()
               if source != "host" or (stage, "cuda") not in self._ms}
        order = {stage: i for i, stage in enumerate(CHUNK_STAGES)}
        return {s: round(out[s], 3) for s in sorted(out, key=lambda s: (order.get(s, len(order)), s))}

    def _put(self, stage: str, source: str, ms: float) -> None:
        self._ms.setdefault((stage, source), deque(maxlen=self.window)).append(ms)


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
    resume: Resume | None = None  # a recoverable failure of a `recover` session: where to resume


def playback_event(ev: SegmentEvent, at: float) -> EventDraft:
    """A speech segment's start or finish at the output, as a session event (its detail: machine-readable
    key=value pairs; a start says where its latency went, ms: the wait for the next chunk boundary, compute
    and transfer, the jitter buffer)."""
    if ev.kind == "finished":  # an interrupted one: dated when the clear reached the room
        return EventDraft("playback_finished", detail=f"segment={ev.segment} position_s={ev.position_s:.3f} "
                          f"interrupted={int(ev.interrupted)}", at=ev.at if ev.at is not None else at)
    parts = [f"segment={ev.segment}"]
    if ev.latency_s is not None:
        parts.append(f"latency_ms={ev.latency_s * 1e3:.1f}")
    if (sp := ev.split) is not None:
        parts += [f"chunk={sp.chunk}", f"boundary_ms={sp.boundary_s * 1e3:.1f}", f"compute_ms={sp.compute_s * 1e3:.1f}",
                  f"buffer_ms={sp.buffer_s * 1e3:.1f}", f"shown_at={sp.shown_at:.4f}"]
    return EventDraft("playback_started", detail=" ".join(parts), at=at)


def keeps_real_time(pacing: str, output_kind: str) -> bool:
    """Does the session's loop keep real time? Always for a LiveKit room (viewers play it as it comes);
    otherwise as the service's `pacing` says ("unpaced": back to back, for benchmarks and file renders)."""
    return pacing == "realtime" or output_kind == "livekit"


class SessionRunner:
    """The chunk loop of one started session, its status, events and stats. Runs in one thread
    (`run`); `stop`, `report` and the audio buffer are safe to use from others."""

    def __init__(self, session_id: str, cfg: SessionConfig, *, max_duration_s: float,
                 chunk_path: ChunkPathConfig | None = None, livekit: bool = False,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, audio: AudioBuffer | None = None,
                 on_chunk: Callable[[ChunkReport, float], None] | None = None,
                 history: History | None = None, resume: Resume | None = None, depth: int = 2,
                 fetch_timeout_s: float = 30.0, paced: bool = True, lead_chunks: float = 2.0, onsets: bool = True,
                 preempt: bool = False) -> None:
        """`chunk_path` (the service's) and `livekit` (the output is a LiveKit room) decide the chunk loop's policy;
        without it, the former keywords `depth` .. `preempt` do (kept for one release)."""
        g = cfg.model.generation
        if chunk_path is None:
            chunk_path = ChunkPathConfig(depth=depth, chunk_timeout_s=fetch_timeout_s, run_ahead_chunks=lead_chunks,
                                         onset_slack_s=ChunkPathConfig().onset_slack_s if onsets else None,
                                         preempt_idle=preempt, pacing="realtime" if paced else "unpaced")
            livekit = preempt  # (preemption is for LiveKit outputs)
        self.chunk_path, self.livekit = chunk_path, livekit
        self.session_id, self.depth, self.fetch_timeout_s = session_id, chunk_path.depth, chunk_path.chunk_timeout_s
        self.chunk_s, self.max_duration_s = g.frames_per_chunk / g.fps, max_duration_s
        self.paced = keeps_real_time(chunk_path.pacing, "livekit" if livekit else "")  # False: chunks back to back
        self.clock, self.wall = clock, wall
        self.audio = audio or AudioBuffer(g.frames_per_chunk, cfg.model.audio.sample_rate, g.fps)
        self.stats = SessionStats()
        self.started_at: float | None = None
        self.terminal: tuple[SessionStatus, str] | None = None
        self._events: list[EventDraft] = []
        self._latency: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._speech: deque[float] = deque(maxlen=LATENCY_WINDOW)  # speech segments' start latencies (ms)
        self._stages = StageWindow()
        self._stop_reason: str | None = None
        self.phases: dict[str, float] = {}  # start-up phases (seconds), reported with READY
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self.on_event: Callable[[], None] = lambda: None  # called (any thread) when a status changes
        self.on_chunk = on_chunk  # telemetry: every published chunk's report and submit time (loop thread)
        self.loop_ended_at: float | None = None  # clock() when the chunk loop returned
        self.history = history  # recent audio, for recovery (`recover` sessions)
        # a resumed session: local chunks before `first_chunk` primed the workers; chunk numbers continue
        self.first_chunk = resume.primed if resume else 0
        self.chunk_offset = (resume.chunks - self.first_chunk) if resume else 0
        if resume is not None:
            self.stats = replace(resume.stats)

    # ----------------------------------------------------------------------------- any thread
    def stop(self, reason: str) -> None:
        """End the session (first reason wins); the loop notices within one chunk."""
        with self._lock:
            self._stop_reason = self._stop_reason or reason
        self._stopped.set()
        self.audio.pushed.set()  # the loop may be waiting for audio

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
        """Build the pipeline, announce READY, drive the loop until it stops, tear the pipeline down.

        A failure is announced at once (FAILED within a chunk of it). A normal end is returned but not
        yet announced: the caller closes the output first, then calls `finish`, so a client that sees
        ENDED finds the output complete."""
        t0 = self.clock()
        try:
            pipeline = make_pipeline()
        except ChunkFailure as failure:
            return self.finish(SessionStatus.FAILED, f"start_failed: {failure}")
        self.phases["compile_s"] = self.clock() - t0
        try:
            if self._stop_reason is None:
                self.status(SessionStatus.READY, " ".join(f"{k}={v:.3f}" for k, v in self.phases.items()))
            policy = ChunkPolicy.of(self.chunk_path, chunk_s=self.chunk_s, start=self.clock(),
                                    max_duration_s=self.max_duration_s, first_chunk=self.first_chunk,
                                    livekit=self.livekit, paced=self.paced)
            result = drive(pipeline, policy, LoopIO(
                self.session_id, self._take, self.clock, self._wait, lambda: self._stop_reason, self._on_report,
                self.fetch_timeout_s, self.audio.windows_ready if self.paced else None))
            self.loop_ended_at = self.clock()
            if result.failure is not None:
                return self.finish(SessionStatus.FAILED, str(result.failure))
            outcome = Outcome(SessionStatus.ENDED, result.reason, True, replace(self.stats))
        finally:
            clean = pipeline.close()
        return outcome if clean else replace(outcome, healthy=False)

    def _wait(self, timeout_s: float) -> None:
        """Until `timeout_s` passed, audio was pushed, or the session was stopped."""
        if timeout_s > 0 and not self._stopped.is_set():
            self.audio.pushed.wait(timeout_s)

    def _take(self, k: int) -> np.ndarray:
        pcm = self.audio.take(k)
        return self.history.taken(k, pcm) if self.history is not None else pcm

    def _on_report(self, report: ChunkReport, submitted_at: float) -> None:
        """Chunk k was published; its latency is submit -> published (the room stamps it on this
        node's monotonic clock, which the whole slot shares: STRICT_PACK)."""
        first = self.started_at is None
        with self._lock:
            if first:
                self.started_at = self.wall()
                self._events.append(EventDraft("status", status=SessionStatus.RUNNING, at=self.started_at))
            if report.given_up:  # nothing went out: not a chunk of the stream, no latency
                self._events.append(EventDraft("chunk", chunk=report.chunk + self.chunk_offset,
                                               detail="given_up=1 (the onset after it took its place)",
                                               at=self.wall()))
            else:
                self._published(report, submitted_at)
            for ev in report.playback:
                self._events.append(playback_event(ev, self.wall()))
                if ev.kind == "started" and ev.latency_s is not None:
                    self._speech.append(ev.latency_s * 1e3)
                    self.stats.speech_ms_p50 = float(np.median(self._speech))
        if self.history is not None:
            self.history.on_published(report.chunk)
        if first:
            self.on_event()
        if self.on_chunk is not None and not report.given_up:
            try:
                self.on_chunk(report, submitted_at)
            except Exception:  # telemetry must never stop a session: drop it, say so once
                log.exception("session %s: chunk telemetry failed; it is off for this session", self.session_id)
                self.on_chunk = None

    def _published(self, report: ChunkReport, submitted_at: float) -> None:
        """A chunk that went out: the stats and its event (under the lock)."""
        s = self.stats
        self._latency.append((report.published_at - submitted_at) * 1e3)
        lat = np.asarray(self._latency)
        s.chunks, s.frames = s.chunks + 1, s.frames + report.frames
        s.late_chunks += report.late
        s.fps, s.presented_fps = report.delivered_fps, report.presented_fps
        s.step_ms_p50, s.step_ms_p95 = float(np.percentile(lat, 50)), float(np.percentile(lat, 95))
        s.buffer_ms, s.av_offset_ms = report.buffer_s * 1e3, report.av_offset_s * 1e3
        self._stages.add(report.stages, report.chunk)
        s.stage_ms = self._stages.p50()
        detail = f"digest={report.digest} late={int(report.late)}" + (
            f" cut_ms={report.cut_s * 1e3:.1f}" if report.cut_s else "") + (
            f" audio_dry={report.audio_dry}" if report.audio_dry else "") + (
            f" head_frames={report.head_frames}" if report.head_frames else "") + "".join(
            f" {t.stage}_ms={t.duration_ns / 1e6:.1f}" for t in report.stages
            if t.chunk == report.chunk and t.source == "host" and t.stage in ("dit", "decode"))
        self._events.append(EventDraft("chunk", chunk=report.chunk + self.chunk_offset, detail=detail,
                                       at=self.wall()))
