"""The room worker of a slot: paced playout of each chunk's frames and audio window into the session's
output (a LiveKit room, an MP4 file, or nowhere), and the playout measurements chunk reports carry.

A plain class (tests construct it directly); `deployments.sessions.slot` makes a Ray actor of it in the
slot's room bundle. Chunks reach it from the decoder through the slot's graph (`deployments.pipeline.graph`).
"""

from __future__ import annotations

import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from characters.chunk_policy import ChunkPathConfig
from characters.config import SessionConfig
from characters.host import freeze_heap
from characters.media import Mp4Writer
from characters.pacing import SegmentEvent, speech_prefix
from characters.stage_times import StageTime
from deployments import telemetry
from deployments.livekit.config import LiveKitOutput
from deployments.pipeline.messages import ChunkInput, ChunkReport, Frames, SessionMismatch
from deployments.pipeline.workers import realtime
from deployments.types import OutputSpec


class MediaSink(Protocol):
    """Where a session's frames and audio go; the seam where a LiveKit publisher plugs in later."""

    def write(self, frames: np.ndarray, pcm: np.ndarray, speech_samples: int | None = None,
              submitted_at: float | None = None, onset: bool = False, early_s: float = 0.0,
              continues: bool = False) -> float: ...
    # (F, H, W, 3) uint8, (n,) float32; returns the seconds of idle content cut ahead of an onset (a sink with a
    # playout timeline, `LiveKitSink`; 0.0 for the others); `continues`: the rest of the chunk written last

    def close(self) -> None: ...


class NullSink:
    """Output kind "null": counts and discards."""

    def __init__(self) -> None:
        self.frames = 0

    def write(self, frames: np.ndarray, pcm: np.ndarray, speech_samples: int | None = None,
              submitted_at: float | None = None, onset: bool = False, early_s: float = 0.0,
              continues: bool = False) -> float:
        self.frames += len(frames)
        return 0.0

    def close(self) -> None:
        pass


class Mp4Sink:
    """Output kind "file": H.264 + AAC MP4, frames of chunk k muxed with chunk k's audio."""

    def __init__(self, path: Path, width: int, height: int, fps: int, sample_rate: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.writer = Mp4Writer(path, width, height, fps=fps, sample_rate=sample_rate)

    def write(self, frames: np.ndarray, pcm: np.ndarray, speech_samples: int | None = None,
              submitted_at: float | None = None, onset: bool = False, early_s: float = 0.0,
              continues: bool = False) -> float:
        self.writer.write_frames(frames)
        self.writer.write_audio(pcm)
        return 0.0

    def close(self) -> None:
        self.writer.close()


class PlayoutMeter:
    """Playout schedule of a chunk stream against a clock: late chunks and delivered fps.

    Playout starts `buffer_s` after chunk 0 arrives (a jitter buffer). Chunk k is due one chunk after
    chunk k-1 played; arriving after that it is *late*: it plays on arrival, and the schedule slips by
    the lateness (the viewer sees a freeze that long). Delivered fps is frames per second of playout
    over the last `window` chunks (24 when nothing is late).
    """

    def __init__(self, chunk_s: float, frames_per_chunk: int, buffer_s: float = 0.0, window: int = 12) -> None:
        self.chunk_s, self.frames_per_chunk, self.buffer_s = chunk_s, frames_per_chunk, buffer_s
        self.played: deque[float] = deque(maxlen=max(2, window))  # play times of the last chunks
        self.late = 0
        self.chunks = 0

    def on_chunk(self, now: float) -> tuple[bool, float]:
        """A chunk arrived at `now`: (late?, lateness in seconds)."""
        due = now + self.buffer_s if not self.played else self.played[-1] + self.chunk_s
        lateness = max(0.0, now - due)
        self.played.append(max(due, now))
        self.chunks += 1
        self.late += lateness > 0
        return lateness > 0, lateness

    def queued_s(self, now: float) -> float:
        """Media queued ahead of the playhead at `now`: the last chunk's playout end minus now."""
        return max(0.0, self.played[-1] + self.chunk_s - now) if self.played else 0.0

    @property
    def delivered_fps(self) -> float:
        if len(self.played) < 2:
            return 0.0
        span = self.played[-1] - self.played[0]
        return (len(self.played) - 1) * self.frames_per_chunk / span if span > 0 else 0.0


class SessionAudioHandler:
    """The room's agent-audio callbacks, forwarded to the session actor (never blocking the room's loop):
    agent speech -> the session's audio queue, `lk.clear_buffer` -> drop queued audio (the room awaits
    the dropped-sample count), END_CALL / agent left / room empty / max duration -> end the session.
    Every call names `session_id`: the slot's session actor serves session after session, and drops a
    late call meant for one that already ended."""

    def __init__(self, session: Any, session_id: str) -> None:
        self.session, self.session_id = session, session_id

    def push_audio(self, pcm16: bytes, sample_rate: int, channels: int) -> object:
        return self.session.push_audio.remote(self.session_id, pcm16, sample_rate, channels)

    def clear_audio(self) -> Any:
        return self.session.clear_audio.remote(self.session_id)  # an ObjectRef: awaitable on the room's loop

    def end_session(self, reason: str) -> object:
        return self.session.stop.remote(self.session_id, reason)


def frames_digest(frames: np.ndarray) -> str:
    """64-bit fingerprint of a chunk's frames: CRC-32 of each half of their bytes, read in place.

    Reports carry it so runs can be compared chunk by chunk (determinism, TP vs one GPU). A 480x832 chunk is
    14 MB: blake2b over a copy took 18 ms of the room's CPU per chunk, this takes 3.4 ms."""
    data = np.ascontiguousarray(frames).data.cast("B")
    half = len(data) // 2
    return f"{zlib.crc32(data[:half]):08x}{zlib.crc32(data[half:]):08x}"


@dataclass(frozen=True)
class _First:
    """An onset's first frames, playing (`RoomWorker.publish_first`), until `publish` takes the rest."""

    frames: Frames
    samples: int  # the audio that went with them
    speech_after: int  # speech samples in the rest of the window
    cut_s: float
    now: float
    late: bool
    lateness: float
    publish: StageTime


UNTRIMMED = ChunkPathConfig(min_slack_s=None)  # a RoomWorker built without the service's chunk path


class RoomWorker:
    """The session's output: publishes chunk k's frames with chunk k's audio; measures the playout."""

    def __init__(self, cfg: SessionConfig, *, clock: Callable[[], float] = time.monotonic,
                 chunk_path: ChunkPathConfig = UNTRIMMED, nice: int | None = None) -> None:
        """`chunk_path`: the service's (`ServiceConfig.chunk_path`); the default trims no idle chunks."""
        realtime(nice, "room")  # its playout thread (started per session) inherits it
        self.cfg, self.clock, self.chunk_path = cfg, clock, chunk_path
        telemetry.setup("room")  # this process's telemetry (OTEL_* of its environment; off by default)
        g = cfg.model.generation
        self.chunk_s = g.frames_per_chunk / g.fps
        self.buffer_s = chunk_path.jitter_buffer_chunks * self.chunk_s
        self._late_seen, self._stall_seen = 0, 0.0  # the LiveKit playout's late chunks and stall, as reported
        self.sink: MediaSink | None = None
        self.meter = PlayoutMeter(self.chunk_s, g.frames_per_chunk, self.buffer_s)
        self.session_id: str | None = None
        self._playback: deque[SegmentEvent] = deque(maxlen=256)  # from the room's thread, taken by `publish`
        self._held: Frames | None = None  # a whole chunk `publish_first` got, for `publish`
        self._first: _First | None = None  # an onset's head `publish_first` published

    def open(self, session_id: str, output: OutputSpec | LiveKitOutput, path: str | None = None,
             session: Any = None, max_duration_s: float | None = None, poster: np.ndarray | None = None) -> None:
        """Start publishing for `session_id`: "file" writes an MP4 at `path`, "null" discards. `poster`: the
        session's (H, W, 3) uint8 reference image, a LiveKit video track's first frame (no black frames before
        the first chunk)."""
        self.close()
        m = self.cfg.model
        g = m.generation
        if output.kind == "file":
            if path is None:
                raise ValueError("output kind 'file' needs a path; the scheduler resolves it under output_dir")
            self.sink = Mp4Sink(Path(path), g.width, g.height, g.fps, m.audio.sample_rate)
        elif output.kind == "livekit":
            from deployments.livekit.config import MediaFormat
            from deployments.livekit.publisher import AUDIO_FRAME_MS
            from deployments.livekit.sink import LiveKitSink

            if not isinstance(output, LiveKitOutput):
                raise TypeError(f"output kind 'livekit' needs a LiveKitOutput, got {type(output).__name__}")
            sink = LiveKitSink(output, MediaFormat(g.width, g.height, g.fps, g.frames_per_chunk),
                               SessionAudioHandler(session, session_id) if session is not None else None,
                               max_duration_s=None if max_duration_s is None else max_duration_s + 5,
                               pacing=self.chunk_path.playout(fps=g.fps, frames_per_chunk=g.frames_per_chunk,
                                                              sample_rate=m.audio.sample_rate,
                                                              audio_frame_ms=AUDIO_FRAME_MS),
                               on_playback=self._playback.append,  # deque.append: safe from another thread
                               poster=poster)
            sink.start()  # RoomError: the session fails to start, with the reason
            self.sink = sink
        else:
            self.sink = NullSink()
        self.meter = PlayoutMeter(self.chunk_s, g.frames_per_chunk, self.buffer_s)
        self._late_seen, self._stall_seen = 0, 0.0
        self._playback.clear()
        self._held = self._first = None
        self.session_id = session_id

    def publish_first(self, inp: ChunkInput, first: Frames) -> int:
        """A chunk's first part (`DecoderWorker.decode_first`). A speech onset's first frame goes out at once, with
        its share of the audio, cutting idle content ahead of it: the viewer sees and hears the onset after about
        half of the chunk's decode. A whole chunk (any other) is held for `publish`, which comes next. Returns
        the frames published (0: held)."""
        self._check(inp, first)
        self._held = self._first = None
        sink = self.sink
        assert sink is not None
        f = self.cfg.model.generation.frames_per_chunk
        if len(first.frames) >= f or not inp.onset or not self.chunk_path.onsets or first.given_up:
            self._held = first
            return 0
        t0 = time.time_ns()
        now = self.clock()
        late, lateness = self.meter.on_chunk(now)
        n = len(first.frames) * inp.pcm.size // f  # the samples that play with these frames (`characters.pacing`)
        speech = speech_prefix(inp.pcm)
        cut_s = sink.write(first.frames, inp.pcm[:n], speech_samples=min(speech, n), submitted_at=inp.submitted_at,
                           onset=True, early_s=inp.early_s)
        self._first = _First(first, n, speech - min(speech, n), cut_s, now, late, lateness,
                             StageTime(inp.chunk, "publish", t0, time.time_ns() - t0, "host"))
        return len(first.frames)

    def publish(self, inp: ChunkInput, frames: Frames, shown: int | None = None) -> ChunkReport:
        """Chunk k's frames and its audio into the output; the chunk's report. After `publish_first` (`shown`:
        its answer, which orders the two in the graph): the frames it left, with the rest of the audio."""
        self._check(inp, frames)
        held, first, self._held, self._first = self._held, self._first, None, None
        sink = self.sink
        assert sink is not None
        if frames.given_up:
            return self._given_up(inp, frames)
        if held is not None and held.chunk == inp.chunk and held.given_up:  # (`publish_first` held it)
            return self._given_up(inp, held)
        if first is not None and first.frames.chunk == inp.chunk:  # an onset's rest: its head is playing
            # (no submit time: the head's arrival said how long the chunk took)
            sink.write(frames.frames, inp.pcm[first.samples:], speech_samples=first.speech_after, onset=False,
                       early_s=inp.early_s, continues=True)
            now, late, lateness, cut_s = first.now, first.late, first.lateness, first.cut_s
            stages = (*frames.stages, first.publish)  # the onset's publish: its head's, which the viewer waits on
            all_frames = np.concatenate([first.frames.frames, frames.frames])
            head = len(first.frames.frames)
        else:
            if held is not None and held.chunk == inp.chunk:  # the whole chunk came as `publish_first`'s part
                frames = Frames(held.session_id, held.chunk, np.concatenate([held.frames, frames.frames])
                                if len(frames.frames) else held.frames, (*held.stages, *frames.stages))
            t0 = time.time_ns()
            now = self.clock()
            late, lateness = self.meter.on_chunk(now)
            onset = inp.onset and self.chunk_path.onsets
            cut_s = sink.write(frames.frames, inp.pcm, submitted_at=inp.submitted_at, onset=onset,
                               early_s=inp.early_s)
            # the stage ends where the output has the chunk (a LiveKit playout plays it from here on): the digest
            # below is bookkeeping after it, off the path to the viewer (3.9 ms at 4 x 704x1088 on a 2-core EPYC)
            stages = (*frames.stages, StageTime(inp.chunk, "publish", t0, time.time_ns() - t0, "host"))
            all_frames, head = frames.frames, 0
        digest = frames_digest(all_frames)
        buffer_s, av_offset_s = self.meter.queued_s(now), float(getattr(self.sink, "av_offset_s", 0.0))
        presented, dry = 0.0, 0
        if (room := getattr(self.sink, "latest_stats", None)) is not None:  # LiveKit: its playout's measurements
            buffer_s, av_offset_s = room.playout.buffered_s, room.playout.av_offset_ms / 1e3
            presented, dry = room.playout.fps, room.playout.audio_dry
            # late chunks as the real playout saw them (its timeline, trimmed or not), not the meter's model:
            # the chunks that ended a stall since the last report (a chunk's lateness shows once it is due)
            late = room.playout.late_chunks > self._late_seen
            lateness = max(0.0, room.playout.stall_s - self._stall_seen) if late else 0.0
            self._late_seen, self._stall_seen = room.playout.late_chunks, room.playout.stall_s
        playback = []
        while self._playback:
            playback.append(self._playback.popleft())
        return ChunkReport(inp.session_id, inp.chunk, len(all_frames), late, lateness, self.meter.delivered_fps,
                           digest, now, stages, buffer_s, av_offset_s, presented, tuple(playback), cut_s, dry,
                           head)

    def _given_up(self, inp: ChunkInput, frames: Frames) -> ChunkReport:
        """An idle chunk the DiT gave up for the onset after it (`DiTWorker.preempt`): nothing goes out, and the
        stream is a chunk shorter than the chunk loop's clock says (cut_s: the loop moves its boundaries as for
        the idle content an onset cuts). The onset then plays as soon as it arrives, as every onset does."""
        now = self.clock()
        playback = []
        while self._playback:
            playback.append(self._playback.popleft())
        return ChunkReport(inp.session_id, inp.chunk, 0, False, 0.0, self.meter.delivered_fps, "", now,
                           frames.stages, self.meter.queued_s(now),
                           playback=tuple(playback), cut_s=self.chunk_s, given_up=True)

    def _check(self, inp: ChunkInput, frames: Frames) -> None:
        if self.sink is None or frames.session_id != self.session_id or (inp.session_id, inp.chunk) != (
                frames.session_id, frames.chunk):
            raise SessionMismatch(
                f"room for session {self.session_id!r} got frames of {frames.session_id!r} chunk {frames.chunk} "
                f"with audio of {inp.session_id!r} chunk {inp.chunk}; open the room for the session first"
            )

    def close(self) -> None:
        """Finish the output (the MP4 trailer). Idempotent."""
        sink, self.sink, self.session_id = self.sink, None, None
        if sink is not None:
            sink.close()

    def reset(self) -> None:
        self.close()

    def settle(self) -> None:
        """Import what a LiveKit session uses, then take what this process built out of the garbage collector's
        reach (`characters.host.freeze_heap`): nothing of a session yet, so nothing of one is frozen."""
        try:
            import deployments.livekit.publisher
            import deployments.livekit.sink  # noqa: F401  # with the LiveKit SDK and its FFI bindings
        except ImportError:  # an image without the LiveKit SDK (the GPU machine's): its sessions never use it
            pass
        freeze_heap("room")

    def ping(self) -> str:
        return "room"
