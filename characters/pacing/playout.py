"""Playout pacing: a small jitter buffer and one playout clock for generated chunks. Pure logic, no I/O.

A chunk is F video frames plus the exact audio window that conditioned them (`chunk_sample_range`).
`Playout` queues chunks and, polled against an injected clock, hands out video frames at `fps` and
audio in 10 ms frames, both cut from the same chunk, so audio and video stay in sync by construction.

Timeline. Output audio sample `s` plays at `t0 + s / sample_rate`; output video frame `v` at
`t0 + (v * sample_rate // fps) / sample_rate`, the same integer frame boundaries as
`characters.audio.frame_end_sample`. A chunk is *committed* to the timeline when its audio is first
needed: its frames take the next F frame slots and its samples the next samples, so frame i of a
chunk shows while sample `i * n // F` of its window plays (within one sample, 62.5 us). Audio is
handed out `audio_lead_s` early because the sink queues it (LiveKit's AudioSource plays a queue);
`poll(audio_queue_s=...)` reports that queue so the A/V offset is measured, not assumed.

Jitter buffer. Playout starts once the first chunk has waited `target_depth` chunk durations, or
when more than `target_depth` chunks are queued: that is the slack against late chunks.

Late-chunk policy (documented contract). A chunk that is not queued when its audio is needed is
late: the playout holds the last frame and plays silence, one frame slot (41.7 ms) at a time, and
plays the late chunk in full as soon as it arrives. Spoken audio is never dropped and never played
without its frames; a stall delays everything after it (the schedule slips by the stall). Latency is
recovered only from idle chunks: when more than `max_depth` chunks are queued, or the buffer stayed a
chunk deeper than the target for `shrink_after_s`, the oldest chunk with no speech in it is dropped
(its audio is silence, so nothing said is lost). Finer, with `min_slack_s` set: every chunk's *slack*
(how long it was queued before its audio was needed; 0 for a late one) is kept for `slack_window_s`;
while the least slack of that window exceeds `min_slack_s` by a frame, an idle chunk about to be
committed loses its last frame and that frame's audio (silence): the timeline, and with it the latency
of the next speech, shortens by one frame (41.7 ms at 24 fps), at most once a chunk. The buffer settles
at `min_slack_s` above the worst lateness of the window instead of the start-up depth, and grows back
by itself when a chunk is late (the stall). When the owner polls late
(its loop stalled), only `max_catchup_s` of backlog is handed out and the timeline slips by the rest
(`slips`): during a stall longer than the audio lead the sink's queue ran dry and played a gap, so
the audio is late by that much for good; the video slips with it instead of racing ahead.

Speech onsets. A chunk pushed with `onset=True` (the generator made it from the first speech after idle
chunks, early, without waiting for its chunk boundary: `deployments.pipeline.graph.run_chunk_loop`) plays
as soon as it can: the idle content ahead of it on the timeline (queued idle chunks, then committed idle
frames whose audio is not handed out yet) is cut, whole frames from the latest back, then the last frame's
audio not handed out yet in part (the frame shows that much shorter, the frame grid after it moves as much
earlier), until the chunk's audio is due `onset_slack_s` after it arrived to the sample (or the idle content
ends), plus however much the slowest chunk of the
last `slack_window_s` took to make beyond a chunk's duration (from its submit, or from the arrival of the chunk
before it if that was later: the pipeline's pace): the chunk after the onset must still arrive before its turn.
`push` returns the seconds cut, and the pusher must move its chunk clock that much earlier (the chunks after
the onset then keep the slack they had; a generator that ignored it would see them late by as much). An onset
chunk's own slack is not counted by the idle trimming (it is small by design), and speech is never cut.

Speech segments (the avatar protocol's unit: one agent audio stream) are kept by `characters.pacing.speech`:
which samples of a chunk are whose, when a segment starts (its first sample's frame is shown) and finishes.

Interruption. `clear(dropped)` (the generator dropped `dropped` queued samples): every unfinished
segment finishes at once, interrupted. Speech already taken by the generator (in flight) is marked;
chunks made from it, and queued chunks holding speech, are *blanked*: they keep their place and length
on the timeline but hold a frame and play silence. The held frame is, from the next frame on, the last
one shown without speech (`hold_on_clear="rest"`: the character at rest, mouth closed, so it stops
talking within a frame) until the first chunk generated after the clear arrives. Committed speech not
yet played is muted the same way from the current play position (the caller must flush its audio queue:
`ClearResult.flush_audio`). Keeping the timeline means the first chunk generated after the clear plays
on its original schedule, with the jitter buffer's full slack (removing the gap would leave none).

Why one module of this size: the playout's state (queue, committed timeline, held frames, audio hand-out) is one
timeline that every operation moves; latency recovery's decisions are apart (`characters.pacing.trim`), and so is
the speech ledger (`characters.pacing.speech`).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from characters.pacing.config import PacingConfig
from characters.pacing.events import (
    AudioOut,
    ClearResult,
    PlayoutStats,
    SegmentEvent,
    SpeechSplit,
    VideoOut,
    speech_prefix,
    to_int16,
)
from characters.pacing.speech import CLEARED, Segment, SpeechLedger
from characters.pacing.trim import TrimPolicy

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ internals


@dataclass(eq=False)
class _Chunk:
    frames: np.ndarray | None  # (F, H, W, 3) uint8; None: blanked (hold the last frame F times)
    count: int  # F
    pcm: np.ndarray  # (n,) float32
    spans: list[tuple[str | None, int, int]]  # (segment or None for unknown speech, start, end) in pcm
    arrived: float
    index: int = 0  # chunks pushed before it
    submitted: float | None = None  # when the generator took its audio (the caller's clock), if known
    onset: bool = False  # played as soon as it arrived (its slack is not the idle trimming's business)
    early_s: float = 0.0  # made this long before its boundary (slack the generator bought, not the pipeline's)
    short: int = 0  # idle, with an onset behind it: samples it loses when committed (a cut of part of a frame)

    @property
    def speech(self) -> bool:
        return bool(self.spans)

    def blank(self) -> None:
        """Interrupted: keep the chunk's place and length, show held frames and play silence instead."""
        self.frames, self.pcm, self.spans = None, np.zeros_like(self.pcm), []


@dataclass(eq=False)
class _Slot:
    index: int
    frame: np.ndarray | None  # None: hold the last frame
    first_sample: int  # output sample paired with the frame's first line of audio
    plays: list[tuple[str | None, int]] = field(default_factory=list)  # (segment, samples) shown with it
    chunk: _Chunk | None = None  # the chunk it was cut from (None: a held frame of a stall)


# ------------------------------------------------------------------------------------------ playout


class Playout:
    """Jitter buffer + playout clock. Not thread-safe: one owner calls it (an event loop)."""

    def __init__(self, config: PacingConfig | None = None, *, clock: Callable[[], float]) -> None:
        self.cfg = c = config or PacingConfig()
        self.clock = clock
        self._af = c.audio_frame_samples
        self._queue: deque[_Chunk] = deque()
        self._speech = SpeechLedger(c.sample_rate, c.stale_speech_s, clock)  # what was sent, and whose it is
        self._t0: float | None = None
        self._slots: deque[_Slot] = deque()  # committed, not yet shown
        self._audio: deque[np.ndarray] = deque()  # committed samples [a, w), not yet handed out
        self._a = self._w = self._v = self._vc = 0  # audio out / committed; video out / committed
        self._grid = 0  # samples the frame grid moved earlier by onsets' cuts of part of a frame
        self._last: np.ndarray | None = None
        self._stalled = False
        self._stall_since = 0.0
        self._audio_play: dict[int, float] = {}  # audio frame index -> when it plays
        self._shown: deque[tuple[float, bool]] = deque()  # (time, fresh) of shown frames in the window
        self._offsets: deque[tuple[float, float]] = deque()
        self._n = {"late": 0, "underruns": 0, "idle": 0, "cleared": 0, "slips": 0, "frames": 0, "fresh": 0,
                   "audio": 0, "trimmed": 0, "onsets": 0, "dry": 0}
        self._flushed = False  # the sink's audio queue was flushed (an interruption): empty by design once
        self._stall_total = 0.0
        self._cut_total = 0.0
        self._offset_last = 0.0
        self._clear_at: float | None = None
        self._idle_after: float | None = None
        self._rest: np.ndarray | None = None  # last frame shown that no speech played with
        self._last_speech = False  # whether the frame held now was shown with speech
        self._still_at: float | None = None
        self._still_after: float | None = None
        self._pushed = 0
        self._trims = TrimPolicy(c)  # what latency recovery may trim, shed or cut (pure)

    # ----------------------------------------------------------------------------- speech ledger
    def speech_open(self, segment: str) -> None:
        """A new speech segment begins (segments finish in the order they were opened)."""
        self._speech.open(segment)

    def speech_sent(self, segment: str, samples: int) -> None:
        """`samples` samples of `segment` were queued for generation, after everything sent before."""
        self._speech.sent(segment, samples)

    def speech_ended(self, segment: str) -> list[SegmentEvent]:
        """No more samples for `segment`; returns the segments that finish now (e.g. an empty one)."""
        return self._speech.ended(segment)

    # ----------------------------------------------------------------------------- chunks
    def push(self, frames: np.ndarray, pcm: np.ndarray, speech_samples: int | None = None,
             submitted_at: float | None = None, onset: bool = False, early_s: float = 0.0,
             continues: bool = False) -> float:
        """Queue a generated chunk: (F, H, W, 3) uint8 frames and the (n,) float32 window that made them.
        `submitted_at`: when the generator took that window (on this playout's clock): segment starts then
        say where their latency went (`SegmentEvent.split`). `onset`: a speech onset, played as soon as it
        can (see the module docstring). `early_s`: the generator took its window that long before its boundary (its
        audio was queued): the slack that bought is the generator's, not the pipeline's, and the idle trimming does
        not count it. `continues`: the rest of the chunk pushed last, whose first frames went ahead of it (an onset's
        first frame, made before the rest): the same chunk, by its index. Returns the seconds of idle content cut
        ahead of it (0.0 mostly)."""
        c = self.cfg
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or len(frames) < 1:
            raise ValueError(f"frames must be (F, H, W, 3) uint8 with F >= 1, got {frames.shape} {frames.dtype}")
        expect = len(frames) * c.sample_rate / c.fps
        if pcm.ndim != 1 or pcm.dtype != np.float32 or abs(pcm.size - expect) > 1:
            raise ValueError(f"the audio of {len(frames)} frames must be (n,) float32 with n within 1 of {expect:.1f} "
                             f"at {c.sample_rate} Hz / {c.fps} fps, got {pcm.shape} {pcm.dtype}; pass the exact "
                             "window that conditioned the frames (characters.audio.chunk_sample_range)")
        if self._last is not None and frames.shape[1:] != self._last.shape:
            raise ValueError(f"frames are {frames.shape[1:]}, earlier frames were {self._last.shape}; "
                             "the resolution is fixed for a session")
        now = self.clock()
        self._trims.arrived(now, submitted_at)
        speech = speech_prefix(pcm) if speech_samples is None else min(max(0, speech_samples), pcm.size)
        spans = self._speech.take(speech, now)
        index = self._pushed - 1 if continues and self._pushed else self._pushed
        chunk = _Chunk(frames, len(frames), pcm, spans, now, index, submitted_at, early_s=max(0.0, early_s))
        self._pushed = index + 1
        if any(owner == CLEARED for owner, _, _ in spans):
            self._speech.skip(chunk.spans)
            chunk.blank()
            self._n["cleared"] += 1
        cut = 0.0
        if onset and chunk.speech:
            chunk.onset = True
            self._n["onsets"] += 1
            cut = self._cut_ahead(now)
        self._queue.append(chunk)
        if len(self._queue) > c.max_depth:
            self._drop_idle()
        return cut

    def clear(self, dropped_samples: int) -> ClearResult:
        """Interrupt: the generator dropped `dropped_samples` queued samples (the rest of what was sent
        and not yet seen in a chunk is in flight). See the module docstring."""
        events = self._speech.interrupt(dropped_samples)
        dropped = 0
        for q in self._queue:
            if q.speech:
                q.blank()
                dropped += 1
        self._n["cleared"] += dropped
        flush = any(slot.plays for slot in self._slots)
        if flush and self._t0 is not None:
            self._mute(self.clock())
            self._flushed = True
        self._clear_at, self._idle_after = self.clock(), None
        self._still_at, self._still_after = self._clear_at, None
        if self.cfg.hold_on_clear == "rest" and self._rest is not None:
            self._last, self._last_speech = self._rest, False  # held slots from the next frame on: at rest
        return ClearResult(events, flush, dropped)

    # ----------------------------------------------------------------------------- playout
    def next_due(self) -> float | None:
        """When `poll` next has something to hand out (None: nothing until a chunk arrives)."""
        if self._t0 is None:
            if not self._queue:
                return None
            if len(self._queue) > self.cfg.target_depth:
                return self._queue[0].arrived
            return self._queue[0].arrived + self.cfg.target_depth * self.cfg.chunk_s
        return min(self._audio_due(self._a), self._video_due(self._v))

    def poll(self, audio_queue_s: float | None = None) -> list[VideoOut | AudioOut | SegmentEvent]:
        """Everything due by now, in play order. `audio_queue_s`: audio the sink holds before this batch (None:
        not known; taken as 0 for the A/V offset, and no `audio_dry` counted)."""
        now = self.clock()
        out: list[VideoOut | AudioOut | SegmentEvent] = []
        if self._t0 is None:
            due = self.next_due()
            if due is None or now < due:
                return out
            self._t0 = now  # the first audio is due `audio_lead_s` ago: that is the lead, not lateness
        else:
            due = self.next_due()
            assert due is not None
            if now - due > self.cfg.max_catchup_s:
                self._t0 += now - due - self.cfg.max_catchup_s
                self._n["slips"] += 1
        pushed = 0
        while True:
            ta, tv = self._audio_due(self._a), self._video_due(self._v)
            if min(ta, tv) > now:
                break
            if ta <= tv:
                if not pushed and audio_queue_s is not None and audio_queue_s <= 0 and self._n["audio"] \
                        and not self._flushed:
                    self._n["dry"] += 1  # the sink played everything it had before this: it ran dry
                self._flushed = False
                audio = self._emit_audio(ta, now + (audio_queue_s or 0.0) + pushed / self.cfg.sample_rate)
                pushed += audio.samples.size
                out.append(audio)
            else:
                out.extend(self._emit_video(self._v, tv, now))
        self._trim(now)
        return out

    def stats(self) -> PlayoutStats:
        now = self.clock()
        self._trim(now)
        c, n = self.cfg, self._n
        shown = list(self._shown)
        fps = fresh_fps = 0.0
        if len(shown) >= 2 and shown[-1][0] > shown[0][0]:
            span = shown[-1][0] - shown[0][0]
            fps = (len(shown) - 1) / span
            fresh_fps = max(0, sum(f for _, f in shown) - 1) / span
        stall = self._stall_total + (now - self._stall_since if self._stalled else 0.0)
        return PlayoutStats(
            started=self._t0 is not None, queued_chunks=len(self._queue),
            buffered_s=len(self._queue) * c.chunk_s + len(self._slots) / c.fps,
            late_chunks=n["late"], underruns=n["underruns"], stall_s=stall, dropped_idle_chunks=n["idle"],
            trimmed_frames=n["trimmed"], onsets=n["onsets"], cut_s=self._cut_total,
            slack_min_s=self._trims.slack_min(),
            dropped_cleared_chunks=n["cleared"], slips=n["slips"], frames_sent=n["frames"], fresh_frames=n["fresh"],
            audio_frames_sent=n["audio"], fps=fps, fresh_fps=fresh_fps, av_offset_ms=self._offset_last * 1e3,
            av_offset_max_ms=max((abs(o) for _, o in self._offsets), default=0.0) * 1e3,
            lost_speech_samples=self._speech.lost, audio_dry=n["dry"], idle_after_clear_s=self._idle_after,
            still_after_clear_s=self._still_after)

    # ----------------------------------------------------------------------------- internals
    def _fs(self, v: int) -> int:
        """First output sample of frame slot v (not committed yet): on the frame grid, less what onsets cut off it
        in parts of a frame (`_grid`)."""
        return v * self.cfg.sample_rate // self.cfg.fps - self._grid

    def _audio_due(self, sample: int) -> float:
        assert self._t0 is not None
        return self._t0 + sample / self.cfg.sample_rate - self.cfg.audio_lead_s

    def _video_due(self, v: int) -> float:
        assert self._t0 is not None
        first = self._slots[0].first_sample if self._slots and self._slots[0].index == v else self._fs(v)
        return self._t0 + first / self.cfg.sample_rate

    def _commit(self, now: float) -> None:
        """Append the next chunk (or one held frame of silence) to the timeline."""
        if self._queue:
            chunk = self._queue.popleft()
            late = self._stalled
            if self._stalled:
                self._stall_total += now - self._stall_since
                self._n["late"] += 1
                made = None if chunk.submitted is None else chunk.arrived - chunk.submitted
                log.warning("late chunk %d (%s): the viewer saw a held frame for %.3f s; it took %s s from submit to "
                            "here, submitted %.3f s before its boundary", chunk.index,
                            "speech" if chunk.speech else "idle", now - self._stall_since,
                            "?" if made is None else f"{made:.3f}", chunk.early_s)
            self._stalled = False
            self._trim_idle(chunk, 0.0 if late else now - chunk.arrived, now)
            if not chunk.speech and (fit := self._fs(self._vc + chunk.count) - self._w) > 0 and fit != chunk.pcm.size:
                # an idle chunk ends on the timeline's frame grid (its audio is silence: a sample more or less is
                # nothing), so the sample or two that cuts and drops leave behind never add up
                chunk.pcm = np.resize(chunk.pcm, fit) if fit > chunk.pcm.size else chunk.pcm[:fit]
            if chunk.short:  # an onset behind it cut part of a frame here: its frames show that much shorter
                chunk.pcm = chunk.pcm[: max(chunk.count, chunk.pcm.size - chunk.short)]
            n, f = chunk.pcm.size, chunk.count
            for i in range(f):
                lo, hi = i * n // f, (i + 1) * n // f
                plays = [(o, min(hi, s1) - max(lo, s0)) for o, s0, s1 in chunk.spans if min(hi, s1) > max(lo, s0)]
                frame = None if chunk.frames is None else chunk.frames[i]
                self._slots.append(_Slot(self._vc + i, frame, self._w + lo, plays, chunk))
            self._audio.append(chunk.pcm)
            self._w += n
            self._vc += f
            if chunk.short:
                self._grid = self._vc * self.cfg.sample_rate // self.cfg.fps - self._w  # the frames after it, earlier
            self._shrink(now)
            return
        self._trims.not_deep()
        if not self._stalled:
            self._stalled, self._stall_since = True, now
            self._n["underruns"] += 1
        end = self._fs(self._vc + 1)
        self._slots.append(_Slot(self._vc, None, self._w))
        if end > self._w:
            self._audio.append(np.zeros(end - self._w, np.float32))
            self._w = end
        self._vc += 1

    def _shrink(self, now: float) -> None:
        """Chunks queued at every commit for `shrink_after_s`: the buffer is a chunk deeper than the target
        (e.g. playout was anchored on a slow first chunk); shed one idle chunk, never speech."""
        deep = len(self._queue) >= max(1, math.ceil(self.cfg.target_depth)) and not any(q.speech for q in self._queue)
        if self._trims.shed_due(now, deep) and self._drop_idle():  # (speech queued: the generator runs ahead)
            self._trims.shed()

    def _trim_idle(self, chunk: _Chunk, slack: float, now: float) -> None:
        """Record `chunk`'s slack; drop its last frame (and that frame's audio) when it is idle and every chunk
        of the full window had a frame more slack than `min_slack_s` (see the module docstring)."""
        c = self.cfg
        if c.min_slack_s is None:
            return
        self._trims.committed(now, slack, onset=chunk.onset, early_s=chunk.early_s)
        if chunk.speech or chunk.frames is None or chunk.count < 2 or not self._trims.spare(now, 1.0 / c.fps):
            return
        f = chunk.count
        keep = min(chunk.pcm.size, max(0, self._fs(self._vc + f - 1) - self._w))  # ends on the timeline's frame grid
        chunk.frames, chunk.count, chunk.pcm = chunk.frames[:f - 1], f - 1, chunk.pcm[:keep]
        self._trims.take(1.0 / c.fps)
        self._n["trimmed"] += 1

    def _cut_ahead(self, now: float) -> float:
        """Cut idle content ahead of an onset chunk about to be queued (see the module docstring): queued idle
        chunks, then committed idle frames whose audio is not handed out yet, whole frames from the latest back, then
        part of the last one, until it would start `onset_slack_s` after `now`. Nothing is cut past speech, while
        stalled, or before playout started. Returns the seconds cut."""
        c = self.cfg
        if self._t0 is None or self._stalled:
            return 0.0
        if any(q.speech or q.frames is None for q in self._queue) or any(s.plays for s in self._slots):
            return 0.0  # speech (or an interruption's blanked chunk) still ahead: not an onset after all
        ahead = self._vc + sum(q.count for q in self._queue)  # the onset chunk's first frame slot now
        # frames we may cut: its audio (due audio_lead_s before its first frame) stays onset_slack_s ahead of now,
        # and more when chunks lately took longer than a chunk to make (the next one is made after this one)
        slack = self._trims.onset_slack()
        budget = math.floor((self._video_due(ahead) - c.audio_lead_s - now - slack) * c.fps + 1e-9)
        cut = 0
        while budget > 0 and self._queue:  # queued idle chunks, the latest first
            last = self._queue[-1]
            take = min(budget, last.count)
            if take == last.count:
                self._queue.pop()
                self._n["idle"] += 1
            else:
                keep = last.count - take
                last.frames, last.count = last.frames[:keep], keep  # type: ignore[index]  # idle: frames set
                last.pcm = last.pcm[: last.pcm.size * keep // (keep + take)]
            cut += take
            budget -= take
        # committed idle frames whose audio is still ours: slots at the tail that start at or after `_a`
        drop = 0
        while drop < min(budget, len(self._slots)) and self._slots[-1 - drop].first_sample >= self._a:
            slot = self._slots[-1 - drop]
            if slot.frame is None:  # a held frame (a stall's): keep the timeline as it is
                break
            drop += 1
        if drop:
            first = self._slots[-drop]
            for _ in range(drop):
                self._slots.pop()
            self._vc, self._w = first.index, first.first_sample
            keep_samples = self._w - self._a
            buf = np.concatenate(list(self._audio)) if self._audio else np.zeros(0, np.float32)
            self._audio = deque([buf[:keep_samples]]) if keep_samples > 0 else deque()
            cut += drop
        # then part of a frame: the last committed frame's idle audio not handed out yet is shortened so the onset's
        # audio is due its slack after now to the sample, not up to a frame later (41.7 ms at 24 fps, 21 on
        # average); the frames after it move as much earlier on the grid, so they still show with their audio
        sr = c.sample_rate
        ahead = self._vc + sum(q.count for q in self._queue)
        part = max(0, math.floor((self._video_due(ahead) - c.audio_lead_s - now - slack) * sr))
        if self._queue:  # the last idle chunk left gets that much shorter when it is committed (`_Chunk.short`)
            last = self._queue[-1]
            part = min(part, max(0, last.pcm.size - last.short - last.count))  # a sample a frame stays
            last.short += part
        elif self._slots and self._slots[-1].frame is not None:
            part = min(part, self._w - max(self._a, self._slots[-1].first_sample + 1))
            if part > 0:
                buf = np.concatenate(list(self._audio))
                self._audio = deque([buf[:buf.size - part]])
                self._w -= part
                self._grid = self._vc * sr // c.fps - self._w  # the onset's first frame starts where the audio ends
        else:
            part = 0
        part = max(0, part)  # (the committed frame may have had none of its audio left to cut)
        if cut or part:
            self._trims.not_deep()
        seconds = cut / c.fps + part / c.sample_rate
        self._cut_total += seconds
        return seconds

    def _drop_idle(self) -> bool:
        """Drop the oldest queued chunk without speech (latency recovery); False if every one has speech."""
        idle = next((i for i, q in enumerate(self._queue) if not q.speech), None)
        if idle is not None:
            del self._queue[idle]
            self._n["idle"] += 1
        return idle is not None

    def _emit_audio(self, due: float, plays_at: float) -> AudioOut:
        """The audio frame holding sample `_a`, from `_a` on (shorter than a frame only after a mute)."""
        j = self._a // self._af
        need = (j + 1) * self._af
        while self._w < need:
            self._commit(due)
        size = need - self._a
        buf = np.empty(size, np.float32)
        got = 0
        while got < size:
            part = self._audio[0]
            k = min(part.size, size - got)
            buf[got:got + k] = part[:k]
            got += k
            if k == part.size:
                self._audio.popleft()
            else:
                self._audio[0] = part[k:]
        self._audio_play[j] = plays_at - (self._a - j * self._af) / self.cfg.sample_rate  # of sample j * af
        self._a = need
        self._n["audio"] += 1
        return AudioOut(j, to_int16(buf), due)

    def _emit_video(self, v: int, due: float, now: float) -> list[VideoOut | SegmentEvent]:
        while self._vc <= v:
            self._commit(due)
        slot = self._slots.popleft()
        assert slot.index == v, (slot.index, v)
        self._v = v + 1
        fresh = slot.frame is not None
        if slot.frame is not None:
            self._last, self._last_speech = slot.frame, bool(slot.plays)
            if not slot.plays:
                self._rest = slot.frame
            if self._clear_at is not None:
                self._idle_after, self._clear_at = now - self._clear_at, None
        if self._still_at is not None and self._last is not None and not self._last_speech:
            self._still_after, self._still_at = now - self._still_at, None
        out: list[VideoOut | SegmentEvent] = []
        if self._last is None:
            return out  # nothing shown yet: nothing to hold
        out.append(VideoOut(v, self._last, fresh, due))
        self._n["frames"] += 1
        self._n["fresh"] += fresh
        self._shown.append((now, fresh))
        j = slot.first_sample // self._af
        if j in self._audio_play:
            plays_at = self._audio_play[j] + (slot.first_sample - j * self._af) / self.cfg.sample_rate
            self._offset_last = now - plays_at
            self._offsets.append((now, self._offset_last))
        for seg_id, n in slot.plays:
            seg = self._speech.segments.get(seg_id) if seg_id is not None else None
            if seg is None:
                continue
            if not seg.started:
                seg.started = True
                waited = None if seg.first_sent is None else now - seg.first_sent
                out.append(SegmentEvent("started", seg.id, latency_s=waited, split=self._split(seg, slot, now)))
            seg.played += n
        out.extend(self._speech.finish_ready())
        return out

    @staticmethod
    def _split(seg: Segment, slot: _Slot, now: float) -> SpeechSplit | None:
        chunk = slot.chunk
        if seg.first_sent is None or chunk is None or chunk.submitted is None:
            return None
        return SpeechSplit(chunk.index, seg.first_sent, chunk.submitted, chunk.arrived, now)

    def _mute(self, now: float) -> None:
        """Interrupted speech is committed: from the current play position on, committed audio becomes
        silence and speech frames become held frames; the timeline keeps its length. Audio already
        handed out past the play position is handed out again (as silence): the sink has flushed it."""
        assert self._t0 is not None
        play = max(0, math.ceil((now - self._t0) * self.cfg.sample_rate))
        a = min(self._a, play)  # the next frame handed out is cut to start here: the sink queue stays aligned
        self._audio = deque([np.zeros(self._w - a, np.float32)])
        self._a = a
        self._audio_play = {k: t for k, t in self._audio_play.items() if (k + 1) * self._af <= a}
        for slot in self._slots:
            if slot.plays:
                slot.frame, slot.plays = None, []

    def _trim(self, now: float) -> None:
        horizon = now - self.cfg.stats_window_s
        while self._shown and self._shown[0][0] < horizon:
            self._shown.popleft()
        while self._offsets and self._offsets[0][0] < horizon:
            self._offsets.popleft()
        if len(self._audio_play) > 4096:
            keep = self._a // self._af - 2048
            self._audio_play = {k: t for k, t in self._audio_play.items() if k >= keep}
