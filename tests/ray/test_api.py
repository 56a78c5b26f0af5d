"""The API over real Ray + Serve: HTTP on 127.0.0.1 and gRPC through Serve's gRPC proxy, with API keys on.

A small fake scheduler actor (the real interface, a two-bundle ledger, a one-place queue) stands in
for `deployments.sessions.scheduler`; it is registered under the scheduler's name, so the ingress finds it.
One Ray + Serve instance for the module.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on 127.0.0.1 (before importing ray)

import base64
import http.client
import io
import json
import socket
import struct
import time
import zlib
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import ray
from PIL import Image
from ray import serve

from deployments.api.app import APP_NAME, GRPC_SERVICER_FUNCTIONS, build_app
from deployments.api.proto import characters_pb2 as pb
from deployments.api.proto import characters_pb2_grpc as pb_grpc
from deployments.sessions.cluster import init_local, stop_local
from deployments.types import NAMESPACE, SCHEDULER_NAME

pytestmark = pytest.mark.ray

KEY = "test-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = {"max_body_bytes": 256 * 1024, "max_image_bytes": 128 * 1024, "max_image_pixels": 1024 * 1024}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_fake_scheduler(bundles: int, queue_max: int) -> Any:
    """A Ray actor class with the scheduler's interface (defined here so Ray pickles it by value)."""
    import asyncio

    from characters.audio import convert_pcm, pcm16_to_float
    from deployments.types import (
        Capacity,
        NoCapacity,
        SessionEvent,
        SessionInfo,
        SessionStatus,
        UnknownSession,
    )

    @ray.remote(num_cpus=0)
    class FakeScheduler:
        def __init__(self) -> None:
            self.sessions: dict[str, SessionInfo] = {}
            self.specs: dict[str, Any] = {}
            self.log: dict[str, list[SessionEvent]] = {}
            self.queue: list[str] = []
            self.free = bundles
            self.changed = asyncio.Condition()

        async def _emit(self, sid: str, kind: str, **kw: Any) -> None:
            log = self.log.setdefault(sid, [])
            log.append(SessionEvent(seq=len(log) + 1, session_id=sid, kind=kind, **kw))  # type: ignore[arg-type]
            async with self.changed:
                self.changed.notify_all()

        def _info(self, sid: str) -> SessionInfo:
            if sid not in self.sessions:
                raise UnknownSession(sid)
            return self.sessions[sid]

        async def create_session(self, spec: Any) -> SessionInfo:
            if self.free == 0 and len(self.queue) >= queue_max:
                raise NoCapacity(f"all {bundles} bundles are busy and the queue is full", 2.5)
            sid = spec.session_id
            self.specs[sid] = spec
            if self.free:
                self.free -= 1
                info = SessionInfo(id=sid, status=SessionStatus.STARTING, preset=spec.preset, warm_start=False,
                                   owner=spec.api_key_id)
            else:
                self.queue.append(sid)
                info = SessionInfo(id=sid, status=SessionStatus.QUEUED, preset=spec.preset,
                                   queue_position=len(self.queue), owner=spec.api_key_id)
            self.sessions[sid] = info
            await self._emit(sid, "status", status=info.status)
            return info

        async def get_session(self, session_id: str) -> SessionInfo:
            return self._info(session_id)

        async def list_sessions(self) -> list[SessionInfo]:
            return list(self.sessions.values())

        async def end_session(self, session_id: str, reason: str = "deleted") -> SessionInfo:
            info = self._info(session_id)
            if info.status.terminal:
                return info
            if session_id in self.queue:
                self.queue.remove(session_id)
            else:
                self.free += 1
            info.status, info.reason, info.ended_at = SessionStatus.ENDED, reason, time.time()
            await self._emit(session_id, "status", status=info.status, detail=reason)
            return info

        async def capacity(self) -> Capacity:
            running = sum(not s.status.terminal and s.id not in self.queue for s in self.sessions.values())
            return Capacity(bundles_total=bundles, bundles_free=self.free, sessions_running=running,
                            queued=len(self.queue), warm_slots_free=0)

        async def push_audio(self, session_id: str, pcm: bytes, sample_rate: int, channels: int) -> None:
            info = self._info(session_id)
            mono16k = convert_pcm(pcm16_to_float(pcm), sample_rate, channels)
            info.stats.audio_queued_s += mono16k.size / 16000
            info.stats.chunks += 1
            await self._emit(session_id, "chunk", chunk=info.stats.chunks - 1, detail=f"{mono16k.size} samples")

        async def clear_audio(self, session_id: str) -> None:
            self._info(session_id).stats.audio_queued_s = 0.0
            await self._emit(session_id, "playback_finished", detail="interrupted")

        async def events(self, session_id: str, after_seq: int, timeout_s: float = 10.0) -> list[SessionEvent]:
            self._info(session_id)
            deadline = time.monotonic() + timeout_s
            async with self.changed:
                while len(self.log.get(session_id, [])) <= after_seq and time.monotonic() < deadline:
                    try:
                        await asyncio.wait_for(self.changed.wait(), deadline - time.monotonic())
                    except TimeoutError:
                        break
            return self.log.get(session_id, [])[after_seq:]

        async def image_of(self, session_id: str) -> tuple[tuple[int, ...], int]:
            img = self.specs[session_id].image
            return img.shape, int(np.asarray(img)[..., 0].mean())

        async def key_of(self, session_id: str) -> str | None:
            return self.specs[session_id].api_key_id

    return FakeScheduler


class Server:
    def __init__(self, http_port: int, grpc_port: int) -> None:
        self.http_port, self.grpc_port = http_port, grpc_port
        self.channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        self.stub = pb_grpc.CharactersStub(self.channel)

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str | None] | None = None,
                raw: bytes | None = None) -> tuple[int, dict[str, str], Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=30)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        hdrs: dict[str, str | None] = {"Content-Type": "application/json", **AUTH, **(headers or {})}
        conn.request(method, path, body=data, headers={k: v for k, v in hdrs.items() if v is not None})
        resp = conn.getresponse()
        payload = resp.read()
        conn.close()
        ctype = resp.getheader("content-type") or ""
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, (
            json.loads(payload) if "json" in ctype else payload.decode())


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    os.environ["CHARACTERS_API_KEYS"] = f"tester:{KEY}"  # the replica inherits it through the raylet
    init_local(num_cpus=2, configure_logging=False)
    try:
        make_fake_scheduler(bundles=2, queue_max=1).options(name=SCHEDULER_NAME, namespace=NAMESPACE,
                                                             lifetime="detached").remote()
        srv = Server(free_port(), free_port())
        serve.start(http_options={"host": "127.0.0.1", "port": srv.http_port},
                    grpc_options={"port": srv.grpc_port, "grpc_servicer_functions": list(GRPC_SERVICER_FUNCTIONS)})
        ingress = {"num_cpus": 0.1, "num_replicas": 2}  # two replicas: the avatar registry is shared
        serve.run(build_app({"api": {**LIMITS, "max_duration_s": 600}, "ingress": ingress}),
                  name=APP_NAME, route_prefix="/")
        yield srv
        srv.channel.close()
    finally:
        os.environ.pop("CHARACTERS_API_KEYS", None)
        serve.shutdown()
        stop_local()


def png(width: int = 64, height: int = 48, colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, "PNG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def png_header_only(width: int, height: int) -> bytes:
    """A small PNG whose header claims width x height (a few pixel rows only): refused before decoding."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 1000))
            + chunk(b"IEND", b""))


def create_body(**over: Any) -> dict[str, Any]:
    return {"avatar": {"image": b64(png())}, "maxDuration": 60, **over}


def fake() -> Any:
    return ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE)



def noise_png(side: int) -> bytes:
    """An incompressible PNG of about side*side*3 bytes."""
    rng = np.random.default_rng(side)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG", compress_level=0)
    return buf.getvalue()


GRPC_AUTH = [("authorization", f"Bearer {KEY}")]


# --------------------------------------------------------------------------------------------- HTTP


def test_avatars_are_shared_by_every_ingress_replica(server: Server) -> None:
    """Registered through one replica, found (and deleted) through any: Serve routes each request to one of
    the two replicas, so with a registry per replica about half of these lookups would miss."""
    assert serve.status().applications[APP_NAME].deployments["CharactersIngress"].replica_states == {"RUNNING": 2}
    ids = []
    for i in range(4):
        status, _, avatar = server.request("POST", "/v1/avatars", {"image": b64(png()), "name": f"a{i}"})
        assert status == 201, avatar
        ids.append(avatar["id"])
    for _ in range(4):
        for i, avatar_id in enumerate(ids):
            status, _, got = server.request("GET", f"/v1/avatars/{avatar_id}")
            assert status == 200 and got["name"] == f"a{i}" and got["status"] in ("PROCESSING", "READY"), got
    assert server.request("DELETE", f"/v1/avatars/{ids[0]}")[0] == 204
    for _ in range(6):
        status, _, err = server.request("GET", f"/v1/avatars/{ids[0]}")
        assert status == 404 and err["error"]["code"] == "avatar_not_found"


def test_create_get_list_delete(server: Server) -> None:
    status, headers, body = server.request("POST", "/v1/sessions", create_body(seed=7))
    assert status == 201, body
    sid = body["id"]
    assert headers["location"] == f"/v1/sessions/{sid}"
    assert body["status"] == "STARTING" and body["preset"] == "tiny" and body["warmStart"] is False
    assert set(body) == {"id", "status", "preset", "reason", "createdAt", "startedAt", "endedAt", "queuePosition",
                         "warmStart", "stats"}
    assert set(body["stats"]) == {"chunks", "frames", "fps", "lateChunks", "stepMsP50", "stepMsP95", "audioQueuedS",
                                  "bufferMs", "avOffsetMs", "stageMs", "presentedFps", "speechMsP50"}
    # The scheduler got the image decoded at the preset's resolution, and the key's id (not the key).
    shape, red = ray.get(fake().image_of.remote(sid))
    assert shape == (176, 272, 3) and red == 200
    assert ray.get(fake().key_of.remote(sid)) == "tester"

    assert server.request("GET", f"/v1/sessions/{sid}")[2]["status"] == "STARTING"
    listed = server.request("GET", "/v1/sessions")[2]["sessions"]
    assert sid in [s["id"] for s in listed]
    assert server.request("GET", "/v1/capacity")[2] == {
        "bundlesTotal": 2, "bundlesFree": 1, "sessionsRunning": 1, "queued": 0, "warmSlotsFree": 0}

    status, _, ended = server.request("DELETE", f"/v1/sessions/{sid}")
    assert status == 200 and ended["status"] == "ENDED" and ended["reason"] == "deleted" and ended["endedAt"]
    status, _, again = server.request("DELETE", f"/v1/sessions/{sid}")  # idempotent
    assert status == 200 and again == ended
    assert server.request("GET", "/v1/capacity")[2]["bundlesFree"] == 2
    assert server.request("GET", "/healthz", headers={"Authorization": None})[:3:2] == (200, {"status": "ok"})


def test_no_capacity_is_503_with_retry_after(server: Server) -> None:
    ids = []
    try:
        for expected in ("STARTING", "STARTING", "QUEUED"):
            status, _, body = server.request("POST", "/v1/sessions", create_body())
            assert status == 201 and body["status"] == expected
            ids.append(body["id"])
        assert body["queuePosition"] == 1
        status, headers, body = server.request("POST", "/v1/sessions", create_body())
        assert status == 503
        assert headers["retry-after"] == "3"  # 2.5 s, rounded up to whole seconds
        assert body["error"]["code"] == "no_capacity" and "queue is full" in body["error"]["message"]
        assert body["error"]["field"] is None
    finally:
        for sid in ids:
            server.request("DELETE", f"/v1/sessions/{sid}")
    assert server.request("GET", "/v1/capacity")[2]["bundlesFree"] == 2


BAD_CREATES: list[tuple[str, dict[str, Any], int, str, str | None]] = [
    ("bad base64", {"avatar": {"image": "@@not base64@@"}}, 422, "invalid_image", "avatar.image"),
    ("not an image", {"avatar": {"image": b64(b"hello, I am text" * 4)}}, 422, "invalid_image", "avatar.image"),
    ("truncated png", {"avatar": {"image": b64(png()[:70])}}, 422, "invalid_image", "avatar.image"),
    ("tiny image", {"avatar": {"image": b64(png(8, 8))}}, 422, "invalid_image", "avatar.image"),
    ("huge dimensions", {"avatar": {"image": b64(png_header_only(30000, 30000))}}, 413, "image_too_large",
     "avatar.image"),
    ("over the pixel limit", {"avatar": {"image": b64(png(1100, 1000))}}, 413, "image_too_large", "avatar.image"),
    ("image over the byte limit", {"avatar": {"image": b64(noise_png(230))}}, 413, "image_too_large", "avatar.image"),
    ("missing avatar", {"maxDuration": 30}, 422, "invalid_field", "avatar"),
    ("missing image", {"avatar": {}}, 422, "invalid_field", "avatar.image"),
    ("image not a string", {"avatar": {"image": 5}}, 422, "invalid_field", "avatar.image"),
    ("maxDuration a string", create_body(maxDuration="long"), 422, "invalid_field", "maxDuration"),
    ("seed a string", create_body(seed="x"), 422, "invalid_field", "seed"),
    ("unknown preset", create_body(preset="huge"), 422, "invalid_field", "preset"),
    ("preset not served", create_body(preset="57b"), 422, "invalid_field", "preset"),
    ("negative maxDuration", create_body(maxDuration=-5), 422, "invalid_field", "maxDuration"),
    ("maxDuration over the cap", create_body(maxDuration=601), 422, "invalid_field", "maxDuration"),
    ("unknown field", create_body(colour="red"), 422, "invalid_field", "colour"),
    ("output path escapes", create_body(output={"kind": "file", "path": "../../etc/x.mp4"}), 422, "invalid_field",
     "output.path"),
    ("output kind unknown", create_body(output={"kind": "rtmp"}), 422, "invalid_field", "output.kind"),
    ("body is a list", [1, 2], 422, "invalid_field", None),  # type: ignore[list-item]
]


@pytest.mark.parametrize(("body", "status", "code", "field"), [c[1:] for c in BAD_CREATES],
                         ids=[c[0] for c in BAD_CREATES])
def test_create_refusals(server: Server, body: dict[str, Any], status: int, code: str, field: str | None) -> None:
    got, _, answer = server.request("POST", "/v1/sessions", body)
    assert (got, answer["error"]["code"], answer["error"]["field"]) == (status, code, field), answer
    assert set(answer) == {"error"} and set(answer["error"]) == {"code", "message", "field"}
    assert len(answer["error"]["message"]) > 10


def test_malformed_json_and_oversized_bodies(server: Server) -> None:
    status, _, body = server.request("POST", "/v1/sessions", raw=b'{"avatar": ')
    assert status == 400 and body["error"]["code"] == "invalid_json"
    status, _, body = server.request("POST", "/v1/sessions", raw=b"x" * (300 * 1024))  # declared length
    assert status == 413 and body["error"]["code"] == "body_too_large" and "262144" in body["error"]["message"]
    # Streamed without Content-Length: counted as it arrives.
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    conn.request("POST", "/v1/sessions", body=iter([b"y" * 65536] * 5), encode_chunked=True,
                 headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked", **AUTH})
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "body_too_large"
    conn.close()


def test_unknown_session_route_and_method(server: Server) -> None:
    for method in ("GET", "DELETE"):
        status, _, body = server.request(method, "/v1/sessions/no-such-session")
        assert status == 404 and body["error"] == {
            "code": "session_not_found", "message": "no session with id 'no-such-session'", "field": "id"}
    status, _, body = server.request("GET", "/v1/nothing-here")
    assert status == 404 and body["error"]["code"] == "not_found"
    status, headers, body = server.request("PUT", "/v1/sessions")
    assert status == 405 and body["error"]["code"] == "method_not_allowed" and headers["allow"] == "GET, POST"


def test_api_keys_are_required(server: Server) -> None:
    for path in ("/v1/sessions", "/v1/capacity", "/openapi.json", "/v1/sessions/x"):
        status, headers, body = server.request("GET", path, headers={"Authorization": None})
        assert status == 401 and body["error"]["code"] == "missing_api_key", path
        assert headers["www-authenticate"] == "Bearer"
    status, _, body = server.request("POST", "/v1/sessions", create_body(), headers={"Authorization": "Bearer nope"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and "nope" not in body["error"]["message"]
    assert server.request("GET", "/healthz", headers={"Authorization": None})[0] == 200


def test_openapi_lists_endpoints_and_error_schema(server: Server) -> None:
    status, _, doc = server.request("GET", "/openapi.json")
    assert status == 200
    assert set(doc["paths"]) == {"/v1/sessions", "/v1/sessions/{session_id}", "/v1/capacity", "/healthz",
                                 "/v1/realtime_sessions", "/v1/realtime_sessions/{session_id}",
                                 "/v1/realtime_sessions/{session_id}/consume", "/v1/avatars",
                                 "/v1/avatars/{avatar_id}", "/v1/sessions/{session_id}/audio", "/v1/watch/config",
                                 "/v1/watch/sessions", "/v1/watch/token",
                                 "/v1/livekit",  # + the watch page's (deployments.api.watch)
                                 "/readyz", "/v1/usage", "/v1/avatar_usage"}  # + the ingress's (deployments.api.app)
    assert set(doc["paths"]["/v1/sessions"]) == {"get", "post"}
    assert set(doc["paths"]["/v1/sessions/{session_id}"]) == {"get", "delete"}
    post = doc["paths"]["/v1/sessions"]["post"]
    assert post["responses"]["201"]["content"]["application/json"]["schema"]["$ref"].endswith("/SessionOut")
    for code in ("400", "401", "413", "422", "503"):
        assert post["responses"][code]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    assert "Retry-After" in post["responses"]["503"]["headers"]
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    assert set(schemas["CreateSessionRequest"]["properties"]) == {"avatar", "preset", "maxDuration", "output", "seed",
                                                                  "recover"}
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


# --------------------------------------------------------------------------------------------- gRPC


def rpc_error(fn: Any, *args: Any, **kw: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = fn(*args, **kw)
        for _ in result if hasattr(result, "__iter__") else ():
            pass
    return info.value


def test_grpc_control(server: Server) -> None:
    stub = server.stub
    created = stub.CreateSession(pb.CreateSessionRequest(image=png(), max_duration_s=30, seed=3), metadata=GRPC_AUTH)
    assert created.status == pb.SESSION_STATUS_STARTING and created.preset == "tiny" and len(created.id) == 32
    assert ray.get(fake().key_of.remote(created.id)) == "tester"
    assert stub.GetSession(pb.GetSessionRequest(session_id=created.id), metadata=GRPC_AUTH).id == created.id
    listed = stub.ListSessions(pb.ListSessionsRequest(), metadata=GRPC_AUTH).sessions
    assert created.id in [s.id for s in listed]
    cap = stub.GetCapacity(pb.GetCapacityRequest(), metadata=GRPC_AUTH)
    assert (cap.bundles_total, cap.bundles_free, cap.sessions_running) == (2, 1, 1)
    ended = stub.EndSession(pb.EndSessionRequest(session_id=created.id, reason="done"), metadata=GRPC_AUTH)
    assert ended.status == pb.SESSION_STATUS_ENDED and ended.reason == "done" and ended.HasField("ended_at")

    err = rpc_error(stub.GetSession, pb.GetSessionRequest(session_id="nope"), metadata=GRPC_AUTH)
    assert err.code() == grpc.StatusCode.NOT_FOUND and "no session with id 'nope'" in err.details()
    err = rpc_error(stub.GetCapacity, pb.GetCapacityRequest())
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "missing_api_key" in err.details()
    err = rpc_error(stub.CreateSession, pb.CreateSessionRequest(image=b"not an image"), metadata=GRPC_AUTH)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("invalid_image: image: ")
    err = rpc_error(stub.CreateSession, pb.CreateSessionRequest(image=png(), max_duration_s=-1), metadata=GRPC_AUTH)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_duration_s" in err.details()
    err = rpc_error(stub.CreateSession, pb.CreateSessionRequest(image=png(), preset="huge"), metadata=GRPC_AUTH)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "preset" in err.details()


def test_grpc_no_capacity_is_resource_exhausted(server: Server) -> None:
    ids = [server.stub.CreateSession(pb.CreateSessionRequest(image=png()), metadata=GRPC_AUTH).id for _ in range(3)]
    try:
        err = rpc_error(server.stub.CreateSession, pb.CreateSessionRequest(image=png()), metadata=GRPC_AUTH)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and err.details().startswith("no_capacity: ")
        assert ("retry-after", "3") in list(err.trailing_metadata() or ())
    finally:
        for sid in ids:
            server.stub.EndSession(pb.EndSessionRequest(session_id=sid), metadata=GRPC_AUTH)


class Feeder:
    """A request iterator fed from the test thread; `close()` half-closes the stream."""

    def __init__(self) -> None:
        import queue

        self.q: queue.Queue[pb.AudioChunk | None] = queue.Queue()

    def send(self, **fields: Any) -> None:
        self.q.put(pb.AudioChunk(**fields))

    def close(self) -> None:
        self.q.put(None)

    def __iter__(self) -> Iterator[pb.AudioChunk]:
        while (chunk := self.q.get()) is not None:
            yield chunk


def test_grpc_stream_audio_and_events(server: Server) -> None:
    sid = server.stub.CreateSession(pb.CreateSessionRequest(image=png()), metadata=GRPC_AUTH).id
    feeder = Feeder()
    stereo_48k_20ms = np.zeros((960, 2), "<i2").tobytes()
    feeder.send(session_id=sid, pcm=stereo_48k_20ms, sample_rate=48000, channels=2)
    events = server.stub.StreamAudio(iter(feeder), metadata=GRPC_AUTH, timeout=60)
    try:
        first, second = next(events), next(events)
        assert (first.seq, first.kind, first.status) == (1, pb.SessionEvent.KIND_STATUS, pb.SESSION_STATUS_STARTING)
        assert (second.seq, second.kind, second.chunk, second.detail) == (
            2, pb.SessionEvent.KIND_CHUNK, 0, "320 samples")  # 20 ms at 16 kHz mono
        assert server.request("GET", f"/v1/sessions/{sid}")[2]["stats"]["audioQueuedS"] == pytest.approx(0.02)
        feeder.send(clear=True)
        third = next(events)
        assert third.kind == pb.SessionEvent.KIND_PLAYBACK_FINISHED and third.detail == "interrupted"
        feeder.close()  # half-close: no more audio, events keep coming
        assert server.request("DELETE", f"/v1/sessions/{sid}")[0] == 200
        last = next(events)
        assert (last.seq, last.kind, last.status) == (4, pb.SessionEvent.KIND_STATUS, pb.SESSION_STATUS_ENDED)
        assert list(events) == []  # the terminal status ends the stream
        assert events.code() == grpc.StatusCode.OK
    finally:
        feeder.close()
        events.cancel()


def test_grpc_stream_audio_refusals(server: Server) -> None:
    sid = server.stub.CreateSession(pb.CreateSessionRequest(image=png()), metadata=GRPC_AUTH).id
    try:
        cases: list[tuple[list[pb.AudioChunk], Any, grpc.StatusCode, str]] = [
            ([pb.AudioChunk(pcm=b"\0\0", sample_rate=16000)], GRPC_AUTH, grpc.StatusCode.INVALID_ARGUMENT,
             "session_id"),
            ([pb.AudioChunk(session_id="nope")], GRPC_AUTH, grpc.StatusCode.NOT_FOUND, "no session with id 'nope'"),
            ([pb.AudioChunk(session_id=sid, pcm=b"\0\0\0", sample_rate=16000)], GRPC_AUTH,
             grpc.StatusCode.INVALID_ARGUMENT, "pcm: is 3 bytes"),
            ([pb.AudioChunk(session_id=sid, pcm=b"\0\0", sample_rate=0)], GRPC_AUTH,
             grpc.StatusCode.INVALID_ARGUMENT, "sample_rate: is 0"),
            ([pb.AudioChunk(session_id=sid), pb.AudioChunk(session_id="other", pcm=b"\0\0", sample_rate=16000)],
             GRPC_AUTH, grpc.StatusCode.INVALID_ARGUMENT, "one stream per session"),
            ([pb.AudioChunk(session_id=sid)], None, grpc.StatusCode.UNAUTHENTICATED, "missing_api_key"),
        ]
        for chunks, metadata, code, text in cases:
            err = rpc_error(server.stub.StreamAudio, iter(chunks), metadata=metadata, timeout=30)
            assert err.code() == code and text in err.details(), (chunks, err.details())
    finally:
        server.stub.EndSession(pb.EndSessionRequest(session_id=sid), metadata=GRPC_AUTH)
