"""characters.pacing on virtual time: sync by construction, jitter buffer, late chunks, segments, clear."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest

from characters.audio import chunk_sample_range
from characters.pacing import (
    AudioOut,
    ClearResult,
    PacingConfig,
    Playout,
    SegmentEvent,
    VideoOut,
    speech_prefix,
    to_int16,
)

SR, FPS, F = 16000, 24, 4
T = F / FPS  # chunk duration
LEAD = 0.04


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def chunk(k: int, speech: int | None = None, h: int = 6, w: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Chunk k: frame i is filled with (4k + i) % 251 + 1; audio = `speech` non-zero samples (all if None),
    then zeros. Sample values encode their absolute index so the output stream can be checked exactly."""
    s0, s1 = chunk_sample_range(k, F)
    frames = np.stack([np.full((h, w, 3), (F * k + i) % 251 + 1, np.uint8) for i in range(F)])
    pcm = (((np.arange(s0, s1) % 1000) + 1) / 32768.0).astype(np.float32)  # never 0
    n = pcm.size if speech is None else speech
    pcm[n:] = 0.0
    return frames, pcm


def silent(k: int) -> tuple[np.ndarray, np.ndarray]:
    return chunk(k, speech=0)


@dataclass
class Run:
    """Drives a Playout on virtual time: chunk arrivals at given times, polls exactly when due."""

    playout: Playout
    clock: Clock
    arrivals: list[tuple[float, int, int | None]] = field(default_factory=list)  # (time, k, speech)
    out: list[tuple[float, VideoOut | AudioOut | SegmentEvent]] = field(default_factory=list)
    extra_s: float = 0.0  # the simulated sink holds this much more than what it was given
    sink_end: float = 0.0  # when the simulated sink's queued audio runs out
    onsets: set[int] = field(default_factory=set)  # chunks pushed with onset=True
    cuts: dict[int, float] = field(default_factory=dict)  # what those pushes returned
    made_s: float | None = None  # each chunk was submitted this long before it arrives (None: not said)
    early: dict[int, float] = field(default_factory=dict)  # chunk -> early_s its push says
    parts: dict[int, float] = field(default_factory=dict)  # chunk -> its first frame pushed alone, the rest this later

    def poll(self) -> None:
        now = self.clock.t
        items = self.playout.poll(audio_queue_s=max(0.0, self.sink_end - now) + self.extra_s)
        for item in items:
            if isinstance(item, AudioOut):
                self.sink_end = max(self.sink_end, now) + item.samples.size / SR
            self.out.append((now, item))

    def clear(self, dropped: int) -> ClearResult:
        res = self.playout.clear(dropped)
        if res.flush_audio:
            self.sink_end = self.clock.t
        return res

    def until(self, t_end: float, late_by: float = 0.0) -> None:
        pending = sorted(self.arrivals)
        self.arrivals = []
        while True:
            due = self.playout.next_due()
            t_arr = pending[0][0] if pending else math.inf
            t_due = (due + late_by) if due is not None else math.inf
            t = min(t_arr, t_due)
            if t > t_end:
                self.clock.t = max(self.clock.t, t_end)
                self.arrivals = pending
                return
            self.clock.t = max(self.clock.t, t)
            if t_arr <= t_due:
                _, k, speech = pending.pop(0)
                made = None if self.made_s is None else self.clock.t - self.made_s
                frames, pcm = chunk(abs(k), speech)
                n = pcm.size // F
                if k < 0:  # the rest of a chunk pushed in two parts
                    self.playout.push(frames[1:], pcm[n:], submitted_at=None, continues=True)
                    continue
                if k in self.parts:
                    frames, pcm = frames[:1], pcm[:n]
                    pending.append((self.clock.t + self.parts[k], -k, speech))
                    pending.sort()
                cut = self.playout.push(frames, pcm, submitted_at=made, onset=k in self.onsets,
                                        early_s=self.early.get(k, 0.0))
                if k in self.onsets:
                    self.cuts[k] = cut
            else:
                self.poll()

    def video(self) -> list[VideoOut]:
        return [o for _, o in self.out if isinstance(o, VideoOut)]

    def audio(self) -> np.ndarray:
        parts = [o.samples for _, o in self.out if isinstance(o, AudioOut)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int16)

    def events(self) -> list[tuple[float, SegmentEvent]]:
        return [(t, o) for t, o in self.out if isinstance(o, SegmentEvent)]


def make(**cfg: float) -> tuple[Playout, Clock]:
    clock = Clock()
    return Playout(PacingConfig(**cfg), clock=clock), clock  # type: ignore[arg-type]


def on_time(run: Run, chunks: range, t0: float, speech: int | None = 0) -> None:
    run.arrivals += [(t0 + k * T, k, speech) for k in chunks]


def stream(k0: int, k1: int, speech: int | None = None) -> np.ndarray:
    return np.concatenate([to_int16(chunk(k, speech)[1]) for k in range(k0, k1)])


# ------------------------------------------------------------------------------------------ sync


def test_on_time_chunks_play_at_24fps_with_their_own_audio_in_sync() -> None:
    p, clock = make()
    run = Run(p, clock)
    on_time(run, range(30), clock.t, speech=None)
    run.until(clock.t + 30 * T + 0.5)
    video = run.video()
    t0 = video[0].due
    assert t0 == pytest.approx(100.0 + T)  # started one chunk (target_depth) after the first arrival
    fresh = [v for v in video if v.fresh]
    assert len(fresh) == 30 * F
    assert [int(v.frame[0, 0, 0]) for v in fresh] == [(i % 251) + 1 for i in range(30 * F)]  # every frame, in order
    assert [v.due for v in fresh] == pytest.approx([t0 + (i * SR // FPS) / SR for i in range(30 * F)])
    audio = run.audio()
    s_end = chunk_sample_range(29, F)[1]
    assert np.array_equal(audio[:s_end], stream(0, 30))  # every sample, none lost or repeated
    # frame i of chunk k is shown while sample i * n // F of chunk k plays: the audio frame holding that
    # sample is handed out LEAD early, and the sink holds LEAD of audio, so the measured offset is 0
    st = p.stats()
    assert st.av_offset_max_ms == pytest.approx(0.0, abs=0.07)  # within one sample (62.5 us)
    assert st.late_chunks == st.slips == 0
    assert st.audio_dry == 0  # polled when due, the sink always held the lead
    assert st.underruns == 1  # only after the last chunk: the stream ended, the last frame is held
    assert st.frames_sent >= 30 * F and st.fresh_frames == 30 * F
    assert st.audio_frames_sent == len(audio) // 160


def test_audio_frames_are_10ms_due_lead_before_their_play_time() -> None:
    p, clock = make(audio_lead_s=0.03)
    run = Run(p, clock)
    on_time(run, range(4), clock.t)
    run.until(clock.t + 0.6)
    audio = [o for _, o in run.out if isinstance(o, AudioOut)]
    t0 = run.video()[0].due
    assert all(a.samples.shape == (160,) and a.samples.dtype == np.int16 for a in audio)
    assert [a.due for a in audio[:10]] == pytest.approx([t0 + j * 0.01 - 0.03 for j in range(10)])
    assert [a.index for a in audio] == list(range(len(audio)))


def test_measured_av_offset_follows_late_video_and_sink_queue() -> None:
    p, clock = make()
    run = Run(p, clock, extra_s=0.012)  # the sink holds 12 ms more than it was given: audio plays later
    on_time(run, range(10), clock.t)
    run.until(clock.t + 1.5)
    assert p.stats().av_offset_ms == pytest.approx(-12.0, abs=0.1)  # video 12 ms ahead of its audio


def test_fps_stats_count_fresh_and_held_frames() -> None:
    p, clock = make()
    run = Run(p, clock)
    on_time(run, range(20), clock.t)
    run.until(clock.t + 20 * T)
    st = p.stats()
    assert st.fps == pytest.approx(24.0, rel=0.02) and st.fresh_fps == pytest.approx(24.0, rel=0.02)
    run.until(clock.t + 2.5)  # the stream stopped: frames are held, none fresh
    st = p.stats()
    assert st.fps == pytest.approx(24.0, rel=0.02) and st.fresh_fps == 0.0


# ------------------------------------------------------------------------------------------ jitter buffer


def test_playout_waits_target_depth_or_starts_when_more_is_queued() -> None:
    p, clock = make(target_depth=2)
    p.push(*silent(0))
    assert p.next_due() == pytest.approx(clock.t + 2 * T)
    clock.t += 0.1
    assert p.poll() == [] and not p.stats().started
    p.push(*silent(1))
    p.push(*silent(2))  # three queued > 2: start now
    assert p.next_due() == pytest.approx(100.0)
    assert any(isinstance(o, VideoOut) for o in p.poll())


def test_late_chunk_holds_last_frame_and_plays_silence_then_all_its_audio() -> None:
    p, clock = make()
    run = Run(p, clock)
    t = clock.t
    run.arrivals += [(t + k * T, k, None) for k in range(3)] + [(t + 3 * T + 0.3, 3, None)]
    run.arrivals += [(t + k * T + 0.3, k, None) for k in range(4, 8)]
    run.until(t + 7 * T + 0.3)
    st = p.stats()
    assert st.late_chunks == 1 and st.underruns == 1
    # playout started one chunk after chunk 0 arrived, so chunk 3 was due at arrival + T - LEAD (its audio
    # is handed out first): late by 0.3 - (T - LEAD); the stall is that, rounded up to whole frame slots
    lateness = 0.3 - (T - LEAD)
    assert lateness <= st.stall_s <= lateness + 1 / FPS
    assert st.av_offset_max_ms < 0.07  # in sync after the stall too
    run.until(t + 3.0)
    video = run.video()
    held = [v for v in video[: 8 * F + 20] if not v.fresh]
    assert held and all(int(v.frame[0, 0, 0]) == (F * 2 + 3) % 251 + 1 for v in held[:3])  # chunk 2's last frame
    fresh = [int(v.frame[0, 0, 0]) for v in video if v.fresh]
    assert fresh == [(i % 251) + 1 for i in range(8 * F)]  # no frame lost
    audio = run.audio()
    speech = audio[np.flatnonzero(audio)]
    assert np.array_equal(speech, stream(0, 8)), "every spoken sample plays, in order"
    gap = np.flatnonzero(audio == 0)
    s2_end = chunk_sample_range(2, F)[1]
    assert gap[0] == s2_end  # silence starts exactly where chunk 2's audio ends


def test_idle_chunks_are_dropped_above_max_depth_speech_never() -> None:
    p, clock = make(max_depth=3, target_depth=10)
    p.push(*silent(0))
    for k in range(1, 4):
        p.push(*chunk(k))  # speech (of no known segment)
    st = p.stats()
    assert st.queued_chunks == 3 and st.dropped_idle_chunks == 1  # the idle chunk went
    for k in range(4, 8):
        p.push(*chunk(k))
    st = p.stats()
    assert st.queued_chunks == 7 and st.dropped_idle_chunks == 1  # speech is kept: latency grows instead
    run = Run(p, clock)
    run.until(clock.t + 3.0)
    assert [int(v.frame[0, 0, 0]) for v in run.video() if v.fresh] == [(i % 251) + 1 for i in range(4, 32)]


def test_a_stalled_owner_slips_the_timeline_and_stays_in_sync() -> None:
    p, clock = make()
    run = Run(p, clock)
    t = clock.t
    on_time(run, range(30), t, speech=None)
    run.until(t + 1.5)
    run.until(t + 1.8, late_by=0.3)  # the owner's loop stalls 0.3 s once: the sink's audio queue runs dry
    run.until(t + 6.0)
    st = p.stats()
    assert st.slips == 1
    assert st.audio_dry == 1  # the sink played all it had: the gap the viewer heard, counted once
    offsets_after = st.av_offset_max_ms  # the window (2 s) covers only the time after the stall
    assert offsets_after < 0.07, "audio and video slipped together"
    fresh = [int(v.frame[0, 0, 0]) for v in run.video() if v.fresh]
    assert fresh == [(i % 251) + 1 for i in range(30 * F)]
    assert np.array_equal(run.audio()[np.flatnonzero(run.audio())], stream(0, 30))  # no speech lost


@pytest.mark.parametrize("speech", [0, None])
def test_a_buffer_left_deep_by_a_stall_sheds_one_idle_chunk(speech: int | None) -> None:
    p, clock = make(shrink_after_s=2.0)
    run = Run(p, clock)
    t = clock.t
    # chunk 3 is 0.3 s late; the chunks made after it were on time and arrive right behind it (FIFO):
    # after the stall the buffer is deeper by the stall
    run.arrivals += [(max(t + k * T, t + 3 * T + 0.3 if k >= 3 else 0.0), k, speech) for k in range(40)]
    run.until(t + 1.5)
    deep = p.stats().buffered_s
    assert deep >= 2 * T - 1e-9  # (steady state: at most one chunk)
    run.until(t + 6.0)
    st = p.stats()
    assert st.late_chunks == 1
    if speech == 0:
        assert st.dropped_idle_chunks >= 1 and st.buffered_s <= deep - T  # latency recovered, chunk by chunk
    else:
        assert st.dropped_idle_chunks == 0 and st.buffered_s >= 2 * T - 1e-9  # never speech: latency stays


def test_late_poll_slips_instead_of_bursting() -> None:
    p, clock = make(max_catchup_s=0.1)
    run = Run(p, clock)
    on_time(run, range(40), clock.t, speech=None)
    run.until(clock.t + 2.0)
    n_before = len(run.out)
    clock.t += 1.0  # the owner was blocked for a second
    n_polled = len(run.out)
    run.poll()
    assert p.stats().slips == 1
    assert len(run.out) - n_polled <= 14  # 0.1 s of backlog (10 audio frames, 3 video frames), not a second's
    run.until(clock.t + 5.0)
    fresh = [int(v.frame[0, 0, 0]) for v in run.video() if v.fresh]
    assert fresh == [(i % 251) + 1 for i in range(40 * F)]  # nothing dropped by the slip
    assert len(run.out) > n_before


# ------------------------------------------------------------------------------------------ segments


def test_segment_started_on_its_first_frame_finished_when_all_shown() -> None:
    p, clock = make()
    run = Run(p, clock)
    n0 = chunk_sample_range(0, F)[1]
    n1 = chunk_sample_range(1, F)[1] - n0
    p.speech_open("a")
    p.speech_sent("a", n0 + n1 // 2)  # 1.5 chunks of speech
    assert p.speech_ended("a") == []
    t = clock.t
    run.arrivals += [(t, 0, None), (t + T, 1, n1 // 2)] + [(t + k * T, k, 0) for k in range(2, 6)]
    run.until(t + 2.0)
    events = run.events()
    assert [e.kind for _, e in events] == ["started", "finished"]
    video = run.video()
    assert events[0][0] == video[0].due  # with the first frame
    assert events[0][1].latency_s == pytest.approx(video[0].due - t)  # sent at t, first frame shown at due
    fin_t, fin = events[1]
    # the frame whose audio holds the segment's last sample: chunk 1, frame 1 (samples [n1/4, n1/2))
    assert fin_t == pytest.approx(video[F + 1].due)
    assert fin.position_s == pytest.approx((n0 + n1 // 2) / SR) and not fin.interrupted


def test_segments_finish_in_order_and_an_empty_one_right_after() -> None:
    p, clock = make()
    run = Run(p, clock)
    n0 = chunk_sample_range(0, F)[1]
    p.speech_open("a")
    p.speech_sent("a", 1000)
    p.speech_ended("a")
    p.speech_open("b")
    p.speech_sent("b", n0 - 1000)
    p.speech_open("c")
    assert p.speech_ended("c") == []  # empty, but a and b come first
    p.speech_ended("b")
    run.arrivals += [(clock.t, 0, None), (clock.t + T, 1, 0)]
    run.until(clock.t + 1.0)
    kinds = [(e.kind, e.segment) for _, e in run.events()]
    assert kinds == [("started", "a"), ("started", "b"), ("finished", "a"), ("finished", "b"), ("finished", "c")]
    fins = [e for _, e in run.events() if e.kind == "finished"]
    assert [f.position_s for f in fins] == pytest.approx([1000 / SR, (n0 - 1000) / SR, 0.0])


def test_empty_segment_alone_finishes_when_it_ends() -> None:
    p, _ = make()
    p.speech_open("x")
    assert p.speech_ended("x") == [SegmentEvent("finished", "x", 0.0)]


def test_speech_is_inferred_from_the_non_zero_prefix_or_given() -> None:
    assert speech_prefix(np.array([0.1, -0.2, 0.3, 0.0, 0.0], np.float32)) == 3
    assert speech_prefix(np.array([0.0, 0.5, 0.0], np.float32)) == 2  # a zero inside speech is still speech
    assert speech_prefix(np.zeros(4, np.float32)) == 0
    p, clock = make()
    p.speech_open("a")
    p.speech_sent("a", 3000)
    p.push(*chunk(0, speech=1000), speech_samples=2000)  # the caller's count wins
    p.push(*chunk(1))  # inferred: all of it, of which 1000 samples are "a"
    p.speech_ended("a")
    run = Run(p, clock)
    run.until(clock.t + 1.0)
    fin = [e for _, e in run.events() if e.kind == "finished"]
    assert fin == [SegmentEvent("finished", "a", 3000 / SR)]


def test_speech_lost_by_the_generator_is_skipped_after_the_stale_time() -> None:
    p, clock = make(stale_speech_s=1.0)
    run = Run(p, clock)
    p.speech_open("a")
    p.speech_sent("a", 500)  # the generator never got these
    p.speech_ended("a")
    on_time(run, range(12), clock.t)  # all silent
    run.until(clock.t + 12 * T)
    assert [e.kind for _, e in run.events()] == ["finished"]
    assert p.stats().lost_speech_samples == 500
    finished_at = run.events()[0][0]
    assert finished_at >= 101.0


# ------------------------------------------------------------------------------------------ clear


def test_clear_interrupts_drops_queued_and_inflight_speech_and_returns_to_idle() -> None:
    p, clock = make()
    run = Run(p, clock)
    t = clock.t
    total = chunk_sample_range(9, F)[1]  # ten chunks of speech sent
    p.speech_open("a")
    p.speech_sent("a", total)
    p.speech_ended("a")
    run.arrivals += [(t + k * T, k, None) for k in range(3)]  # chunks 0..2 made from it
    run.until(t + 2 * T + 0.05)  # chunk 0 shown, chunk 1 playing, chunk 2 queued
    t_clear = clock.t
    dropped_by_generator = total - chunk_sample_range(3, F)[1]  # chunk 3 was in flight
    res = run.clear(dropped_by_generator)
    assert res.flush_audio and res.dropped_chunks == 1
    assert [(e.kind, e.segment, e.interrupted) for e in res.events] == [("finished", "a", True)]
    shown_audio = res.events[0].position_s
    assert chunk_sample_range(0, F)[1] / SR < shown_audio < chunk_sample_range(1, F)[1] / SR
    run.arrivals += [(t + 3 * T, 3, None)]  # the in-flight chunk arrives: dropped
    run.arrivals += [(t + k * T, k, 0) for k in range(4, 8)]  # idle chunks made after the clear
    run.until(t + 3.0)
    st = p.stats()
    assert st.dropped_cleared_chunks == 2
    after = [(tt, o) for tt, o in run.out if tt >= t_clear]
    first_fresh = next(tt for tt, o in after if isinstance(o, VideoOut) and o.fresh)
    # the blanked chunks keep their slots: the first idle chunk plays on the original schedule, one chunk
    # (the jitter buffer) after it arrived, so the chunks after it are not late
    assert first_fresh == pytest.approx(t + 5 * T)
    assert st.idle_after_clear_s == pytest.approx(first_fresh - t_clear)
    held = [o for tt, o in after if isinstance(o, VideoOut) and tt < first_fresh]
    assert held and not any(v.fresh for v in held)
    assert all(int(v.frame[0, 0, 0]) == int(held[0].frame[0, 0, 0]) for v in held)  # one frame held
    played_after = np.concatenate([o.samples for tt, o in after if isinstance(o, AudioOut)])
    assert not played_after.any(), "no interrupted speech is handed out after the clear"
    assert st.late_chunks == 0 and st.av_offset_max_ms < 0.13  # within two samples
    assert st.audio_dry == 0  # the flush emptied the sink's queue on purpose: no gap of the playout's
    assert not any(isinstance(o, SegmentEvent) for _, o in after)  # nothing more for the cleared segment


@pytest.mark.parametrize("hold", ["rest", "last"])
def test_clear_shows_the_character_at_rest_from_the_next_frame(hold: str) -> None:
    """Idle chunks 0-1, then speech in 2-4; a clear while chunk 2 plays: from the next frame on, the held
    frame is the last one shown without speech (chunk 1's last frame), not the frame of the cut word."""
    p, clock = make(hold_on_clear=hold)  # type: ignore[arg-type]
    run = Run(p, clock)
    t = clock.t
    s2, s5 = chunk_sample_range(2, F)[0], chunk_sample_range(5, F)[0]
    run.arrivals += [(t + k * T, k, 0) for k in range(2)]
    run.until(t + 2 * T - 0.01)
    p.speech_open("a")
    p.speech_sent("a", s5 - s2)
    p.speech_ended("a")
    run.arrivals += [(t + k * T, k, None) for k in range(2, 5)]
    run.until(t + 3 * T + 0.03)  # chunk 2 (speech) playing, chunk 3 queued, chunk 4 in flight
    speaking = run.video()[-1]
    rest_value = (F * 1 + F - 1) % 251 + 1  # chunk 1's last frame
    assert speaking.fresh and int(speaking.frame[0, 0, 0]) != rest_value
    t_clear = clock.t
    run.clear(0)
    run.arrivals += [(t + k * T, k, 0) for k in range(5, 9)]
    run.until(t + 2.0)
    after = [(tt, o) for tt, o in run.out if tt >= t_clear and isinstance(o, VideoOut)]
    first_fresh = next(tt for tt, o in after if o.fresh)
    held = [int(o.frame[0, 0, 0]) for tt, o in after if tt < first_fresh]
    st = p.stats()
    assert held and st.still_after_clear_s is not None and st.idle_after_clear_s is not None
    if hold == "rest":
        assert set(held) == {rest_value}
        assert st.still_after_clear_s <= 1 / 24 + 1e-9 < st.idle_after_clear_s
    else:
        assert set(held) == {int(speaking.frame[0, 0, 0])}
        assert st.still_after_clear_s == st.idle_after_clear_s  # still only once fresh idle frames come


def test_after_clear_a_new_segment_is_attributed_exactly() -> None:
    p, clock = make()
    run = Run(p, clock)
    t = clock.t
    p.speech_open("a")
    p.speech_sent("a", 6000)
    run.arrivals += [(t, 0, None)]
    run.until(t + 0.1)
    res = run.clear(6000 - chunk_sample_range(0, F)[1] - 1000)  # 1000 samples of chunk 1 in flight
    assert [e.segment for e in res.events] == ["a"]
    p.speech_open("b")
    p.speech_sent("b", 2000)
    p.speech_ended("b")
    # chunk 1 was taken before the clear: 1000 samples of "a" (dropped); chunk 2 holds "b"
    run.arrivals += [(t + T, 1, 1000), (t + 2 * T, 2, 2000), (t + 3 * T, 3, 0), (t + 4 * T, 4, 0)]
    run.until(t + 2.0)
    ev = [(e.kind, e.segment) for _, e in run.events()]
    assert ev == [("started", "b"), ("finished", "b")]
    assert run.events()[-1][1].position_s == pytest.approx(2000 / SR)
    st = p.stats()
    assert st.dropped_cleared_chunks == 2  # chunk 0 (queued, not yet started) and chunk 1 (in flight)
    assert st.av_offset_max_ms < 0.07


def test_clear_with_nothing_playing_does_not_flush() -> None:
    p, clock = make()
    run = Run(p, clock)
    on_time(run, range(3), clock.t)
    run.until(clock.t + 0.5)
    p.speech_open("a")
    p.speech_sent("a", 100)
    res = run.clear(100)  # everything still queued in the generator
    assert not res.flush_audio and res.dropped_chunks == 0
    assert res.events == [SegmentEvent("finished", "a", 0.0, interrupted=True)]


# ------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(("frames", "pcm", "match"), [
    (np.zeros((4, 6, 8), np.uint8), np.zeros(2666, np.float32), "frames must be"),
    (np.zeros((4, 6, 8, 3), np.float32), np.zeros(2666, np.float32), "frames must be"),
    (np.zeros((4, 6, 8, 3), np.uint8), np.zeros(2000, np.float32), "exact window"),
    (np.zeros((4, 6, 8, 3), np.uint8), np.zeros(2666, np.float64), "exact window"),
])
def test_push_refuses_malformed_chunks(frames: np.ndarray, pcm: np.ndarray, match: str) -> None:
    p, _ = make()
    with pytest.raises(ValueError, match=match):
        p.push(frames, pcm)


def test_resolution_is_fixed_and_segments_must_be_open() -> None:
    p, clock = make()
    run = Run(p, clock)
    on_time(run, range(2), clock.t)
    run.until(clock.t + 0.5)
    with pytest.raises(ValueError, match="resolution is fixed"):
        p.push(*chunk(2, h=8))
    with pytest.raises(ValueError, match="not open"):
        p.speech_sent("nope", 10)
    p.speech_open("a")
    with pytest.raises(ValueError, match="already open"):
        p.speech_open("a")
    p.speech_ended("a")


def test_a_segment_start_says_where_its_latency_went() -> None:
    """sent -> the chunk holding its first sample submitted (boundary) -> arrived (compute) -> shown (buffer),
    for a segment whose first sample lands in the second chunk pushed."""
    p, clock = make()
    run = Run(p, clock)
    t = clock.t
    p.push(*silent(0), submitted_at=t - 0.12)  # an idle chunk first: the segment is not in it
    run.until(t + 0.02)
    p.speech_open("a")
    p.speech_sent("a", 800)  # sent at t + 0.02
    clock.t = t + 0.05
    submitted = clock.t  # the chunk loop takes chunk 1's window 30 ms after the speech came
    clock.t = t + T
    p.push(*chunk(1, 800), submitted_at=submitted)  # arrives 0.117 s later (compute and transfer)
    run.until(t + 1.0)
    (started,) = [e for _, e in run.events() if e.kind == "started"]
    sp = started.split
    assert sp is not None and sp.chunk == 1
    assert (sp.sent_at, sp.submitted_at, sp.arrived_at) == (t + 0.02, submitted, t + T)
    assert sp.shown_at == run.video()[F].due  # chunk 1's first frame
    assert sp.boundary_s == pytest.approx(0.03) and sp.compute_s == pytest.approx(T - 0.05)
    assert sp.buffer_s == pytest.approx(sp.shown_at - (t + T)) and sp.buffer_s > 0
    assert started.latency_s == pytest.approx(sp.boundary_s + sp.compute_s + sp.buffer_s)


def test_without_submit_times_a_start_has_its_latency_but_no_split() -> None:
    p, clock = make()
    run = Run(p, clock)
    p.speech_open("a")
    p.speech_sent("a", 800)
    run.arrivals += [(clock.t + 0.1, 0, 800)]
    run.until(clock.t + 1.0)
    (started,) = [e for _, e in run.events() if e.kind == "started"]
    assert started.latency_s is not None and started.latency_s > 0.1 and started.split is None


# ------------------------------------------------------------------------------------------ trimming idle chunks


def test_idle_chunks_lose_frames_until_the_slack_is_min_slack_then_speech_keeps_every_frame() -> None:
    """On-time chunks queue a whole chunk ahead (the start-up depth). Idle chunks are trimmed a frame at a
    time until the least slack of the window is under min_slack_s + a frame; then speech plays whole, with
    its own audio, in sync, with that much less latency and no late chunk."""
    p, clock = make(min_slack_s=0.02, slack_window_s=2.0)
    run = Run(p, clock)
    t = clock.t
    on_time(run, range(40), t, speech=0)
    on_time(run, range(40, 60), t, speech=None)
    run.until(t + 1.9)
    st = p.stats()
    # the window is not full yet: nothing trimmed; the slack is the start-up depth (a chunk) less the audio
    # lead and up to one 10 ms audio frame (a chunk is committed when the audio frame that needs it is cut)
    assert st.trimmed_frames == 0 and st.slack_min_s is not None and T - LEAD - 0.01 <= st.slack_min_s <= T - LEAD
    run.until(t + 40 * T)
    st = p.stats()
    assert st.trimmed_frames == 2  # 0.120 s of slack -> 0.078 -> 0.037: a third would leave < 0.02
    assert st.slack_min_s is not None and 0.02 <= st.slack_min_s < 0.02 + 1 / FPS
    run.until(t + 60 * T)  # (chunk 59 still playing: the end of the stream is an underrun)
    st = p.stats()
    assert (st.trimmed_frames, st.late_chunks, st.underruns) == (2, 0, 0)
    run.until(t + 60 * T + 1.0)
    fresh = [int(v.frame[0, 0, 0]) for v in run.video() if v.fresh]
    speech = [(i % 251) + 1 for i in range(40 * F, 60 * F)]
    assert fresh[-len(speech):] == speech and len(fresh) == 60 * F - 2  # only 2 idle frames went
    audio = run.audio()
    assert np.array_equal(audio[np.flatnonzero(audio)], stream(40, 60))  # every speech sample, once, in order
    assert st.av_offset_max_ms == pytest.approx(0.0, abs=0.07)  # still within a sample: audio cut on frame edges
    video = run.video()
    # the audio handed out matches the frames shown: the timeline stayed on its frame grid
    assert audio.size == pytest.approx(len(video) * SR / FPS, abs=SR // 100)
    first_speech = next(v for v in video if v.fresh and int(v.frame[0, 0, 0]) == speech[0])
    assert first_speech.due == pytest.approx(t + 40 * T + T - 2 / FPS, abs=1e-3)  # 2 frames (83 ms) sooner


def test_a_late_chunk_stops_the_trimming_for_a_window_and_no_speech_is_ever_trimmed() -> None:
    p, clock = make(min_slack_s=0.04, slack_window_s=2.0)
    run = Run(p, clock)
    t = clock.t
    # all speech: never trimmed, however deep the buffer
    on_time(run, range(30), t, speech=None)
    run.until(t + 30 * T + 0.5)
    assert p.stats().trimmed_frames == 0
    p, clock = make(min_slack_s=0.02, slack_window_s=2.0)
    run = Run(p, clock)
    t = clock.t
    # idle, chunk 20 is 0.4 s late: its slack counts as 0, so nothing is trimmed until the window passed it
    run.arrivals += [(t + k * T + (0.4 if k == 20 else 0.0), k, 0) for k in range(60)]
    run.until(t + 20 * T + 0.2)
    before = p.stats().trimmed_frames
    assert before == 2
    run.until(t + 20 * T + 0.4 + 1.9)
    st = p.stats()
    assert st.late_chunks == 1 and st.trimmed_frames == before  # the window still holds the late one
    run.until(t + 60 * T + 1.0)
    st = p.stats()
    assert st.trimmed_frames > before and st.late_chunks == 1  # the stall's slack trimmed away again


def test_trimming_follows_the_jitter_it_sees_without_making_chunks_late() -> None:
    """Chunks arriving with up to 80 ms of random lateness: the buffer settles above the worst of it."""
    rng = np.random.default_rng(0)
    p, clock = make(min_slack_s=0.03, slack_window_s=4.0)
    run = Run(p, clock)
    t = clock.t
    run.arrivals += [(t + k * T + float(rng.uniform(0, 0.08)), k, 0) for k in range(240)]
    run.until(t + 240 * T)
    st = p.stats()
    assert st.late_chunks == 0 and st.underruns == 0 and st.trimmed_frames >= 1
    # the least slack left: above 0 (never late), below the start-up depth's (trimmed), and under the margin
    # only by jitter the window had not seen
    assert st.slack_min_s is not None and 0 < st.slack_min_s < 0.03 + 1 / FPS


# ------------------------------------------------------------------------------------------ onsets


def onset_run(arrive: float, speech_chunks: int = 6, made_s: float | None = None,
              **cfg: float) -> tuple[Run, float, float]:
    """Idle chunks 0..19 on time (a chunk of start-up depth), then speech from chunk 20, which arrives `arrive`
    after chunk 19 did, as an onset; the generator moves its clock by the cut it is told (as
    `run_chunk_loop` does) and the rest of the speech, then idle chunks, arrive on that clock."""
    p, clock = make(**cfg)
    run = Run(p, clock, onsets={20}, made_s=made_s)
    t = clock.t
    on_time(run, range(20), t, speech=0)
    run.arrivals.append((t + 19 * T + arrive, 20, None))
    run.until(t + 19 * T + arrive)
    cut = run.cuts[20]
    k1 = 21 + speech_chunks - 1
    run.arrivals += [(t + k * T - cut, k, None) for k in range(21, k1)]
    run.arrivals += [(t + k * T - cut, k, 0) for k in range(k1, k1 + 12)]
    run.until(t + (k1 + 11) * T - cut + 0.01)  # the last chunk arrived (later, the stream's end is an underrun)
    return run, t + 19 * T + arrive, cut


def test_an_onset_chunk_plays_at_once_cutting_only_idle_frames_and_nothing_is_late_after() -> None:
    run, arrived, cut = onset_run(0.05)
    p = run.playout
    # on time it would have started two chunks after chunk 19 arrived (the start-up depth, then chunk 19): 283 ms
    # of idle content ahead of it, cut down to what keeps its audio onset_slack_s (20 ms) ahead: the queued chunk 19
    # and one committed frame of chunk 18 whose audio was not out yet, whole, then part of the frame before
    assert 5 / FPS < cut < 6 / FPS
    part = round((cut - 5 / FPS) * SR)  # samples of that frame cut: it shows this much shorter
    video = run.video()
    first = next(v for v in video if v.fresh and int(v.frame[0, 0, 0]) == (F * 20) % 251 + 1)
    assert arrived + LEAD + 0.02 - 1e-9 <= first.due < arrived + LEAD + 0.02 + 2 / SR  # to the sample, not the frame
    st = p.stats()
    assert (st.late_chunks, st.underruns, st.onsets) == (0, 0, 1) and st.cut_s == pytest.approx(cut)
    audio = run.audio()
    assert np.array_equal(audio[np.flatnonzero(audio)], stream(20, 26))  # every speech sample, once, in order
    fresh = [int(v.frame[0, 0, 0]) for v in video if v.fresh]
    speech = [(i % 251) + 1 for i in range(20 * F, 26 * F)]
    i = fresh.index(speech[0])
    assert fresh[i:i + len(speech)] == speech  # every speech frame, in order
    assert len(fresh) + F * sum(1 for q in p._queue) + sum(1 for x in p._slots if x.frame is not None) == 38 * F - 5
    # (the 5 frames cut were idle ones: every other frame was shown or is still to come)
    # sync: the audio handed out runs ahead of the frames shown by the audio lead, less than a frame (the run
    # stops mid-stream; one frame showed `part` samples shorter), and every frame shown met its audio within 2
    # samples (a chunk cuts its window at its own frame edges, which after a cut of frames not a multiple of 3 are
    # the timeline's within a sample or two)
    assert 0 <= audio.size + part - len(video) * SR / FPS <= (LEAD + 1 / FPS) * SR
    assert st.av_offset_max_ms == pytest.approx(0.0, abs=0.13)


@pytest.mark.parametrize("rest_after", [0.03, 0.075])
def test_an_onsets_first_frame_plays_alone_and_its_rest_continues_the_same_chunk(rest_after: float) -> None:
    """An onset's first frame pushed alone (`DecoderWorker.decode_first`), the other three `continues=True` later:
    it starts as a whole onset chunk would, every speech sample and frame plays once in order and in sync, and the
    chunk keeps one index (a segment's start names the generator's chunk). The rest is late only when it comes after
    the first frame's audio has played out of its slack (a frame plus onset_slack_s: 61.7 ms)."""
    p, clock = make()
    run = Run(p, clock, onsets={20}, made_s=0.1, parts={20: rest_after})
    t = clock.t
    p.speech_open("a")
    p.speech_sent("a", sum(chunk(k)[1].size for k in range(20, 26)))
    on_time(run, range(20), t, speech=0)
    run.arrivals.append((t + 19 * T + 0.05, 20, None))
    run.until(t + 19 * T + 0.05)
    cut = run.cuts[20]
    assert 5 / FPS < cut < 6 / FPS  # as for the whole chunk (test_an_onset_chunk_plays_at_once_...)
    after = 0.05  # the chunks after it come on the moved clock, after its rest (as the decoder hands them on)
    assert t + 19 * T + 0.05 + rest_after < t + 21 * T - cut + after
    run.arrivals += [(t + k * T - cut + after, k, None) for k in range(21, 26)]
    run.arrivals += [(t + k * T - cut + after, k, 0) for k in range(26, 38)]
    run.until(t + 37 * T - cut + after + 0.01)
    st = p.stats()
    late = rest_after > 1 / FPS + 0.02
    assert (st.late_chunks, st.onsets) == (int(late), 1)
    audio = run.audio()
    assert np.array_equal(audio[np.flatnonzero(audio)], stream(20, 26))  # every speech sample, once, in order
    fresh = [int(v.frame[0, 0, 0]) for v in run.video() if v.fresh]
    speech = [(i % 251) + 1 for i in range(20 * F, 26 * F)]
    assert fresh[fresh.index(speech[0]):][:len(speech)] == speech
    if not late:
        assert st.av_offset_max_ms == pytest.approx(0.0, abs=0.13)
    (start,) = [e for _, e in run.events() if e.kind == "started"]
    assert start.split is not None and start.split.chunk == 20  # pushes 0..19, then chunk 20 in two
    assert p._pushed == 38


def test_an_onset_cuts_committed_idle_frames_whose_audio_is_not_out() -> None:
    """Arriving late in its boundary, most of the idle content ahead is the committed chunk's own frames."""
    run, arrived, cut = onset_run(0.15)
    # chunk 19 is committed (its audio was due 127 ms after it arrived) and the queue empty: of its frames, the
    # ones whose audio is not out, as many as keep the onset's audio 20 ms ahead: its last two, and part of the one
    # before
    assert 2 / FPS < cut < 3 / FPS
    part = round((cut - 2 / FPS) * SR)
    first = next(v for v in run.video() if v.fresh and int(v.frame[0, 0, 0]) == (F * 20) % 251 + 1)
    assert arrived + LEAD + 0.02 - 1e-9 <= first.due < arrived + LEAD + 0.02 + 2 / SR
    st = run.playout.stats()
    assert (st.late_chunks, st.underruns) == (0, 0)
    audio = run.audio()
    assert np.array_equal(audio[np.flatnonzero(audio)], stream(20, 26))
    assert 0 <= audio.size + part - len(run.video()) * SR / FPS <= (LEAD + 1 / FPS) * SR
    assert st.av_offset_max_ms == pytest.approx(0.0, abs=0.13)


def test_no_cut_past_speech_before_playout_or_without_the_flag() -> None:
    p, clock = make()
    assert p.push(*chunk(0), onset=True) == 0.0  # playout not started: nothing ahead to cut
    run = Run(p, clock, onsets={5})
    t = clock.t
    on_time(run, range(1, 5), t, speech=None)  # speech queued ahead of the onset
    run.arrivals.append((t + 4 * T + 0.01, 5, None))
    run.until(t + 4 * T + 0.02)
    assert run.cuts[5] == 0.0
    p, clock = make()
    run = Run(p, clock, onsets={8})
    on_time(run, range(8), clock.t, speech=0)
    run.arrivals.append((clock.t + 7 * T + 0.01, 8, 0))  # flagged, but no speech in it: not an onset
    run.until(clock.t + 7 * T + 0.02)
    assert run.cuts[8] == 0.0 and p.stats().onsets == 0


def test_an_onset_keeps_the_slack_that_slow_chunks_need() -> None:
    """Chunks that took 0.3 s from submit to arrival (a loaded machine): the chunk after the onset, made once the
    onset is out, takes as long, so the onset keeps 0.3 - T s more slack than onset_slack_s, and nothing is late."""
    run, arrived, cut = onset_run(0.05, made_s=0.3, max_depth=4)
    need = LEAD + 0.02 + (0.3 - T)
    first = next(v for v in run.video() if v.fresh and int(v.frame[0, 0, 0]) == (F * 20) % 251 + 1)
    assert arrived + need - 1e-9 <= first.due < arrived + need + 2 / SR
    assert 0 < cut < 5 / FPS  # less than the 5 frames a fast machine's onset cuts (the first onset test)
    st = run.playout.stats()
    assert (st.late_chunks, st.underruns) == (0, 0)
    # the cut ended inside the idle chunk still queued ahead of the onset (deeper buffer): that chunk's frames
    # showed shorter, and everything after it still shows with its own audio
    audio = run.audio()
    assert np.array_equal(audio[np.flatnonzero(audio)], stream(20, 26))
    assert st.av_offset_max_ms == pytest.approx(0.0, abs=0.13)


def test_slack_a_chunk_had_from_being_made_early_does_not_trim_the_buffer() -> None:
    """Chunks that take 0.15 s to make but were started 0.10 s before their boundary (their audio was queued)
    arrive with slack the pipeline itself does not have: trimming it away would make the next chunk started on
    its boundary late. Told so (`early_s`), the playout keeps it; not told, it trims."""
    trimmed = []
    for early in (0.10, 0.0):
        p, clock = make(min_slack_s=0.02, slack_window_s=2.0)
        run = Run(p, clock, early={k: early for k in range(1, 60)})
        t = clock.t
        run.arrivals += [(t, 0, 0)] + [(t + k * T + 0.05, k, 0) for k in range(1, 60)]
        run.until(t + 60 * T)
        st = p.stats()
        assert st.late_chunks == 0
        trimmed.append(st.trimmed_frames)
    assert trimmed[0] == 0 and trimmed[1] > 0
