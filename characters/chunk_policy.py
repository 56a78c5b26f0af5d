"""The chunk path's settings and its decisions: when chunk k goes, and how it is marked.

`ChunkPathConfig` is the one typed config of the real-time chunk path (chunks in flight, run-ahead, speech
onsets, preemption, the output's jitter buffer and trimming), composed into `ServiceConfig.chunk_path` and
handed whole to the actors that read it; every setting has one name and one unit (seconds or chunks) from
the YAML to the code. `ChunkPolicy` is the pure object that owns the loop's decisions, like admission's
`placement.policy`: it holds no Ray, no I/O and no clock (the caller passes `now`), so its tests run in
virtual time. The loop that drives the workers (`deployments.pipeline.loop`) only asks it, submits,
collects and reports.

Decisions, per chunk k:
- when: at its boundary `t0 + (k - first_chunk) * chunk_s`, or, when its audio window is already queued,
  up to `run_ahead_chunks` chunk durations before it (speech from a TTS comes faster than real time);
- onset: the first chunk with speech after chunks without, when the next window is queued too: the room
  plays it at once, cutting idle content ahead of it, and the boundaries move that much earlier (`collected`);
- urgent: idle chunks, an onset and the `urgent_chunks` - 1 after it, and speech taken less than a chunk
  before its boundary; the rest of the speech, made a chunk or more ahead, goes at the DiT's own priority;
- preemption: idle chunks are preemptible, and an onset asks the DiT to give up the idle one in flight.
What the playout trims, sheds and cuts is decided by its own pure policy, `characters.pacing.TrimPolicy`,
from the same config (`ChunkPathConfig.playout`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from characters.pacing import PacingConfig


class ChunkPathConfig(BaseModel):
    """The real-time chunk path of every session of a service (`ServiceConfig.chunk_path`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    depth: int = Field(default=2, ge=1, le=8, description="Chunks in flight: 2 lets the DiT make chunk k+1 while "
                       "k is decoded.")
    pacing: Literal["realtime", "unpaced"] = Field(
        default="realtime", description="realtime: chunk k is submitted at k x its play time; unpaced: back to back, "
        "as fast as the pipeline goes (benchmarks, file renders). LiveKit outputs are always realtime.")
    run_ahead_chunks: float = Field(
        default=2.0, ge=0, le=8, description="A chunk whose audio window is all queued goes as soon as it is, up to "
        "this many chunk durations before its boundary (speech waits for no boundary). 0: every chunk waits for it.")
    urgent_chunks: int = Field(default=3, ge=0, le=64, description="An onset and the chunks after it, this many in "
                               "all, are made at the chunk path's raised priority (through the agent's burst).")
    preempt_idle: bool = Field(
        default=True, description="LiveKit outputs: a speech onset takes the place of the idle chunk the DiT is "
        "making (it gives that chunk up between two parts of its step: topology.step_groups). Off: the onset waits.")
    onset_first_frame: Literal["auto", "on", "off"] = Field(
        default="auto", description="A speech onset's chunk is decoded in two parts, its first frame first, which "
        "the room plays at once (characters.vae, decode_first). auto: on for GPU decoders, off on CPUs.")
    jitter_buffer_chunks: float = Field(
        default=1.0, ge=0, le=4, description="The output's jitter buffer, in chunk durations: the slack against late "
        "chunks, paid as latency by every chunk (the first waits this long before playout starts).")
    min_slack_s: float | None = Field(
        default=0.2, ge=0, le=1, description="LiveKit outputs: idle chunks are trimmed a frame at a time while every "
        "chunk of the last slack window was queued this long plus a frame ahead of its play time, so a buffer that "
        "grew on a late chunk settles back to this slack (characters.pacing). None: off.")
    onset_slack_s: float | None = Field(
        default=0.02, ge=0, le=1, description="LiveKit outputs: a speech onset plays this long after it reached the "
        "room, the idle frames ahead of it cut (characters.pacing, speech onsets). None: onsets off (speech waits "
        "behind the jitter buffer like any chunk).")
    audio_lead_s: float = Field(
        default=0.02, ge=0, le=0.5, description="LiveKit outputs: audio goes to the audio source this long before its "
        "frames are due, so a room loop that wakes late never leaves the source's queue dry; every word is heard "
        "this much later.")
    chunk_timeout_s: float = Field(default=30.0, gt=0, description="Wait for one chunk's result before failing.")

    @property
    def onsets(self) -> bool:
        """Are speech onsets marked (and played at once)?"""
        return self.onset_slack_s is not None

    def playout(self, *, fps: int, frames_per_chunk: int, sample_rate: int, audio_frame_ms: int) -> PacingConfig:
        """The LiveKit output's playout settings: these, on the session's media format."""
        return PacingConfig(fps=fps, frames_per_chunk=frames_per_chunk, sample_rate=sample_rate,
                            audio_frame_ms=audio_frame_ms, target_depth=self.jitter_buffer_chunks,
                            min_slack_s=self.min_slack_s, onset_slack_s=self.onset_slack_s or 0.0,
                            audio_lead_s=self.audio_lead_s,  # the catch-up never over the lead
                            max_catchup_s=min(self.audio_lead_s, PacingConfig.model_fields["max_catchup_s"].default))


@dataclass(frozen=True)
class ChunkPlan:
    """What to submit now: chunk `chunk`, and how the workers treat it (`ChunkInput`'s fields)."""

    chunk: int
    submitted_at: float
    onset: bool
    early_s: float  # how long before its boundary it goes
    urgent: bool
    preemptible: bool
    preempt: int | None  # the chunk in flight the DiT should give up for this one (None: none)


class ChunkPolicy:
    """The chunk loop's decisions for one session (module docstring). Pure: `now` comes from the caller.

    Use: `go_at(full)` says when chunk `chunk` may go (`full`: whole windows queued from it on, 0-2); at or
    after that, `plan(now, speech, full)` decides how it goes and counts it in flight; when `must_collect()`,
    the caller fetches the oldest chunk's report and hands its `cut_s` to `collected`, which returns that
    chunk's submit time."""

    def __init__(self, *, chunk_s: float, depth: int, start: float, max_duration_s: float, first_chunk: int = 0,
                 run_ahead_chunks: float = 0.0, onsets: bool = True, urgent_chunks: int = 3,
                 preempt: bool = False) -> None:
        self.chunk_s, self.depth, self.max_duration_s = chunk_s, depth, max_duration_s
        self.started = self.t0 = start
        self.first_chunk = self.chunk = first_chunk
        self.lead_s = run_ahead_chunks * chunk_s
        self.onsets, self.urgent_chunks, self.preempt = onsets, urgent_chunks, preempt
        self.in_flight: deque[float] = deque()  # submit times, oldest first
        self._spoke = False  # the last chunk submitted held speech
        self._urgent = 0  # chunks still to mark urgent

    @classmethod
    def of(cls, cfg: ChunkPathConfig, *, chunk_s: float, start: float, max_duration_s: float, first_chunk: int = 0,
           livekit: bool = False, paced: bool = True) -> ChunkPolicy:
        """The policy `cfg` asks for. `paced` False: chunks back to back (no boundaries, no run-ahead)."""
        return cls(chunk_s=chunk_s if paced else 0.0, depth=cfg.depth, start=start, max_duration_s=max_duration_s,
                   first_chunk=first_chunk, run_ahead_chunks=cfg.run_ahead_chunks, onsets=cfg.onsets,
                   urgent_chunks=cfg.urgent_chunks, preempt=cfg.preempt_idle and livekit and cfg.onsets)

    @property
    def due(self) -> float:
        """The boundary of the next chunk."""
        return self.t0 + (self.chunk - self.first_chunk) * self.chunk_s

    @property
    def submitted(self) -> int:
        return self.chunk - self.first_chunk

    def go_at(self, full: int) -> float:
        """When the next chunk may go: its boundary, or `run_ahead_chunks` before it when its window is full."""
        return self.due - self.lead_s if full else self.due

    def expired(self, now: float) -> bool:
        return now - self.started >= self.max_duration_s

    def plan(self, now: float, *, speech: bool, full: int) -> ChunkPlan:
        """Submit the next chunk at `now` (`speech`: its window holds any; `full` as for `go_at`)."""
        onset = self.onsets and speech and not self._spoke and full >= 2
        self._spoke = speech
        self._urgent = self.urgent_chunks if onset else max(0, self._urgent - 1)
        # chunk k - 1 (idle: before the onset) may still be in the making: the onset takes its place
        preempt = self.chunk - 1 if onset and self.preempt and self.in_flight else None
        early = max(0.0, self.due - now)
        plan = ChunkPlan(self.chunk, now, onset, early, self._urgent > 0 or not speech or early < self.chunk_s,
                         self.preempt and not speech, preempt)
        self.in_flight.append(now)
        self.chunk += 1
        return plan

    def must_collect(self) -> bool:
        return len(self.in_flight) >= self.depth

    def collected(self, cut_s: float) -> float:
        """The oldest chunk in flight came back; the room cut `cut_s` of idle content ahead of an onset (or the
        DiT gave a whole chunk up): the boundaries follow. Returns that chunk's submit time."""
        self.t0 -= cut_s
        return self.in_flight.popleft()
