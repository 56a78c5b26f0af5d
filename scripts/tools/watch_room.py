"""A plain viewer of a LiveKit room: what a participant that only subscribes receives, for `--seconds`.

    export LIVEKIT_URL=ws://127.0.0.1:7880 LIVEKIT_API_KEY=devkey LIVEKIT_API_SECRET=secret
    python scripts/tools/watch_room.py --room demo --seconds 75 --out /tmp/watch.json

Joins `--room` as `--identity` (a token made from the key and secret), subscribes to every track and counts, per
remote participant: video frames received (fps over the span from the first to the last, the longest gap between
two, frames that are all black) and audio (seconds above -40 dBFS in 10 ms frames). The character's own count of
late chunks is the session's (`GET /v1/sessions/{id}`, `stats.lateChunks`): a late chunk reaches a viewer as a
held frame, so its gap shows here too. Prints a line per participant, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from livekit import api, rtc

BLACK_MEAN = 24.0  # mean luma below this: a black frame (video range puts black at 16; a codec adds a little)


async def watch(url: str, token: str, seconds: float) -> dict[str, dict[str, Any]]:
    room = rtc.Room()
    video: dict[str, list[tuple[float, bool]]] = {}
    loud: dict[str, float] = {}
    tasks: list[asyncio.Task[None]] = []
    streams: list[rtc.VideoStream | rtc.AudioStream] = []

    async def on_video(who: str, stream: rtc.VideoStream) -> None:
        async for ev in stream:
            y = np.frombuffer(ev.frame.convert(rtc.VideoBufferType.I420).data, np.uint8)
            luma = y[: ev.frame.width * ev.frame.height]
            video.setdefault(who, []).append((time.monotonic(), float(luma.mean()) < BLACK_MEAN))

    async def on_audio(who: str, stream: rtc.AudioStream) -> None:
        async for ev in stream:
            pcm = np.frombuffer(ev.frame.data, np.int16).astype(np.float64) / 32768
            if pcm.size and np.sqrt(np.mean(pcm * pcm)) > 0.01:
                loud[who] = loud.get(who, 0.0) + pcm.size / ev.frame.sample_rate / ev.frame.num_channels

    def on_track(track: rtc.Track, _pub: rtc.RemoteTrackPublication, who: rtc.RemoteParticipant) -> None:
        if track.kind == rtc.TrackKind.KIND_VIDEO:
            vs = rtc.VideoStream(track)
            streams.append(vs)
            tasks.append(asyncio.create_task(on_video(who.identity, vs)))
        elif track.kind == rtc.TrackKind.KIND_AUDIO:
            aus = rtc.AudioStream(track, sample_rate=16000, num_channels=1)
            streams.append(aus)
            tasks.append(asyncio.create_task(on_audio(who.identity, aus)))

    room.on("track_subscribed", on_track)
    await room.connect(url, token)
    try:
        await asyncio.sleep(seconds)
    finally:
        for s in streams:
            await s.aclose()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await room.disconnect()
    out: dict[str, dict[str, Any]] = {}
    for who in sorted(set(video) | set(loud)):
        frames = video.get(who, [])
        t = np.array([f[0] for f in frames])
        span = float(t[-1] - t[0]) if t.size > 1 else 0.0
        gaps = np.diff(t) if t.size > 1 else np.zeros(0)
        out[who] = {"frames": len(frames), "span_s": round(span, 2),
                    "fps": round((len(frames) - 1) / span, 2) if span > 0 else None,
                    "longest_gap_ms": round(float(gaps.max()) * 1e3, 1) if gaps.size else None,
                    "gaps_over_100ms": int((gaps > 0.1).sum()), "black_frames": sum(f[1] for f in frames),
                    "audio_above_-40dBFS_s": round(loud.get(who, 0.0), 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--room", required=True)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--identity", default="viewer")
    ap.add_argument("--out", type=Path, default=None, help="a JSON of the counts")
    args = ap.parse_args()
    url = os.environ.get("LIVEKIT_URL", "ws://127.0.0.1:7880")
    key, secret = os.environ.get("LIVEKIT_API_KEY", "devkey"), os.environ.get("LIVEKIT_API_SECRET", "secret")
    grants = api.VideoGrants(room_join=True, room=args.room)
    token = api.AccessToken(key, secret).with_identity(args.identity).with_grants(grants).to_jwt()
    result = asyncio.run(watch(url, token, args.seconds))
    for who, r in result.items():
        print(f"{who}: {r['frames']} frames over {r['span_s']} s = {r['fps']} fps received, longest gap "
              f"{r['longest_gap_ms']} ms ({r['gaps_over_100ms']} over 100 ms), {r['black_frames']} black; "
              f"audio above -40 dBFS {r['audio_above_-40dBFS_s']} s")
    if args.out is not None:
        args.out.write_text(json.dumps({"room": args.room, "seconds": args.seconds, "participants": result}, indent=1))


if __name__ == "__main__":
    main()
