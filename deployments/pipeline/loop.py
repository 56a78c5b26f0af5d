"""The chunk loop of one session: ask the policy, submit, collect, report.

`drive` is the whole loop (`characters.chunk_policy.ChunkPolicy` decides when chunk k goes and how it is
marked; this module only waits, submits and collects). `run_chunk_loop` is its former keyword form, kept
for one release.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from characters.chunk_policy import ChunkPolicy
from deployments.pipeline.graph import ChunkFailure, Pipeline
from deployments.pipeline.messages import ChunkInput, ChunkReport


@dataclass(frozen=True)
class LoopResult:
    reason: str  # why the loop stopped: the stop reason, "max_duration", or a ChunkFailure reason
    failure: ChunkFailure | None
    submitted: int


@dataclass(frozen=True)
class LoopIO:
    """What the loop reads and calls besides the pipeline. `wait(s)` must return early when audio arrives;
    `ready(k)`: whole windows queued from chunk k on (0-2; None: never ahead of the boundary)."""

    session_id: str
    audio: Callable[[int], np.ndarray]
    clock: Callable[[], float]
    wait: Callable[[float], object]
    stop_reason: Callable[[], str | None]
    on_report: Callable[[ChunkReport, float], None]
    fetch_timeout_s: float
    ready: Callable[[int], int] | None = None


def drive(pipeline: Pipeline, policy: ChunkPolicy, io: LoopIO) -> LoopResult:
    """Run chunks until a stop, `max_duration_s` or the first failure; chunks in flight are fetched on a stop."""
    reason: str | None = None
    try:
        while (turn := _turn(policy, io))[0] is None:
            pcm = io.audio(policy.chunk)
            # speech is never exactly 0.0 (the room nudges zeros), padding always is
            plan = policy.plan(io.clock(), speech=bool(pcm.any()), full=turn[1])  # decide
            if plan.preempt is not None:
                pipeline.preempt(io.session_id, plan.preempt)
            pipeline.submit(ChunkInput(io.session_id, plan.chunk, pcm, plan.submitted_at, plan.onset,  # submit
                                       plan.early_s, plan.urgent, plan.preemptible))
            while policy.must_collect():
                _collect(pipeline, policy, io)  # collect, report
        reason = turn[0]
        while policy.in_flight:
            _collect(pipeline, policy, io)
    except ChunkFailure as failure:
        return LoopResult(failure.reason, failure, policy.submitted)
    return LoopResult(reason, None, policy.submitted)


def _turn(policy: ChunkPolicy, io: LoopIO) -> tuple[str | None, int]:
    """Wait until the next chunk may go; (why the loop stops, or None; whole windows queued for it)."""
    full = 0
    while (reason := io.stop_reason()) is None:
        now = io.clock()
        full = io.ready(policy.chunk) if io.ready is not None else 0  # (before the wait: a push wakes it)
        if now >= (at := policy.go_at(full)):
            break
        io.wait(at - now)
    if reason is None and policy.expired(io.clock()):
        reason = "max_duration"
    return reason, full


def _collect(pipeline: Pipeline, policy: ChunkPolicy, io: LoopIO) -> None:
    report = pipeline.fetch(io.fetch_timeout_s)
    io.on_report(report, policy.collected(report.cut_s))


def run_chunk_loop(pipeline: Pipeline, *, session_id: str, audio: Callable[[int], np.ndarray], chunk_s: float,
                   depth: int, max_duration_s: float, fetch_timeout_s: float, clock: Callable[[], float],
                   wait: Callable[[float], object], stop_reason: Callable[[], str | None],
                   on_report: Callable[[ChunkReport, float], None], first_chunk: int = 0,
                   ready: Callable[[int], int] | None = None, lead_chunks: float = 0.0, onsets: bool = True,
                   urgent_chunks: int = 3, preempt: bool = False) -> LoopResult:
    """`drive` with the policy's settings as keywords (deprecated: build a `ChunkPolicy` and call `drive`)."""
    policy = ChunkPolicy(chunk_s=chunk_s, depth=depth, start=clock(), max_duration_s=max_duration_s,
                         first_chunk=first_chunk, run_ahead_chunks=lead_chunks, onsets=onsets,
                         urgent_chunks=urgent_chunks, preempt=preempt)
    return drive(pipeline, policy, LoopIO(session_id, audio, clock, wait, stop_reason, on_report, fetch_timeout_s,
                                          ready))
