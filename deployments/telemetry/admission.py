"""The scheduler's spans and metrics: admission (queue wait), slot builds, capacity gauges, ended sessions.

- `session` opens when a request reaches the scheduler and ends with the session, whatever the end (refused,
  ended or failed while queued or while its slot builds, ended, failed): status and reason on it. It is a
  child of the request's context; a request without one makes it the root of the session's trace (then the
  admission is its child and the session carries its context instead).
- `scheduler.admission` ends when the session holds a slot (decision warm or cold) or never will (rejected,
  expired, ended while queued, failed); a child of the request's context, as the session actor's spans are.
- `session.end_request`, the session span's child: a DELETE reached the scheduler (its reason), linked to
  the request's own span, so the DELETE's trace and the session's are tied both ways.
- `slot.build` roots a slot's own trace: a slot outlives sessions (warm pool) or is built before its
  session can start, so it is not a child of any session. A slot built for one session (cold start)
  links to that session's admission span, and every admission links to the build of the slot it got.
- `cluster.node_joined`, `cluster.node_draining`, `cluster.node_lost`: one short span per node change the
  scheduler sees (its own trace), with who saw it (the GCS's table or the scheduler's probe of the raylet),
  the node's GPUs and how many of the scheduler's slots and sessions were on it; the same counted in
  `characters.node.changes` (and a lost node's sessions in `characters.node.sessions_lost`).
- Gauges are computed under the scheduler's lock on every dispatch (`snapshot`) and swapped in at
  once; the export thread only reads them.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.trace import Span

from deployments.telemetry import names as N
from deployments.telemetry.core import Telemetry, context_of, extract, fail, inject, links_to, span_context


@dataclass
class Admission:
    """One request's admission span (None when tracing is off) and when it arrived."""

    span: Span | None
    arrived: float = field(default_factory=time.monotonic)
    open: bool = True
    session: Span | None = None  # the session's own span (create -> end)
    session_id: str = ""


@dataclass
class SlotTrace:
    slot_id: str
    span: Span | None
    context: dict[str, str]  # W3C carrier of the slot's build span, for the slot's workers

    @property
    def otel_context(self) -> otel_context.Context:
        return extract(self.context)


class SchedulerTelemetry:
    def __init__(self, tel: Telemetry) -> None:
        self.tel = tel
        self._m = {s.name: tel.instrument(s) for s in N.METRICS}

    # ----------------------------------------------------------------------------- admission
    def admission(self, session_id: str, preset: str, trace_context: Mapping[str, str],
                  queue_len: int) -> tuple[Admission, dict[str, str]]:
        """Open the request's admission; returns it and the trace context the session will carry."""
        if not self.tel.traces:
            return Admission(None), dict(trace_context)
        parent = extract(trace_context)
        session = self.tel.start_span(N.SESSION, parent, attributes={N.SESSION_ID: session_id, N.PRESET: preset})
        if span_context(parent) is None:  # no request context: the session's span roots its trace
            parent, trace_context = context_of(session), inject(context_of(session))
        span = self.tel.start_span(N.ADMISSION, parent, attributes={
            N.SESSION_ID: session_id, N.PRESET: preset, N.ADMISSION_QUEUE_POSITION: queue_len})
        return Admission(span, session=session, session_id=session_id), dict(trace_context)

    def end_requested(self, adm: Admission | None, reason: str, trace_context: Mapping[str, str]) -> None:
        """A request to end the session reached the scheduler: a span in the session's trace, linked to it."""
        if adm is None or adm.session is None or not adm.session.is_recording():
            return
        self.tel.start_span(N.SESSION_END_REQUEST, context_of(adm.session), links=links_to(extract(trace_context)),
                            attributes={N.SESSION_ID: adm.session_id, N.END_REASON: reason[:64]}).end()

    def session_ended(self, adm: Admission | None, status: str | None, reason: str) -> None:
        """The session's span ends (once), with its status (None: refused, never a session) and reason code."""
        if adm is None or adm.session is None or not adm.session.is_recording():
            return
        if status is not None:
            adm.session.set_attribute(N.SESSION_STATUS, status)
        adm.session.set_attribute(N.END_REASON, reason.split(":", 1)[0].strip()[:64] or "unknown")
        if status == "FAILED":
            fail(adm.session, reason.split(":", 1)[0].strip()[:64] or "failed")
        adm.session.end()

    def queued(self, adm: Admission, position: int) -> None:
        if adm.span is not None:
            adm.span.add_event("queued", {N.ADMISSION_QUEUE_POSITION: position})

    def decided(self, adm: Admission | None, decision: str, *, slot: SlotTrace | None = None,
                warm: bool | None = None) -> None:
        """The admission is over: `decision` is warm, cold, rejected, expired, ended or failed."""
        if adm is None or not adm.open:
            return
        adm.open = False
        wait = time.monotonic() - adm.arrived
        if self.tel.metrics:
            self._m[N.ADMISSION_WAIT.name].record(wait, {N.ADMISSION_DECISION: decision})
        if adm.span is None:
            return
        adm.span.set_attribute(N.ADMISSION_DECISION, decision)
        adm.span.set_attribute(N.ADMISSION_WAIT_S, round(wait, 4))
        if warm is not None:
            adm.span.set_attribute(N.WARM_START, warm)
        if slot is not None and (sc := span_context(slot.otel_context)) is not None:
            adm.span.add_link(sc, {N.SLOT_ID: slot.slot_id})
        if decision in ("expired", "failed"):
            fail(adm.span, decision)
        adm.span.end()
        if decision == "rejected" or (decision == "expired" and adm.session is not None):
            self.session_ended(adm, None if decision == "rejected" else "FAILED", decision)

    # ----------------------------------------------------------------------------- slots
    def slot_building(self, slot_id: str, built_for: Admission | None) -> SlotTrace:
        if not self.tel.traces:
            return SlotTrace(slot_id, None, {})
        links = links_to(context_of(built_for.span)) if built_for is not None and built_for.span is not None else []
        span = self.tel.start_span(N.SLOT_BUILD, None, links=links, attributes={
            N.SLOT_ID: slot_id, N.SLOT_PURPOSE: "cold" if built_for is not None else "warm"})
        return SlotTrace(slot_id, span, inject(context_of(span)))

    def slot_built(self, trace: SlotTrace, *, node_id: str | None = None, device: str | None = None,
                   error: str | None = None) -> None:
        if trace.span is None or not trace.span.is_recording():
            return
        if node_id:
            trace.span.set_attribute(N.NODE_ID, node_id)
        if device:
            trace.span.set_attribute(N.DEVICE, device)
        if error is not None:
            fail(trace.span, error)
        trace.span.end()

    def worker_stages(self, stages: Mapping[str, Mapping[str, float]]) -> None:
        """Stage durations of a slot's workers ({"dit0": {"load_weights": s, ...}, "decoder": {...}})."""
        if not self.tel.metrics:
            return
        hist = self._m[N.WORKER_STAGE_DURATION.name]
        for worker, seconds in stages.items():
            role = worker.rstrip("0123456789")
            for stage, s in seconds.items():
                hist.record(s, {N.WORKER_ROLE: role, N.STAGE: stage})

    # ----------------------------------------------------------------------------- nodes
    def node_changed(self, kind: str, node_id: str, detail: str, seen_by: str, gpus: float, *, slots: int,
                     sessions: int) -> None:
        if self.tel.metrics:
            self._m[N.NODE_CHANGES.name].record(1, {N.NODE_CHANGE_KIND: kind, N.NODE_SEEN_BY: seen_by})
            if kind == "lost" and sessions:
                self._m[N.NODE_SESSIONS_LOST.name].record(sessions, {})
        if self.tel.traces:
            span = self.tel.start_span(N.NODE_CHANGE[kind], None, attributes={
                N.NODE_ID: node_id, N.NODE_CHANGE_KIND: kind, N.NODE_SEEN_BY: seen_by, N.NODE_DETAIL: detail,
                N.NODE_GPUS: gpus, N.NODE_SLOTS: slots, N.NODE_SESSIONS: sessions})
            if kind == "lost":
                fail(span, "node_lost")
            span.end()

    # ----------------------------------------------------------------------------- gauges and counts
    def ended(self, status: str, reason: str) -> None:
        if self.tel.metrics:
            code = reason.split(":", 1)[0].strip()[:64] or "unknown"
            self._m[N.SESSIONS_ENDED.name].record(1, {N.SESSION_STATUS: status, N.END_REASON: code})

    def usage(self, tenant: str | None, preset: str, streamed_s: float, gpu_s: float, started: bool) -> None:
        """An ended session's usage (the figures of `deployments.store.usage`), by tenant and preset."""
        if self.tel.metrics:
            attrs = {N.TENANT: tenant or "-", N.PRESET: preset}
            self._m[N.USAGE_STREAMED.name].record(streamed_s, attrs)
            self._m[N.USAGE_GPU.name].record(gpu_s, attrs)
            self._m[N.USAGE_STARTED.name].record(int(started), attrs)

    def snapshot(self, *, statuses: Iterable[str], queue_len: int, bundles_free: int, bundles_used: int,
                 slot_states: Iterable[str], leaked_pgs: int | None, nodes: Mapping[str, int] | None = None,
                 demand: int = 0) -> None:
        """Swap in the scheduler's gauges (call under its lock; cheap, and only when metrics are on)."""
        m = self._m
        by_status = Counter(statuses)
        m[N.SESSIONS.name].set_all({((N.SESSION_STATUS, s),): float(n) for s, n in by_status.items()})
        m[N.QUEUE_LENGTH.name].set_all({(): float(queue_len)})
        m[N.BUNDLES_FREE.name].set_all({(): float(bundles_free)})
        m[N.BUNDLES_USED.name].set_all({(): float(bundles_used)})
        m[N.SLOTS.name].set_all({((N.SLOT_STATE, s),): float(n) for s, n in Counter(slot_states).items()})
        if leaked_pgs is not None:
            m[N.LEAKED_PGS.name].set_all({(): float(leaked_pgs)})
        m[N.NODES.name].set_all({((N.NODE_STATE, s),): float(n) for s, n in (nodes or {}).items()})
        m[N.AUTOSCALER_DEMAND.name].set_all({(): float(demand)})


def leaked_placement_groups(table: Mapping[str, Mapping[str, Any]], held: Iterable[str], prefix: str = "slot-") -> int:
    """Slot placement groups (named `slot-...`) that Ray still has and the scheduler does not hold."""
    mine = set(held)
    return sum(1 for pg in table.values() if str(pg.get("name", "")).startswith(prefix)
               and pg.get("state") not in ("REMOVED",) and pg.get("name") not in mine)
