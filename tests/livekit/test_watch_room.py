"""scripts/tools/watch_room.py, the plain viewer the README's voice-agent check uses, against a real LiveKit server: a
publisher sends 24 fps video with a pause and a black frame, and a tone; the watcher's counts match what was sent."""

from __future__ import annotations

import asyncio
import importlib.util
import time
from pathlib import Path

import numpy as np
import pytest
from livekit import rtc
from lk_helpers import token

from deployments.livekit import LiveKitServer

pytestmark = [pytest.mark.livekit, pytest.mark.filterwarnings("ignore::jwt.warnings.InsecureKeyLengthWarning")]

REPO = Path(__file__).resolve().parents[2]
W, H, FPS, SR = 96, 64, 24, 16000


def load_watch_room():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("watch_room", REPO / "scripts" / "tools" / "watch_room.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_watcher_counts_frames_gaps_black_frames_and_audio(livekit_server: LiveKitServer) -> None:
    watch_room = load_watch_room()

    async def publish(done: asyncio.Event) -> None:
        room = rtc.Room()
        await room.connect(livekit_server.url, token(livekit_server, "watched", "character"))
        video, audio = rtc.VideoSource(W, H), rtc.AudioSource(SR, 1)
        lp = room.local_participant
        await lp.publish_track(rtc.LocalVideoTrack.create_video_track("v", video), rtc.TrackPublishOptions(
            source=rtc.TrackSource.SOURCE_CAMERA, simulcast=False,
            video_encoding=rtc.VideoEncoding(max_framerate=FPS, max_bitrate=500_000)))  # as the character's room
        await lp.publish_track(rtc.LocalAudioTrack.create_audio_track("a", audio),
                               rtc.TrackPublishOptions(source=rtc.TrackSource.SOURCE_MICROPHONE))
        grey = np.full((H, W, 3), 128, np.uint8) + (np.arange(W) % 7).astype(np.uint8)[:, None]  # some texture
        tone = (0.3 * 32767 * np.sin(2 * np.pi * 440 * np.arange(SR // 100) / SR)).astype(np.int16)
        t0 = time.monotonic()
        for i in range(5 * FPS):  # 5 s at 24 fps, frame 60 black, nothing sent for 0.5 s after frame 80
            if i == 80:
                await asyncio.sleep(0.5)
                t0 += 0.5
            frame = np.zeros_like(grey) if i == 60 else np.roll(grey, i, 1)
            video.capture_frame(rtc.VideoFrame(W, H, rtc.VideoBufferType.RGB24, frame.tobytes()))
            for _ in range(4 if i % 6 else 5):  # ~41.7 ms of 10 ms tone frames
                await audio.capture_frame(rtc.AudioFrame(tone.tobytes(), SR, 1, tone.size))
            await asyncio.sleep(max(0.0, t0 + (i + 1) / FPS - time.monotonic()))
        await done.wait()
        await room.disconnect()

    async def main() -> dict:  # type: ignore[type-arg]
        done = asyncio.Event()
        publisher = asyncio.create_task(publish(done))
        await asyncio.sleep(0.5)  # the publisher is in the room
        result = await watch_room.watch(livekit_server.url, token(livekit_server, "watched", "viewer"), 6.5)
        done.set()
        await publisher
        return dict(result)

    result = asyncio.run(main())
    r = result["character"]
    assert 100 <= r["frames"] <= 120, r  # 120 sent; the first few may go before the subscription
    assert 20.0 <= r["fps"] <= 24.5, r  # over a span with a 0.5 s pause
    assert 450 <= r["longest_gap_ms"] <= 800 and r["gaps_over_100ms"] >= 1, r
    assert r["black_frames"] >= 1, r
    assert 3.0 <= r["audio_above_-40dBFS_s"] <= 6.0, r
