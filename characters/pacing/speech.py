"""`SpeechLedger`: the speech a playout was sent, by segment, and whose samples each generated chunk holds.

Speech segments are the avatar protocol's unit (one agent audio stream). The room reports what it sent to
generation, in order (`open`, `sent`, `ended`); a chunk's window holds agent speech first, then padding, so its
leading samples are attributed to what was sent, first in first out (`take`). A segment finishes when it has
ended and all its samples were shown (or skipped), in segment order (`finish_ready`). Speech still not generated
`stale_speech_s` after it was sent, when a chunk without speech arrives, was lost by the generator and counts as
skipped. An interruption finishes every open segment at once and marks speech in flight as `CLEARED`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from characters.pacing.events import SegmentEvent

CLEARED = "\x00cleared"  # ledger owner of speech taken by the generator before an interruption

Spans = list[tuple[str | None, int, int]]  # (segment or None for unknown speech, start, end) in a chunk's pcm


@dataclass
class Segment:
    id: str
    sent: int = 0
    played: int = 0
    skipped: int = 0
    ended: bool = False
    started: bool = False
    first_sent: float | None = None


@dataclass
class _Sent:
    owner: str  # a segment id, or CLEARED
    left: int  # samples not yet seen in a chunk
    at: float  # when they were sent


class SpeechLedger:
    """Open segments (in order) and the speech sent to generation and not yet seen in a chunk (FIFO)."""

    def __init__(self, sample_rate: int, stale_speech_s: float, clock: Callable[[], float]) -> None:
        self.sample_rate, self.stale_speech_s, self.clock = sample_rate, stale_speech_s, clock
        self.segments: dict[str, Segment] = {}
        self._sent: deque[_Sent] = deque()
        self.lost = 0  # speech samples the generator never made (stale)

    def open(self, segment: str) -> None:
        if segment in self.segments:
            raise ValueError(f"speech segment {segment!r} is already open; give each segment a new id")
        self.segments[segment] = Segment(segment)

    def sent(self, segment: str, samples: int) -> None:
        seg = self.segments.get(segment)
        if seg is None:
            raise ValueError(f"speech segment {segment!r} is not open (or already finished); call speech_open first")
        if seg.ended:
            raise ValueError(f"speech segment {segment!r} already ended; open a new segment")
        if samples > 0:
            if seg.first_sent is None:
                seg.first_sent = self.clock()
            seg.sent += samples
            self._sent.append(_Sent(segment, samples, self.clock()))

    def ended(self, segment: str) -> list[SegmentEvent]:
        if segment in self.segments:
            self.segments[segment].ended = True
        return self.finish_ready()

    def take(self, speech: int, now: float) -> Spans:
        """Attribute a chunk's first `speech` samples to what was sent, FIFO; drop stale speech."""
        if speech == 0:
            while self._sent and now - self._sent[0].at > self.stale_speech_s:
                lost = self._sent.popleft()
                self.lost += lost.left
                if lost.owner in self.segments:
                    self.segments[lost.owner].skipped += lost.left
        spans: Spans = []
        pos = 0
        while pos < speech and self._sent:
            entry = self._sent[0]
            n = min(entry.left, speech - pos)
            spans.append((entry.owner, pos, pos + n))
            entry.left -= n
            if entry.left == 0:
                self._sent.popleft()
            pos += n
        if pos < speech:
            spans.append((None, pos, speech))  # speech the room did not send (another audio path)
        return spans

    def skip(self, spans: Spans) -> None:
        """A dropped chunk's live speech counts as done for its segments (so they still finish)."""
        for owner, s0, s1 in spans:
            if owner is not None and owner in self.segments:
                self.segments[owner].skipped += s1 - s0

    def interrupt(self, dropped_samples: int) -> list[SegmentEvent]:
        """The generator dropped `dropped_samples` queued samples; what else was sent is in flight (CLEARED).
        Every open segment finishes now, interrupted."""
        pending = sum(e.left for e in self._sent)
        inflight = max(0, pending - max(0, dropped_samples))
        self._sent.clear()
        if inflight:
            self._sent.append(_Sent(CLEARED, inflight, self.clock()))
        events = [SegmentEvent("finished", s.id, s.played / self.sample_rate, interrupted=True)
                  for s in self.segments.values()]
        self.segments.clear()
        return events

    def finish_ready(self) -> list[SegmentEvent]:
        """The segments that finish now, in order."""
        out = []
        while self.segments:
            seg = next(iter(self.segments.values()))
            if not seg.ended or seg.played + seg.skipped < seg.sent:
                break
            del self.segments[seg.id]
            out.append(SegmentEvent("finished", seg.id, seg.played / self.sample_rate))
        return out
