"""The HTTP API without Ray: validation, limits, error shapes, scheduler refusals, OpenAPI, CORS.

The FastAPI app from `deployments.api.http.build_http_app` runs in-process (Starlette's TestClient) over an
in-memory scheduler with the real interface.
"""

from __future__ import annotations

import base64
import io
import struct
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from memory_scheduler import MemoryScheduler
from PIL import Image
from starlette.testclient import TestClient

from deployments.api.errors import ApiError
from deployments.api.frontend import SessionFrontend
from deployments.api.http import build_http_app
from deployments.api.requests import ApiConfig, load_avatar
from deployments.api.schemas import SessionOut
from deployments.types import (
    NoCapacity,
    OutputSpec,
    SessionInfo,
    SessionStatus,
)

LIMITS = ApiConfig(max_body_bytes=64 * 1024, max_image_bytes=30 * 1024, max_image_pixels=600 * 600,
                   max_duration_s=600)


@pytest.fixture()
def sched() -> MemoryScheduler:
    return MemoryScheduler()


@pytest.fixture()
def client(sched: MemoryScheduler) -> Iterator[TestClient]:
    with TestClient(build_http_app(SessionFrontend(sched, LIMITS)), raise_server_exceptions=False) as c:
        yield c


def png(width: int = 64, height: int = 48, mode: str = "RGB", fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (width, height), 200 if mode in ("L", "P") else (200, 200, 200, 255)[:len(mode)]).save(buf, fmt)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def body(**over: Any) -> dict[str, Any]:
    return {"avatar": {"image": b64(png())}, **over}


def png_header(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def error_of(resp: Any) -> tuple[int, str, str | None]:
    data = resp.json()
    assert set(data) == {"error"} and set(data["error"]) == {"code", "message", "field"}, data
    return resp.status_code, data["error"]["code"], data["error"]["field"]


# ----------------------------------------------------------------------------------------- happy path


def test_create_passes_a_validated_spec(client: TestClient, sched: MemoryScheduler) -> None:
    resp = client.post("/v1/sessions", json=body(maxDuration=42, seed=9, preset="tiny"),
                       headers={"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"})
    assert resp.status_code == 201, resp.text
    out = resp.json()
    assert resp.headers["location"] == f"/v1/sessions/{out['id']}"
    spec = sched.specs[out["id"]]
    assert spec.image.shape == (176, 272, 3) and spec.image.dtype == np.uint8
    assert int(spec.image.mean()) == 200  # the grey image, resized to the preset's resolution
    assert (spec.preset, spec.max_duration_s, spec.seed, spec.output, spec.api_key_id) == (
        "tiny", 42.0, 9, OutputSpec(), None)
    assert spec.trace_context == {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}
    assert out["status"] == "STARTING" and out["createdAt"] > 0 and out["stats"]["lateChunks"] == 0


@pytest.mark.parametrize("encode", [
    lambda d: "data:image/png;base64," + b64(d),
    lambda d: "\n".join(b64(d)[i:i + 76] for i in range(0, len(b64(d)), 76)),  # MIME line breaks
], ids=["data-url", "wrapped"])
def test_image_encodings_accepted(client: TestClient, encode: Any) -> None:
    assert client.post("/v1/sessions", json={"avatar": {"image": encode(png())}}).status_code == 201


@pytest.mark.parametrize(("mode", "fmt"), [("L", "JPEG"), ("RGBA", "PNG"), ("P", "GIF"), ("RGB", "WEBP")])
def test_image_formats_accepted(client: TestClient, mode: str, fmt: str) -> None:
    assert client.post("/v1/sessions", json={"avatar": {"image": b64(png(40, 40, mode, fmt))}}).status_code == 201


def test_get_list_delete_capacity_health(client: TestClient) -> None:
    sid = client.post("/v1/sessions", json=body()).json()["id"]
    assert client.get(f"/v1/sessions/{sid}").json()["id"] == sid
    assert [s["id"] for s in client.get("/v1/sessions").json()["sessions"]] == [sid]
    assert client.get("/v1/capacity").json() == {
        "bundlesTotal": 2, "bundlesFree": 1, "sessionsRunning": 1, "queued": 0, "warmSlotsFree": 0}
    ended = client.delete(f"/v1/sessions/{sid}")
    assert ended.status_code == 200 and ended.json()["status"] == "ENDED" and ended.json()["reason"] == "deleted"
    assert client.get("/healthz").json() == {"status": "ok"}


# ------------------------------------------------------------------------------------------- refusals

REFUSALS: list[tuple[str, Any, int, str, str | None]] = [
    ("bad data url", {"avatar": {"image": "data:image/png," + b64(png())}}, 422, "invalid_image", "avatar.image"),
    ("urlsafe base64 chars", {"avatar": {"image": "ab-_"}}, 422, "invalid_image", "avatar.image"),
    ("empty image", {"avatar": {"image": ""}}, 422, "invalid_image", "avatar.image"),
    ("base64 too long", {"avatar": {"image": "A" * 45000}}, 413, "image_too_large", "avatar.image"),
    ("pixels over limit", {"avatar": {"image": b64(png(700, 600))}}, 413, "image_too_large", "avatar.image"),
    ("decompression bomb", {"avatar": {"image": b64(png_header(200_000, 200_000))}}, 413, "image_too_large",
     "avatar.image"),
    ("smaller than 16 px", {"avatar": {"image": b64(png(15, 40))}}, 422, "invalid_image", "avatar.image"),
    ("NaN maxDuration", None, 422, "invalid_field", "maxDuration"),
    ("zero maxDuration", body(maxDuration=0), 422, "invalid_field", "maxDuration"),
    ("maxDuration over cap", body(maxDuration=600.5), 422, "invalid_field", "maxDuration"),
    ("maxDuration string", body(maxDuration="300"), 422, "invalid_field", "maxDuration"),
    ("seed bool", body(seed=True), 422, "invalid_field", "seed"),
    ("seed negative", body(seed=-1), 422, "invalid_field", "seed"),
    ("seed too big", body(seed=2**63), 422, "invalid_field", "seed"),
    ("preset wrong type", body(preset=3), 422, "invalid_field", "preset"),
    ("preset unknown", body(preset="huge"), 422, "invalid_field", "preset"),
    ("preset not served", body(preset="wan-1.3b"), 422, "invalid_field", "preset"),
    ("snake_case field", body(max_duration=30), 422, "invalid_field", "max_duration"),
    ("nested unknown field", {"avatar": {"image": b64(png()), "type": "custom"}}, 422, "invalid_field",
     "avatar.type"),
    ("path without file", body(output={"kind": "null", "path": "a.mp4"}), 422, "invalid_field", "output"),
    ("absolute path", body(output={"kind": "file", "path": "/etc/a.mp4"}), 422, "invalid_field", "output.path"),
    ("dotdot path", body(output={"kind": "file", "path": "a/../../b.mp4"}), 422, "invalid_field", "output.path"),
    ("not mp4", body(output={"kind": "file", "path": "a.sh"}), 422, "invalid_field", "output.path"),
    ("string body", "hello", 422, "invalid_field", None),
]


@pytest.mark.parametrize(("payload", "status", "code", "field"), [r[1:] for r in REFUSALS],
                         ids=[r[0] for r in REFUSALS])
def test_create_refusals(client: TestClient, sched: MemoryScheduler, payload: Any, status: int, code: str,
                         field: str | None) -> None:
    if payload is None:  # Python's json accepts NaN, so FastAPI does too: the range check must refuse it
        resp = client.post("/v1/sessions", content=b'{"avatar": {"image": "%s"}, "maxDuration": NaN}'
                           % b64(png()).encode(), headers={"content-type": "application/json"})
    else:
        resp = client.post("/v1/sessions", json=payload)
    assert error_of(resp) == (status, code, field), resp.text
    assert not sched.specs  # nothing reached the scheduler


def test_file_output_passes_relative_path_or_is_disabled(sched: MemoryScheduler) -> None:
    with TestClient(build_http_app(SessionFrontend(sched, LIMITS))) as c:
        sid = c.post("/v1/sessions", json=body(output={"kind": "file", "path": "demo/a.mp4"})).json()["id"]
        assert sched.specs[sid].output == OutputSpec(kind="file", path="demo/a.mp4")
        sid = c.post("/v1/sessions", json=body(output={"kind": "file"})).json()["id"]
        assert sched.specs[sid].output == OutputSpec(kind="file", path=None)  # the scheduler names it <id>.mp4
    with TestClient(build_http_app(SessionFrontend(sched, ApiConfig(file_output=False)))) as c:
        resp = c.post("/v1/sessions", json=body(output={"kind": "file", "path": "a.mp4"}))
        assert error_of(resp) == (422, "invalid_field", "output.kind")


def test_decoded_bytes_limit_and_messages() -> None:
    with pytest.raises(ApiError) as info:
        load_avatar(b"\0" * (LIMITS.max_image_bytes + 1), "tiny", LIMITS)
    assert (info.value.status, info.value.code, info.value.field) == (413, "image_too_large", "avatar.image")
    assert f"{LIMITS.max_image_bytes + 1} bytes, over the limit of {LIMITS.max_image_bytes}" in info.value.message
    with pytest.raises(ApiError) as info:
        load_avatar(png()[:80], "tiny", LIMITS)
    assert info.value.code == "invalid_image" and "truncated" in info.value.message
    assert "BytesIO" not in info.value.message


def test_scheduler_refusals_map_to_http(client: TestClient, sched: MemoryScheduler) -> None:
    sched.refuse = NoCapacity("API key has 2 live sessions, the limit is 2", 4.2, code="quota_exceeded")
    resp = client.post("/v1/sessions", json=body())
    assert error_of(resp) == (429, "quota_exceeded", None) and resp.headers["retry-after"] == "5"
    sched.refuse = ApiError(503, "scheduler_unavailable", "down", retry_after_s=5)
    resp = client.post("/v1/sessions", json=body())
    assert error_of(resp) == (503, "scheduler_unavailable", None) and resp.headers["retry-after"] == "5"
    sched.refuse = RuntimeError("secret internals")
    resp = client.post("/v1/sessions", json=body())
    assert error_of(resp) == (500, "internal", None) and "secret" not in resp.text
    assert error_of(client.get("/v1/sessions/unknown")) == (404, "session_not_found", "id")
    assert error_of(client.delete("/v1/sessions/" + "x" * 500)) == (404, "session_not_found", "id")


def test_protocol_errors_have_the_error_shape(client: TestClient) -> None:
    assert error_of(client.get("/nope")) == (404, "not_found", None)
    resp = client.patch("/v1/sessions/abc")
    assert error_of(resp) == (405, "method_not_allowed", None) and resp.headers["allow"] == "DELETE, GET"
    assert error_of(client.post("/v1/sessions", content=b"{bad", headers={"content-type": "application/json"})) == (
        400, "invalid_json", None)
    assert error_of(client.post("/v1/sessions", content=b"")) == (422, "invalid_field", None)
    too_big = b"x" * (LIMITS.max_body_bytes + 1)
    assert error_of(client.post("/v1/sessions", content=too_big)) == (413, "body_too_large", None)
    streamed = client.post("/v1/sessions", content=iter([b"x" * 20000] * 4))  # chunked: no Content-Length
    assert error_of(streamed) == (413, "body_too_large", None)


@pytest.mark.parametrize(("path", "query", "field"), [
    ("/v1/sessions", "limit=3", "limit"),  # takes none
    ("/v1/capacity", "x=1", "x"),
    ("/v1/sessions", "=null", "''"),  # an empty name
    ("/v1/avatars", "cursor=&=null", "''"),  # beside one it takes (schemathesis found this one accepted)
    ("/v1/avatars", "limt=3", "limt"),  # a misspelt one is an error, not a silent default
    ("/v1/realtime_sessions/abc", "verbose=1", "verbose"),
    ("/v1/sessions", "k" * 100 + "=1", "k" * 64 + "..."),
])
def test_unknown_query_parameters_are_refused_naming_them(client: TestClient, path: str, query: str,
                                                          field: str) -> None:
    """As a body's unknown field is: 422, the parameter named (cut like any client-given name), what the route takes
    listed; the routes' own parameters still work."""
    resp = client.get(f"{path}?{query}")
    assert error_of(resp) == (422, "invalid_field", field), resp.text
    assert "is not a query parameter of this route" in resp.json()["error"]["message"]
    assert client.get("/v1/avatars?limit=2&cursor=").status_code == 200
    assert client.get("/v1/sessions?").status_code == 200


def test_openapi_documents_routes_errors_and_limits(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    assert set(doc["paths"]) == {"/v1/sessions", "/v1/sessions/{session_id}", "/v1/capacity", "/healthz",
                                 "/v1/realtime_sessions", "/v1/realtime_sessions/{session_id}",
                                 "/v1/realtime_sessions/{session_id}/consume", "/v1/avatars", "/v1/avatars/{avatar_id}"}
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    assert set(doc["components"]["schemas"]["ErrorDetail"]["properties"]) == {"code", "message", "field"}
    for path, method in (("/v1/sessions/{session_id}", "delete"), ("/v1/capacity", "get")):
        assert doc["paths"][path][method]["responses"]["401"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorBody"}
    assert f"request body <= {LIMITS.max_body_bytes} bytes" in doc["info"]["description"]
    assert client.get("/docs").status_code == 200


def test_cors_is_off_by_default_and_on_when_configured(sched: MemoryScheduler) -> None:
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    with TestClient(build_http_app(SessionFrontend(sched, LIMITS))) as c:
        resp = c.options("/v1/sessions", headers=preflight)
        assert resp.status_code == 405 and "access-control-allow-origin" not in resp.headers
        assert "access-control-allow-origin" not in c.get("/healthz", headers={"Origin": "https://app.example"}).headers
    cfg = LIMITS.model_copy(update={"cors_origins": ("https://app.example",)})
    with TestClient(build_http_app(SessionFrontend(sched, cfg))) as c:
        resp = c.options("/v1/sessions", headers=preflight)
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "https://app.example"


def test_session_out_is_camel_case() -> None:
    info = SessionInfo("s1", SessionStatus.RUNNING, "tiny", started_at=2.0, queue_position=None, warm_start=True)
    info.stats.step_ms_p95 = 12.5
    out = SessionOut.of(info).model_dump(by_alias=True)
    assert out["startedAt"] == 2.0 and out["warmStart"] is True and out["stats"]["stepMsP95"] == 12.5
    assert out["status"] == SessionStatus.RUNNING


def test_api_config_refuses_unknown_presets() -> None:
    with pytest.raises(ValueError, match=r"api\.presets"):
        ApiConfig(presets=("nope",))
