"""A viewer receives the character's video and audio from a `LiveKitRoom` fed in real time (real server)."""

from __future__ import annotations

import asyncio
import re
import time

import pytest
from lk_helpers import CHUNK_S, FPS, FakeSession, Generator, H, Viewer, W
from lk_helpers import token as lk_token

from deployments.livekit import LiveKitOutput, LiveKitRoom, LiveKitServer, LiveKitSink, MediaFormat

pytestmark = [pytest.mark.livekit, pytest.mark.filterwarnings("ignore::jwt.warnings.InsecureKeyLengthWarning")]

WINDOW_S = 20.0


def output(server: LiveKitServer, room: str) -> LiveKitOutput:
    return LiveKitOutput(url=server.url, room_name=room, api_key=server.api_key, api_secret=server.api_secret)


def test_viewer_gets_24fps_video_at_the_preset_size_and_continuous_audio(livekit_server: LiveKitServer) -> None:
    async def main() -> None:
        room = LiveKitRoom(output(livekit_server, "media"), MediaFormat(W, H))
        viewer = Viewer(livekit_server, "media")
        gen = Generator(room, FakeSession(), tone=True)
        await room.start()
        await gen.start()
        await viewer.start()
        try:
            await asyncio.wait_for(viewer.subscribed.wait(), 10)
            await asyncio.sleep(1.5)  # the jitter buffer, the encoder's ramp-up
            t0 = time.monotonic()
            await asyncio.sleep(WINDOW_S)
            t1 = time.monotonic()
            stats = room.stats()
        finally:
            await viewer.aclose()
            await gen.aclose()
            await room.aclose()
        fps = viewer.fps(t0, t1)
        sizes = {(w, h) for _, w, h in viewer.video}
        rms = viewer.rms(t0, t1)
        received_s = sum(a.size for t, a in viewer.audio if t0 <= t < t1) / 16000
        quiet = sum(r < 0.05 for r in rms) / len(rms)
        print(f"viewer: {fps:.2f} fps, sizes {sizes}, audio {received_s:.2f} s in {t1 - t0:.2f} s, quiet frames "
              f"{quiet:.3%}; playout {stats.playout}")
        assert fps >= 23.5
        assert sizes == {(W, H)}
        assert received_s == pytest.approx(t1 - t0, rel=0.03)
        assert quiet < 0.01, "the tone plays without gaps"
        p = stats.playout
        assert p.fps == pytest.approx(FPS, rel=0.02) and p.fresh_fps == pytest.approx(FPS, rel=0.02)
        assert p.late_chunks == 0 and abs(p.av_offset_ms) < 15
        assert p.buffered_s < 3 * CHUNK_S

    asyncio.run(main())


def test_the_poster_is_the_video_tracks_first_frame_not_black(livekit_server: LiveKitServer) -> None:
    """Until its source has a frame, the rtc library sends black keepalive frames; a room given a poster (the
    character's image) shows it from the track's first frame, before any chunk, and never again once chunks play.
    The viewer is in the room first, as a user is when the character is dispatched to them."""
    import numpy as np
    from livekit import rtc
    from lk_helpers import F, frames_for

    from characters.audio import chunk_sample_range

    yy, xx = np.mgrid[0:H, 0:W]
    poster = np.stack([xx * 255 // W, yy * 255 // H, np.full_like(xx, 128)], -1).astype(np.uint8)
    with pytest.raises(ValueError, match="poster"):
        LiveKitRoom(output(livekit_server, "poster"), MediaFormat(W, H), poster=poster[:, :-1])

    async def main() -> tuple[list[np.ndarray], list[np.ndarray]]:
        frames: list[np.ndarray] = []
        viewer = rtc.Room()
        tasks: list[asyncio.Task[None]] = []

        async def record(stream: rtc.VideoStream) -> None:
            async for ev in stream:
                rgb = ev.frame.convert(rtc.VideoBufferType.RGB24)
                frames.append(np.frombuffer(rgb.data, np.uint8).reshape(rgb.height, rgb.width, 3).copy())

        def on_track(track: rtc.Track, *_: object) -> None:
            if track.kind == rtc.TrackKind.KIND_VIDEO:
                tasks.append(asyncio.create_task(record(rtc.VideoStream(track))))

        viewer.on("track_subscribed", on_track)
        await viewer.connect(livekit_server.url, lk_token(livekit_server, "poster", "viewer"))
        room = LiveKitRoom(output(livekit_server, "poster"), MediaFormat(W, H), poster=poster)
        await room.start()
        try:
            deadline = time.monotonic() + 10
            while not frames and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)  # a black keepalive frame would come every 100 ms
            before = len(frames)
            for k in range(12):  # 2 s of chunks, queued at once: the playout paces them
                s0, s1 = chunk_sample_range(k, F)
                pcm = np.zeros(s1 - s0, np.float32)
                room.push_chunk(frames_for(k, pcm), pcm)
            await asyncio.sleep(2.5)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await viewer.disconnect()
            await room.aclose()
        return frames[:before], frames[before:]

    waiting, playing = asyncio.run(main())
    assert waiting, "the viewer got no frame: the poster was not sent"
    err = [float(np.abs(f.astype(np.int16) - poster).mean()) for f in waiting]
    print(f"poster: {len(waiting)} frames before the first chunk, mean abs error {max(err):.1f} (of 255)")
    assert max(err) < 20, err  # every frame is the poster (1.4 off through VP8 here), none black (~127 off)
    shown = [float(np.abs(f.astype(np.int16) - poster).mean()) < 20 for f in playing]
    first_chunk = shown.index(False)  # the chunks' frames (gray, a moving bar) are ~60 off the poster
    assert len(playing) - first_chunk >= 40 and not any(shown[first_chunk:]), shown  # no poster between them


def test_sink_publishes_from_a_synchronous_caller_and_closes_cleanly(livekit_server: LiveKitServer) -> None:
    """The MediaSink protocol from a plain thread (as RoomWorker calls it): start, write, close."""
    import numpy as np
    from lk_helpers import F, frames_for

    from characters.audio import chunk_sample_range

    sink = LiveKitSink(output(livekit_server, "sink"), MediaFormat(W, H))
    sink.start()
    try:
        t0 = time.monotonic()
        for k in range(24):  # 4 s
            s0, s1 = chunk_sample_range(k, F)
            pcm = np.zeros(s1 - s0, np.float32)
            sink.write(frames_for(k, pcm), pcm)
            time.sleep(max(0.0, t0 + (k + 1) * CHUNK_S - time.monotonic()))
        stats = sink.stats()
        assert stats is not None and stats.connected
        snap = sink.latest_stats  # the non-blocking snapshot (at most 0.5 s old)
        assert snap is not None and snap.playout.fresh_frames >= stats.playout.fresh_frames - 14
        assert stats.playout.fresh_frames >= 20 * F and stats.playout.late_chunks == 0
    finally:
        sink.close()
    sink.close()  # idempotent
    assert sink.stats() is None
    sink.write(np.zeros((F, H, W, 3), np.uint8), np.zeros(2666, np.float32))  # after close: dropped, no error
    assert sink.dropped_writes == 1
    with pytest.raises(ValueError, match=r"takes \(F, 176, 272, 3\) uint8 frames"):
        sink.write(np.zeros((F, H, W + 2, 3), np.uint8), np.zeros(2666, np.float32))


def test_a_refused_join_raises_room_error_and_leaves_no_thread(livekit_server: LiveKitServer,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import threading

    from deployments.livekit import RoomError

    bad = LiveKitOutput(url=livekit_server.url, room_name="refused", api_key=livekit_server.api_key,
                        api_secret="not-the-server-secret-0123456789")
    before = {t.name for t in threading.enumerate()}
    sink = LiveKitSink(bad, MediaFormat(W, H), start_timeout_s=15)
    t0 = time.monotonic()
    caplog.set_level(logging.WARNING)
    with pytest.raises(RoomError, match="could not join room 'refused'") as info:
        sink.start()
    assert time.monotonic() - t0 < 10
    assert "401" in str(info.value) and "eyJ" not in str(info.value), "the server echoes the token: redacted"
    # the SDK logs the refusal itself (its wording varies with the signalling path it tried last:
    # "Handshake { status: 401 }" on v1, "invalid token" on the fallback), never with the token in it
    sdk = [r.getMessage() for r in caplog.records if r.name.split(".")[0] == "livekit"]
    assert any(re.search(r"401|invalid token", m) for m in sdk), sdk
    assert "eyJ" not in caplog.text
    assert not any(t.name.startswith("livekit-refused") for t in threading.enumerate() if t.name not in before)
    sink.close()  # idempotent after a failed start
