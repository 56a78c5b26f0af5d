"""The Runway-compatible routes (realtime sessions, consume, avatars) and the native `output.kind = "livekit"`,
over the real FastAPI app in process (no Ray, no LiveKit server): the exact bodies per status, the session
key's life (READY -> consumed once -> RUNNING), avatar processing (PROCESSING -> READY | FAILED), URL fetching
only under an allowed prefix, pagination, and every refusal's status, code and field."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from livekit import api as lkapi
from memory_scheduler import MemoryScheduler
from PIL import Image
from starlette.testclient import TestClient

from characters.config import MODEL_PRESETS
from deployments.api.auth import ApiKeys
from deployments.api.frontend import SessionFrontend
from deployments.api.http import build_http_app
from deployments.api.requests import ApiConfig
from deployments.api.runway import RUNWAY_VERSION, preset_face, runway_view
from deployments.api.watch import WatchSettings
from deployments.livekit import LiveKitOutput
from deployments.types import SessionInfo, SessionStatus

GEN = MODEL_PRESETS["tiny"].generation
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhdmF0YXIifQ.c2lnbmF0dXJl"
HEADERS = {"X-Runway-Version": RUNWAY_VERSION, "Authorization": "Bearer runway-secret-0123456789"}
LK = WatchSettings(url="ws://lk.internal:7880", public_url="wss://lk.example.org", api_key="APIkey123",
                   api_secret="a-secret-of-32-characters-or-more!!")
VOICE = {"type": "runway-live-preset", "presetId": "clara"}


@pytest.fixture()
def sched() -> MemoryScheduler:
    return MemoryScheduler(created=SessionStatus.QUEUED)


def make(sched: MemoryScheduler, keys: ApiKeys | None = None, livekit: WatchSettings = LK, **config: Any) -> TestClient:
    frontend = SessionFrontend(sched, ApiConfig(max_duration_s=600, **config))
    client = TestClient(build_http_app(frontend, keys, livekit), raise_server_exceptions=False)
    client.frontend = frontend  # type: ignore[attr-defined]
    return client


@pytest.fixture()
def client(sched: MemoryScheduler) -> Iterator[TestClient]:
    with make(sched) as c:
        yield c


def body(**over: Any) -> dict[str, Any]:
    """Exactly what livekit-plugins-runway 1.8.9 posts (see deployments/api/runway.py)."""
    b: dict[str, Any] = {"model": "gwm1_avatars", "avatar": {"type": "runway-preset", "presetId": "sample-face"},
                         "livekit": {"url": "wss://lk.example", "token": JWT, "roomName": "room-1",
                                     "agentIdentity": "agent-1"}}
    b.update(over)
    return b


def png_bytes(w: int = 64, h: int = 48, level: int = 120) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), level, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def png_b64(w: int = 64, h: int = 48) -> str:
    return base64.b64encode(png_bytes(w, h)).decode()


def data_uri(level: int = 120) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(level=level)).decode()


def error_of(resp: Any) -> tuple[int, str, str | None]:
    err = resp.json()["error"]
    return resp.status_code, err["code"], err["field"]


def settle(client: TestClient, avatar_id: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Poll the avatar until it leaves PROCESSING (the processing runs on the app's loop)."""
    deadline = time.monotonic() + 10
    while True:
        got = client.get(f"/v1/avatars/{avatar_id}", headers=headers or {}).json()
        if got["status"] != "PROCESSING" or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


# -------------------------------------------------------------------------------- realtime sessions


def test_the_plugins_request_answers_only_an_id_and_passes_its_room(client: TestClient, sched: MemoryScheduler) -> None:
    resp = client.post("/v1/realtime_sessions", json=body(maxDuration=120), headers=HEADERS)
    assert resp.status_code == 200 and resp.headers["x-runway-version"] == RUNWAY_VERSION
    assert set(resp.json()) == {"id"}
    spec = sched.specs[resp.json()["id"]]
    assert spec.preset == "tiny" and spec.max_duration_s == 120.0
    assert spec.output == LiveKitOutput(url="wss://lk.example", room_name="room-1", token=JWT,
                                        identity="runway-avatar-agent", agent_identity="agent-1")
    assert np.array_equal(spec.image, preset_face("sample-face", GEN.height, GEN.width))


def test_integration_is_the_same_room_and_livekit_is_its_deprecated_twin(client: TestClient,
                                                                        sched: MemoryScheduler) -> None:
    lk = body()["livekit"]
    resp = client.post("/v1/realtime_sessions", json=body(livekit=None, integration={"type": "livekit", **lk},
                                                          avatar={"type": "runway-preset", "presetId": "influencer"}))
    assert resp.status_code == 200, resp.text
    spec = sched.specs[resp.json()["id"]]
    assert spec.output == LiveKitOutput(url="wss://lk.example", room_name="room-1", token=JWT,
                                        identity="runway-avatar-agent", agent_identity="agent-1")
    assert np.array_equal(spec.image, preset_face("sample-face", GEN.height, GEN.width))  # every preset: our face


def test_default_max_duration_unknown_fields_ignored_version_optional(client: TestClient,
                                                                     sched: MemoryScheduler) -> None:
    resp = client.post("/v1/realtime_sessions", json=body(futureField={"x": 1}))
    assert resp.status_code == 200
    assert sched.specs[resp.json()["id"]].max_duration_s == 300.0


@pytest.mark.parametrize(("payload", "headers", "status", "code", "field"), [
    (body(model="gen4_turbo"), {}, 422, "invalid_field", "model"),
    (body(), {"X-Runway-Version": "2023-01-01"}, 422, "invalid_field", "X-Runway-Version"),
    (body(avatar={"type": "stock", "id": "x"}), {}, 422, "invalid_field", "avatar"),
    (body(avatar={"type": "custom"}), {}, 422, "invalid_field", "avatar.custom.avatarId"),
    (body(avatar={"type": "runway-preset", "presetId": "nobody"}), {}, 422, "invalid_field", "avatar.presetId"),
    (body(avatar={"type": "custom", "avatarId": "f" * 32}), {}, 422, "avatar_not_found", "avatar.avatarId"),
    (body(integration={"type": "livekit", "url": "wss://x", "token": JWT, "roomName": "r"}), {}, 422,
     "invalid_field", "livekit"),
    (body(livekit=None, integration={"type": "elevenlabs", "signedUrl": "wss://x"}), {}, 422, "invalid_field",
     "integration.type"),
    (body(livekit=None, integration={"type": "livekit", "url": "lk.example", "token": JWT, "roomName": "r"}), {},
     422, "invalid_field", "integration.url"),
    (body(livekit={"url": "lk.example", "token": JWT, "roomName": "r"}), {}, 422, "invalid_field", "livekit.url"),
    (body(livekit={"url": "wss://lk.example", "token": "opaque", "roomName": "r"}), {}, 422, "invalid_field",
     "livekit.token"),
    (body(maxDuration=601), {}, 422, "invalid_field", "maxDuration"),
    (body(maxDuration=0), {}, 422, "invalid_field", "maxDuration"),
    (body(tools=[{"type": "client_event", "name": "9lives", "description": "x"}]), {}, 422, "invalid_field",
     "tools.0.name"),
])
def test_create_refusals_have_the_error_shape(client: TestClient, sched: MemoryScheduler, payload: dict[str, Any],
                                              headers: dict[str, str], status: int, code: str, field: str) -> None:
    assert error_of(client.post("/v1/realtime_sessions", json=payload, headers=headers)) == (status, code, field)
    assert not sched.specs


def test_without_an_integration_a_service_room_a_session_key_valid_once(sched: MemoryScheduler) -> None:
    sched.created = SessionStatus.STARTING
    with make(sched) as client:
        tools = [{"type": "client_event", "name": "show_caption", "description": "Show a caption",
                  "parameters": [{"name": "text", "type": "string", "description": "the text"}]}]
        sid = client.post("/v1/realtime_sessions", json={"model": "gwm1_avatars", "avatar": body()["avatar"],
                                                         "personality": "kind", "startScript": "Hi!",
                                                         "tools": tools}).json()["id"]
        spec = sched.specs[sid]
        out = spec.output
        assert isinstance(out, LiveKitOutput) and (out.url, out.room_name, out.api_key, out.api_secret, out.token,
                                                   out.identity, out.agent_identity) == (
            LK.url, f"watch-{sid}", LK.api_key, LK.api_secret, None, "character", None)
        record = asyncio.run(client.frontend.realtime.get(sid))  # type: ignore[attr-defined]
        assert (record.personality, record.start_script, record.tools) == ("kind", "Hi!", (
            {"type": "client_event", "name": "show_caption", "description": "Show a caption",
             "parameters": [{"name": "text", "type": "string", "description": "the text"}]},))
        created = client.get(f"/v1/realtime_sessions/{sid}").json()
        assert created == {"id": sid, "createdAt": created["createdAt"], "status": "NOT_READY", "queued": False}
        assert error_of(client.post(f"/v1/realtime_sessions/{sid}/consume")) == (401, "missing_session_key", None)
        sched.infos[sid].status = SessionStatus.READY
        ready = client.get(f"/v1/realtime_sessions/{sid}").json()
        assert set(ready) == {"id", "createdAt", "status", "sessionKey", "expiresAt"} and ready["status"] == "READY"
        key = ready["sessionKey"]
        assert len(key) >= 40 and ready["expiresAt"].endswith("Z")
        assert error_of(client.post(f"/v1/realtime_sessions/{sid}/consume",
                                    headers={"Authorization": "Bearer " + "x" * 43})) == (401, "invalid_session_key",
                                                                                          None)
        consumed = client.post(f"/v1/realtime_sessions/{sid}/consume", headers={"Authorization": f"Bearer {key}"})
        assert consumed.status_code == 200, consumed.text
        got = consumed.json()
        assert set(got) == {"url", "token", "roomName"} and (got["url"], got["roomName"]) == (LK.public_url,
                                                                                            f"watch-{sid}")
        claims = lkapi.TokenVerifier(LK.api_key, LK.api_secret).verify(got["token"])
        g = claims.video
        assert g is not None and claims.identity.startswith("user-")
        assert (g.room_join, g.room, g.can_subscribe, g.can_publish, g.can_publish_data) == (
            True, f"watch-{sid}", True, True, True)
        again = client.post(f"/v1/realtime_sessions/{sid}/consume", headers={"Authorization": f"Bearer {key}"})
        assert error_of(again) == (401, "invalid_session_key", None)
        assert "valid once" in again.json()["error"]["message"]
        assert client.get(f"/v1/realtime_sessions/{sid}").json() == {"id": sid, "createdAt": created["createdAt"],
                                                                    "status": "RUNNING"}


def test_a_session_key_expires_and_is_refused_before_ready_and_after_the_end(sched: MemoryScheduler) -> None:
    sched.created = SessionStatus.READY
    with make(sched, session_key_ttl_s=0.05) as client:
        sid = client.post("/v1/realtime_sessions", json={"model": "gwm1_avatars", "avatar": body()["avatar"]}).json()[
            "id"]
        key = client.get(f"/v1/realtime_sessions/{sid}").json()["sessionKey"]
        time.sleep(0.1)
        late = client.post(f"/v1/realtime_sessions/{sid}/consume", headers={"Authorization": f"Bearer {key}"})
        assert error_of(late) == (401, "invalid_session_key", None) and "expired" in late.json()["error"]["message"]
    with make(sched) as client:
        sid = client.post("/v1/realtime_sessions", json={"model": "gwm1_avatars", "avatar": body()["avatar"]}).json()[
            "id"]
        key = client.get(f"/v1/realtime_sessions/{sid}").json()["sessionKey"]
        sched.infos[sid].status = SessionStatus.QUEUED
        assert error_of(client.post(f"/v1/realtime_sessions/{sid}/consume",
                                    headers={"Authorization": f"Bearer {key}"})) == (409, "session_not_ready", None)
        sched.infos[sid].status, sched.infos[sid].reason = SessionStatus.ENDED, "room_empty"
        assert error_of(client.post(f"/v1/realtime_sessions/{sid}/consume",
                                    headers={"Authorization": f"Bearer {key}"})) == (409, "session_not_ready", None)
        assert error_of(client.post("/v1/realtime_sessions/nope/consume",
                                    headers={"Authorization": f"Bearer {key}"})) == (401, "invalid_session_key", None)


def test_no_livekit_server_of_its_own_needs_an_integration(sched: MemoryScheduler) -> None:
    with make(sched, livekit=WatchSettings()) as client:
        resp = client.post("/v1/realtime_sessions", json={"model": "gwm1_avatars", "avatar": body()["avatar"]})
        assert error_of(resp) == (422, "livekit_not_configured", "integration")
        assert "CHARACTERS_LIVEKIT_URL" in resp.json()["error"]["message"] and not sched.specs
        sid = client.post("/v1/realtime_sessions", json=body()).json()["id"]  # with one: fine
        assert sched.specs[sid].output.room_name == "room-1"  # type: ignore[union-attr]


def test_a_5xx_that_retrying_cannot_fix_tells_the_sdks_not_to_retry() -> None:
    from deployments.api.errors import ApiError

    assert ApiError(503, "x", "m", no_retry=True).headers == {"x-should-retry": "false"}
    assert ApiError(503, "x", "m", retry_after_s=2.0).headers == {"Retry-After": "2"}


def test_get_and_delete_map_statuses(client: TestClient, sched: MemoryScheduler) -> None:
    sid = client.post("/v1/realtime_sessions", json=body()).json()["id"]
    created = client.get(f"/v1/realtime_sessions/{sid}").json()
    assert created == {"id": sid, "createdAt": created["createdAt"], "status": "NOT_READY", "queued": True}
    sched.infos[sid].status = SessionStatus.READY  # with an integration: no key, RUNNING once the room is joined
    assert client.get(f"/v1/realtime_sessions/{sid}").json()["status"] == "RUNNING"
    resp = client.delete(f"/v1/realtime_sessions/{sid}")
    assert resp.status_code == 204 and resp.content == b""
    assert client.get(f"/v1/realtime_sessions/{sid}").json() == {"id": sid, "createdAt": created["createdAt"],
                                                                "status": "CANCELLED"}
    assert client.delete(f"/v1/realtime_sessions/{sid}").status_code == 204  # idempotent
    assert error_of(client.get("/v1/realtime_sessions/nope")) == (404, "session_not_found", "id")


def test_runway_status_mapping() -> None:
    def view(status: SessionStatus, reason: str | None = None, **kw: Any) -> dict[str, Any]:
        out = runway_view(SessionInfo("s", status, "tiny", reason=reason, created_at=1.7e9, **kw), None)
        return out.model_dump(by_alias=True)

    base = {"id": "s", "createdAt": "2023-11-14T22:13:20Z"}
    assert view(SessionStatus.QUEUED) == {**base, "status": "NOT_READY", "queued": True}
    assert view(SessionStatus.STARTING) == {**base, "status": "NOT_READY", "queued": False}
    assert view(SessionStatus.RUNNING) == {**base, "status": "RUNNING"}
    assert view(SessionStatus.ENDED, "deleted") == {**base, "status": "CANCELLED"}
    assert view(SessionStatus.ENDED, "end_call", started_at=1.7e9 + 2, ended_at=1.7e9 + 63.6) == {
        **base, "status": "COMPLETED", "duration": 62}
    assert view(SessionStatus.FAILED, "actor_died: the decoder worker died") == {
        **base, "status": "FAILED", "failure": "actor_died: the decoder worker died", "failureCode": "actor_died"}


def test_the_clients_user_agent_is_logged_once(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="deployments.api.runway"):
        for _ in range(3):
            client.get("/v1/realtime_sessions/nope", headers={"User-Agent": "RunwayML/Python 5.24.0"})
    lines = [r.getMessage() for r in caplog.records if "runway client" in r.getMessage()]
    assert lines == ["runway client 'RunwayML/Python 5.24.0' (key -) on GET /v1/realtime_sessions/nope"]


# ------------------------------------------------------------------------------------------- avatars


def runway_avatar(**over: Any) -> dict[str, Any]:
    return {"name": "Ann", "personality": "A patient tutor.", "referenceImage": data_uri(), "voice": VOICE, **over}


def test_a_runway_avatar_is_processed_once_then_used_by_sessions(client: TestClient, sched: MemoryScheduler) -> None:
    resp = client.post("/v1/avatars", json=runway_avatar(startScript="Hello!", documentIds=["doc-1"]))
    assert resp.status_code == 201, resp.text
    made = resp.json()
    assert made["status"] == "PROCESSING" and resp.headers["location"] == f"/v1/avatars/{made['id']}"
    ready = settle(client, made["id"])
    assert ready == {"id": made["id"], "status": "READY", "createdAt": made["createdAt"],
                     "updatedAt": ready["updatedAt"], "name": "Ann", "personality": "A patient tutor.",
                     "voice": {"type": "runway-live-preset", "presetId": "clara", "name": "Clara",
                               "description": ready["voice"]["description"]},
                     "startScript": "Hello!", "documentIds": ["doc-1"], "referenceImageUri": None,
                     "processedImageUri": None}
    resp = client.post("/v1/realtime_sessions", json=body(avatar={"type": "custom", "avatarId": made["id"]}))
    spec = sched.specs[resp.json()["id"]]
    assert spec.image.shape == (GEN.height, GEN.width, 3) and int(spec.image.mean()) == 120
    assert not spec.image.flags.writeable  # the processed image itself: nothing is decoded per session
    assert client.delete(f"/v1/avatars/{made['id']}").status_code == 204
    assert error_of(client.get(f"/v1/avatars/{made['id']}")) == (404, "avatar_not_found", "id")
    gone = client.post("/v1/realtime_sessions", json=body(avatar={"type": "custom", "avatarId": made["id"]}))
    assert error_of(gone) == (422, "avatar_not_found", "avatar.avatarId")


def test_the_native_body_still_registers_an_image(client: TestClient, sched: MemoryScheduler) -> None:
    reg = client.post("/v1/avatars", json={"image": "data:image/png;base64," + png_b64(), "name": "Bo"})
    assert reg.status_code == 201, reg.text
    got = settle(client, reg.json()["id"])
    assert (got["status"], got["name"], got["personality"], got["voice"]) == ("READY", "Bo", "", None)
    resp = client.post("/v1/realtime_sessions", json=body(avatar={"type": "custom", "avatarId": got["id"]}))
    assert int(sched.specs[resp.json()["id"]].image.mean()) == 120


def test_a_session_waits_for_no_avatar_a_broken_image_fails_processing(client: TestClient) -> None:
    truncated = "data:image/png;base64," + base64.b64encode(png_bytes()[:60]).decode()
    made = client.post("/v1/avatars", json=runway_avatar(referenceImage=truncated)).json()
    failed = settle(client, made["id"])
    assert failed["status"] == "FAILED" and failed["failureReason"].startswith("referenceImage ")
    resp = client.post("/v1/realtime_sessions", json=body(avatar={"type": "custom", "avatarId": made["id"]}))
    assert error_of(resp) == (422, "avatar_not_ready", "avatar.avatarId")
    assert "FAILED" in resp.json()["error"]["message"]


def test_update_list_and_pages(client: TestClient) -> None:
    ids = [client.post("/v1/avatars", json=runway_avatar(name=f"a{i}")).json()["id"] for i in range(5)]
    for i in ids:
        settle(client, i)
    first = client.get("/v1/avatars", params={"limit": 2}).json()
    assert [a["name"] for a in first["data"]] == ["a4", "a3"] and first["nextCursor"]
    second = client.get("/v1/avatars", params={"limit": 2, "cursor": first["nextCursor"]}).json()
    third = client.get("/v1/avatars", params={"limit": 2, "cursor": second["nextCursor"]}).json()
    assert [a["name"] for a in second["data"] + third["data"]] == ["a2", "a1", "a0"] and third["nextCursor"] is None
    assert error_of(client.get("/v1/avatars", params={"cursor": "bogus"})) == (422, "invalid_field", "cursor")
    assert error_of(client.get("/v1/avatars", params={"limit": 101}))[:2] == (422, "invalid_field")

    patched = client.patch(f"/v1/avatars/{ids[0]}", json={"name": "Zed", "startScript": None,
                                                           "voice": {"type": "custom", "id": "my-voice"}})
    assert patched.status_code == 200, patched.text
    p = patched.json()
    assert (p["name"], p["startScript"], p["voice"], p["status"]) == (
        "Zed", None, {"type": "custom", "id": "my-voice", "deleted": False, "name": None, "description": None},
        "READY")
    reimaged = client.patch(f"/v1/avatars/{ids[0]}", json={"referenceImage": data_uri(level=200)}).json()
    assert reimaged["status"] == "PROCESSING" and settle(client, ids[0])["status"] == "READY"
    assert error_of(client.patch(f"/v1/avatars/{ids[0]}", json={})) == (422, "invalid_field", None)
    assert error_of(client.patch(f"/v1/avatars/{ids[0]}", json={"name": None})) == (422, "invalid_field", "name")
    assert error_of(client.patch("/v1/avatars/nope", json={"name": "x"})) == (404, "avatar_not_found", "id")


@pytest.mark.parametrize(("payload", "status", "code", "field"), [
    ({}, 422, "invalid_field", "referenceImage"),
    ({"image": "!!!"}, 422, "invalid_image", "image"),
    ({"image": base64.b64encode(b"text").decode()}, 422, "invalid_image", "image"),
    (runway_avatar(personality=None), 422, "invalid_field", "personality"),
    (runway_avatar(voice=None), 422, "invalid_field", "voice"),
    (runway_avatar(voice={"type": "runway-live-preset", "presetId": "zoe"}), 422, "invalid_field",
     "voice.runway-live-preset.presetId"),
    (runway_avatar(referenceImage="data:image/png;base64,!!!"), 422, "invalid_image", "referenceImage"),
    (runway_avatar(referenceImage="data:text/plain;base64," + base64.b64encode(b"hello").decode()), 422,
     "invalid_image", "referenceImage"),
    (runway_avatar(referenceImage="https://cdn.example.com/a.png"), 422, "invalid_field", "referenceImage"),
    (runway_avatar(referenceImage="runway://uploads/abc"), 422, "invalid_field", "referenceImage"),
    (runway_avatar(imageProcessing="sharpen"), 422, "invalid_field", "imageProcessing"),
    (runway_avatar(color="blue"), 422, "invalid_field", "color"),
    ({**runway_avatar(), "image": png_b64()}, 422, "invalid_field", "image"),
])
def test_avatar_refusals(client: TestClient, payload: dict[str, Any], status: int, code: str, field: str) -> None:
    payload = {k: v for k, v in payload.items() if v is not None}
    assert error_of(client.post("/v1/avatars", json=payload)) == (status, code, field)
    assert client.get("/v1/avatars").json()["data"] == []


class Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # http.server's name
        if self.path == "/faces/a.png":
            raw = png_bytes(level=90)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
        elif self.path == "/faces/moved.png":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/latest/meta-data")
            self.end_headers()
        else:
            self.send_error(404)

    def log_message(self, *args: Any) -> None:
        pass


def test_an_image_url_is_fetched_only_under_an_allowed_prefix_and_never_redirected(sched: MemoryScheduler) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with make(sched, avatar_image_url_prefixes=(f"{base}/faces/",)) as client:
            ok = client.post("/v1/avatars", json=runway_avatar(referenceImage=f"{base}/faces/a.png")).json()
            assert settle(client, ok["id"])["status"] == "READY"
            resp = client.post("/v1/realtime_sessions", json=body(avatar={"type": "custom", "avatarId": ok["id"]}))
            assert int(sched.specs[resp.json()["id"]].image.mean()) == 90
            for path, reason in (("missing.png", "HTTP 404"), ("moved.png", "HTTP 302")):
                made = client.post("/v1/avatars", json=runway_avatar(referenceImage=f"{base}/faces/{path}")).json()
                failed = settle(client, made["id"])
                assert failed["status"] == "FAILED" and reason in failed["failureReason"], failed
            outside = client.post("/v1/avatars", json=runway_avatar(referenceImage=f"{base}/private/a.png"))
            assert error_of(outside) == (422, "invalid_field", "referenceImage")
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(ValueError, match="must be scheme://host"):
        ApiConfig(avatar_image_url_prefixes=("https://cdn.example.com",))


def test_avatars_and_sessions_are_the_keys_own(sched: MemoryScheduler) -> None:
    keys = ApiKeys.parse("a:" + "a" * 20 + ",b:" + "b" * 20 + ",ops@operator:" + "o" * 20)
    a, b, ops = ({"Authorization": "Bearer " + c * 20} for c in "abo")
    with make(sched, keys) as client:
        mine = client.post("/v1/avatars", json=runway_avatar(), headers=a).json()["id"]
        settle(client, mine, a)
        assert error_of(client.get(f"/v1/avatars/{mine}", headers=b)) == (404, "avatar_not_found", "id")
        assert error_of(client.patch(f"/v1/avatars/{mine}", json={"name": "x"}, headers=b)) == (
            404, "avatar_not_found", "id")
        assert error_of(client.delete(f"/v1/avatars/{mine}", headers=b)) == (404, "avatar_not_found", "id")
        assert client.get("/v1/avatars", headers=b).json()["data"] == []
        assert [x["id"] for x in client.get("/v1/avatars", headers=ops).json()["data"]] == [mine]
        theirs = client.post("/v1/realtime_sessions", headers=b,
                             json=body(avatar={"type": "custom", "avatarId": mine}))
        assert error_of(theirs) == (422, "avatar_not_found", "avatar.avatarId")
        sid = client.post("/v1/realtime_sessions", headers=a, json=body(avatar={"type": "custom",
                                                                                "avatarId": mine})).json()["id"]
        assert sched.specs[sid].api_key_id == "a"
        assert error_of(client.get(f"/v1/realtime_sessions/{sid}", headers=b)) == (404, "session_not_found", "id")
        assert error_of(client.delete(f"/v1/realtime_sessions/{sid}", headers=b)) == (404, "session_not_found", "id")
        assert client.get(f"/v1/realtime_sessions/{sid}", headers=ops).status_code == 200
        assert sched.infos[sid].status is SessionStatus.QUEUED  # b's DELETE ended nothing


# ------------------------------------------------------------------------------------------ native output


def native(output: dict[str, Any]) -> dict[str, Any]:
    return {"avatar": {"image": png_b64()}, "output": output}


def test_native_livekit_output_becomes_a_livekit_output_spec(client: TestClient, sched: MemoryScheduler) -> None:
    resp = client.post("/v1/sessions", json=native({"kind": "livekit", "url": "ws://127.0.0.1:7880",
                                                    "roomName": "demo", "apiKey": "key", "apiSecret": "s3cret",
                                                    "agentIdentity": "agent-1"}))
    assert resp.status_code == 201
    out = sched.specs[resp.json()["id"]].output
    assert isinstance(out, LiveKitOutput)
    assert (out.url, out.room_name, out.api_key, out.api_secret, out.identity, out.agent_identity) == (
        "ws://127.0.0.1:7880", "demo", "key", "s3cret", "character", "agent-1")
    resp = client.post("/v1/sessions", json=native({"kind": "livekit", "url": "wss://x", "roomName": "d",
                                                    "token": JWT}))
    assert sched.specs[resp.json()["id"]].output.token == JWT  # type: ignore[attr-defined]


@pytest.mark.parametrize(("output", "field"), [
    ({"kind": "livekit", "url": "wss://x", "token": JWT}, "output"),  # no roomName
    ({"kind": "livekit", "url": "wss://x", "roomName": "r"}, "output"),  # no credentials
    ({"kind": "livekit", "url": "wss://x", "roomName": "r", "token": JWT, "apiKey": "k", "apiSecret": "s"},
     "output"),
    ({"kind": "livekit", "url": "wss://x", "roomName": "r", "token": "opaque"}, "output"),
    ({"kind": "livekit", "url": "x", "roomName": "r", "token": JWT}, "output"),
    ({"kind": "null", "roomName": "r"}, "output"),
    ({"kind": "file", "url": "wss://x"}, "output"),
    ({"kind": "livekit", "url": "wss://x", "roomName": "r", "token": JWT, "port": 1}, "output.port"),
])
def test_native_livekit_output_refusals(client: TestClient, output: dict[str, Any], field: str) -> None:
    assert error_of(client.post("/v1/sessions", json=native(output))) == (422, "invalid_field", field)


def test_the_avatar_store_drops_a_stale_processing_result_and_times_processing_out() -> None:
    from deployments.api.avatars import PROCESSING_TIMEOUT_S, Avatar, AvatarStore

    store = AvatarStore(max_avatars=1)
    a = store.add(Avatar(id="", owner="k", name="n", personality="", voice=None, start_script=None, document_ids=(),
                         image_processing="optimize", created_at=0.0, updated_at=0.0))
    assert a is not None and store.add(a) is None  # full: refused, nothing evicted
    again = store.update(a.id, {}, 1.0, new_image=True)  # the reference changed while version 0 was processing
    assert again is not None and again.version == 1
    image = np.zeros((4, 4, 3), np.uint8)
    assert store.finish(a.id, 0, image, None, 2.0) is None and store.image(a.id) is None  # the stale result
    done = store.finish(a.id, 1, image, None, 3.0)
    assert done is not None and done.status == "READY" and not store.image(a.id).flags.writeable  # type: ignore[union-attr]
    stuck = store.update(a.id, {}, 10.0, new_image=True)
    assert stuck is not None and stuck.settled(10.0 + PROCESSING_TIMEOUT_S).status == "PROCESSING"
    late = stuck.settled(10.0 + PROCESSING_TIMEOUT_S + 1)
    assert late.status == "FAILED" and "did not finish" in (late.failure_reason or "")
