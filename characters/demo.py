"""`characters demo`: one session in this process, written to an MP4 with the audio muxed in.

With `realtime`, chunks are paced at 24 fps against an injected clock: playout starts when chunk 0
is ready, chunk k is due one chunk-duration after chunk k-1, and a chunk that is not ready when due
is *late*: its frames still play, the playout clock slips by the lateness (the viewer sees a freeze
of that length), and the late count goes up. Without `realtime`, chunks are made as fast as they can.

The engine's two stages run through `characters.stages.StagePipeline`: with two or more cores the DiT of
chunk k+1 runs beside the decode of chunk k (one intra-op thread each, the topology's fields), never
further ahead. With `realtime`, a calibration on a few chunks of silence says first whether this machine,
as loaded now, keeps up (`on_calibration`; the CLI prints it, and warns when it is too slow).
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
from characters.host import freeze_heap
from characters.media import SAMPLE_IMAGE, Mp4Writer, frame_reference
from characters.stages import Calibration, StagePipeline, calibrate


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
    delivered_fps: float  # generated frames over the playout span: every frame here is generated, none repeated
    wall_s: float
    overlap: bool = False  # DiT of chunk k+1 beside the decode of chunk k (two threads)
    cpu_ms_p50: float = 0.0  # CPU time per chunk, DiT + decoder threads
    cpu_ms_p95: float = 0.0
    dit_ms_p50: float = 0.0  # wall time of each stage
    decode_ms_p50: float = 0.0
    calibration: dict[str, object] | None = None
    face_found: bool = True  # a face was found in the image: framed with the head whole, frames anchored on it
    framing: str = ""  # how the image was framed, in words (`characters.media.Framing.describe`)
    step_ms: list[float] = field(repr=False, default_factory=list)

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d.pop("step_ms")
        return d


def run_demo(cfg: SessionConfig, *, out: str | Path, image: str | Path | None = None, audio: str | Path | None = None,
             seconds: float = 10.0, realtime: bool = False, device: str = "cpu",
             clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
             on_chunk: Callable[[int, float], None] | None = None, overlap: bool | None = None,
             on_calibration: Callable[[Calibration], None] | None = None, settle: bool = False,
             anchor: bool = True) -> DemoReport:
    """`overlap`: run the DiT of chunk k+1 beside the decode of chunk k (default: when 2+ cores are ours).
    `anchor`: frames anchored on the reference (`characters.identity`; False: as the decoder makes them).
    `on_calibration` hears the calibration (realtime runs only) before the session starts. `settle`: this
    process is the demo's own; once warm, take what it built out of the garbage collector's reach
    (`characters.host.freeze_heap`)."""
    m = cfg.model
    g = m.generation
    picture, framing = frame_reference(image or SAMPLE_IMAGE, g.height, g.width)
    speech = load_audio(audio or SAMPLE_AUDIO)
    engine = CharacterEngine(cfg, device=device)
    n_chunks = max(1, math.ceil(seconds * g.fps / g.frames_per_chunk))
    chunk_s = g.frames_per_chunk / g.fps
    cal = calibrate(engine, picture, overlap=overlap) if realtime else None
    if cal is not None and on_calibration is not None:
        on_calibration(cal)
    if settle:
        freeze_heap("demo")

    def chunk_pcm(k: int) -> np.ndarray:
        a, b = engine.chunk_samples(k)
        pcm = np.zeros(b - a, dtype=np.float32)
        have = speech[a:b]
        pcm[: len(have)] = have
        return pcm

    steps: list[float] = []
    cpu: list[float] = []
    dit: list[float] = []
    dec: list[float] = []
    late = 0
    engine.start(picture, anchor=anchor)
    pcms = [chunk_pcm(k) for k in range(n_chunks)]
    with Mp4Writer(out, g.width, g.height, fps=g.fps, sample_rate=m.audio.sample_rate) as writer, \
            StagePipeline(engine, overlap=overlap) as pipe:
        t_start = clock()
        due = playout_start = 0.0
        t0 = clock()
        for res in pipe.stream(pcms):
            k = res.chunk
            ready = clock()
            steps.append((ready - t0) * 1e3)  # this chunk's turn: its decode (beside the next DiT), or both stages
            cpu.append(res.cpu_ms)
            dit.append(res.dit.wall_ms)
            dec.append(res.decode.wall_ms)
            if realtime:
                if k == 0:
                    due = playout_start = ready
                elif ready > due:
                    late += 1
                    due = ready  # the viewer sees a freeze; playout resumes from here
                else:
                    sleep(due - ready)
                due += chunk_s
            writer.write_frames(res.frames)
            writer.write_audio(pcms[k])
            if on_chunk is not None:
                on_chunk(k, steps[-1])
            t0 = clock()
        wall = clock() - t_start
    s = np.asarray(steps)
    frames_total = n_chunks * g.frames_per_chunk
    span = (due - playout_start) if realtime else wall  # playout span, or generation time
    return DemoReport(out=str(out), chunks=n_chunks, frames=frames_total, seconds_of_video=frames_total / g.fps,
                      step_ms_p50=float(np.percentile(s, 50)), step_ms_p95=float(np.percentile(s, 95)),
                      step_ms_max=float(s.max()), late_chunks=late, realtime=realtime,
                      delivered_fps=frames_total / span if span > 0 else float("inf"), wall_s=wall,
                      overlap=pipe.overlap, cpu_ms_p50=float(np.percentile(cpu, 50)),
                      cpu_ms_p95=float(np.percentile(cpu, 95)), dit_ms_p50=float(np.percentile(dit, 50)),
                      decode_ms_p50=float(np.percentile(dec, 50)),
                      calibration=asdict(cal) | {"too_slow": cal.too_slow} if cal is not None else None,
                      face_found=framing.face_found, framing=framing.describe(), step_ms=steps)
