"""A session's spans and metrics, made in its session actor from what the workers measured.

Trace anatomy (one trace per session; docs/operations.md has a captured example):

    POST /v1/sessions                     the request (ingress): the session's root context
    ├── scheduler.admission               queue wait until a slot is held; links to the slot's own trace
    ├── session.start                     session actor run() -> first chunk published
    │   ├── session.prepare               reference encoded, workers started, room open
    │   └── session.compile               the chunk graph compiled
    ├── chunk (k)                         submitted -> published; sampled, see below
    │   ├── chunk.dit                     DiT rank 0 step (host timer on CPU, CUDA events on GPU)
    │   │   └── chunk.cache_write         the extra cache-update pass (when the preset has one)
    │   ├── chunk.handoff                 DiT done -> decoder starts (latent transfer and queueing; GPU
    │   │                                 times on GPUs, see `handoff`)
    │   ├── chunk.decode                  VAE decode (host timer on CPU, CUDA events on GPU)
    │   └── chunk.publish                 room: playout bookkeeping and sink write
    └── session.end                       loop stopped -> output closed; summary attributes

Every span is short and exported when it ends: nothing waits an hour for a session span to close, a
crash loses at most one export batch, and the trace is readable while the session lives.

Chunk spans are sampled per session (`ChunkSampler`): every chunk of the first
`trace_chunks_first` (start-up is where things go wrong), then one in `trace_chunks_every`, plus late
chunks up to `trace_late_per_min` per minute (a token bucket, so a session that is always late
cannot flood the exporter). A 1-hour session with defaults: 24 + 360 chunk spans (+ late ones), 6
spans each: ~2.3k spans, ~0.6 span/s. Metrics see every chunk.

On GPU workers a chunk's CUDA times arrive with a later chunk (events are read only once complete),
so a sampled chunk waits here until its DiT and decode GPU times are in, or `GPU_WAIT_CHUNKS`
chunks have passed (its host times are used then).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import Span

from characters.stage_times import StageTime
from deployments.telemetry import names as N
from deployments.telemetry.core import Telemetry, context_of, extract, fail, span_context, time_ns_of

GPU_WAIT_CHUNKS = 4  # a sampled chunk's span waits at most this many chunks for its GPU times


class ChunkSampler:
    """Which chunks get spans: the first `first`, every `every`-th, and late ones up to `late_per_min`."""

    def __init__(self, first: int, every: int, late_per_min: int) -> None:
        self.first, self.every = first, every
        self.capacity = float(late_per_min)
        self.rate = late_per_min / 60.0
        self.tokens = self.capacity
        self._at: float | None = None

    def keep(self, chunk: int, late: bool, now_s: float) -> str | None:
        """Why chunk `chunk` is traced ("first", "every", "late"), or None."""
        if chunk < self.first:
            return "first"
        if self.every and chunk % self.every == 0:
            return "every"
        if not late or self.rate <= 0:
            return None
        if self._at is not None:
            self.tokens = min(self.capacity, self.tokens + (now_s - self._at) * self.rate)
        self._at = now_s
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return "late"
        return None


@dataclass
class _Pending:
    report: Any  # deployments.pipeline.messages.ChunkReport
    submitted_ns: int
    published_ns: int
    why: str
    host: dict[str, StageTime]
    cuda: dict[str, StageTime]
    waited: int = 0


def pick(times: list[StageTime], chunk: int, source: str) -> dict[str, StageTime]:
    return {t.stage: t for t in times if t.chunk == chunk and t.source == source}


def handoff(times: Mapping[str, StageTime]) -> tuple[int, int] | None:
    """DiT end -> decoder start on the node's clock, when both are known, from times of one source.

    Host times: the DiT worker's call returning -> the decoder's call starting. On GPUs the DiT call returns
    once its work is queued, so that span also holds the DiT's GPU time still to run; the GPU times (CUDA
    events, each recorder anchored to the host clock at session start) give the handoff itself: DiT rank 0's
    last kernel done -> the decoder's first kernel starting (latent transfer, Ray's scheduling, queueing)."""
    dit, dec = times.get("dit"), times.get("decode")
    if dit is None or dec is None:
        return None
    return dit.end_ns, max(dit.end_ns, dec.start_ns)


class GpuHandoffs:
    """Pairs chunk k's DiT end and decode start from CUDA times as they arrive (a chunk or more later, not
    always in one report); keeps the last `keep` chunks' unpaired halves."""

    def __init__(self, keep: int = 16) -> None:
        self.keep = keep
        self._half: dict[int, dict[str, StageTime]] = {}

    def add(self, stages: Sequence[StageTime]) -> list[tuple[int, int, int]]:
        """(chunk, start ns, end ns) of each handoff completed by `stages`."""
        out = []
        for t in stages:
            if t.source != "cuda" or t.stage not in ("dit", "decode"):
                continue
            half = self._half.setdefault(t.chunk, {})
            half[t.stage] = t
            if (h := handoff(half)) is not None:
                out.append((t.chunk, *h))
                del self._half[t.chunk]
        if self._half:
            newest = max(self._half)
            for k in [k for k in self._half if k <= newest - self.keep]:
                del self._half[k]
        return out


class SessionTelemetry:
    """Spans and metrics of one session (see the module docstring). Call from one thread at a time."""

    def __init__(self, tel: Telemetry, session_id: str, trace_context: Mapping[str, str], *, preset: str,
                 output_kind: str, device: str = "cpu") -> None:
        self.tel, self.session_id, self.device = tel, session_id, device
        self.parent = extract(trace_context)
        cfg = tel.config
        self.sampler = ChunkSampler(cfg.trace_chunks_first, cfg.trace_chunks_every, cfg.trace_late_per_min)
        self.attrs = {N.SESSION_ID: session_id, N.PRESET: preset, N.OUTPUT_KIND: output_kind}
        self._series = ((N.SESSION_ID, session_id),)
        self._start: Span | None = None
        self._pending: dict[int, _Pending] = {}
        self._m = {s.name: tel.instrument(s) for s in N.METRICS}
        self._gpu_handoffs = GpuHandoffs()
        if tel.metrics:  # the counters exist from the start (a rate of 0 is not an absent series)
            self._m[N.CHUNKS.name].record(0)
            self._m[N.LATE_CHUNKS.name].record(0)

    # ----------------------------------------------------------------------------- start and end
    def starting(self, start_ns: int | None = None) -> None:
        """The session actor began run(): open `session.start` (ended by the first chunk, or at the end)."""
        if self.tel.traces:
            self._start = self.tel.start_span(N.SESSION_START, self.parent, start_ns=start_ns, attributes=self.attrs)
            if span_context(self.parent) is None:  # no request context: the start span roots the session
                self.parent = context_of(self._start)

    def phase(self, name: str, start_ns: int, end_ns: int, error: str | None = None) -> None:
        """A start-up phase (`N.SESSION_PREPARE`, `N.SESSION_COMPILE`) under `session.start`."""
        if self._start is None:
            return
        span = self.tel.start_span(name, context_of(self._start), start_ns=start_ns, attributes=self.attrs)
        if error is not None:
            fail(span, error)
        span.end(end_time=end_ns)

    def ended(self, status: str, reason: str, stats: Any, *, start_ns: int, phases: Mapping[str, float]) -> None:
        """The session is over (output closed): `session.end` with the summary; pending chunks go out."""
        for k in sorted(self._pending):
            self._emit(self._pending.pop(k))
        code = reason.split(":", 1)[0].strip()[:64] or "unknown"
        if self.tel.metrics:
            for spec in (N.SESSION_FPS, N.SESSION_BUFFER, N.SESSION_AV_OFFSET):
                self._m[spec.name].set_all({})
        if not self.tel.traces:
            return
        if self._start is not None and self._start.is_recording():
            for phase, seconds in phases.items():  # it never got a chunk out
                self._start.set_attribute(N.phase_key(phase), round(seconds, 4))
            self._start.set_attribute(N.END_REASON, code)
            if status == "FAILED":
                fail(self._start, code)
            self._start.end()
            self._start = None
        span = self.tel.start_span(N.SESSION_END, self.parent, start_ns=start_ns, attributes={
            **self.attrs, N.SESSION_STATUS: status, N.END_REASON: code, N.SESSION_CHUNKS: stats.chunks,
            N.SESSION_LATE_CHUNKS: stats.late_chunks, N.DELIVERED_FPS: round(stats.fps, 3)})
        if status == "FAILED":
            fail(span, code)
        span.end()

    # ----------------------------------------------------------------------------- every chunk
    def on_chunk(self, report: Any, submitted_at: float, phases: Mapping[str, float] | None = None) -> str | None:
        """Chunk k was published (`report`, submitted at `submitted_at` on time.monotonic); returns why it is
        traced (first, every, late) or None."""
        stages: list[StageTime] = list(getattr(report, "stages", ()))
        k = report.chunk
        host = pick(stages, k, "host")
        if self.tel.metrics:
            self._record(report, submitted_at, stages, host)
        if not self.tel.traces:
            return None
        published_ns = time_ns_of(report.published_at)
        if self._start is not None:  # the first chunk is out: the session has started
            for phase, seconds in (phases or {}).items():
                self._start.set_attribute(N.phase_key(phase), round(seconds, 4))
            self._start.end(end_time=published_ns)
            self._start = None
        why = self.sampler.keep(k, bool(report.late), time.monotonic())
        if why is not None:
            self._pending[k] = _Pending(report, time_ns_of(submitted_at), published_ns, why, host, {})
        for t in stages:
            if t.source == "cuda" and t.chunk in self._pending:
                self._pending[t.chunk].cuda[t.stage] = t
        for j in sorted(self._pending):
            p = self._pending[j]
            p.waited = k - j
            if self.device != "cuda" or {"dit", "decode"} <= set(p.cuda) or p.waited >= GPU_WAIT_CHUNKS:
                self._emit(self._pending.pop(j))
        return why

    def _record(self, report: Any, submitted_at: float, stages: list[StageTime], host: dict[str, StageTime]) -> None:
        m = self._m
        m[N.CHUNKS.name].record(1)
        if report.late:
            m[N.LATE_CHUNKS.name].record(1)
        m[N.CHUNK_LATENCY.name].record(max(0.0, report.published_at - submitted_at))
        hist = m[N.CHUNK_STAGE_DURATION.name]
        for t in stages:
            hist.record(t.duration_ns / 1e9, {N.STAGE: t.stage, N.TIMING_SOURCE: t.source})
        if self.device != "cuda" and (h := handoff(host)) is not None:  # on GPUs the host span holds DiT work
            hist.record((h[1] - h[0]) / 1e9, {N.STAGE: "handoff", N.TIMING_SOURCE: "host"})
        for _, a, b in self._gpu_handoffs.add(stages):
            hist.record((b - a) / 1e9, {N.STAGE: "handoff", N.TIMING_SOURCE: "cuda"})
        m[N.SESSION_FPS.name].set_all({self._series: report.delivered_fps})
        m[N.SESSION_BUFFER.name].set_all({self._series: getattr(report, "buffer_s", 0.0)})
        m[N.SESSION_AV_OFFSET.name].set_all({self._series: getattr(report, "av_offset_s", 0.0)})

    def _emit(self, p: _Pending) -> None:
        r = p.report
        times = {**p.host, **p.cuda}  # GPU times win where both exist
        start_ns = min(p.submitted_ns, *(t.start_ns for t in times.values()))
        chunk = self.tel.start_span(N.CHUNK, self.parent, start_ns=start_ns, attributes={
            N.SESSION_ID: self.session_id, N.CHUNK_INDEX: r.chunk, N.CHUNK_LATE: bool(r.late),
            N.CHUNK_LATENESS_S: round(r.lateness_s, 4), N.CHUNK_LATENCY_S: round((p.published_ns - p.submitted_ns)
                                                                                 / 1e9, 4),
            N.CHUNK_SAMPLED_BY: p.why, N.DELIVERED_FPS: round(r.delivered_fps, 3),
            N.BUFFER_S: round(getattr(r, "buffer_s", 0.0), 4), N.AV_OFFSET_S: round(getattr(r, "av_offset_s", 0.0), 4)})
        ctx = context_of(chunk)
        dit = times.get("dit")
        dit_span = self._stage(ctx, dit) if dit is not None else None
        if (cw := times.get("cache_write")) is not None:
            self._stage(context_of(dit_span) if dit_span is not None else ctx, cw)
        source, h = ("cuda", gpu) if (gpu := handoff(p.cuda)) is not None else ("host", handoff(p.host))
        if h is not None:
            span = self.tel.start_span(N.CHUNK_STAGE["handoff"], ctx, start_ns=h[0],
                                       attributes={N.STAGE: "handoff", N.TIMING_SOURCE: source})
            span.end(end_time=h[1])
        for stage in ("decode", "publish"):
            if (t := times.get(stage)) is not None:
                self._stage(ctx, t)
        chunk.end(end_time=max(p.published_ns, p.submitted_ns, *(t.end_ns for t in times.values())))

    def _stage(self, parent: Any, t: StageTime) -> Span:
        span = self.tel.start_span(N.CHUNK_STAGE.get(t.stage, f"chunk.{t.stage}"), parent, start_ns=t.start_ns,
                                   attributes={N.STAGE: t.stage, N.TIMING_SOURCE: t.source})
        span.end(end_time=t.end_ns)
        return span
