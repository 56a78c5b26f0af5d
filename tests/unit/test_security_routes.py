"""Every route of the served app needs a key when keys are configured, except health and the watch page's
static files (and consume, whose bearer is the session's key); every gRPC method too. With two tenant keys and
an operator's, every route that names a session, an avatar or a room answers another key's with 404 (never
403) and changes nothing, lists hold only the caller's own, and the operator sees all: over HTTP (native,
Runway, watch) and gRPC. Also: the per-key quota answers 429 + Retry-After (gRPC: RESOURCE_EXHAUSTED +
retry-after), CORS is off by default, and LiveKit credentials in a request never come back in a refusal. The
app is built as the ingress builds it (`deployments.api.app._Ingress`), in process.
"""

from __future__ import annotations

import asyncio
import datetime
import re
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from fastapi import Depends, Security
from fastapi.routing import APIRoute, APIWebSocketRoute
from fastapi.security import HTTPBearer
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect
from test_api_grpc import Context
from test_api_grpc import Scheduler as GrpcScheduler
from test_api_validation import LIMITS, MemoryScheduler, b64, png

from deployments.api.auth import OPEN_PATHS, OPEN_PREFIXES, SESSION_KEY_PATHS, WS_POLICY_VIOLATION, ApiKeys
from deployments.api.frontend import SessionFrontend
from deployments.api.grpc_service import CharactersGrpc, GrpcAbort
from deployments.api.health import Readiness, add_health_routes
from deployments.api.http import build_http_app
from deployments.api.proto import characters_pb2 as pb
from deployments.api.requests import known_query
from deployments.api.runway import RunwayClient
from deployments.api.usage import UsageRegistry, add_usage_routes
from deployments.api.watch import WatchSettings, add_watch_routes
from deployments.livekit.config import mint_token
from deployments.store import SessionRows, UsageQueries, open_engine
from deployments.store.db import MEMORY_URL
from deployments.types import NoCapacity

KEY = "security-key-0123456789abcdef"
ALLOWED_OPEN = {"/healthz", "/readyz", "/", "/watch"}  # health, readiness, the watch page's redirect and files
SECRET = "LK-SECRET-7f3a9c2e51d84b06a1-0123456789"  # a recognisable LiveKit API secret
TOKEN = mint_token("devkey", SECRET, room="r", identity="character")  # a real JWT, signed with it


@pytest.fixture()
def sched() -> MemoryScheduler:
    return MemoryScheduler()


DEV = WatchSettings(url="ws://127.0.0.1:1", public_url="ws://127.0.0.1:1", api_key="devkey", api_secret="secret",
                    dev=True)  # the service's own (development) LiveKit server: rooms of its own; never connected


def served_app(sched: Any, keys: ApiKeys | None = None, livekit: WatchSettings = DEV) -> Any:
    frontend = SessionFrontend(sched, LIMITS)
    keys = keys or ApiKeys.from_keys([("sec", KEY)])
    app = add_watch_routes(build_http_app(frontend, keys, livekit), frontend, livekit)
    engine = open_engine(MEMORY_URL)  # the session records usage is read from (the walk writes one of a's)
    app.state.records = SessionRows(engine, "test")
    bearer = [Security(HTTPBearer(auto_error=False)), Depends(known_query)]
    add_health_routes(app, Readiness(sched, warm_slots=0))
    add_usage_routes(app, UsageRegistry(UsageQueries(engine)), {"dependencies": bearer},
                     {"dependencies": [*bearer, Depends(RunwayClient())]})

    @app.websocket("/v1/probe-ws")  # a WebSocket route, so the middleware's WebSocket branch is walked too
    async def probe(ws: WebSocket) -> None:
        await ws.accept()
        await ws.send_text("hello")
        await ws.close()

    return app


@pytest.fixture()
def client(sched: MemoryScheduler) -> Iterator[TestClient]:
    with TestClient(served_app(sched), raise_server_exceptions=False) as c:
        yield c


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", path).replace(":path", "")


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def test_open_paths_are_only_health_and_the_watch_page() -> None:
    assert set(OPEN_PATHS) == ALLOWED_OPEN and OPEN_PREFIXES == ("/watch/",)


def test_every_route_needs_a_key(client: TestClient) -> None:
    walked = 0
    for route in client.app.routes:  # type: ignore[attr-defined]
        if isinstance(route, WebSocketRoute | APIWebSocketRoute):
            with pytest.raises(WebSocketDisconnect) as closed, client.websocket_connect(route.path) as ws:
                ws.receive_text()
            assert closed.value.code == WS_POLICY_VIOLATION, route.path
            with client.websocket_connect(route.path, headers={"Authorization": f"Bearer {KEY}"}) as ws:
                assert ws.receive_text() == "hello"
            walked += 1
            continue
        assert isinstance(route, APIRoute | Route | Mount), route
        path = concrete(route.path) + ("/" if isinstance(route, Mount) else "")
        methods = sorted(getattr(route, "methods", None) or {"GET"})
        for method in methods:
            if is_open(path):
                assert path in ALLOWED_OPEN or path.startswith("/watch/"), path
                assert client.request(method, path).status_code != 401, path
                continue
            kind = "session" if SESSION_KEY_PATHS.match(path) else "api"  # consume: its bearer is a session key
            for header, code in ((None, f"missing_{kind}_key"), ("Bearer wrong-key-01234567890", f"invalid_{kind}_key"),
                                 (f"Basic {KEY}", f"missing_{kind}_key"), (f"Bearer {KEY}", "invalid_session_key")):
                if kind == "api" and header == f"Bearer {KEY}":
                    continue  # the right API key (the walk below takes it)
                headers = {"Authorization": header} if header else {}
                resp = client.request(method, path, headers=headers, json={})
                assert resp.status_code == 401, (method, path, resp.status_code)
                assert resp.headers["www-authenticate"] == "Bearer"
                assert method == "HEAD" or resp.json()["error"]["code"] == code
                assert "access-control-allow-origin" not in resp.headers  # CORS is off by default
                assert KEY not in resp.text
            walked += 1
    assert walked >= 20  # native, Runway, watch, docs and schema routes, the WebSocket


# ------------------------------------------------------------------------------------- tenancy (two keys)

KEY_A, KEY_B, KEY_OPS = "tenant-a-key-0123456789", "tenant-b-key-0123456789", "operator-key-0123456789"
TENANTS = ApiKeys.parse(f"a:{KEY_A},b:{KEY_B},ops@operator:{KEY_OPS}")
AS = {name: {"Authorization": f"Bearer {key}"} for name, key in (("a", KEY_A), ("b", KEY_B), ("ops", KEY_OPS))}
# Every route, by what it does with another tenant's things. A new route fails the walk until it is placed here.
SCOPED = {  # names a session or an avatar in its path: another key's is 404, as an unknown id is
    ("GET", "/v1/sessions/{session_id}"), ("DELETE", "/v1/sessions/{session_id}"),
    ("POST", "/v1/sessions/{session_id}/audio"), ("DELETE", "/v1/sessions/{session_id}/audio"),
    ("GET", "/v1/realtime_sessions/{session_id}"), ("DELETE", "/v1/realtime_sessions/{session_id}"),
    ("GET", "/v1/avatars/{avatar_id}"), ("PATCH", "/v1/avatars/{avatar_id}"), ("DELETE", "/v1/avatars/{avatar_id}"),
}
LISTS = {("GET", "/v1/sessions"), ("GET", "/v1/avatars")}  # the caller's own only; an operator's: all
USAGE = {("GET", "/v1/usage"), ("GET", "/v1/avatar_usage")}  # the caller's own sessions' figures; an operator's: all
BY_BODY = {("POST", "/v1/watch/token"): "roomName", ("POST", "/v1/realtime_sessions"): "avatar.avatarId"}
CREATES = {("POST", "/v1/sessions"), ("POST", "/v1/avatars"), ("POST", "/v1/watch/sessions")}  # own things only
SERVICE = {("GET", "/v1/capacity"), ("GET", "/v1/watch/config"), ("GET", "/v1/livekit"), ("GET", "/healthz"),
           ("GET", "/readyz"),
           ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/docs/oauth2-redirect"), ("GET", "/redoc"),
           ("GET", "/"), ("GET", "/watch/samples/{name}"), ("GET", "/v1/probe-ws")}  # no tenant's data
SESSION_KEYED = {("POST", "/v1/realtime_sessions/{session_id}/consume")}  # the session key is the credential


def with_key(who: str, kw: dict[str, Any]) -> dict[str, Any]:
    return {**kw, "headers": {**kw.get("headers", {}), **AS[who]}}


def test_every_route_keeps_tenants_apart_with_two_keys_and_an_operator_sees_all(sched: MemoryScheduler) -> None:
    app = served_app(sched, TENANTS)
    with TestClient(app, raise_server_exceptions=False) as client:
        native = client.post("/v1/sessions", json={"avatar": {"image": b64(png())}}, headers=AS["a"]).json()["id"]
        watched = client.post("/v1/watch/sessions", json={"avatar": {"image": b64(png())}}, headers=AS["a"]).json()
        room = watched["viewer"]["roomName"]
        avatar = client.post("/v1/avatars", json={"image": b64(png()), "name": "a's"}, headers=AS["a"]).json()["id"]
        while client.get(f"/v1/avatars/{avatar}", headers=AS["a"]).json()["status"] == "PROCESSING":
            pass
        runway = client.post("/v1/realtime_sessions", headers=AS["a"], json={
            "model": "gwm1_avatars", "avatar": {"type": "custom", "avatarId": avatar}}).json()["id"]
        a_sessions = {native, watched["session"]["id"], runway}
        app.state.records.save(sched.infos[native], 1, time.time())  # its record, as the scheduler writes it
        today = datetime.datetime.now(datetime.UTC).date()
        days = f"?startDate={today}&endDate={today + datetime.timedelta(days=1)}"
        assert {s.api_key_id for s in sched.specs.values()} == {"a"} and set(sched.specs) == a_sessions
        ids = {"session_id": runway, "avatar_id": avatar, "name": "face.png"}
        bodies: dict[tuple[str, str], Any] = {
            ("POST", "/v1/sessions/{session_id}/audio"): b"\0\0" * 160,
            ("PATCH", "/v1/avatars/{avatar_id}"): {"name": "renamed"},
            ("POST", "/v1/watch/token"): {"roomName": room},
            ("POST", "/v1/realtime_sessions"): {"model": "gwm1_avatars",
                                                "avatar": {"type": "custom", "avatarId": avatar}},
        }

        def state(sched: MemoryScheduler) -> tuple[Any, ...]:  # what b must not change
            got = client.get(f"/v1/avatars/{avatar}", headers=AS["a"]).json()
            return (len(sched.audio), len(sched.cleared), len(sched.specs), got["name"], got["status"],
                    tuple((i.status, i.reason) for i in sched.infos.values()))

        walked: set[tuple[str, str]] = set()
        for route in app.routes:
            if isinstance(route, Mount):
                continue  # the watch page's files (no data)
            for method in sorted((getattr(route, "methods", None) or {"GET"}) - {"HEAD"}):
                op = (method, route.path)
                walked.add(op)
                path = re.sub(r"\{([^}:]+)(:path)?\}", lambda m: ids.get(m.group(1), "x"), route.path)
                payload = bodies.get(op)
                kw: dict[str, Any] = ({"content": payload, "headers": {"content-type": "application/octet-stream"}}
                                      if isinstance(payload, bytes) else {"json": payload} if payload else {})
                if op in SCOPED:
                    if "audio" in path and method == "POST":
                        path += "?sampleRate=16000&channels=1"
                    before = state(sched)
                    resp = client.request(method, path, **with_key("b", kw))
                    err = resp.json()["error"]
                    assert resp.status_code == 404 and err["code"] in ("session_not_found", "avatar_not_found"), (
                        op, resp.text)
                    assert state(sched) == before, op  # b changed nothing of a's
                    assert err["message"].startswith("no ") and "another" not in err["message"], err
                    if method != "DELETE":  # the operator reaches it (and ends nothing: a's things are checked below)
                        assert client.request(method, path, **with_key("ops", kw)).status_code < 300, op
                elif op in BY_BODY:
                    resp = client.request(method, path, **with_key("b", kw))
                    err = resp.json()["error"]
                    assert resp.status_code in (404, 422) and err["field"] == BY_BODY[op] and err["code"] in (
                        "session_not_found", "avatar_not_found"), (op, resp.text)
                    assert client.request(method, path, **with_key("ops", kw)).status_code in (200, 201), op
                elif op in USAGE:
                    mine, every = client.get(path + days, headers=AS["b"]), client.get(path + days, headers=AS["ops"])
                    assert mine.status_code == every.status_code == 200, (op, mine.text)
                    if path == "/v1/usage":
                        assert mine.json()["data"] == [] and [u["tenant"] for u in every.json()["data"]] == ["a"]
                    else:
                        assert (mine.json()["totalSessions"], every.json()["totalSessions"]) == (0, 1), op
                elif op in LISTS:
                    key = "sessions" if "sessions" in path else "data"
                    assert client.get(path, headers=AS["b"]).json()[key] == [], op
                    assert {x["id"] for x in client.get(path, headers=AS["ops"]).json()[key]} >= (
                        a_sessions if key == "sessions" else {avatar}), op
                else:
                    assert op in CREATES | SERVICE | SESSION_KEYED, f"{op} is not placed in a tenancy class above"
        assert walked == SCOPED | LISTS | USAGE | set(BY_BODY) | CREATES | SERVICE | SESSION_KEYED
        # nobody ended a's sessions (b could not; the operator's DELETEs were left out), b renamed nothing
        assert all(not sched.infos[sid].status.terminal for sid in a_sessions)
        assert client.get(f"/v1/avatars/{avatar}", headers=AS["a"]).json()["name"] == "renamed"  # by the operator
        assert client.get("/v1/livekit", headers=AS["b"]).json()["apiSecret"] is None  # a secret mints any token
        assert client.get("/v1/livekit", headers=AS["ops"]).json()["apiSecret"] == "secret"
        # and a itself still reaches everything of its own
        assert client.get(f"/v1/sessions/{runway}", headers=AS["a"]).status_code == 200
        assert client.post("/v1/watch/token", json={"roomName": room}, headers=AS["a"]).status_code == 200
        assert client.post("/v1/watch/token", json={"roomName": "elsewhere"}, headers=AS["a"]).status_code == 404
        assert client.delete(f"/v1/sessions/{native}", headers=AS["a"]).json()["status"] == "ENDED"


def test_every_grpc_method_keeps_tenants_apart() -> None:
    sched = GrpcScheduler()

    class Service(CharactersGrpc):
        def __init__(self) -> None:
            self.frontend = SessionFrontend(sched, LIMITS)
            self.keys = TENANTS

    svc = Service()

    def md(who: str) -> list[tuple[str, str]]:
        return [("authorization", AS[who]["Authorization"])]

    async def main() -> None:
        ctx = Context(md("a"))
        sid = (await svc.CreateSession(pb.CreateSessionRequest(image=png()), ctx)).id  # type: ignore[arg-type]
        assert ctx.code is None and sched.specs[sid].api_key_id == "a"
        for name, request in (("GetSession", pb.GetSessionRequest(session_id=sid)),
                              ("EndSession", pb.EndSessionRequest(session_id=sid))):
            ctx = Context(md("b"))
            await getattr(svc, name)(request, ctx)
            assert ctx.code == grpc.StatusCode.NOT_FOUND and ctx.details.startswith("session_not_found:"), name

        async def chunks() -> Any:
            yield pb.AudioChunk(session_id=sid, pcm=b"\0\0" * 160, sample_rate=16000, channels=1)

        ctx = Context(md("b"))
        with pytest.raises(GrpcAbort):
            async for _ in svc.StreamAudio(chunks(), ctx):  # type: ignore[arg-type]
                pass
        assert ctx.code == grpc.StatusCode.NOT_FOUND and sched.pushed == []
        ctx = Context(md("b"))
        assert list((await svc.ListSessions(pb.ListSessionsRequest(), ctx)).sessions) == []  # type: ignore[arg-type]
        ctx = Context(md("ops"))
        listed = await svc.ListSessions(pb.ListSessionsRequest(), ctx)  # type: ignore[arg-type]
        assert [s.id for s in listed.sessions] == [sid] and not sched.infos[sid].status.terminal
        ctx = Context(md("ops"))
        ended = await svc.EndSession(pb.EndSessionRequest(session_id=sid), ctx)  # type: ignore[arg-type]
        assert ctx.code is None and ended.status == pb.SESSION_STATUS_ENDED

    asyncio.run(asyncio.wait_for(main(), 10))


@pytest.mark.parametrize("path", ["/watch/../v1/capacity", "/watch/%2e%2e/v1/sessions", "/healthz/../v1/sessions",
                                  "//v1/sessions", "/v1/sessions/", "/HEALTHZ", "/healthz?x=/v1/sessions"])
def test_path_tricks_give_no_data_without_a_key(client: TestClient, path: str) -> None:
    resp = client.get(path, follow_redirects=False)
    assert resp.status_code in (401, 404, 307) or (path.startswith("/healthz") and resp.json() == {"status": "ok"}), (
        path, resp.status_code, resp.text[:200])
    if resp.status_code == 307:  # a redirect must land on a route that wants a key
        assert client.get(resp.headers["location"]).status_code == 401


def test_every_grpc_method_needs_a_key() -> None:
    class Service(CharactersGrpc):
        def __init__(self) -> None:
            self.frontend = SessionFrontend(GrpcScheduler(), LIMITS)
            self.keys = ApiKeys.from_keys([("sec", KEY)])

    svc = Service()
    methods = pb.DESCRIPTOR.services_by_name["Characters"].methods
    assert {m.name for m in methods} == {"CreateSession", "GetSession", "ListSessions", "EndSession", "GetCapacity",
                                         "StreamAudio"}

    async def chunks() -> Any:
        yield pb.AudioChunk(session_id="s")

    async def call(name: str, ctx: Context) -> None:
        if name == "StreamAudio":
            with pytest.raises(GrpcAbort):
                async for _ in svc.StreamAudio(chunks(), ctx):  # type: ignore[arg-type]
                    pass
            return
        request = getattr(pb, methods[[m.name for m in methods].index(name)].input_type.name)()
        await getattr(svc, name)(request, ctx)

    for m in methods:
        for metadata, code in (([], "missing_api_key"), ([("authorization", "Bearer wrong-0123456789abcdef")],
                                                         "invalid_api_key")):
            ctx = Context(metadata)
            asyncio.run(asyncio.wait_for(call(m.name, ctx), 5))
            assert ctx.code == grpc.StatusCode.UNAUTHENTICATED and ctx.details.startswith(code), (m.name, ctx.details)


def test_quota_is_429_with_retry_after_over_http_and_resource_exhausted_over_grpc(
        client: TestClient, sched: MemoryScheduler) -> None:
    sched.refuse = NoCapacity("API key 'sec' has 2 live sessions, the limit is 2; end one first", 5.0,
                              code="quota_exceeded")
    auth = {"Authorization": f"Bearer {KEY}"}
    native = client.post("/v1/sessions", json={"avatar": {"image": b64(png())}}, headers=auth)
    runway = client.post("/v1/realtime_sessions", headers=auth, json={
        "model": "gwm1_avatars", "avatar": {"type": "runway-preset", "presetId": "sample-face"},
        "livekit": {"url": "ws://127.0.0.1:7880", "token": TOKEN, "roomName": "r"}})
    for resp in (native, runway):
        assert resp.status_code == 429 and resp.headers["retry-after"] == "5", resp.text
        assert resp.json()["error"]["code"] == "quota_exceeded" and "limit is 2" in resp.json()["error"]["message"]
    doc = client.get("/openapi.json", headers=auth).json()
    assert "Retry-After" in doc["paths"]["/v1/sessions"]["post"]["responses"]["429"]["headers"]

    grpc_sched = GrpcScheduler()
    grpc_sched.refuse = sched.refuse

    class Service(CharactersGrpc):
        def __init__(self) -> None:
            self.frontend = SessionFrontend(grpc_sched, LIMITS)
            self.keys = ApiKeys.from_keys([("sec", KEY)])

    ctx = Context([("authorization", f"Bearer {KEY}")])
    asyncio.run(Service().CreateSession(pb.CreateSessionRequest(image=png()), ctx))  # type: ignore[arg-type]
    assert ctx.code == grpc.StatusCode.RESOURCE_EXHAUSTED and ctx.trailing == [("retry-after", "5")]
    assert ctx.details.startswith("quota_exceeded: ")


LIVEKIT_REFUSALS: list[dict[str, Any]] = [
    {"kind": "livekit", "url": "ftp://nowhere", "roomName": "r", "token": TOKEN},
    {"kind": "livekit", "url": "ws://127.0.0.1:1", "roomName": "", "token": TOKEN},
    {"kind": "livekit", "url": "ws://127.0.0.1:1", "roomName": "r", "token": TOKEN, "apiKey": "k", "apiSecret": SECRET},
    {"kind": "livekit", "url": "ws://127.0.0.1:1", "roomName": "r", "token": SECRET},  # not a JWT
    {"kind": "livekit", "url": "ws://127.0.0.1:1", "roomName": "r", "apiKey": "k", "apiSecret": SECRET,
     "identity": "bad identity!"},
    {"kind": "livekit", "url": "ws://127.0.0.1:1", "roomName": "r", "token": TOKEN + "x" * 9000},
    {"kind": "null", "token": TOKEN, "apiSecret": SECRET},
    {"kind": "file", "path": "../x.mp4", "token": TOKEN},
]


@pytest.mark.parametrize("output", LIVEKIT_REFUSALS)
def test_refusals_never_echo_livekit_credentials(client: TestClient, sched: MemoryScheduler,
                                                 output: dict[str, Any]) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    resp = client.post("/v1/sessions", json={"avatar": {"image": b64(png())}, "output": output}, headers=auth)
    assert resp.status_code == 422, resp.text
    lk = {k: v for k, v in output.items() if k in ("url", "token", "roomName")}
    runway = client.post("/v1/realtime_sessions", headers=auth, json={
        "model": "gwm1_avatars", "avatar": {"type": "runway-preset", "presetId": "sample-face"},
        "livekit": {"url": "ws://127.0.0.1:1", "roomName": "r", **lk, "token": output.get("token", SECRET)}})
    for r in (resp, runway):
        assert SECRET not in r.text and TOKEN.split(".")[2] not in r.text and TOKEN.split(".")[1] not in r.text, r.text
    assert not sched.specs or runway.status_code == 200


def test_limits_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from deployments.api.requests import ApiConfig

    monkeypatch.setenv("CHARACTERS_MAX_BODY_BYTES", "4096")
    monkeypatch.setenv("CHARACTERS_MAX_IMAGE_PIXELS", "1024")
    monkeypatch.setenv("CHARACTERS_CORS_ORIGINS", "https://a.example, https://b.example")
    cfg = ApiConfig()
    assert (cfg.max_body_bytes, cfg.max_image_pixels, cfg.cors_origins) == (4096, 1024, ("https://a.example",
                                                                                         "https://b.example"))
    assert ApiConfig(max_body_bytes=2048).max_body_bytes == 2048  # app args win
    with TestClient(build_http_app(SessionFrontend(MemoryScheduler(), cfg))) as c:
        assert c.post("/v1/sessions", content=b"x" * 5000).json()["error"]["code"] == "body_too_large"
        assert c.post("/v1/sessions", json={"avatar": {"image": b64(png(40, 40))}}).json()["error"] == {
            "code": "image_too_large", "field": "avatar.image",
            "message": "is 40x40 = 1600 pixels, over the limit of 1024; downscale it"}
    monkeypatch.setenv("CHARACTERS_MAX_BODY_BYTES", "10")
    with pytest.raises(ValueError, match="max_body_bytes"):
        ApiConfig()
    monkeypatch.setenv("CHARACTERS_MAX_BODY_BYTES", "lots")
    with pytest.raises(ValueError, match="CHARACTERS_MAX_BODY_BYTES='lots' is invalid"):
        ApiConfig()
