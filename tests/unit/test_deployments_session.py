"""Session pieces without Ray: exact audio slicing, the paced chunk loop on virtual time, the
session runner's lifecycle and stats, and the room's playout meter."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from characters.audio import chunk_sample_range
from characters.config import session_config
from characters.pacing import SegmentEvent, SpeechSplit
from deployments.pipeline.graph import ChunkFailure
from deployments.pipeline.loop import run_chunk_loop
from deployments.pipeline.messages import ChunkInput, ChunkReport
from deployments.pipeline.output import PlayoutMeter
from deployments.sessions.runner import AudioBuffer, SessionRunner, keeps_real_time, playback_event
from deployments.types import SessionStatus

CHUNK_S = 4 / 24


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> bool:
        self.now += max(0.0, seconds)
        return False


class FakePipeline:
    """Records submissions; a chunk takes `latency_s` of virtual time; `fail_at` raises on that fetch."""

    def __init__(self, clock: VirtualClock, latency_s: float = 0.05, fail_at: int | None = None) -> None:
        self.clock, self.latency_s, self.fail_at = clock, latency_s, fail_at
        self.submitted: list[ChunkInput] = []
        self.pending: deque[tuple[ChunkInput, float]] = deque()
        self.fetch_times: list[float] = []
        self.closed = False
        self.cut_s = 0.0
        self.preempted: list[tuple[str, int]] = []

    def submit(self, inp: ChunkInput) -> None:
        self.submitted.append(inp)
        self.pending.append((inp, self.clock.now))

    def preempt(self, session_id: str, chunk: int) -> None:
        self.preempted.append((session_id, chunk))

    def fetch(self, timeout_s: float) -> ChunkReport:
        inp, submitted = self.pending.popleft()
        if inp.chunk == self.fail_at:
            raise ChunkFailure("actor_died", "DiTWorker rank 0 died (ActorDiedError)")
        published = submitted + self.latency_s
        self.clock.now = max(self.clock.now, published)  # a fetch blocks until the chunk is out
        self.fetch_times.append(self.clock.now)
        if inp.preemptible and (inp.session_id, inp.chunk) in self.preempted:  # a DiT that gave it up
            return ChunkReport(inp.session_id, inp.chunk, 0, False, 0.0, 24.0, "", published, cut_s=CHUNK_S,
                               given_up=True)
        late = published > 0.05 + inp.chunk * CHUNK_S + 1e-9
        cut = self.cut_s if inp.onset else 0.0  # a room that cut this much idle content ahead of an onset
        return ChunkReport(inp.session_id, inp.chunk, 4, late, 0.0, 24.0, f"d{inp.chunk}", published, cut_s=cut)

    def close(self) -> bool:
        self.closed = True
        return True


def loop(pipe: FakePipeline, clock: VirtualClock, *, max_s: float = 1.0, depth: int = 2,
         stop: Callable[[], str | None] = lambda: None) -> tuple[str, list[int]]:
    reports: list[int] = []
    result = run_chunk_loop(pipe, session_id="s", audio=lambda k: np.zeros(2, np.float32), chunk_s=CHUNK_S,
                            depth=depth, max_duration_s=max_s, fetch_timeout_s=1.0, clock=clock, wait=clock.sleep,
                            stop_reason=stop, on_report=lambda r, t: reports.append(r.chunk))
    return result.reason, reports


def test_audio_buffer_slices_exact_chunks_and_pads_with_silence() -> None:
    buf = AudioBuffer(frames_per_chunk=4)
    stream = np.arange(1, 9000, dtype=np.float32)
    buf.push(stream[:5000])
    buf.push(stream[5000:])
    got = [buf.take(k) for k in range(5)]
    sizes = [b - a for a, b in (chunk_sample_range(k, 4) for k in range(5))]
    assert [len(g) for g in got] == sizes == [2666, 2667, 2667, 2666, 2667]
    joined = np.concatenate(got)
    assert np.array_equal(joined[: stream.size], stream)  # in order, nothing lost or repeated
    assert not joined[stream.size :].any()  # then silence: the character idles
    assert buf.queued_s == 0.0


def test_audio_buffer_clear_drops_queued_audio_and_limits_the_queue() -> None:
    buf = AudioBuffer(frames_per_chunk=4, max_s=1.0)
    buf.push(np.ones(8000, np.float32))
    assert buf.queued_s == 0.5
    assert buf.clear() == 8000
    assert not buf.take(0).any()
    with pytest.raises(ValueError, match="above the limit of 1 s"):
        buf.push(np.ones(16001, np.float32))
    with pytest.raises(ValueError, match="1-D float32"):
        buf.push(np.ones(10, np.int16))


def test_loop_paces_at_24_fps_and_pipelines_two_chunks() -> None:
    clock = VirtualClock()
    pipe = FakePipeline(clock)
    reason, reports = loop(pipe, clock, max_s=1.0)
    assert reason == "max_duration"
    assert [i.chunk for i in pipe.submitted] == list(range(6)) and reports == list(range(6))
    # chunk k+1 is submitted before chunk k is fetched
    assert pipe.fetch_times[0] == pytest.approx(CHUNK_S)
    assert all(len(i.pcm) == 2 for i in pipe.submitted)
    assert pipe.closed is False  # closing is the runner's job


def test_loop_stops_on_request_and_drains_chunks_in_flight() -> None:
    clock = VirtualClock()
    pipe = FakePipeline(clock)
    reason, reports = loop(pipe, clock, max_s=100.0, stop=lambda: "deleted" if clock.now >= 0.5 else None)
    assert reason == "deleted"
    assert reports == list(range(len(pipe.submitted)))  # every submitted chunk was fetched
    assert len(pipe.submitted) == 3


def test_loop_reports_the_first_failure() -> None:
    clock = VirtualClock()
    pipe = FakePipeline(clock, fail_at=3)
    reason, reports = loop(pipe, clock, max_s=100.0)
    assert reason == "actor_died" and reports == [0, 1, 2]


class AgentClock(VirtualClock):
    """Virtual time that pushes agent audio into `buffer` at given times; a sleep ends early at a push (as the
    runner's wait does: the audio queue wakes it)."""

    def __init__(self, buffer: AudioBuffer, pushes: list[tuple[float, int]]) -> None:
        super().__init__()
        self.buffer, self.pushes = buffer, sorted(pushes)  # (time, samples of speech)

    def sleep(self, seconds: float) -> bool:
        target = self.now + max(0.0, seconds)
        if self.pushes and self.pushes[0][0] <= target:
            at, n = self.pushes.pop(0)
            self.now = max(self.now, at)
            self.buffer.push(np.full(n, 0.1, np.float32))
            return True
        self.now = target
        return False


def agent_loop(pushes: list[tuple[float, int]], cut_s: float = 0.0, max_s: float = 2.5,
               lead_chunks: float = 2.0, preempt: bool = False) -> FakePipeline:
    now = [0.0]
    buf = AudioBuffer(frames_per_chunk=4, clock=lambda: now[0])
    clock = AgentClock(buf, pushes)
    buf.clock = lambda: clock.now
    pipe = FakePipeline(clock, latency_s=0.08)
    pipe.cut_s = cut_s
    run_chunk_loop(pipe, session_id="s", audio=buf.take, chunk_s=CHUNK_S, depth=2, max_duration_s=max_s,
                   fetch_timeout_s=1.0, clock=clock, wait=clock.sleep, stop_reason=lambda: None,
                   on_report=lambda r, t: None, ready=buf.windows_ready, lead_chunks=lead_chunks, preempt=preempt)
    return pipe


def starts(pipe: FakePipeline) -> list[float]:
    return [i.submitted_at or 0.0 for i in pipe.submitted]


def test_speech_goes_when_its_window_is_full_not_at_the_next_boundary_and_an_onset_moves_the_clock() -> None:
    """Idle chunks on their boundaries; 0.5 s of speech pushed at once 0.05 s after boundary 3 (a TTS is faster
    than real time): chunk 4 takes it at once, as an onset (the next window is full too), chunks 5 and 6 follow
    as soon as the pipeline has room (their audio is there), and once the room says it cut 0.125 s ahead of the
    onset every boundary is that much earlier."""
    t_speech = 3 * CHUNK_S + 0.05
    pipe = agent_loop([(t_speech, 8000)], cut_s=0.125)
    ins = pipe.submitted
    assert [i.chunk for i in ins[:4]] == [0, 1, 2, 3]
    assert starts(pipe)[:4] == pytest.approx([k * CHUNK_S for k in range(4)])
    assert not any(i.pcm.any() for i in ins[:4]) and not any(i.onset for i in ins[:4])
    assert ins[4].submitted_at == pytest.approx(t_speech) and ins[4].onset and ins[4].pcm.all()
    # chunk 5 once chunk 3 is out (0.5 + 0.08), well before its boundary; chunk 6 once chunk 4 is out (t_speech +
    # 0.08), whose report moved the boundaries 0.125 s earlier
    assert ins[5].submitted_at == pytest.approx(3 * CHUNK_S + 0.08) and not ins[5].onset and ins[5].pcm.all()
    assert ins[6].submitted_at == pytest.approx(t_speech + 0.08)
    assert ins[6].pcm.all() and not ins[6].onset
    # the speech ends within chunk 6 (8000 samples = 3 windows); the idle chunks after go on the moved boundaries
    after = [i for i in ins if i.chunk >= 8]
    assert after and all(i.submitted_at == pytest.approx(i.chunk * CHUNK_S - 0.125) for i in after)
    assert sum(i.onset for i in ins) == 1
    # urgent: the idle chunks, the onset and the two chunks after it (all of this short speech)
    assert all(i.urgent for i in ins)
    long = agent_loop([(t_speech, 16000)], cut_s=0.125, max_s=2.5).submitted  # 1 s of speech: 6 windows
    assert [i.urgent for i in long if i.pcm.any()] == [True, True, True, False, False, False]
    assert all(i.early_s >= CHUNK_S for i in long[7:10])  # the calm ones were made a chunk or more ahead


def test_speech_at_real_time_goes_when_its_window_fills_but_is_no_onset_and_a_partial_window_waits() -> None:
    """20 ms of speech every 20 ms from 0.34 s (a live microphone, not a TTS burst): chunk 3's window is full at
    its boundary; the next window cannot follow at once, so it is no onset (an onset's successor must not find
    its audio missing) and the boundaries stay where they were."""
    pipe = agent_loop([(0.34 + 0.02 * i, 320) for i in range(40)], cut_s=0.125, max_s=1.5)
    ins = pipe.submitted
    assert ins[3].submitted_at == pytest.approx(3 * CHUNK_S) and ins[3].pcm.all()
    assert not any(i.onset for i in ins)
    assert all(i.submitted_at <= i.chunk * CHUNK_S + 1e-9 for i in ins)  # none after its boundary: none moved
    # speech at real time runs no chunk ahead: urgent, every chunk of it
    assert [i.urgent for i in ins if i.pcm.any()] == [True] * sum(bool(i.pcm.any()) for i in ins) != []
    w = 2667  # chunk 4's window (chunk_sample_range(4, 4)), all at once: a burst, so an onset
    pipe = agent_loop([(3 * CHUNK_S + 0.05, w)], cut_s=0.125, max_s=1.5)
    assert pipe.submitted[4].submitted_at == pytest.approx(3 * CHUNK_S + 0.05) and pipe.submitted[4].onset
    pipe = agent_loop([(3 * CHUNK_S + 0.05, 1000)], max_s=1.5)  # less than a window: its boundary, padded
    ins = pipe.submitted
    assert ins[4].submitted_at == pytest.approx(4 * CHUNK_S) and ins[4].pcm[:1000].all() and not ins[4].pcm[1000:].any()
    assert not any(i.onset for i in ins)


def test_an_onset_asks_the_dit_to_give_up_the_idle_chunk_in_flight_and_the_clock_moves_a_chunk_more() -> None:
    """`preempt`: idle chunks are preemptible, speech is not; the onset (chunk 4, 0.05 s after boundary 3) asks
    for chunk 3, still in flight, to be given up, before it is submitted; chunk 3's report says it was (a
    chunk of the stream gone), so the boundaries after move a chunk earlier on top of the onset's cut."""
    t_speech = 3 * CHUNK_S + 0.05
    pipe = agent_loop([(t_speech, 8000)], cut_s=0.125, preempt=True)
    ins = pipe.submitted
    assert pipe.preempted == [("s", 3)]
    assert [i.preemptible for i in ins] == [not i.pcm.any() for i in ins] and ins[4].onset
    after = [i for i in ins if i.chunk >= 8]
    assert after and all(i.submitted_at == pytest.approx((i.chunk - 1) * CHUNK_S - 0.125) for i in after)
    # without it: nothing asked, nothing preemptible, the boundaries move by the cut alone
    pipe = agent_loop([(t_speech, 8000)], cut_s=0.125)
    assert pipe.preempted == [] and not any(i.preemptible for i in pipe.submitted)


def test_without_lead_nothing_goes_before_its_boundary() -> None:
    pipe = agent_loop([(3 * CHUNK_S + 0.05, 8000)], lead_chunks=0.0, max_s=1.5)
    assert all(i.submitted_at == pytest.approx(i.chunk * CHUNK_S) for i in pipe.submitted)
    assert pipe.submitted[4].onset  # an onset on its boundary still plays at once (the room cuts the buffer)


def runner(clock: VirtualClock, max_s: float = 1.0, paced: bool = True) -> SessionRunner:
    cfg = session_config("tiny", "cpu")
    r = SessionRunner("s", cfg, max_duration_s=max_s, depth=2, fetch_timeout_s=1.0, clock=clock, wall=clock,
                      paced=paced)
    r._wait = clock.sleep  # type: ignore[method-assign]  # virtual time
    return r


def test_runner_lifecycle_events_and_stats() -> None:
    clock = VirtualClock()
    r = runner(clock)
    pipe = FakePipeline(clock, latency_s=0.05)
    outcome = r.run(lambda: pipe)
    assert (outcome.status, outcome.reason, outcome.healthy) == (SessionStatus.ENDED, "max_duration", True)
    assert pipe.closed
    before = r.report()
    assert before.terminal is None  # a normal end is announced once the output is closed
    assert r.finish(outcome.status, outcome.reason) == outcome
    report = r.report()
    events = before.events + report.events
    statuses = [(e.status, e.detail) for e in events if e.kind == "status"]
    assert statuses == [(SessionStatus.READY, "compile_s=0.000"), (SessionStatus.RUNNING, None),
                        (SessionStatus.ENDED, "max_duration")]
    assert [e.chunk for e in events if e.kind == "chunk"] == list(range(6))
    s = report.stats
    assert (s.chunks, s.frames, s.late_chunks) == (6, 24, 0)
    assert s.step_ms_p50 == pytest.approx(50.0)
    assert r.report().events == []  # a report hands each event out once


def test_unpaced_runner_submits_back_to_back_at_the_pipelines_speed() -> None:
    clock = VirtualClock()
    r = runner(clock, paced=False)  # ServiceConfig.pacing "unpaced": benchmarks and file renders
    pipe = FakePipeline(clock, latency_s=0.05)
    outcome = r.run(lambda: pipe)
    assert (outcome.status, outcome.reason) == (SessionStatus.ENDED, "max_duration")
    # the fake's chunks take 50 ms each, two in flight: 40 in the second (paced: 6, one per 166.7 ms)
    assert [i.chunk for i in pipe.submitted] == list(range(40))
    assert max(np.diff(pipe.fetch_times)) == pytest.approx(0.05)


def test_only_non_livekit_outputs_may_run_unpaced() -> None:
    assert [keeps_real_time("unpaced", k) for k in ("null", "file", "livekit")] == [False, False, True]
    assert all(keeps_real_time("realtime", k) for k in ("null", "file", "livekit"))


def test_runner_failure_marks_the_slot_unhealthy() -> None:
    clock = VirtualClock()
    r = runner(clock)
    pipe = FakePipeline(clock, fail_at=2)
    outcome = r.run(lambda: pipe)
    assert outcome.status is SessionStatus.FAILED and not outcome.healthy
    assert outcome.reason == "actor_died: DiTWorker rank 0 died (ActorDiedError)"
    assert pipe.closed
    assert r.finish(SessionStatus.ENDED, "deleted").reason == outcome.reason  # the first end wins


def test_runner_start_failure() -> None:
    clock = VirtualClock()
    r = runner(clock)

    def broken() -> FakePipeline:
        raise ChunkFailure("pipeline_error", "compile failed")

    outcome = r.run(broken)
    assert outcome.status is SessionStatus.FAILED and outcome.reason.startswith("start_failed: pipeline_error")


def test_playout_meter_counts_late_chunks_and_delivered_fps() -> None:
    meter = PlayoutMeter(CHUNK_S, 4, buffer_s=CHUNK_S, window=4)
    assert meter.on_chunk(1.0) == (False, 0.0)  # plays at 1 + buffer
    for k in range(1, 4):
        assert meter.on_chunk(1.0 + k * CHUNK_S)[0] is False  # on time, within the jitter buffer
    assert meter.delivered_fps == pytest.approx(24.0)
    late, lateness = meter.on_chunk(1.0 + 4 * CHUNK_S + 0.5)  # due at 1 + 5 chunks, arrives 0.5 - 1 chunk late
    assert late and lateness == pytest.approx(0.5 - CHUNK_S)
    assert meter.late == 1 and meter.delivered_fps < 24.0


class SpeakingPipeline(FakePipeline):
    """FakePipeline whose chunk 2 report carries a segment's start (with its split) and chunk 4 its finish,
    as the room reports them; presented fps as a LiveKit room measures it."""

    def fetch(self, timeout_s: float) -> ChunkReport:
        report = super().fetch(timeout_s)
        playback: tuple[SegmentEvent, ...] = ()
        if report.chunk == 2:
            split = SpeechSplit(1, sent_at=1.0, submitted_at=1.04, arrived_at=1.15, shown_at=1.31)
            playback = (SegmentEvent("started", "seg-1", latency_s=0.31, split=split),)
        elif report.chunk == 4:
            playback = (SegmentEvent("finished", "seg-1", position_s=0.5, interrupted=True),)
        return replace(report, presented_fps=23.5, playback=playback)


def test_runner_turns_the_rooms_speech_starts_into_events_and_stats() -> None:
    clock = VirtualClock()
    r = runner(clock)
    pipe = SpeakingPipeline(clock, latency_s=0.05)
    r.run(lambda: pipe)
    events = r.report().events
    started = [e.detail for e in events if e.kind == "playback_started"]
    finished = [e.detail for e in events if e.kind == "playback_finished"]
    assert started == ["segment=seg-1 latency_ms=310.0 chunk=1 boundary_ms=40.0 compute_ms=110.0 buffer_ms=160.0 "
                       "shown_at=1.3100"]
    assert finished == ["segment=seg-1 position_s=0.500 interrupted=1"]
    s = r.report().stats
    assert s.speech_ms_p50 == pytest.approx(310.0) and s.presented_fps == 23.5 and s.fps == 24.0
    # the chunk loop stamps each chunk with the moment it took its audio (the room splits latency with it)
    assert [i.submitted_at for i in pipe.submitted] == pytest.approx([k * CHUNK_S for k in range(6)], abs=1e-9)


def test_an_interrupted_segments_finish_is_dated_when_the_clear_arrived() -> None:
    """The room dates an interruption's finish (`SegmentEvent.at`, wall clock) when `lk.clear_buffer` reached it; the
    session's event keeps that time, not when the next chunk report carried it. Other events: when they are told."""
    cut = playback_event(SegmentEvent("finished", "s", 1.25, interrupted=True, at=5.0), at=9.0)
    assert (cut.kind, cut.at) == ("playback_finished", 5.0) and "interrupted=1" in (cut.detail or "")
    assert playback_event(SegmentEvent("finished", "s", 3.0), at=9.0).at == 9.0
