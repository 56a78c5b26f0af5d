"""One session: its audio, its lifecycle and stats (plain classes), and `SessionActor`, the thin Ray
actor of a slot that starts its sessions, one after another, and drives their chunk loop.

Lifecycle (the scheduler owns QUEUED and STARTING; the session actor the rest):

    QUEUED -> STARTING -> READY -> RUNNING -> ENDED (deleted | max_duration | ...) / FAILED (reason)

READY: every rank started, the reference in the sink, the slot's graph at hand (compiled with the
slot). RUNNING: the first chunk was published. A failure at any point ends the session FAILED with a
machine-readable reason (actor_died, chunk_timeout, worker_error, start_failed, ...) and the slot is
then removed; a session created with `recover` instead goes back to STARTING (detail `recovering:
<reason>`) and resumes on a fresh slot (`deployments.recovery`).

Audio: agent PCM is converted to float32 mono 16 kHz on arrival and queued; chunk k takes exactly
the samples of `chunk_sample_range(k)` from the queue, padded with silence when the queue runs dry
(the character idles; generation never stops). `clear_audio` drops the queue (interruption).

Stats: `step_ms_p50/p95` are chunk latencies, submit -> published by the room (DiT step, handoff,
decode, publish; pipelined, so up to `pipeline_depth` chunks overlap); `fps` and `late_chunks` are
the room's playout measurements (`workers.PlayoutMeter`); `buffer_ms` and `av_offset_ms` the output's
(a LiveKit room's playout, else the meter); `stage_ms` the median of each chunk stage (`StageWindow`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import ray
from ray.exceptions import RayError

from characters.audio import chunk_sample_range, convert_pcm, pcm16_to_float
from characters.config import SessionConfig
from characters.telemetry import CHUNK_STAGES, StageTime
from deployments import telemetry
from deployments.pipeline import (
    ActorCallPipeline,
    ChunkFailure,
    CompiledPipeline,
    Pipeline,
    Workers,
    classify,
    run_chunk_loop,
)
from deployments.recovery import History, Resume, prime, prime_windows
from deployments.settings import ServiceConfig
from deployments.telemetry import SessionTelemetry
from deployments.telemetry import names as N
from deployments.telemetry.session import GpuHandoffs, handoff
from deployments.types import SessionSpec, SessionStats, SessionStatus
from deployments.workers import ChunkReport

LATENCY_WINDOW = 120  # chunks kept for the latency percentiles (~20 s)

log = logging.getLogger(__name__)


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


def keeps_real_time(pacing: str, output_kind: str) -> bool:
    """Does the session's loop keep real time? Always for a LiveKit room (viewers play it as it comes);
    otherwise as the service's `pacing` says ("unpaced": back to back, for benchmarks and file renders)."""
    return pacing == "realtime" or output_kind == "livekit"


class SessionRunner:
    """The chunk loop of one started session, its status, events and stats. Runs in one thread
    (`run`); `stop`, `report` and the audio buffer are safe to use from others."""

    def __init__(self, session_id: str, cfg: SessionConfig, *, max_duration_s: float, depth: int,
                 fetch_timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, audio: AudioBuffer | None = None,
                 on_chunk: Callable[[ChunkReport, float], None] | None = None,
                 history: History | None = None, resume: Resume | None = None, paced: bool = True) -> None:
        g = cfg.model.generation
        self.session_id, self.depth, self.fetch_timeout_s = session_id, depth, fetch_timeout_s
        self.chunk_s, self.max_duration_s = g.frames_per_chunk / g.fps, max_duration_s
        self.paced = paced  # False: chunks back to back (ServiceConfig.pacing "unpaced")
        self.clock, self.wall = clock, wall
        self.audio = audio or AudioBuffer(g.frames_per_chunk, cfg.model.audio.sample_rate, g.fps)
        self.stats = SessionStats()
        self.started_at: float | None = None
        self.terminal: tuple[SessionStatus, str] | None = None
        self._events: list[EventDraft] = []
        self._latency: deque[float] = deque(maxlen=LATENCY_WINDOW)
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
            result = run_chunk_loop(
                pipeline, session_id=self.session_id, audio=self._take, first_chunk=self.first_chunk,
                chunk_s=self.chunk_s if self.paced else 0.0, depth=self.depth,
                max_duration_s=self.max_duration_s, fetch_timeout_s=self.fetch_timeout_s, clock=self.clock,
                wait=self._stopped.wait, stop_reason=lambda: self._stop_reason, on_report=self._on_report)
            self.loop_ended_at = self.clock()
            if result.failure is not None:
                return self.finish(SessionStatus.FAILED, str(result.failure))
            outcome = Outcome(SessionStatus.ENDED, result.reason, True, replace(self.stats))
        finally:
            clean = pipeline.close()
        return outcome if clean else replace(outcome, healthy=False)

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
            s = self.stats
            self._latency.append((report.published_at - submitted_at) * 1e3)
            lat = np.asarray(self._latency)
            s.chunks, s.frames = s.chunks + 1, s.frames + report.frames
            s.late_chunks += report.late
            s.fps = report.delivered_fps
            s.step_ms_p50, s.step_ms_p95 = float(np.percentile(lat, 50)), float(np.percentile(lat, 95))
            s.buffer_ms, s.av_offset_ms = report.buffer_s * 1e3, report.av_offset_s * 1e3
            self._stages.add(report.stages, report.chunk)
            s.stage_ms = self._stages.p50()
            detail = f"digest={report.digest} late={int(report.late)}"
            self._events.append(EventDraft("chunk", chunk=report.chunk + self.chunk_offset, detail=detail,
                                           at=self.wall()))
        if self.history is not None:
            self.history.on_published(report.chunk)
        if first:
            self.on_event()
        if self.on_chunk is not None:
            try:
                self.on_chunk(report, submitted_at)
            except Exception:  # telemetry must never stop a session: drop it, say so once
                log.exception("session %s: chunk telemetry failed; it is off for this session", self.session_id)
                self.on_chunk = None


# ------------------------------------------------------------------------------------------ the actor


class SessionActor:
    """Thin Ray actor that drives one slot's sessions, one at a time: prepares the workers for each,
    runs its `SessionRunner` in a thread, reports to the scheduler. It lives in the slot's room bundle
    as long as the slot (started with it, so a session never waits for a Python process to start and
    import torch) and holds the slot's chunk pipeline: the compiled graph is compiled once, in
    `warm_up` while the slot is built, and driven for every session after (`deployments.pipeline`
    says why). Calls about a session name it: one naming a session that is not (or no longer) the
    current one is dropped, so a late stop or push never reaches the slot's next session."""

    def __init__(self, cfg: SessionConfig, service: ServiceConfig, workers: Workers,
                 slot_id: str | None = None) -> None:
        self.cfg, self.service, self.workers = cfg, service, workers
        # one session actor per slot: its metric series are the slot's
        self.tel = telemetry.setup("session", instance=f"{slot_id}.session" if slot_id else None)
        self.pipeline: Pipeline | None = None  # the slot's chunk pipeline, kept across sessions
        self._pipeline_lock = threading.Lock()
        self._unusable: str | None = None  # why this slot serves no further session (a session failed)
        self._clear()

    def _clear(self) -> None:
        """No current session: a new actor, or the scheduler has taken the last one's outcome."""
        self.session_id: str | None = None
        self.spec: SessionSpec | None = None
        self.output_path: str | None = None
        self.trace: SessionTelemetry | None = None
        g = self.cfg.model.generation
        self.audio = AudioBuffer(g.frames_per_chunk, self.cfg.model.audio.sample_rate, g.fps)
        self.runner: SessionRunner | None = None
        self.scheduler: Any | None = None
        self._wake: asyncio.Event | None = None
        self._closing = False
        self._resume: Resume | None = None
        self._outcome: Outcome | None = None
        self._task: asyncio.Task[Outcome] | None = None

    async def warm_up(self) -> None:
        """Compile the slot's chunk graph (the last stage of building the slot: no session waits for it)."""
        await asyncio.to_thread(self._slot_pipeline)

    def ping(self) -> bool:
        """False when the slot's compiled graph broke (its loop ended on some actor): remove the slot."""
        return not isinstance(self.pipeline, CompiledPipeline) or self.pipeline.alive()

    def push_audio(self, session_id: str, pcm16: bytes, sample_rate: int, channels: int) -> float:
        """Queue agent audio (16-bit PCM, any rate and channel count) for `session_id`; returns seconds
        queued (0.0 and dropped: `session_id` is not the current session)."""
        if not self._live(session_id):
            return 0.0
        self.audio.push(convert_pcm(pcm16_to_float(pcm16), sample_rate, channels))
        return self.audio.queued_s

    def clear_audio(self, session_id: str) -> int:
        return self.audio.clear() if self._live(session_id) else 0

    def stop(self, session_id: str, reason: str) -> None:
        if self._live(session_id) and self.runner is not None:
            self.runner.stop(reason)

    def _live(self, session_id: str) -> bool:
        return session_id == self.session_id and self._outcome is None

    async def start(self, spec: SessionSpec, output_path: str | None, scheduler: Any | None,
                    requested_at: float | None = None, resume: Resume | None = None) -> None:
        """Start `spec` on the slot; returns once it is the current session (calls naming it are taken
        from then on) and streams on; `outcome` says how it ended. `resume`: a recovered session
        (`deployments.recovery`): prime the workers, continue its chunks."""
        if self.session_id is not None:
            raise RuntimeError(f"the slot's SessionActor still holds session {self.session_id!r}; the scheduler "
                               "forgets a session (`forget`) before it starts the next one")
        if self._unusable is not None:
            raise RuntimeError(f"this slot serves no further session ({self._unusable}); the scheduler removes it")
        self.session_id, self.spec, self.output_path = spec.session_id, spec, output_path
        self.scheduler, self._resume = scheduler, resume
        if resume is not None and resume.pending.size:
            self.audio.push(resume.pending)  # speech of chunks the viewer never got, then the queue
        if self.tel.enabled:
            try:
                self.trace = SessionTelemetry(self.tel, spec.session_id, spec.trace_context, preset=spec.preset,
                                              output_kind=spec.output.kind, device=self.workers.device)
            except Exception:  # telemetry must never stop a session
                log.exception("session %s: telemetry failed to start; it is off for this session", spec.session_id)
            self._traced(lambda t: t.starting(int(requested_at * 1e9) if requested_at else None))
        self.runner = SessionRunner(spec.session_id, self.cfg, max_duration_s=spec.max_duration_s, audio=self.audio,
                                    depth=self.service.pipeline_depth, fetch_timeout_s=self.service.chunk_timeout_s,
                                    on_chunk=self._on_chunk if self.trace is not None else None,
                                    history=History(self.cfg.model.generation.ring_slots) if spec.recover else None,
                                    resume=resume,
                                    paced=keeps_real_time(self.service.pacing, spec.output.kind))
        if requested_at is not None:  # the scheduler's wall clock (another node's, NTP-close)
            self.runner.phases["wait_actor_s"] = max(0.0, time.time() - requested_at)
        self._task = asyncio.get_running_loop().create_task(self._run(self.runner))

    async def outcome(self, session_id: str) -> Outcome:
        """How `session_id` ended, once it has (the scheduler awaits this; so does a restarted one, for a
        session it adopted). A failure of the session's task itself is raised here."""
        if session_id != self.session_id or self._task is None:
            raise ValueError(f"session {session_id!r} is not this slot's current session ({self.session_id!r})")
        return await asyncio.shield(self._task)

    def forget(self, session_id: str) -> bool:
        """The scheduler took `session_id`'s outcome and reset the workers: drop the session, so the actor
        is free (`describe` then says so). True when the actor is free; a running session is kept."""
        if session_id == self.session_id and self._outcome is not None:
            self._clear()
        return self.session_id is None

    async def _run(self, runner: SessionRunner) -> Outcome:
        loop = asyncio.get_running_loop()
        self._wake = wake = asyncio.Event()

        def ring() -> None:
            loop.call_soon_threadsafe(wake.set)

        runner.on_event = ring
        reporter = asyncio.create_task(self._report_loop())
        try:
            try:
                t0, w0 = time.monotonic(), time.time_ns()
                await self._prepare()
                runner.phases["prepare_s"] = time.monotonic() - t0
                self._phase(N.SESSION_PREPARE, w0)
            except (RayError, ValueError, OSError) as err:
                self._phase(N.SESSION_PREPARE, w0, type(err).__name__)
                outcome = runner.finish(SessionStatus.FAILED, f"start_failed: {classify(err)}")
            else:
                outcome = await asyncio.to_thread(runner.run, self._make_traced_pipeline)
            closed = await self._close_room()
            final = runner.finish(outcome.status, outcome.reason)  # announced now: the output is complete
            outcome = replace(final, healthy=outcome.healthy and closed and final.healthy)
            ended = runner.loop_ended_at
            final_outcome = outcome
            self._traced(lambda t: t.ended(
                final_outcome.status.value, final_outcome.reason, final_outcome.stats, phases=runner.phases,
                start_ns=telemetry.time_ns_of(ended) if ended is not None else time.time_ns()))
        finally:
            self._closing = True
            wake.set()
            await reporter  # sends whatever is left, then returns
            if self.tel.enabled:  # the session's spans and metrics leave now, not at the next export
                await asyncio.to_thread(self.tel.flush, 2.0)
        if runner.history is not None and outcome.status is SessionStatus.FAILED:
            outcome = replace(outcome, resume=runner.history.resume(
                chunks=outcome.stats.chunks, queued=self.audio.drain(), stats=outcome.stats,
                attempt=self._resume.attempt + 1 if self._resume else 1, reason=outcome.reason))
        if not outcome.healthy:  # the scheduler removes the slot; its graph may be out of step
            self._unusable = f"session {runner.session_id!r} ended {outcome.status.value}: {outcome.reason}"
        self._outcome = outcome
        return outcome

    def describe(self) -> dict[str, Any]:
        """What a restarted scheduler needs to adopt this actor (`deployments.ledger`): the slot's
        workers, and the session it runs or ran and was not yet forgotten, if any (status, stats, outcome
        once ended). `spec` None: the actor, and so the slot, is free."""
        r = self.runner
        if r is None or self.spec is None:
            return {"workers": self.workers, "spec": None}
        status = r.terminal[0] if r.terminal else SessionStatus.RUNNING if r.started_at else (
            SessionStatus.READY if "compile_s" in r.phases else SessionStatus.STARTING)
        return {"workers": self.workers, "spec": self.spec, "status": status, "started_at": r.started_at,
                "stats": replace(r.stats), "outcome": self._outcome, "output_path": self.output_path}

    def _on_chunk(self, report: ChunkReport, submitted_at: float) -> None:
        if self.trace is not None and self.runner is not None:  # SessionRunner guards this call
            self.trace.on_chunk(report, submitted_at, self.runner.phases)

    def _traced(self, call: Callable[[SessionTelemetry], object]) -> None:
        """Run a telemetry call; a failure turns telemetry off for this session, never the session."""
        if self.trace is None:
            return
        try:
            call(self.trace)
        except Exception:  # telemetry must never stop a session
            log.exception("session %s: telemetry failed; it is off for this session", self.session_id)
            self.trace = None
            if self.runner is not None:
                self.runner.on_chunk = None

    def _phase(self, name: str, start_ns: int, error: str | None = None) -> None:
        end_ns = time.time_ns()
        self._traced(lambda t: t.phase(name, start_ns, end_ns, error))

    def _make_traced_pipeline(self) -> Pipeline:
        w0 = time.time_ns()
        try:
            pipeline = self._slot_pipeline()
        except BaseException as err:
            self._phase(N.SESSION_COMPILE, w0, type(err).__name__)
            raise
        self._phase(N.SESSION_COMPILE, w0)
        return pipeline

    async def _prepare(self) -> None:
        """Give every worker the session's state (plain actor calls, between the graph's executions)."""
        w, spec = self.workers, self.spec
        assert spec is not None
        sid = spec.session_id
        reference = w.decoder.encode_reference.remote(sid, spec.image)
        await asyncio.gather(*(d.start.remote(sid, reference, spec.seed) for d in w.dits),
                             w.decoder.start.remote(sid), w.room.open.remote(sid, spec.output, self.output_path,
                                               ray.get_runtime_context().current_actor, spec.max_duration_s))
        if self._resume is not None and self._resume.primed:
            g, rate = self.cfg.model.generation, self.cfg.model.audio.sample_rate
            await prime(w, sid, prime_windows(self._resume.prime, self._resume.primed, g.frames_per_chunk, rate, g.fps))

    def _slot_pipeline(self) -> Pipeline:
        """The slot's pipeline: made on first use (normally `warm_up`), the same one for every session."""
        with self._pipeline_lock:
            if self.pipeline is None:
                self.pipeline = self._make_pipeline()
            return self.pipeline

    def _make_pipeline(self) -> Pipeline:
        if self.service.graph == "actor_calls":
            return ActorCallPipeline(self.workers)
        g = self.cfg.model.generation
        frame_bytes = g.frames_per_chunk * g.height * g.width * 3
        return CompiledPipeline(self.workers, depth=self.service.pipeline_depth,
                                buffer_bytes=max(1 << 20, 2 * frame_bytes),
                                teardown_timeout_s=self.service.teardown_timeout_s)

    async def _close_room(self) -> bool:
        """Finish the output (the MP4 trailer); False if the room could not (the slot is then removed)."""
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.workers.room.close.remote().future()),
                                   self.service.chunk_timeout_s)
        except (RayError, TimeoutError, OSError) as err:
            log.warning("session %s: the room did not close: %s", self.session_id, err)
            return False
        return True

    async def _report_loop(self) -> None:
        """Report every `report_interval_s`, and at once on a status change; a last time on closing."""
        assert self._wake is not None and self.runner is not None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.service.report_interval_s)
            self._wake.clear()
            await self._send(self.runner.report())
            if self._closing:
                return

    async def _send(self, report: Report) -> None:
        if self.scheduler is None or self.session_id is None:
            return
        # a gone or stuck scheduler must not stop the session: drop the report
        with contextlib.suppress(RayError, TimeoutError):
            await asyncio.wait_for(asyncio.wrap_future(
                self.scheduler.report.remote(self.session_id, report).future()), 10.0)
