"""What a playout hands out and reports (frames, audio frames, speech segment events, stats), and the PCM helpers
its callers share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

# ------------------------------------------------------------------------------------------ outputs


@dataclass(frozen=True)
class VideoOut:
    """Frame slot `index` of the output; `fresh` is False for a held (repeated) frame."""

    index: int
    frame: np.ndarray  # (H, W, 3) uint8
    fresh: bool
    due: float


@dataclass(frozen=True)
class AudioOut:
    """Output audio frame `index`: samples `[index * n, (index + 1) * n)` of the output stream (n: 10 ms),
    or the tail of that range right after an interruption flushed the sink."""

    index: int
    samples: np.ndarray  # (n,) int16 mono
    due: float


@dataclass(frozen=True)
class SegmentEvent:
    kind: Literal["started", "finished"]
    segment: str
    position_s: float = 0.0  # seconds of the segment shown (finished only)
    interrupted: bool = False
    latency_s: float | None = None  # started only: first speech sent -> its first frame shown
    split: SpeechSplit | None = None  # started only: where that latency went (when the chunk's submit time is known)
    at: float | None = None  # when it happened, wall clock (time.time), where known: an interruption's clear arrived


@dataclass(frozen=True)
class SpeechSplit:
    """Where a segment's start latency went, on the playout's clock: its first sample sent to generation
    (`sent_at`) -> the chunk whose window holds it submitted (`submitted_at`; the wait for the next chunk
    boundary) -> that chunk queued here (`arrived_at`; compute and transfer) -> its first frame with that
    sample shown (`shown_at`; the jitter buffer). The caller's clock must be the one `push` stamps with."""

    chunk: int  # the chunk's index among the chunks pushed (0 = the first)
    sent_at: float
    submitted_at: float
    arrived_at: float
    shown_at: float

    @property
    def boundary_s(self) -> float:
        return self.submitted_at - self.sent_at

    @property
    def compute_s(self) -> float:
        return self.arrived_at - self.submitted_at

    @property
    def buffer_s(self) -> float:
        return self.shown_at - self.arrived_at


@dataclass(frozen=True)
class ClearResult:
    events: list[SegmentEvent]  # one `finished` (interrupted) per unfinished segment, in order
    flush_audio: bool  # unplayed output audio was cut: the sink must drop its queued audio now
    dropped_chunks: int


@dataclass(frozen=True)
class PlayoutStats:
    started: bool
    queued_chunks: int
    buffered_s: float  # queued chunks plus committed frames not yet shown
    late_chunks: int  # chunks that ended a stall (they were not queued when their audio was needed)
    underruns: int  # stalls (each is one or more held frames)
    stall_s: float  # total time shown as held frames while waiting for a late chunk
    dropped_idle_chunks: int  # latency recovery (max_depth, shrink_after_s)
    trimmed_frames: int  # latency recovery within idle chunks (min_slack_s)
    onsets: int  # chunks pushed with onset=True
    cut_s: float  # idle content cut from the timeline ahead of onset chunks, in all
    slack_min_s: float | None  # the least slack of the chunks committed in the last slack_window_s
    dropped_cleared_chunks: int
    slips: int
    frames_sent: int
    fresh_frames: int
    audio_frames_sent: int
    fps: float  # frames handed out per second over the stats window
    fresh_fps: float  # new (not held) frames per second over the stats window
    av_offset_ms: float  # last measured video minus audio play time (positive: video behind)
    av_offset_max_ms: float  # largest |offset| over the stats window
    lost_speech_samples: int
    audio_dry: int  # audio handed out to a sink whose queue had run empty (`poll(audio_queue_s=0)`): a gap the
    #                 viewer hears, unless right after an interruption flushed it or at the start
    idle_after_clear_s: float | None  # last clear -> first new frame shown after it (None: none yet)
    still_after_clear_s: float | None  # last clear -> first frame shown after it that is not speech


def speech_prefix(pcm: np.ndarray) -> int:
    """Samples of speech at the head of a window: up to its last non-zero sample (padding is exact 0.0)."""
    nz = np.flatnonzero(pcm)
    return int(nz[-1]) + 1 if nz.size else 0


def to_int16(pcm: np.ndarray) -> np.ndarray:
    """float32 in [-1, 1] -> int16, the exact inverse of `characters.audio.pcm16_to_float`."""
    return np.clip(np.rint(pcm * 32768.0), -32768, 32767).astype(np.int16)
