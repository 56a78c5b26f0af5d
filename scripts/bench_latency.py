"""Benchmark: agent speech -> the first published frame made from it, through a real LiveKit server.

    python scripts/bench_latency.py                                   # the tiny model in-process (CPU)
    python scripts/bench_latency.py --generator synthetic --depth 2   # a stand-in with the pipeline's delay
    python scripts/bench_latency.py --utterances 12 --out benchmarks/latency_cpu.json

Setup, all on loopback: a `livekit-server --dev` (scripts/install_livekit.sh), the character's room
(`LiveKitSink`, the path `RoomWorker` uses: its own loop thread), a chunk loop thread that takes chunk
k's audio from the session queue at t0 + k * 166.7 ms and produces its frames, an agent participant
speaking through LiveKit Agents' `DataStreamAudioOutput` (the real avatar protocol: `lk.audio_stream`,
`lk.playback_started`, `lk.playback_finished`) and a viewer counting what it receives.

Generators: `tiny` runs `characters.engine.CharacterEngine` (the tiny preset, random weights) in the
chunk loop, one chunk at a time (no DiT/decoder overlap in one process); `synthetic` makes frames at
once and delivers them `--depth` chunks later, the Ray pipeline's chunks in flight.

Measured per utterance (p50/p95): `speech_to_frame_s`, room side: agent audio handed to the session
-> the first video frame whose audio window holds its first sample is published (`SegmentEvent.
latency_s`); `agent_to_started_s`, agent side: first audio frame captured -> `lk.playback_started`
received. Also delivered fps (publisher and viewer), the publisher's measured A/V offset (sampled every
0.5 s), late chunks, and the chunk compute time. Compared with the 0.49 s video share of a 2.13 s
median conversational turn (DESIGN.md section 1). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from livekit import api, rtc
from livekit.agents.voice.avatar import DataStreamAudioOutput

from characters.audio import SAMPLE_AUDIO, chunk_sample_range, convert_pcm, load_audio, pcm16_to_float
from characters.pacing import SegmentEvent, to_int16
from deployments.livekit import LiveKitOutput, LiveKitServer, LiveKitSink, MediaFormat, install_server
from deployments.sessions.runner import AudioBuffer

ROOT = Path(__file__).resolve().parents[1]
VIDEO_SHARE_S = 0.49  # DESIGN.md section 1: the video pipeline's share of a 2.13 s median turn
SR, FPS, F = 16000, 24, 4
CHUNK_S = F / FPS
AVATAR, AGENT, ROOM = "character", "agent", "bench"


class SessionQueue:
    """The session's side of the room's agent-audio callbacks, over the session's own `AudioBuffer`."""

    def __init__(self) -> None:
        self.buffer = AudioBuffer(F, SR, FPS)

    def push_audio(self, pcm16: bytes, sample_rate: int, channels: int) -> None:
        self.buffer.push(convert_pcm(pcm16_to_float(pcm16), sample_rate, channels))

    def clear_audio(self) -> int:
        return self.buffer.clear()

    def end_session(self, reason: str) -> None:
        pass

    def take(self, k: int) -> np.ndarray:
        return self.buffer.take(k)


def synthetic_frames(k: int, pcm: np.ndarray, h: int, w: int) -> np.ndarray:
    frames = np.full((F, h, w, 3), 40, np.uint8)
    level = int(min(1.0, float(np.abs(pcm).mean()) * 8) * 200)
    for i in range(F):
        x = (k * F + i) % w
        frames[i, :, x:x + 4] = 255
        frames[i, h // 2:, :, 0] = 40 + level
    return frames


class ChunkLoop(threading.Thread):
    """Chunk k's audio is taken at t0 + k * T; its frames go to the sink when made (tiny) or `depth`
    chunks later (synthetic)."""

    def __init__(self, sink: LiveKitSink, queue: SessionQueue, generator: str, depth: int) -> None:
        super().__init__(name="chunk-loop", daemon=True)
        self.sink, self.queue, self.generator, self.depth = sink, queue, generator, depth
        self.stop_event = threading.Event()
        self.step_s: list[float] = []
        self.engine: Any = None
        self.ready = threading.Event()

    def run(self) -> None:
        h, w = self.sink.media.height, self.sink.media.width
        if self.generator == "tiny":
            import torch

            from characters.config import session_config
            from characters.engine import CharacterEngine
            from characters.media import load_image

            torch.set_num_threads(1)
            self.engine = CharacterEngine(session_config("tiny"))
            self.engine.start(load_image(SAMPLE_AUDIO.parent / "sample_face.png", h, w))
            for k in range(2):  # warm up, then start over
                s0, s1 = chunk_sample_range(k, F)
                self.engine.step(np.zeros(s1 - s0, np.float32))
            self.engine.start(load_image(SAMPLE_AUDIO.parent / "sample_face.png", h, w))
        self.ready.set()
        inflight: deque[tuple[np.ndarray, np.ndarray]] = deque()
        t0 = time.monotonic()
        k = 0
        while not self.stop_event.wait(max(0.0, t0 + k * CHUNK_S - time.monotonic())):
            pcm = self.queue.take(k)
            t = time.perf_counter()
            if self.engine is not None:
                self.sink.write(self.engine.step(pcm), pcm)
            else:
                inflight.append((synthetic_frames(k, pcm, h, w), pcm))
                if len(inflight) > self.depth:
                    self.sink.write(*inflight.popleft())
            self.step_s.append(time.perf_counter() - t)
            k += 1


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


async def run(server: LiveKitServer, args: argparse.Namespace) -> dict[str, Any]:
    events: list[tuple[float, SegmentEvent]] = []
    queue = SessionQueue()
    out = LiveKitOutput(url=server.url, room_name=ROOM, api_key=server.api_key, api_secret=server.api_secret,
                        identity=AVATAR, agent_identity=AGENT)
    sink = LiveKitSink(out, MediaFormat(272, 176), queue, on_playback=lambda e: events.append((time.monotonic(), e)))
    await asyncio.to_thread(sink.start)
    loop_thread = ChunkLoop(sink, queue, args.generator, args.depth)
    loop_thread.start()
    await asyncio.to_thread(loop_thread.ready.wait)

    def tok(identity: str, kind: Any = None) -> str:
        t = (api.AccessToken(server.api_key, server.api_secret).with_identity(identity)
             .with_grants(api.VideoGrants(room_join=True, room=ROOM)))
        return (t.with_kind(kind) if kind else t).to_jwt()

    agent, viewer = rtc.Room(), rtc.Room()
    frames_seen: list[float] = []
    streams: list[rtc.VideoStream] = []
    tasks: list[asyncio.Task[None]] = []

    async def count(stream: rtc.VideoStream) -> None:
        async for _ in stream:
            frames_seen.append(time.monotonic())

    def on_track(track: rtc.Track, *_: Any) -> None:
        if track.kind == rtc.TrackKind.KIND_VIDEO:
            streams.append(rtc.VideoStream(track))
            tasks.append(asyncio.create_task(count(streams[-1])))

    viewer.on("track_subscribed", on_track)
    await viewer.connect(server.url, tok("viewer"))
    await agent.connect(server.url, tok(AGENT, "agent"))
    output = DataStreamAudioOutput(agent, destination_identity=AVATAR, sample_rate=SR,
                                   wait_remote_track=rtc.TrackKind.KIND_VIDEO, wait_playback_start=True)
    started_at: list[float] = []
    output.on("playback_started", lambda ev: started_at.append(time.monotonic()))
    speech = to_int16(load_audio(SAMPLE_AUDIO))
    voiced = np.flatnonzero(np.abs(speech) > 500)
    offsets: list[float] = []
    t_run = time.monotonic()

    async def sample_offsets() -> None:
        while True:
            await asyncio.sleep(0.5)
            stats = await asyncio.to_thread(sink.stats)
            if stats is not None and stats.playout.started:
                offsets.append(stats.playout.av_offset_ms)

    tasks.append(asyncio.create_task(sample_offsets()))
    agent_latency: list[float] = []
    await asyncio.sleep(1.0)
    for i in range(args.utterances):
        start = int(voiced[(i * 7919) % voiced.size])  # begin on a voiced sample: the first frame shows speech
        utter = speech[start:start + int(args.utterance_s * SR)]
        n_started = len(started_at)
        t_send = time.monotonic()
        for j in range(0, utter.size, 320):
            piece = utter[j:j + 320]
            await output.capture_frame(rtc.AudioFrame(piece.tobytes(), SR, 1, piece.size))
        output.flush()
        await asyncio.wait_for(output.wait_for_playout(), 30)
        if len(started_at) > n_started:
            agent_latency.append(started_at[n_started] - t_send)
        await asyncio.sleep(args.pause_s)
    t_end = time.monotonic()
    stats = sink.stats()
    for s in streams:
        await s.aclose()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await agent.disconnect()
    await viewer.disconnect()
    loop_thread.stop_event.set()
    await asyncio.to_thread(loop_thread.join, 10)
    await asyncio.to_thread(sink.close)

    room_latency = [e.latency_s for _, e in events if e.kind == "started" and e.latency_s is not None]
    viewer_fps = sum(t_run + 1 <= t < t_end for t in frames_seen) / (t_end - t_run - 1)
    abs_off = [abs(o) for o in offsets]
    p = stats.playout if stats is not None else None
    return {
        "generator": args.generator,
        "depth": args.depth if args.generator == "synthetic" else None,
        "utterances": args.utterances,
        "speech_to_frame_s": {"p50": pct(room_latency, 50), "p95": pct(room_latency, 95), "n": len(room_latency),
                              "all": [round(x, 4) for x in room_latency]},
        "agent_to_started_s": {"p50": pct(agent_latency, 50), "p95": pct(agent_latency, 95), "n": len(agent_latency)},
        "video_share_s": VIDEO_SHARE_S,
        "p50_over_video_share": (pct(room_latency, 50) or 0.0) / VIDEO_SHARE_S,
        "fps_publisher": p.fps if p else None,
        "fresh_fps_publisher": p.fresh_fps if p else None,  # new frames (held frames excluded), last 2 s
        "stall_s": p.stall_s if p else None,
        "fps_viewer": viewer_fps,
        "av_offset_ms": {"mean_abs": float(np.mean(abs_off)) if abs_off else None, "p95_abs": pct(abs_off, 95),
                         "max_abs": max(abs_off, default=None)},
        "late_chunks": p.late_chunks if p else None,
        "buffered_s_at_end": p.buffered_s if p else None,
        "dropped_idle_chunks": p.dropped_idle_chunks if p else None,
        "underruns": p.underruns if p else None,
        "slips": p.slips if p else None,
        "chunk_compute_ms": {"p50": (pct(loop_thread.step_s, 50) or 0) * 1e3,
                             "p95": (pct(loop_thread.step_s, 95) or 0) * 1e3},
        "duration_s": t_end - t_run,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--generator", choices=["tiny", "synthetic"], default="tiny")
    ap.add_argument("--depth", type=int, default=2, help="synthetic: chunks in flight (the pipeline's depth)")
    ap.add_argument("--utterances", type=int, default=10)
    ap.add_argument("--utterance-s", type=float, default=1.5)
    ap.add_argument("--pause-s", type=float, default=0.5)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "latency_cpu.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, LiveKitServer(install_server(), Path(tmp)) as server:
        result = asyncio.run(run(server, args))
    result["machine"] = {"platform": platform.platform(), "python": platform.python_version()}
    result["command"] = " ".join(sys.argv)
    rl, al = result["speech_to_frame_s"], result["agent_to_started_s"]
    print(f"generator {result['generator']}: {result['utterances']} utterances over {result['duration_s']:.1f} s")
    print(f"{'metric':<42}{'p50':>10}{'p95':>10}")
    print(f"{'speech at room -> first frame published (s)':<42}{rl['p50']:>10.3f}{rl['p95']:>10.3f}")
    print(f"{'agent capture -> playback_started (s)':<42}{al['p50']:>10.3f}{al['p95']:>10.3f}")
    cc = result["chunk_compute_ms"]
    print(f"{'chunk compute (ms)':<42}{cc['p50']:>10.1f}{cc['p95']:>10.1f}")
    print(f"p50 / video share of a turn ({VIDEO_SHARE_S} s): {result['p50_over_video_share']:.2f}")
    print(f"fps publisher {result['fps_publisher']:.2f} (new frames {result['fresh_fps_publisher']:.2f}), viewer "
          f"{result['fps_viewer']:.2f}; A/V offset |mean| "
          f"{result['av_offset_ms']['mean_abs']:.2f} ms, p95 {result['av_offset_ms']['p95_abs']:.2f} ms; late chunks "
          f"{result['late_chunks']} (stalled {result['stall_s']:.2f} s), slips {result['slips']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
