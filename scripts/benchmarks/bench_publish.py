"""Benchmark: the room's publish call at a preset's resolution, into a real LiveKit room, as the chunk path makes it.

    python scripts/benchmarks/bench_publish.py --preset 57b --seconds 20 --out benchmarks/cpu/publish_57b.json

A `RoomWorker` (the slot's room, without Ray) joins a room on a local `livekit-server --dev` and publishes chunks
at the real pace: the sample face at the preset's resolution with a moving patch (the encoder has work), idle
chunks and, every sixth chunk, speech that starts with an onset (played at once, idle frames ahead of it cut: the
write waits for the room's loop). A plain viewer subscribes to both tracks. Per chunk: the `publish` stage (the
call until the output holds the chunk: the copy of its frames and the hand-over to the room's loop; for an onset
also the cut), and the whole call (with the frames' digest after it). The `57b` latency budget takes the onset
chunks' p50 (`latency_budget.py`). On a 2-core CPU the room's loop does not keep up with 704x1088 video
(it converts and encodes every frame): the playout holds frames and says so; what this measures is the call.
Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from livekit import api, rtc

from characters.audio import chunk_sample_range
from characters.config import session_config
from characters.media import SAMPLE_IMAGE, load_image
from deployments.livekit import LiveKitOutput, LiveKitServer, install_server
from deployments.pipeline.messages import ChunkInput, Frames
from deployments.pipeline.output import RoomWorker
from deployments.settings import ServiceConfig
from scripts.benchmarks import results

ROOT = Path(__file__).resolve().parents[2]
CYCLE = 6  # chunks: 3 idle, then 3 of speech (the first an onset)


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def frames_for(image: np.ndarray, k: int, count: int) -> np.ndarray:
    """`count` frames of the face with a 64 x 64 patch moving across it (new content every frame)."""
    out = np.repeat(image[None], count, axis=0)
    h, w = image.shape[:2]
    for i in range(count):
        y, x = (37 * (k * count + i)) % (h - 64), (53 * (k * count + i)) % (w - 64)
        out[i, y:y + 64, x:x + 64] = 255 - out[i, y:y + 64, x:x + 64]
    return out


def viewer(url: str, token: str, stop: threading.Event, seen: dict[str, int]) -> None:
    """A plain subscriber on its own loop thread: it receives both tracks (the publisher encodes for it)."""

    async def run() -> None:
        room = rtc.Room()
        tasks: list[asyncio.Task[None]] = []

        async def drain(stream: Any, kind: str) -> None:
            async for _ in stream:
                seen[kind] = seen.get(kind, 0) + 1

        def on_track(track: rtc.Track, *_: Any) -> None:
            video = track.kind == rtc.TrackKind.KIND_VIDEO
            stream = rtc.VideoStream(track) if video else rtc.AudioStream(track, sample_rate=16000, num_channels=1)
            tasks.append(asyncio.create_task(drain(stream, "video" if video else "audio")))

        room.on("track_subscribed", on_track)
        await room.connect(url, token)
        while not stop.is_set():
            await asyncio.sleep(0.1)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await room.disconnect()

    asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="57b")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--skip", type=int, default=12, help="chunks left out of the figures at the start")
    ap.add_argument("--no-viewer", action="store_true", help="publish with nobody subscribed")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    service = ServiceConfig()
    cfg = session_config(args.preset, "cpu")
    g = cfg.model.generation
    image = load_image(SAMPLE_IMAGE, g.height, g.width)
    chunk_s = g.frames_per_chunk / g.fps
    rng = np.random.default_rng(0)
    plain: list[float] = []
    onset: list[float] = []
    calls: list[float] = []
    seen: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp, LiveKitServer(install_server(), Path(tmp)) as server:
        def token(identity: str) -> str:
            grants = api.VideoGrants(room_join=True, room="bench-publish")
            return (api.AccessToken(server.api_key, server.api_secret).with_identity(identity)
                    .with_grants(grants).to_jwt())

        stop = threading.Event()
        watcher = threading.Thread(target=viewer, args=(server.url, token("viewer"), stop, seen), daemon=True)
        if not args.no_viewer:
            watcher.start()
        room = RoomWorker(cfg, chunk_path=service.chunk_path)
        room.open("bench", LiveKitOutput(url=server.url, room_name="bench-publish", api_key=server.api_key,
                                         api_secret=server.api_secret))
        chunks = int(args.seconds / chunk_s)
        playout: dict[str, Any] = {}
        t0 = time.monotonic()
        try:
            for k in range(chunks):
                time.sleep(max(0.0, t0 + k * chunk_s - time.monotonic()))
                a, b = chunk_sample_range(k, g.frames_per_chunk, cfg.model.audio.sample_rate, g.fps)
                speech = k % CYCLE >= CYCLE // 2
                pcm = (rng.normal(0, 0.1, b - a).astype(np.float32) + 1e-4) if speech else np.zeros(b - a, np.float32)
                inp = ChunkInput("bench", k, pcm, submitted_at=time.monotonic(), onset=k % CYCLE == CYCLE // 2)
                frames = Frames("bench", k, frames_for(image, k, g.frames_per_chunk))
                c0 = time.perf_counter()
                report = room.publish(inp, frames)
                call = time.perf_counter() - c0
                if k < args.skip:
                    continue
                stage = next(t for t in report.stages if t.stage == "publish").duration_ns / 1e6
                (onset if inp.onset else plain).append(stage)
                calls.append(call * 1e3)
            if (stats := getattr(room.sink, "latest_stats", None)) is not None:
                playout = {"late_chunks": stats.playout.late_chunks, "audio_dry": stats.playout.audio_dry,
                           "fps": stats.playout.fps}
        finally:
            room.close()
            stop.set()
            if watcher.is_alive():
                watcher.join(10)
    result = {
        "bench": "publish", "preset": args.preset, "resolution": [g.height, g.width],
        "frames_per_chunk": g.frames_per_chunk, "chunks": chunks, "skip": args.skip, "viewer": not args.no_viewer,
        "viewer_received": seen, "playout": playout,
        "publish_ms": {"onset": {"p50": pct(onset, 50), "p95": pct(onset, 95), "n": len(onset)},
                       "plain": {"p50": pct(plain, 50), "p95": pct(plain, 95), "n": len(plain)}},
        "call_ms": {"p50": pct(calls, 50), "p95": pct(calls, 95)},
        "audio_lead_ms": service.audio_lead_ms, "onset_slack_ms": service.onset_slack_ms,
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cores": len(os.sched_getaffinity(0))},
        "command": " ".join(["python", *sys.argv]),
    }
    p = result["publish_ms"]
    print(f"{args.preset} {g.height}x{g.width}, {g.frames_per_chunk} frames per chunk, {chunks} chunks; viewer got "
          f"{seen}; the room's playout: {playout}")
    print(f"{'ms':<34}{'p50':>8}{'p95':>8}")
    for name, row in (("publish stage, onset chunks", p["onset"]), ("publish stage, other chunks", p["plain"]),
                      ("the whole call (with the digest)", result["call_ms"])):
        print(f"{name:<34}{row['p50'] or float('nan'):>8.2f}{row['p95'] or float('nan'):>8.2f}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        results.record(args.out, result)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
