"""SessionScheduler: the named, detached actor that admits sessions onto slots and tracks them.

It decides nothing itself: the pure policy (`placement.decide` / `drain` / `commit`) decides, over a
ledger built from `ray.nodes()` and the bundles its slots hold (`placement.actor.ledger`); the slots'
lifecycle is `SlotManager`'s (`deployments.sessions.pool`) and the sessions' records `SessionBook`'s
(`deployments.sessions.book`). The ledger is recomputed from the slots held (one `Admit` each), so
releasing a slot is dropping its record: there is no separate count to drift. Every decision runs under one asyncio
lock with no await inside, so concurrent calls never over-commit. On every event (`_dispatch`):

    1. expire queued requests past their deadline (FAILED, queue_timeout)
    2. hand free warm slots to admitted sessions waiting for a slot, then to the queue in FIFO order
    3. admit queued requests that fit new capacity: a new (cold) slot each
    4. with nobody waiting: retire free slots above the warm target, start slots up to it
    5. publish demand (live slots + queued requests) to the autoscaler

A session takes a free warm slot (warm start), else a new slot when a whole bundle is free (cold
start), else queues (bounded, with a deadline) or is refused with `NoCapacity(retry_after_s)`. When
it ends, its slot is reset (every worker wipes its session state, the slot's SessionActor forgets
it) and returned to the pool, or removed (actors killed, placement group removed) when it is above
target or any actor failed. A slot's SessionActor lives as long as the slot and drives its sessions
one after another over one compiled graph (`deployments.pipeline.graph`).
One module on purpose: its decisions run under one lock, and every event that feeds them is read here.

Nodes (`deployments.sessions.membership`). The ledger holds live nodes only: the GCS's table (read every
NODES_REFRESH_S) less draining nodes (no slot is built there, their free slots are retired) and lost ones,
seen in that table or sooner by the scheduler's probe of each raylet holding its slots (every PROBE_S). A
lost node's sessions end FAILED `node_lost: ...` at once (a `recover` one resumes on another node), its
slots are removed; a node that joins is in the ledger at the next read, and the queue drains onto it.

Faults. A dead worker or session actor ends its session FAILED within a chunk or two (the compiled
graph raises `ActorDiedError`; a dead SessionActor fails its `outcome` call) and its slot is removed.
A `recover` session instead resumes on a fresh bundle (`deployments.sessions.recovery`). Slots and session
actors are detached and named (`placement.names`): when the scheduler itself dies, Ray restarts it
(`max_restarts=-1`, same handle) while sessions stream on, and on start it adopts what its
predecessor left (`deployments.sessions.adoption`) before deciding anything, so no bundle is booked twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any

import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from deployments.pipeline.graph import classify
from deployments.sessions.adoption import adopt, discover
from deployments.sessions.book import SessionBook, SessionRecord
from deployments.sessions.cluster import cluster_has_gpus
from deployments.sessions.membership import NODE_LOST, NodeChange, NodeWatch
from deployments.sessions.pool import RaySlotOps, SlotManager, SlotOps
from deployments.sessions.recovery import RECOVER_MAX_ATTEMPTS, Resume, recoverable
from deployments.sessions.runner import Outcome, Report
from deployments.sessions.slot import Slot
from deployments.settings import ServiceConfig
from deployments.telemetry import SchedulerTelemetry, leaked_placement_groups, setup
from deployments.types import (
    NAMESPACE,
    SCHEDULER_NAME,
    Capacity,
    NoCapacity,
    SessionEvent,
    SessionInfo,
    SessionSpec,
    SessionStats,
    SessionStatus,
)
from placement import (
    AdmissionQueue,
    Admit,
    Enqueue,
    Expire,
    Lease,
    PlacementSpec,
    Reject,
    Request,
    best_fit,
    bundles_for,
    commit,
    decide,
    drain,
    explain_fit,
    free_bundles,
)
from placement.actor import DemandPublisher, RayletProbe, ledger, node_table

log = logging.getLogger(__name__)

NODES_REFRESH_S = 1.0  # the GCS's node table: joins are seen within this
PROBE_S = 0.5  # the raylets of nodes holding slots (2 refused in a row, or 10 s without an answer: lost)
END_WAIT_S = 5.0  # end_session waits this long for the session to reach ENDED
PENDING_AUDIO_MAX_BYTES = 16000 * 2 * 2 * 60  # audio held for a session not yet started: 60 s stereo 16 kHz


DRAIN_RETRY_AFTER_S = 1.0


class NodeLost(RuntimeError):
    """The node of the session's slot was lost while the scheduler waited on the slot (the message: the reason)."""


class SessionScheduler:
    """Async Ray actor (see the module docstring); create it with `get_or_create_scheduler`."""

    def __init__(self, service: ServiceConfig, name: str = SCHEDULER_NAME, ops: SlotOps | None = None) -> None:
        self.service, self.name = service, name  # the actor's name: its slots' placement groups carry it
        self.cfg = service.session_config()
        self.lock = asyncio.Lock()
        self.queue = AdmissionQueue(service.queue_max)
        self.waiting: list[str] = []  # admitted, waiting for a slot to become free
        probe = RayletProbe()
        self.nodes = NodeWatch(node_table, probe, refresh_s=NODES_REFRESH_S, probe_s=PROBE_S, forget=probe.forget)
        self.members = self.nodes.members
        self._lost: dict[str, asyncio.Future[str]] = {}  # session id -> set to why its node was lost
        self._why: dict[str, str] = {}  # queued session id -> why it waits, as last told (an event each change)
        self.spec: PlacementSpec = bundles_for(self.cfg, use_gpus=bool(service.use_gpus))
        self.use_gpus = service.use_gpus
        self._started = False
        self._closing = False
        self._start_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.demand = DemandPublisher(self._spawn)  # to the autoscaler: live slots + queued requests
        self.tele = SchedulerTelemetry(setup("scheduler"))  # OTEL_* of this actor's process (off by default)
        self.book = SessionBook.of_service(self.tele, service, name)  # its records in the service's database
        self.sessions = self.book.sessions
        self._ops = ops  # None: on the cluster (RaySlotOps), once it is known whether it has GPUs
        self.slots = SlotManager(ops or RaySlotOps(self.cfg, service, owner=name, use_gpus=bool(service.use_gpus)),
                                 target=service.warm_slots, demand=self.spec.demand(), lock=self.lock,
                                 spawn=self._spawn, on_built=self._on_built, tele=self.tele)
        self._leaked_pgs: int | None = None  # slot placement groups Ray has and no slot holds (metrics on)
        self.draining = False

    # ------------------------------------------------------------------------------ the interface
    async def create_session(self, spec: SessionSpec) -> SessionInfo:
        await self._start()
        self.service.check_spec(spec)
        if spec.recover and spec.output.kind == "file":
            raise ValueError("recover=true with output kind 'file': a resumed session cannot append to the lost "
                             "room's MP4; use output kind 'livekit' or 'null', or recover=false")
        if self.draining:
            raise NoCapacity("this service is draining for an upgrade and takes no new sessions; retry (the new "
                             "cluster takes them)", DRAIN_RETRY_AFTER_S, code="draining")
        async with self.lock:
            old = self.sessions.get(spec.session_id)
            if old is not None and not old.terminal:
                raise ValueError(f"session {spec.session_id!r} already exists ({old.info.status}); use another id")
            adm, carried = self.tele.admission(spec.session_id, spec.preset, spec.trace_context, len(self.queue))
            if carried != spec.trace_context:  # no request context: the admission span roots the session's trace
                spec = replace(spec, trace_context=carried)
            try:
                self.book.check_quota(spec, self.service.max_sessions_per_key)
            except NoCapacity:
                self.tele.decided(adm, "rejected")
                raise
            now = time.monotonic()
            self._dispatch(now)
            sess = self.book.new(spec, SessionStatus.QUEUED, adm)
            lease = self.slots.acquire() if not self.waiting and not len(self.queue) else None
            if lease is not None:
                self.sessions[spec.session_id] = sess
                self._start_on(sess, lease)
                return sess.info
            if not len(self.queue) and self.slots.counts()["warming"] > len(self.waiting):
                self.sessions[spec.session_id] = sess  # a warm-pool slot is on its way: take it when ready
                self.waiting.append(spec.session_id)
                self.book.status(sess, SessionStatus.STARTING, "warming")
                return sess.info
            request = Request(spec.session_id, self.spec, now, now + self.service.queue_timeout_s)
            decision = decide(self._ledger(), self.queue, request, now)
            if isinstance(decision, Reject):
                self.tele.decided(adm, "rejected")
                raise NoCapacity(
                    f"{explain_fit(self._ledger(), self.spec.demand())}, and the queue is full "
                    f"({len(self.queue)}/{self.queue.max_len}); retry after {decision.retry_after_s:.0f} s",
                    decision.retry_after_s)
            if isinstance(decision, Expire):
                self.tele.decided(adm, "expired")
                raise NoCapacity("the request expired before it was decided; retry", 1.0)
            self.sessions[spec.session_id] = sess
            _, self.queue = commit(self._ledger(), self.queue, [decision], incoming=request)
            if isinstance(decision, Enqueue):
                sess.info.queue_position = decision.position
                self.tele.queued(adm, decision.position)
                self._queued_why(sess, decision.position, explain_fit(self._ledger(), self.spec.demand()))
            else:
                self._admit(decision, sess)
            self._publish_demand()
            return sess.info

    async def get_session(self, session_id: str) -> SessionInfo:
        await self._start()
        return self.book.get(session_id).info

    async def set_draining(self, draining: bool) -> None:
        """Upgrade drain (idempotent; every ingress replica calls it): refuse new creates, end queued and
        waiting requests with reason `draining` so their clients retry against the new cluster, keep no
        warm slots beyond the running sessions; running sessions finish or reach their max duration."""
        async with self.lock:
            self.draining = draining
            self.slots.set_target(0 if draining else self.service.warm_slots)
            if not draining:
                return
            for sid in [*self.queue.ids, *self.waiting]:
                self.queue = self.queue.remove(sid)
                self.book.terminal(self.sessions[sid], SessionStatus.ENDED, "draining")
            self.waiting = []
            self._publish_demand()

    async def list_sessions(self) -> list[SessionInfo]:
        await self._start()
        return self.book.listed()

    async def end_session(self, session_id: str, reason: str = "deleted",
                          trace_context: dict[str, str] | None = None) -> SessionInfo:
        await self._start()
        sess = self.book.get(session_id)
        self.tele.end_requested(sess.admission, reason, trace_context or {})  # the DELETE, in the session's trace
        if sess.terminal:
            return sess.info
        async with self.lock:
            if session_id in self.queue or session_id in self.waiting:
                self.queue = self.queue.remove(session_id)
                self.waiting = [w for w in self.waiting if w != session_id]
                self.book.terminal(sess, SessionStatus.ENDED, reason)
                self._dispatch(time.monotonic())
                return sess.info
            sess.end_reason = sess.end_reason or reason
            if sess.actor is not None:
                sess.actor.stop.remote(session_id, sess.end_reason)
        await self.book.wait_terminal(sess, END_WAIT_S)
        return sess.info

    async def capacity(self) -> Capacity:
        await self._start()
        nodes = self._ledger()
        whole = [replace(n, free=dict(n.total)) for n in nodes]
        running = sum(s.lease is not None and not s.terminal for s in self.sessions.values())
        return Capacity(bundles_total=free_bundles(whole, self.spec), bundles_free=free_bundles(nodes, self.spec),
                        sessions_running=running, queued=len(self.queue),
                        warm_slots_free=self.slots.counts()["free"])

    async def push_audio(self, session_id: str, pcm: bytes, sample_rate: int, channels: int) -> Any | None:
        """Held until the session runs, else forwarded; returns the session's actor (None before it runs), to which
        the ingress sends the session's further audio itself. Validated at the ingress (characters.audio)."""
        await self._start()
        sess = self.book.get(session_id)
        if sess.terminal:
            return None
        if sess.actor is None:
            held = sum(len(p) for p, _, _ in sess.pending_audio) + len(pcm)
            if held > PENDING_AUDIO_MAX_BYTES:
                raise ValueError(f"session {session_id!r} is {sess.info.status} and already holds {held} bytes of "
                                 f"audio (limit {PENDING_AUDIO_MAX_BYTES}); wait until it is RUNNING")
            sess.pending_audio.append((pcm, sample_rate, channels))
            return None
        with contextlib.suppress(ray.exceptions.RayActorError):  # ending: its run reports the end
            await sess.actor.push_audio.remote(session_id, pcm, sample_rate, channels)
        return sess.actor

    async def clear_audio(self, session_id: str) -> None:
        sess = self.book.get(session_id)
        sess.pending_audio.clear()
        if sess.actor is not None and not sess.terminal:
            with contextlib.suppress(ray.exceptions.RayActorError):
                await sess.actor.clear_audio.remote(session_id)

    async def events(self, session_id: str, after_seq: int, timeout_s: float = 10.0) -> list[SessionEvent]:
        await self._start()
        return await self.book.events(self.book.get(session_id), after_seq, timeout_s)

    # ------------------------------------------------------------------------------ from sessions and ops
    async def report(self, session_id: str, report: Report, slot_id: str | None = None) -> None:
        """A session actor's periodic report: events, stats, and its end once known. One from a slot the
        session no longer holds (a lost node's, streaming on for a moment after a recovery) is dropped."""
        await self._start()  # after a restart: the reports of surviving sessions start it
        sess = self.sessions.get(session_id)
        if sess is None or sess.terminal or (slot_id is not None and (sess.lease is None or
                                                                      sess.lease.slot_id != slot_id)):
            return
        sess.info.stats, sess.info.started_at = report.stats, sess.info.started_at or report.started_at
        for d in report.events:
            if d.kind == "status" and d.status is not None and d.status.terminal:
                if not (sess.spec.recover and d.status is SessionStatus.FAILED):  # else `_run` decides: recover?
                    self.book.terminal(sess, d.status, d.detail or "", report.stats)
                break
            if d.kind == "status" and d.status is not None:
                sess.info.status = d.status
            self.book.event(sess, d.kind, status=d.status, chunk=d.chunk, detail=d.detail, at=d.at)

    async def debug_slots(self) -> list[dict[str, Any]]:
        """Slots and their actors (tests and operators)."""
        await self._start()
        return self.slots.describe(lambda slot_id: [s.info.id for s in self.sessions.values()
                                                    if s.lease and s.lease.slot_id == slot_id and not s.terminal])

    async def debug_nodes(self) -> dict[str, str]:
        """Node id -> live, draining or lost, as the scheduler sees the cluster (tests and operators)."""
        await self._start()
        return self.members.states()

    async def shutdown(self) -> None:
        """End every session, drop the queue, remove every slot (tests, redeploys)."""
        self._closing = True
        for sess in list(self.sessions.values()):
            if not sess.terminal:
                await self.end_session(sess.info.id, "shutdown")
        async with self.lock:
            self.slots.remove_all()
            self._publish_demand()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.nodes.close()
        await self.slots.settle()  # every removed slot's graph torn down, its actors and group gone
        await asyncio.to_thread(self.tele.tel.flush, 2.0)

    # ------------------------------------------------------------------------------ decisions (lock held)
    def _dispatch(self, now: float) -> None:
        expired = [d for d in drain(self._ledger(), self.queue, now) if isinstance(d, Expire)]
        arrived = {r.request_id: r.arrived_at for r in self.queue}
        _, self.queue = commit(self._ledger(), self.queue, expired)
        for gone in expired:
            self.book.terminal(self.sessions[gone.request_id], SessionStatus.FAILED,
                           f"queue_timeout: no bundle freed within {now - arrived[gone.request_id]:.0f} s "
                           "(queue_timeout_s)")
        while self.waiting or len(self.queue):
            lease = self.slots.acquire()
            if lease is None:
                break
            if self.waiting:
                sid = self.waiting.pop(0)
            else:
                sid = self.queue.ids[0]
                self.queue = self.queue.remove(sid)
            self._start_on(self.sessions[sid], lease)
        admits = [d for d in drain(self._ledger(), self.queue, now) if isinstance(d, Admit)]
        _, self.queue = commit(self._ledger(), self.queue, admits)
        for admit in admits:
            self._admit(admit, self.sessions[admit.request_id])
        if not self.waiting and not len(self.queue) and not self._recovering():  # (a build would slow a recovery)
            self.slots.retire_surplus()
            for _ in range(self.slots.deficit()):
                node = best_fit(self._ledger(), self.spec.demand())
                if node is None:
                    break
                self.slots.add(node.node_id)
        why = explain_fit(self._ledger(), self.spec.demand()) if len(self.queue) else ""
        for i, sid in enumerate(self.queue.ids):
            self._queued_why(self.sessions[sid], i + 1, why)
        self._why = {sid: w for sid, w in self._why.items() if sid in self.queue}
        self._publish_demand()
        if self.tele.tel.metrics:
            self._snapshot()

    def _queued_why(self, sess: SessionRecord, position: int, why: str) -> None:
        """A queued session's place, and an event whenever why it waits changes (a node joined, a slot freed)."""
        sess.info.queue_position = position
        if self._why.get(sess.info.id) != why:
            self._why[sess.info.id] = why
            self.book.event(sess, "status", status=SessionStatus.QUEUED, detail=f"position {position}: {why}")

    def _recovering(self) -> bool:
        return any(s.resume is not None and s.info.status is not SessionStatus.RUNNING and not s.terminal
                   for s in self.sessions.values())

    def _snapshot(self) -> None:
        """The capacity gauges, as of now (lock held)."""
        self.tele.snapshot(statuses=[s.info.status.value for s in self.sessions.values()], queue_len=len(self.queue),
                           bundles_free=free_bundles(self._ledger(), self.spec), bundles_used=len(self.slots),
                           slot_states=[self.slots.state(sid) or "unknown" for sid in self.slots.records],
                           leaked_pgs=self._leaked_pgs, nodes=self.members.counts(), demand=len(self.demand.want))

    def _admit(self, admit: Admit, sess: SessionRecord) -> None:
        """A whole bundle is free for `sess`: build a new slot for it (cold start)."""
        sess.own_slot = self.slots.add(admit.node_id, sess.admission, sess.info.id)
        self.waiting.append(sess.info.id)
        sess.info.queue_position = None
        self.book.status(sess, SessionStatus.STARTING, "cold")

    def _start_on(self, sess: SessionRecord, lease: Lease) -> None:
        sess.lease = lease
        sess.info.warm_start = lease.slot_id != sess.own_slot
        self.tele.decided(sess.admission, "warm" if sess.info.warm_start else "cold",
                          slot=self.slots.trace(lease.slot_id), warm=sess.info.warm_start)
        sess.info.queue_position = None
        if sess.info.status is not SessionStatus.STARTING:
            self.book.status(sess, SessionStatus.STARTING, "warm" if sess.info.warm_start else "cold")
        self._spawn(self._run(sess))

    def _ledger(self) -> tuple[Any, ...]:
        return ledger(self.members.placeable(), self.slots.used())

    def _publish_demand(self) -> None:
        self.demand.publish([self.spec] * (len(self.slots) + len(self.queue)))

    # ------------------------------------------------------------------------------ tasks
    def _on_built(self, slot_id: str, error: str | None) -> None:
        """A slot's build ended (lock held): on failure, sessions waiting beyond the slots still warming fail
        with its reason; either way, decide again."""
        if error is not None:
            while len(self.waiting) > self.slots.counts()["warming"]:
                self.book.terminal(self.sessions[self.waiting.pop()], SessionStatus.FAILED, error)
        self._dispatch(time.monotonic())

    async def _run(self, sess: SessionRecord) -> None:
        assert sess.lease is not None
        slot = self.slots.slot(sess.lease.slot_id)
        assert slot is not None
        outcome = await (self._await_adopted(sess) if sess.adopted else self._drive(sess, slot))
        sess.adopted = False
        self._lost.pop(sess.info.id, None)
        if (sess.spec.recover and outcome.status is SessionStatus.FAILED and sess.recoveries < RECOVER_MAX_ATTEMPTS
                and (recoverable(outcome.reason) or outcome.reason.startswith(NODE_LOST))):
            await self._recover(sess, slot, outcome)
            return
        healthy = outcome.healthy and await self.slots.reset(slot, sess.info.id)
        sess.info.stats = outcome.stats
        async with self.lock:
            self.book.terminal(sess, outcome.status, outcome.reason, outcome.stats)
            self.slots.release(sess.lease, healthy=healthy)
            self._dispatch(time.monotonic())

    async def _drive(self, sess: SessionRecord, slot: Slot) -> Outcome:
        spec = sess.spec
        if sess.end_reason is not None:
            return Outcome(SessionStatus.ENDED, sess.end_reason, True, SessionStats())
        path = str(self.service.output_path(spec.session_id, spec.output.path)) if spec.output.kind == "file" else None
        if sess.resume is not None and sess.info.started_at is not None:  # a recovery keeps the session's end
            spec = replace(spec, max_duration_s=max(0.5, spec.max_duration_s - (time.time() - sess.info.started_at)))
        sid, actor = spec.session_id, slot.driver  # the slot's SessionActor: it outlives the session
        try:
            await self._unless_lost(sess, actor.start.remote(spec, path, ray.get_runtime_context().current_actor,
                                                             time.time(), sess.resume))
            sess.actor = actor  # calls naming the session reach it from now on
            for pcm, rate, channels in sess.pending_audio:
                actor.push_audio.remote(sid, pcm, rate, channels)
            sess.pending_audio.clear()
            if sess.end_reason is not None:
                actor.stop.remote(sid, sess.end_reason)
            outcome: Outcome = await self._unless_lost(sess, actor.outcome.remote(sid))
            return outcome
        except NodeLost as lost:
            return Outcome(SessionStatus.FAILED, str(lost), False, sess.info.stats)
        except RayError as err:
            return Outcome(SessionStatus.FAILED, f"session_failed: {classify(err)}", False, sess.info.stats)

    async def _await_adopted(self, sess: SessionRecord) -> Outcome:
        """The end of a session adopted from a previous scheduler (which started it)."""
        try:
            outcome: Outcome = await self._unless_lost(sess, sess.actor.outcome.remote(sess.info.id))
            return outcome
        except NodeLost as lost:
            return Outcome(SessionStatus.FAILED, str(lost), False, sess.info.stats)
        except RayError as err:
            return Outcome(SessionStatus.FAILED, f"session_failed: {classify(err)}", False, sess.info.stats)

    async def _unless_lost(self, sess: SessionRecord, ref: Any) -> Any:
        """`await ref`, unless the node of the session's slot is lost first: then NodeLost (the call is left
        to fail on its own, its error unread)."""
        lost = self._lost.setdefault(sess.info.id, asyncio.get_running_loop().create_future())
        call = asyncio.wrap_future(ref.future())
        done, _ = await asyncio.wait({call, lost}, return_when=asyncio.FIRST_COMPLETED)
        if call in done:
            return call.result()
        call.add_done_callback(lambda f: f.cancelled() or f.exception())
        raise NodeLost(lost.result())

    async def _recover(self, sess: SessionRecord, slot: Slot, outcome: Outcome) -> None:
        """A `recover` session lost its bundle: remove it, resume on a free warm slot, else on a new slot
        where a whole bundle is free, else fail for good (`deployments.sessions.recovery`)."""
        sess.recoveries += 1
        seen = max((e.chunk for e in sess.events if e.kind == "chunk" and e.chunk is not None), default=-1) + 1
        resume = outcome.resume or Resume(max(seen, outcome.stats.chunks), stats=outcome.stats)
        async with self.lock:
            assert sess.lease is not None
            self.slots.release(sess.lease, healthy=False)
            sess.lease, sess.actor, sess.own_slot = None, None, None
            sess.resume = replace(resume, attempt=sess.recoveries, reason=outcome.reason)
            sess.info.stats = outcome.stats
            if sess.end_reason is not None or self._closing:
                self.book.terminal(sess, SessionStatus.ENDED, sess.end_reason or "shutdown", outcome.stats)
            else:
                self.book.status(sess, SessionStatus.STARTING,
                                 f"recovering: {outcome.reason} (attempt {sess.recoveries})")
                lease = self.slots.acquire()
                node = best_fit(self._ledger(), self.spec.demand()) if lease is None else None
                if lease is not None:
                    self._start_on(sess, lease)
                elif node is not None:
                    self._admit(Admit(sess.info.id, node.node_id, self.spec.demand()), sess)
                    self.waiting.remove(sess.info.id)
                    self.waiting.insert(0, sess.info.id)  # ahead of new sessions: this one is live
                else:
                    self.book.terminal(sess, SessionStatus.FAILED,
                                       f"{outcome.reason}; recovery failed: no whole bundle is free", outcome.stats)
            self._dispatch(time.monotonic())

    # ------------------------------------------------------------------------------ bookkeeping
    async def _start(self) -> None:
        if self._started:
            return
        async with self._start_lock:
            if self._started:
                return
            await self.nodes.start()
            if self.use_gpus is None:
                self.use_gpus = await asyncio.to_thread(cluster_has_gpus)
                self.spec = bundles_for(self.cfg, use_gpus=self.use_gpus)
                self.slots.demand = self.spec.demand()
                if self._ops is None:
                    self.slots.ops = RaySlotOps(self.cfg, self.service, owner=self.name, use_gpus=self.use_gpus)
            found = await discover(self.name, self.cfg, use_gpus=bool(self.use_gpus))
            async with self.lock:
                for sess in adopt(found, self.book, self.slots, self.name):
                    self._spawn(self._run(sess))
                self.book.restored(int(sum(b.get("GPU", 0) for b in self.spec.bundles)))  # FAILED service_restarted
            self._started = True
            self._spawn(self._tick())
            async with self.lock:
                self._dispatch(time.monotonic())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.service.tick_s)
            if self.nodes.due():
                await self.slots.check_free()
                if self.tele.tel.metrics:
                    await self._check_placement_groups()
            changes = await self.nodes.poll(self.slots.used())
            async with self.lock:
                self._on_nodes(changes)
                self._dispatch(time.monotonic())
                self.book.heartbeat()

    def _on_nodes(self, changes: list[NodeChange]) -> None:
        """Apply node changes (lock held; none: still retire what frees on draining nodes): a lost node's
        sessions fail (or recover) at once and its slots go, a draining node's free slots go."""
        for change in changes:
            slots, sessions = self.slots.on_node(change.node_id), 0
            if change.kind == "lost":
                self.slots.node_lost(change.node_id)
                for sess in self.book.live():
                    if sess.lease is not None and sess.lease.slot_id in slots:
                        sessions += 1
                        fut = self._lost.setdefault(sess.info.id, asyncio.get_running_loop().create_future())
                        if not fut.done():
                            fut.set_result(change.reason)
            log.warning("node %s %s (seen by %s): %d slots, %d sessions on it", change.node_id, change.detail,
                        change.by, len(slots), sessions)
            self.tele.node_changed(change.kind, change.node_id, change.detail, change.by, change.gpus,
                                   slots=len(slots), sessions=sessions)
        self.slots.drop_lost_nodes(str(n["NodeID"]) for n in self.members.placeable())
        lost = [c for c in changes if c.kind == "lost"]
        while lost and len(self.waiting) > self.slots.counts()["warming"]:  # their slot was being built there
            self.book.terminal(self.sessions[self.waiting.pop()], SessionStatus.FAILED,
                               f"{lost[0].reason} while a slot was being built for it; retry")

    async def _check_placement_groups(self) -> None:
        """Count slot placement groups that Ray still has and no slot holds (a leak; metrics only)."""
        try:
            table = await asyncio.to_thread(ray.util.placement_group_table)
        except (RayError, OSError) as err:
            log.warning("could not list placement groups: %s", err)
            return
        async with self.lock:
            self._leaked_pgs = leaked_placement_groups(table, self.slots.records)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("scheduler task failed", exc_info=task.exception())


def get_or_create_scheduler(service: ServiceConfig, *, name: str = SCHEDULER_NAME, node_id: str | None = None) -> Any:
    """The scheduler actor `name` in namespace NAMESPACE: the running one, or a new detached one.
    Ray restarts it when its process dies, on another node when its node died (same handle); the new
    instance adopts the slots and sessions its predecessor left (`deployments.sessions.adoption`).
    `node_id`: prefer that node (soft affinity: e.g. the head, which outlives the GPU nodes). The actor then
    asks for a thousandth of a CPU: Ray 2.60 honours a soft node affinity only for a request of some
    resource; a zero-resource actor landed on another node in 4 of 8 tries on a loopback cluster, 0 of 8
    with 0.001 CPU."""
    affinity = {} if node_id is None else {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=True)}
    handle: Any = ray.remote(SessionScheduler).options(
        name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0 if node_id is None else 0.001, max_concurrency=1000, max_restarts=-1,
        **affinity).remote(service, name)
    handle.capacity.remote()  # starts it: reads the cluster, fills the warm pool
    return handle
