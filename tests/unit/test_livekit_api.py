"""The Runway-compatible routes, the avatar registry and the native `output.kind = "livekit"`, over the real
FastAPI app in-process (no Ray, no LiveKit server)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from memory_scheduler import MemoryScheduler
from PIL import Image
from starlette.testclient import TestClient

from characters.config import MODEL_PRESETS
from deployments.api.auth import ApiKeys
from deployments.api.frontend import SessionFrontend
from deployments.api.http import build_http_app
from deployments.api.requests import ApiConfig
from deployments.api.runway import RUNWAY_VERSION, preset_face, runway_status
from deployments.livekit import LiveKitOutput
from deployments.types import SessionInfo, SessionStatus

GEN = MODEL_PRESETS["tiny"].generation
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhdmF0YXIifQ.c2lnbmF0dXJl"
HEADERS = {"X-Runway-Version": RUNWAY_VERSION, "Authorization": "Bearer runway-secret-0123456789"}


@pytest.fixture()
def sched() -> MemoryScheduler:
    return MemoryScheduler(created=SessionStatus.QUEUED)


@pytest.fixture()
def client(sched: MemoryScheduler) -> Iterator[TestClient]:
    app = build_http_app(SessionFrontend(sched, ApiConfig(max_duration_s=600)))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def body(**over: Any) -> dict[str, Any]:
    """Exactly what livekit-plugins-runway 1.8.9 posts (see deployments/api/runway.py)."""
    b: dict[str, Any] = {"model": "gwm1_avatars", "avatar": {"type": "runway-preset", "presetId": "sample-face"},
                         "livekit": {"url": "wss://lk.example", "token": JWT, "roomName": "room-1",
                                     "agentIdentity": "agent-1"}}
    b.update(over)
    return b


def png_b64(w: int = 64, h: int = 48) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.full((h, w, 3), 120, np.uint8)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def error_of(resp: Any) -> tuple[int, str, str | None]:
    err = resp.json()["error"]
    return resp.status_code, err["code"], err["field"]


def test_create_with_a_preset_face_answers_an_id_and_passes_the_room(client: TestClient,
                                                                     sched: MemoryScheduler) -> None:
    resp = client.post("/v1/realtime_sessions", json=body(maxDuration=120), headers=HEADERS)
    assert resp.status_code == 200
    out = resp.json()
    assert isinstance(out["id"], str) and out["status"] == "PENDING" and out["createdAt"].endswith("Z")
    spec = sched.specs[out["id"]]
    assert spec.preset == "tiny" and spec.max_duration_s == 120.0
    assert spec.output == LiveKitOutput(url="wss://lk.example", room_name="room-1", token=JWT,
                                        identity="runway-avatar-agent", agent_identity="agent-1")
    assert spec.image.shape == (GEN.height, GEN.width, 3)
    assert np.array_equal(spec.image, preset_face("sample-face", GEN.height, GEN.width))


def test_default_max_duration_unknown_fields_ignored_version_optional(client: TestClient,
                                                                     sched: MemoryScheduler) -> None:
    resp = client.post("/v1/realtime_sessions", json=body(futureField={"x": 1}))
    assert resp.status_code == 200
    assert sched.specs[resp.json()["id"]].max_duration_s == 300.0


def test_custom_avatar_registered_then_used_then_deleted(client: TestClient, sched: MemoryScheduler) -> None:
    reg = client.post("/v1/avatars", json={"image": "data:image/png;base64," + png_b64(), "name": "Ann"})
    assert reg.status_code == 201
    avatar = reg.json()
    assert (avatar["name"], avatar["width"], avatar["height"]) == ("Ann", GEN.width, GEN.height)
    assert reg.headers["location"] == f"/v1/avatars/{avatar['id']}"
    assert client.get(f"/v1/avatars/{avatar['id']}").json() == avatar
    resp = client.post("/v1/realtime_sessions", json=body(avatar={"type": "custom", "avatarId": avatar["id"]}))
    spec = sched.specs[resp.json()["id"]]
    assert spec.image.shape == (GEN.height, GEN.width, 3) and int(spec.image.mean()) == 120
    assert client.delete(f"/v1/avatars/{avatar['id']}").status_code == 204
    assert error_of(client.get(f"/v1/avatars/{avatar['id']}")) == (404, "avatar_not_found", "id")
    gone = client.post("/v1/realtime_sessions", json=body(avatar={"type": "custom", "avatarId": avatar["id"]}))
    assert error_of(gone) == (422, "avatar_not_found", "avatar.avatarId")


@pytest.mark.parametrize(("payload", "headers", "status", "code", "field"), [
    (body(model="gen4_turbo"), {}, 422, "invalid_field", "model"),
    (body(), {"X-Runway-Version": "2023-01-01"}, 422, "invalid_field", "X-Runway-Version"),
    (body(avatar={"type": "stock", "id": "x"}), {}, 422, "invalid_field", "avatar"),
    (body(avatar={"type": "custom"}), {}, 422, "invalid_field", "avatar.custom.avatarId"),
    (body(avatar={"type": "runway-preset", "presetId": "influencer"}), {}, 422, "invalid_field", "avatar.presetId"),
    ({k: v for k, v in body().items() if k != "livekit"}, {}, 422, "invalid_field", "livekit"),
    (body(livekit={"url": "lk.example", "token": JWT, "roomName": "r"}), {}, 422, "invalid_field", "livekit.url"),
    (body(livekit={"url": "wss://lk.example", "token": "opaque", "roomName": "r"}), {}, 422, "invalid_field",
     "livekit.token"),
    (body(maxDuration=601), {}, 422, "invalid_field", "maxDuration"),
    (body(maxDuration=0), {}, 422, "invalid_field", "maxDuration"),
])
def test_create_refusals_have_the_error_shape(client: TestClient, payload: dict[str, Any], headers: dict[str, str],
                                              status: int, code: str, field: str) -> None:
    assert error_of(client.post("/v1/realtime_sessions", json=payload, headers=headers)) == (status, code, field)


def test_get_and_delete_map_statuses(client: TestClient, sched: MemoryScheduler) -> None:
    sid = client.post("/v1/realtime_sessions", json=body()).json()["id"]
    sched.infos[sid].status = SessionStatus.RUNNING
    sched.infos[sid].started_at = 1.7e9
    got = client.get(f"/v1/realtime_sessions/{sid}").json()
    assert got["status"] == "RUNNING" and got["startedAt"] == "2023-11-14T22:13:20Z"
    resp = client.delete(f"/v1/realtime_sessions/{sid}")
    assert resp.status_code == 204 and resp.content == b""
    assert client.get(f"/v1/realtime_sessions/{sid}").json()["status"] == "CANCELLED"
    assert client.delete(f"/v1/realtime_sessions/{sid}").status_code == 204  # idempotent
    assert error_of(client.get("/v1/realtime_sessions/nope")) == (404, "session_not_found", "id")


def test_runway_status_mapping() -> None:
    def info(status: SessionStatus, reason: str | None = None) -> SessionInfo:
        return SessionInfo("s", status, "tiny", reason=reason)

    assert [runway_status(info(s)) for s in (SessionStatus.QUEUED, SessionStatus.STARTING, SessionStatus.READY,
                                             SessionStatus.RUNNING)] == ["PENDING", "PENDING", "READY", "RUNNING"]
    assert runway_status(info(SessionStatus.ENDED, "deleted")) == "CANCELLED"
    assert runway_status(info(SessionStatus.ENDED, "end_call")) == "COMPLETED"
    assert runway_status(info(SessionStatus.FAILED, "actor_died")) == "FAILED"


def test_runway_routes_need_the_api_key_when_keys_are_on(sched: MemoryScheduler) -> None:
    keys = ApiKeys.from_keys([("runway", "runway-secret-0123456789")])
    with TestClient(build_http_app(SessionFrontend(sched, ApiConfig()), keys)) as c:
        assert error_of(c.post("/v1/realtime_sessions", json=body()))[:2] == (401, "missing_api_key")
        assert c.post("/v1/realtime_sessions", json=body(), headers=HEADERS).status_code == 200
        spec = next(iter(sched.specs.values()))
        assert spec.api_key_id == "runway"
        assert error_of(c.post("/v1/avatars", json={"image": png_b64()}))[:2] == (401, "missing_api_key")


def test_avatar_refusals(client: TestClient) -> None:
    assert error_of(client.post("/v1/avatars", json={"image": "!!!"})) == (422, "invalid_image", "image")
    assert error_of(client.post("/v1/avatars", json={})) == (422, "invalid_field", "image")
    assert error_of(client.post("/v1/avatars", json={"image": base64.b64encode(b"text").decode()}))[1:] == (
        "invalid_image", "image")


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
