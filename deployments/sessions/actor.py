"""`SessionActor`: the thin Ray actor of a slot that starts its sessions, one after another, and drives
their chunk loop (`deployments.sessions.runner` holds the plain classes it drives)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import ray
from ray.exceptions import RayError

from characters.audio import convert_pcm, pcm16_to_float
from characters.config import SessionConfig
from characters.host import freeze_heap
from deployments import telemetry
from deployments.pipeline.graph import (
    ActorCallPipeline,
    CompiledPipeline,
    Pipeline,
    Workers,
    classify,
    graph_mode,
)
from deployments.pipeline.messages import ChunkReport
from deployments.pipeline.workers import first_frame_on, realtime
from deployments.sessions.recovery import History, Resume, prime, prime_windows
from deployments.sessions.runner import AudioBuffer, Outcome, Report, SessionRunner
from deployments.settings import ServiceConfig
from deployments.telemetry import SessionTelemetry
from deployments.telemetry import names as N
from deployments.types import SessionSpec, SessionStatus

log = logging.getLogger(__name__)


class SessionActor:
    """Thin Ray actor that drives one slot's sessions, one at a time: prepares the workers for each,
    runs its `SessionRunner` in a thread, reports to the scheduler. It lives in the slot's room bundle
    as long as the slot (started with it, so a session never waits for a Python process to start and
    import torch) and holds the slot's chunk pipeline: the compiled graph is compiled once, in
    `warm_up` while the slot is built, and driven for every session after (`deployments.pipeline.graph`
    says why). Calls about a session name it: one naming a session that is not (or no longer) the
    current one is dropped, so a late stop or push never reaches the slot's next session."""

    def __init__(self, cfg: SessionConfig, service: ServiceConfig, workers: Workers,
                 slot_id: str | None = None) -> None:
        self.cfg, self.service, self.workers, self.slot_id = cfg, service, workers, slot_id
        realtime(service.realtime_nice, "session actor")  # its chunk loop (a thread started later) inherits it
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
        """Compile the slot's chunk graph (the last stage of building the slot: no session waits for it), then take
        what this process built out of the garbage collector's reach (`characters.host.freeze_heap`)."""
        await asyncio.to_thread(self._slot_pipeline)
        freeze_heap("session actor")

    async def close(self) -> None:
        """The slot is being removed: tear its compiled graph down first (its actors are killed next), in a
        thread, so this actor's event loop never waits on it."""
        with self._pipeline_lock:
            pipeline, self.pipeline = self.pipeline, None
        if isinstance(pipeline, CompiledPipeline):
            await asyncio.to_thread(pipeline.teardown)

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
        (`deployments.sessions.recovery`): prime the workers, continue its chunks."""
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
                                    chunk_path=self.service.chunk_path, livekit=spec.output.kind == "livekit",
                                    on_chunk=self._on_chunk if self.trace is not None else None,
                                    history=History(self.cfg.model.generation.ring_slots) if spec.recover else None,
                                    resume=resume)
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
        """What a restarted scheduler needs to adopt this actor (`deployments.sessions.adoption`): the slot's
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
                                               ray.get_runtime_context().current_actor, spec.max_duration_s,
                                               spec.image))
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
        if graph_mode(self.service.graph, self.workers.device) == "actor_calls":
            return ActorCallPipeline(self.workers, first_frame_on(self.service.chunk_path.onset_first_frame,
                                                                    self.workers.device))
        g = self.cfg.model.generation
        frame_bytes = g.frames_per_chunk * g.height * g.width * 3
        return CompiledPipeline(self.workers, depth=self.service.chunk_path.depth,
                                buffer_bytes=max(1 << 20, 2 * frame_bytes),
                                teardown_timeout_s=self.service.teardown_timeout_s)

    async def _close_room(self) -> bool:
        """Finish the output (the MP4 trailer); False if the room could not (the slot is then removed)."""
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.workers.room.close.remote().future()),
                                   self.service.chunk_path.chunk_timeout_s)
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
                self.scheduler.report.remote(self.session_id, report, self.slot_id).future()), 10.0)
