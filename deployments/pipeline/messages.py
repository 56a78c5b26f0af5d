"""The messages a chunk travels in between the slot's workers (`deployments.pipeline.workers`, `.room`) and the
chunk loop (`deployments.pipeline.graph`): the graph's input, the DiT ranks' acks and latents, the decoder's
frames, the room's report; and the error a crossed message raises."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from characters.pacing import SegmentEvent
from characters.stage_times import StageTime
from deployments.pipeline.handoff import Latents


@dataclass(frozen=True)
class ChunkInput:
    """The graph's input for chunk k: its exact audio samples (also published with its frames)."""

    session_id: str
    chunk: int
    pcm: np.ndarray  # (n,) float32 mono 16 kHz, n = len(chunk_sample_range(chunk))
    submitted_at: float | None = None  # when the chunk loop took this audio (time.monotonic: the slot's node)
    onset: bool = False  # the first speech after idle chunks: the room plays it at once (`run_chunk_loop`)
    early_s: float = 0.0  # submitted this long before its boundary (its window was full): not slack of the pipeline
    urgent: bool = False  # idle, an onset or just after it, or little run-ahead: the DiT raises its priority for it
    preemptible: bool = False  # idle: the DiT may give it up for an onset that comes while it is made (`preempt`)


@dataclass(frozen=True)
class Ack:
    """What DiT ranks other than 0 return: binds them into the graph (their errors surface)."""

    rank: int
    chunk: int


@dataclass(frozen=True)
class TimedLatents(Latents):
    """DiT rank 0's latents with the stage times measured so far (telemetry on; the handoff reads the rest)."""

    stages: tuple[StageTime, ...] = ()


@dataclass(frozen=True)
class Frames:
    session_id: str
    chunk: int
    frames: np.ndarray  # (F, H, W, 3) uint8
    stages: tuple[StageTime, ...] = ()  # DiT and decoder stage times (telemetry on)
    given_up: bool = False  # the DiT gave the chunk up for an onset (no frames): the room publishes nothing


@dataclass(frozen=True)
class ChunkReport:
    """What the room returns for chunk k (the graph's output)."""

    session_id: str
    chunk: int
    frames: int
    late: bool
    lateness_s: float
    delivered_fps: float  # generated frames per second of playout: new frames only (a late chunk stretches it)
    digest: str  # `frames_digest`: equal frames -> equal digests (a content fingerprint, not a security hash)
    published_at: float  # the room's clock (monotonic: comparable on one node, where the whole slot is)
    stages: tuple[StageTime, ...] = ()  # where the time went (telemetry on): this chunk's host times, and
    #                                     GPU times of earlier chunks (CUDA events are read once complete)
    buffer_s: float = 0.0  # media queued ahead of playout when this chunk arrived (the jitter buffer)
    av_offset_s: float = 0.0  # video minus audio play time, as the sink measures it (0: muxed together)
    presented_fps: float = 0.0  # frames the output presented per second, held repeats of late chunks included
    #                              (a LiveKit room's playout; 0: not measured); delivered_fps counts new frames only
    playback: tuple[SegmentEvent, ...] = ()  # speech segments that started or finished since the last report
    cut_s: float = 0.0  # an onset chunk: idle content the room cut ahead of it (the chunk clock moves as much)
    audio_dry: int = 0  # times the output's audio queue had run empty so far (a gap heard; LiveKit rooms)
    head_frames: int = 0  # frames that went out before the rest of the chunk (an onset's first: `publish_first`)
    given_up: bool = False  # an idle chunk the DiT gave up for the onset after it (nothing published; cut_s: a chunk)


class SessionMismatch(RuntimeError):
    """A worker got a message for another session or chunk than the one it serves."""
