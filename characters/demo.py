"""`characters demo`: one session in this process, written to an MP4 with the audio muxed in.

With `realtime`, chunks are paced at 24 fps against an injected clock: playout starts when chunk 0
is ready, chunk k is due one chunk-duration after chunk k-1, and a chunk that is not ready when due
is *late*: its frames still play, the playout clock slips by the lateness (the viewer sees a freeze
of that length), and the late count goes up. Without `realtime`, chunks are made as fast as they can.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from characters.audio import SAMPLE_AUDIO, load_audio
from characters.config import SessionConfig
from characters.engine import CharacterEngine
from characters.media import SAMPLE_IMAGE, Mp4Writer, load_image


@dataclass
class DemoReport:
    out: str
    chunks: int
    frames: int
    seconds_of_video: float
    step_ms_p50: float
    step_ms_p95: float
    step_ms_max: float
    late_chunks: int
    realtime: bool
    delivered_fps: float
    wall_s: float
    step_ms: list[float] = field(repr=False, default_factory=list)

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d.pop("step_ms")
        return d


def run_demo(cfg: SessionConfig, *, out: str | Path, image: str | Path | None = None, audio: str | Path | None = None,
             seconds: float = 10.0, realtime: bool = False, device: str = "cpu",
             clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
             on_chunk: Callable[[int, float], None] | None = None) -> DemoReport:
    m = cfg.model
    g = m.generation
    picture = load_image(image or SAMPLE_IMAGE, g.height, g.width)
    speech = load_audio(audio or SAMPLE_AUDIO)
    engine = CharacterEngine(cfg, device=device)
    n_chunks = max(1, math.ceil(seconds * g.fps / g.frames_per_chunk))
    chunk_s = g.frames_per_chunk / g.fps
    steps: list[float] = []
    late = 0
    engine.start(picture)
    with Mp4Writer(out, g.width, g.height, fps=g.fps, sample_rate=m.audio.sample_rate) as writer:
        t_start = clock()
        due = playout_start = 0.0
        for k in range(n_chunks):
            a, b = engine.chunk_samples(k)
            pcm = np.zeros(b - a, dtype=np.float32)
            have = speech[a:b]
            pcm[: len(have)] = have
            t0 = clock()
            frames = engine.step(pcm)
            ready = clock()
            steps.append((ready - t0) * 1e3)
            if realtime:
                if k == 0:
                    due = playout_start = ready
                elif ready > due:
                    late += 1
                    due = ready  # the viewer sees a freeze; playout resumes from here
                else:
                    sleep(due - ready)
                due += chunk_s
            writer.write_frames(frames)
            writer.write_audio(pcm)
            if on_chunk is not None:
                on_chunk(k, steps[-1])
        wall = clock() - t_start
    s = np.asarray(steps)
    frames_total = n_chunks * g.frames_per_chunk
    span = (due - playout_start) if realtime else wall  # playout span, or generation time
    return DemoReport(out=str(out), chunks=n_chunks, frames=frames_total, seconds_of_video=frames_total / g.fps,
                      step_ms_p50=float(np.percentile(s, 50)), step_ms_p95=float(np.percentile(s, 95)),
                      step_ms_max=float(s.max()), late_chunks=late, realtime=realtime,
                      delivered_fps=frames_total / span if span > 0 else float("inf"), wall_s=wall, step_ms=steps)
