"""The watch page's routes (deployments.api.watch) over a scheduler in memory, and the session stats they show:
viewer tokens grant exactly join + subscribe on the session's room, agent audio over HTTP reaches the
scheduler byte for byte, refusals take the API's error shape, the page's files need no API key."""

from __future__ import annotations

import base64
import io
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from fastapi.testclient import TestClient
from livekit import api as lkapi
from memory_scheduler import MemoryScheduler

from characters.pacing import SegmentEvent
from characters.stage_times import StageTime
from deployments.api import watch
from deployments.api.auth import ApiKeys
from deployments.api.frontend import SessionFrontend
from deployments.api.http import build_http_app
from deployments.api.requests import ApiConfig
from deployments.livekit.config import LiveKitOutput
from deployments.sessions.runner import StageWindow

ASSETS = Path(__file__).resolve().parents[2] / "characters" / "assets"
LK = watch.WatchSettings(url="ws://lk.internal:7880", public_url="wss://lk.example.org", api_key="APIkey123",
                         api_secret="a-secret-of-32-characters-or-more!!")


def make_client(sched: MemoryScheduler, settings: watch.WatchSettings, keys: ApiKeys | None = None,
                **config: Any) -> TestClient:
    frontend = SessionFrontend(sched, ApiConfig(**config))
    return TestClient(watch.add_watch_routes(build_http_app(frontend, keys), frontend, settings))


@pytest.fixture
def sched() -> MemoryScheduler:
    return MemoryScheduler()


@pytest.fixture
def client(sched: MemoryScheduler) -> Iterator[TestClient]:
    with make_client(sched, LK, max_audio_chunk_bytes=64 * 1024) as c:
        yield c


def face_b64() -> str:
    return base64.b64encode((ASSETS / "sample_face.png").read_bytes()).decode()


def wav_bytes(pcm: bytes, rate: int = 16000, channels: int = 1, width: int = 2) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(pcm)
    return buf.getvalue()


def test_config_says_whether_livekit_is_configured(sched: MemoryScheduler) -> None:
    with make_client(sched, watch.WatchSettings()) as off:
        assert off.get("/v1/watch/config").json() == {"livekit": False, "url": None, "preset": "tiny", "width": 272,
                                                       "height": 176, "fps": 24, "maxDuration": 3600.0}
        r = off.post("/v1/watch/sessions", json={"avatar": {"image": face_b64()}})
        assert r.status_code == 503 and r.json()["error"]["code"] == "livekit_not_configured"
        assert "CHARACTERS_LIVEKIT_URL" in r.json()["error"]["message"] and not sched.specs
    with make_client(sched, LK) as on:
        assert on.get("/v1/watch/config").json()["url"] == "wss://lk.example.org"
    bad = watch.WatchSettings(url="lk.internal:7880", public_url="lk.internal:7880", api_key="k", api_secret="s")
    with make_client(sched, bad) as c:
        r = c.post("/v1/watch/token", json={"roomName": "r"})
        assert r.status_code == 503 and "CHARACTERS_LIVEKIT_URL 'lk.internal:7880'" in r.json()["error"]["message"]


def test_livekit_route_shows_the_server_and_only_a_development_secret(sched: MemoryScheduler) -> None:
    with make_client(sched, LK) as c:  # a real server: its secret is never disclosed
        assert c.get("/v1/livekit").json() == {"configured": True, "url": "wss://lk.example.org",
                                               "apiKey": "APIkey123", "apiSecret": None, "dev": False}
    dev = watch.WatchSettings(url="ws://127.0.0.1:7880", public_url="ws://127.0.0.1:7880", api_key="devkey",
                              api_secret="secret", dev=True)
    with make_client(sched, dev) as c:
        assert c.get("/v1/livekit").json() == {"configured": True, "url": "ws://127.0.0.1:7880", "apiKey": "devkey",
                                               "apiSecret": "secret", "dev": True}
    with make_client(sched, watch.WatchSettings()) as c:
        assert c.get("/v1/livekit").json() == {"configured": False, "url": None, "apiKey": None, "apiSecret": None,
                                               "dev": False}


def test_livekit_route_needs_a_key_when_keys_are_on(sched: MemoryScheduler) -> None:
    keys = ApiKeys.parse("backend:" + "k" * 32)
    with make_client(sched, LK, keys) as c:
        assert c.get("/v1/livekit").status_code == 401
        assert c.get("/v1/livekit", headers={"Authorization": "Bearer " + "k" * 32}).json()["apiKey"] == "APIkey123"


def test_watch_session_publishes_to_its_own_room_and_the_viewer_may_only_subscribe(
        client: TestClient, sched: MemoryScheduler) -> None:
    r = client.post("/v1/watch/sessions", json={"avatar": {"image": face_b64()}, "maxDuration": 60})
    assert r.status_code == 201, r.text
    body = r.json()
    session_id, viewer = body["session"]["id"], body["viewer"]
    assert r.headers["location"] == f"/v1/sessions/{session_id}" and body["session"]["status"] == "STARTING"
    spec = sched.specs[session_id]
    out = spec.output
    assert isinstance(out, LiveKitOutput) and spec.max_duration_s == 60.0 and spec.image.shape == (176, 272, 3)
    assert (out.url, out.api_key, out.api_secret, out.token) == (LK.url, LK.api_key, LK.api_secret, None)
    assert out.room_name == viewer["roomName"] and out.room_name.startswith("watch-")
    assert viewer["url"] == "wss://lk.example.org" and viewer["identity"].startswith("viewer-")
    claims = lkapi.TokenVerifier(LK.api_key, LK.api_secret).verify(viewer["token"])
    g = claims.video
    assert claims.identity == viewer["identity"] and g is not None
    assert (g.room_join, g.room, g.can_subscribe, g.can_publish, g.can_publish_data) == (
        True, out.room_name, True, False, False)
    again = client.post("/v1/watch/sessions", json={"avatar": {"image": face_b64()}}).json()
    assert again["viewer"]["roomName"] != viewer["roomName"]  # a new room per session

    tok = client.post("/v1/watch/token", json={"roomName": "someone-elses"}).json()
    v = lkapi.TokenVerifier(LK.api_key, LK.api_secret).verify(tok["token"]).video
    assert v is not None and (v.room, v.can_subscribe, v.can_publish, v.can_publish_data) == (
        "someone-elses", True, False, False)


def test_agent_audio_over_http_reaches_the_scheduler_intact(client: TestClient, sched: MemoryScheduler) -> None:
    sid = client.post("/v1/watch/sessions", json={"avatar": {"image": face_b64()}}).json()["session"]["id"]
    speech = (ASSETS / "sample_speech.wav").read_bytes()
    with wave.open(str(ASSETS / "sample_speech.wav")) as w:
        pcm = w.readframes(w.getnframes())
    assert client.post(f"/v1/sessions/{sid}/audio", content=speech,
                       headers={"content-type": "audio/wav"}).status_code == 204
    assert {(s, rate, ch) for s, _, rate, ch in sched.audio} == {(sid, 16000, 1)}
    assert all(len(p) <= 64 * 1024 for _, p, _, _ in sched.audio) and len(sched.audio) == -(-len(pcm) // 65536)
    assert b"".join(p for _, p, _, _ in sched.audio) == pcm  # split under max_audio_chunk_bytes, in order

    sched.audio.clear()
    stereo = np.arange(-600, 600, dtype="<i2").tobytes()
    r = client.post(f"/v1/sessions/{sid}/audio?sampleRate=48000&channels=2", content=stereo)
    assert r.status_code == 204 and sched.audio == [(sid, stereo, 48000, 2)]
    assert client.delete(f"/v1/sessions/{sid}/audio").status_code == 204 and sched.cleared == [sid]


@pytest.mark.parametrize(("path", "content", "status", "code", "field"), [
    ("/v1/sessions/{sid}/audio", b"", 422, "invalid_field", "body"),
    ("/v1/sessions/{sid}/audio", b"RIFF not a wav", 422, "invalid_field", "body"),
    ("/v1/sessions/{sid}/audio", wav_bytes(b"\x80" * 100, width=1), 422, "invalid_field", "body"),
    ("/v1/sessions/{sid}/audio?sampleRate=16000", b"\x00\x00", 422, "invalid_field", "channels"),
    ("/v1/sessions/{sid}/audio?sampleRate=16000&channels=0", b"\x00\x00", 422, "invalid_field", "channels"),
    ("/v1/sessions/{sid}/audio?sampleRate=16000&channels=99999999", b"\x00\x00", 422, "invalid_field", "channels"),
    ("/v1/sessions/{sid}/audio?sampleRate=96000&channels=1", b"\x00\x00", 422, "invalid_field", "sample_rate"),
    ("/v1/sessions/{sid}/audio?sampleRate=16000&channels=2", b"\x00\x00", 422, "invalid_field", "pcm"),
    ("/v1/sessions/nope/audio", wav_bytes(b"\x00\x00"), 404, "session_not_found", "id"),
])
def test_agent_audio_refusals(client: TestClient, sched: MemoryScheduler, path: str, content: bytes, status: int,
                              code: str, field: str) -> None:
    sid = client.post("/v1/watch/sessions", json={"avatar": {"image": face_b64()}}).json()["session"]["id"]
    r = client.post(path.format(sid=sid), content=content)
    assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["field"]) == (status, code, field), r.text
    assert sched.audio == []


def test_page_files_are_open_the_api_needs_the_key(sched: MemoryScheduler, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    keys = ApiKeys.from_keys([("web", "k" * 24)])
    (tmp_path / "index.html").write_text("<!doctype html><title>watch</title>")
    monkeypatch.setattr(watch, "PAGE_DIR", tmp_path)
    with make_client(sched, LK, keys) as c:
        root = c.get("/", follow_redirects=False)
        assert (root.status_code, root.headers["location"]) == (307, "/watch/")
        assert c.get("/watch/").text == "<!doctype html><title>watch</title>"
        face = c.get("/watch/samples/face.png")
        assert face.status_code == 200 and face.content == (ASSETS / "sample_face.png").read_bytes()
        assert c.get("/watch/samples/secrets.txt").status_code == 404
        r = c.get("/v1/watch/config")
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
        assert c.get("/v1/watch/config", headers={"authorization": "Bearer " + "k" * 24}).status_code == 200
        assert c.post("/v1/sessions/x/audio", content=b"\x00\x00").status_code == 401


def test_an_unbuilt_page_says_how_to_build_it(sched: MemoryScheduler, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watch, "PAGE_DIR", tmp_path / "missing")
    with make_client(sched, LK) as c:
        r = c.get("/watch/")
        assert r.status_code == 503 and r.json()["error"]["code"] == "watch_page_not_built"
        assert "npm ci && npm run build" in r.json()["error"]["message"]


def test_stage_window_prefers_gpu_times_and_measures_the_handoff() -> None:
    ms = 1_000_000
    w = StageWindow(window=3)
    for k, dit_ms in enumerate((30, 10, 20, 40)):  # the window keeps the last 3: 10, 20, 40 -> 20
        base = k * 1000 * ms
        w.add([StageTime(k, "dit", base, dit_ms * ms, "host"), StageTime(k, "decode", base + 45 * ms, 50 * ms, "host"),
               StageTime(k, "publish", base + 100 * ms, 1 * ms, "host")], k)
    assert w.p50() == {"dit": 20.0, "handoff": 25.0, "decode": 50.0, "publish": 1.0}
    w.add([StageTime(3, "dit", 0, 7 * ms, "cuda"), StageTime(3, "cache_write", 0, 2 * ms, "cuda")], 4)
    assert list(w.p50().items())[:2] == [("dit", 7.0), ("cache_write", 2.0)]  # GPU times win; pipeline order
    assert w.p50()["handoff"] == 25.0  # chunk 3's decode GPU time is not in yet: the host handoff stands
    w.add([StageTime(3, "decode", 9 * ms, 40 * ms, "cuda")], 5)  # the other half, in a later report
    assert w.p50()["handoff"] == 2.0  # GPU: DiT end (7 ms) -> decode start (9 ms)


def test_gpu_handoffs_pair_across_reports_and_forget_old_halves() -> None:
    from deployments.telemetry.session import GpuHandoffs

    ms = 1_000_000
    pairs = GpuHandoffs(keep=4)
    assert pairs.add([StageTime(0, "dit", 0, 10 * ms, "cuda"), StageTime(0, "dit", 0, 1 * ms, "host"),
                      StageTime(0, "decode", 11 * ms, 5 * ms, "host")]) == []  # host halves never pair
    assert pairs.add([StageTime(0, "decode", 13 * ms, 5 * ms, "cuda")]) == [(0, 10 * ms, 13 * ms)]
    assert pairs.add([StageTime(1, "decode", 5 * ms, 5 * ms, "cuda"), StageTime(1, "dit", 0, 8 * ms, "cuda")]) == [
        (1, 8 * ms, 8 * ms)]  # clocks a hair apart: a decode "before" the DiT end counts as 0, not negative
    for k in range(2, 10):  # decode times lost (say, dropped unread): their DiT halves are not kept forever
        pairs.add([StageTime(k, "dit", 0, ms, "cuda")])
    assert sorted(pairs._half) == [6, 7, 8, 9]


def test_room_reports_the_livekit_playouts_buffer_and_av_offset() -> None:
    from types import SimpleNamespace

    from characters.audio import chunk_sample_range
    from characters.config import session_config
    from deployments.pipeline.messages import ChunkInput, Frames
    from deployments.pipeline.output import RoomWorker
    from deployments.types import OutputSpec

    cfg = session_config("tiny", "cpu", model={"generation": {"height": 64, "width": 96}})
    room = RoomWorker(cfg)
    room.open("s", OutputSpec("null"))
    a, b = chunk_sample_range(0, 4)
    inp, frames = ChunkInput("s", 0, np.zeros(b - a, np.float32)), Frames("s", 0, np.zeros((4, 64, 96, 3), np.uint8))
    null = room.publish(inp, frames)
    assert null.av_offset_s == 0.0 and null.buffer_s == pytest.approx(2 * 4 / 24)  # the meter's schedule
    assert [t.stage for t in null.stages] == ["publish"]  # stamped with telemetry off too (SessionStats.stage_ms)

    class LiveKitLike:  # what RoomWorker reads of a LiveKitSink: write/close and the room's latest snapshot
        latest_stats = SimpleNamespace(playout=SimpleNamespace(buffered_s=0.375, av_offset_ms=-2.5, fps=23.5,
                                                               late_chunks=0, stall_s=0.0, audio_dry=2))
        submitted: ClassVar[list[tuple[float | None, bool]]] = []

        def write(self, frames: np.ndarray, pcm: np.ndarray, speech_samples: int | None = None,
                  submitted_at: float | None = None, onset: bool = False, early_s: float = 0.0) -> float:
            self.submitted.append((submitted_at, onset))
            return 0.125 if onset else 0.0

        def close(self) -> None: ...

    room.sink = LiveKitLike()
    room._playback.append(SegmentEvent("started", "seg", latency_s=0.3))  # from the room's thread
    r = room.publish(ChunkInput("s", 1, np.zeros(b - a, np.float32), 12.5), Frames("s", 1, frames.frames))
    assert (r.buffer_s, r.av_offset_s, r.presented_fps, r.audio_dry) == (0.375, -0.0025, 23.5, 2)
    assert LiveKitLike.submitted == [(12.5, False)]  # the chunk's submit time reaches the playout
    assert r.playback == (SegmentEvent("started", "seg", latency_s=0.3),) and not room._playback and r.cut_s == 0.0
    # an onset reaches the playout, and what it cut ahead of it goes back to the chunk loop in the report
    r = room.publish(ChunkInput("s", 2, np.zeros(b - a, np.float32), 12.7, onset=True), Frames("s", 2, frames.frames))
    assert LiveKitLike.submitted[-1] == (12.7, True) and r.cut_s == 0.125
