"""Schema fuzzing of the HTTP API: every operation in /openapi.json (the native and the Runway-compatible
routes), driven by schemathesis from the document the app serves, with valid and invalid (negative) data.

The app is `deployments.api.http.build_http_app` with API keys on, in process, over the in-memory scheduler
of the validation tests (the thing under test is the API's validation, not the scheduler). Each case
must: answer below 500, conform to the document (status codes, content types, bodies, headers), give
every error the one JSON shape with a code and a message, answer within a few seconds, and leave the
scheduler with a new session exactly when it answered 201 with that session's id (no lost session,
no session made by a refused request).

`avatar.image` / `image` are `format: byte` (base64) in the document; here that format draws real image
files and the ways they go wrong: PNG, JPEG, WebP, GIF of 1..700 px (some over the pixel and byte
limits, some over the body limit), truncated at any byte, headers claiming up to 200000 x 200000 pixels
(decompression bombs), other file types and random bytes; sent as plain base64, data URLs (good and
malformed), or wrapped in lines.
"""

from __future__ import annotations

import base64
import io
import time
from typing import Any

import numpy as np
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from memory_scheduler import MemoryScheduler
from PIL import Image
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance
from test_api_validation import LIMITS, png_header

from deployments.api.auth import ApiKeys
from deployments.api.frontend import SessionFrontend
from deployments.api.http import build_http_app
from deployments.api.watch import WatchSettings

KEY = "fuzz-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = 25  # per operation; ~15 operations
CALL_LIMIT_S = 5.0
CREATES = {("POST", "/v1/sessions"), ("POST", "/v1/realtime_sessions")}



def encode(width: int, height: int, mode: str, fmt: str, noise: bool) -> bytes:
    rng = np.random.default_rng(width * 1000 + height)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8) if noise else np.full((height, width, 3), 180,
                                                                                            np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buf, fmt)
    return buf.getvalue()


def image_files() -> st.SearchStrategy[bytes]:
    valid = st.builds(encode, st.integers(1, 700), st.integers(1, 700), st.sampled_from(["RGB", "L"]),
                      st.sampled_from(["PNG", "JPEG", "WEBP", "GIF"]), st.booleans())
    small = st.builds(encode, st.integers(16, 120), st.integers(16, 120), st.sampled_from(["RGB", "L"]),
                      st.sampled_from(["PNG", "JPEG"]), st.just(False))
    truncated = valid.flatmap(lambda raw: st.integers(0, max(0, len(raw) - 1)).map(lambda n: raw[:n]))
    bombs = st.builds(png_header, st.integers(1, 200_000), st.integers(1, 200_000))
    others = st.sampled_from([b"RIFF\x24\x00\x00\x00WAVEfmt ", b"%PDF-1.7\n", b"<svg xmlns='http://www.w3.org/2000/svg'/>",
                              b"GIF89a", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff"])
    return st.one_of(small, valid, truncated, bombs, others, st.binary(max_size=512))


def base64_texts(raw: bytes) -> st.SearchStrategy[str]:
    text = base64.b64encode(raw).decode()
    return st.sampled_from([text, "data:image/png;base64," + text, "data:image/png," + text, text + "=",
                            "\n".join(text[i:i + 76] for i in range(0, len(text), 76))])


schemathesis.openapi.format("byte", image_files().flatmap(base64_texts))
scheduler = MemoryScheduler()
LIVEKIT = WatchSettings(url="ws://127.0.0.1:1", public_url="ws://127.0.0.1:1", api_key="fuzzkey",
                        api_secret="a-fuzz-secret-of-32-characters-or-more")  # rooms of Runway sessions (no connection)
app = build_http_app(SessionFrontend(scheduler, LIMITS), ApiKeys.from_keys([("fuzz", KEY)]), LIVEKIT)
schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTH)


def check_error_shape(response: Any) -> None:
    if response.status_code < 400:
        return
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"code", "message", "field"}, err
    assert isinstance(err["code"], str) and err["code"], err
    assert isinstance(err["message"], str) and len(err["message"]) >= 8, err
    assert err["field"] is None or isinstance(err["field"], str), err


def test_schema_covers_native_and_runway_routes() -> None:
    ops = {(op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations()}
    assert ops == {
        ("POST", "/v1/sessions"), ("GET", "/v1/sessions"), ("GET", "/v1/sessions/{session_id}"),
        ("DELETE", "/v1/sessions/{session_id}"), ("GET", "/v1/capacity"), ("GET", "/healthz"),
        ("POST", "/v1/realtime_sessions"), ("GET", "/v1/realtime_sessions/{session_id}"),
        ("DELETE", "/v1/realtime_sessions/{session_id}"), ("POST", "/v1/realtime_sessions/{session_id}/consume"),
        ("POST", "/v1/avatars"), ("GET", "/v1/avatars"), ("GET", "/v1/avatars/{avatar_id}"),
        ("PATCH", "/v1/avatars/{avatar_id}"), ("DELETE", "/v1/avatars/{avatar_id}"),
    }


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_api_fuzz(case: Any) -> None:
    before = set(scheduler.specs)
    t0 = time.monotonic()
    response = case.call(headers=AUTH)
    took = time.monotonic() - t0
    # positive_data_acceptance is off: the document cannot say "base64 of a decodable image" or the
    # cross-field rules of `output`, so schema-valid bodies are mostly (rightly) refused with 4xx.
    excluded = [positive_data_acceptance] + ([negative_data_rejection] if response.status_code == 413 else [])
    case.validate_response(response, headers=AUTH, excluded_checks=excluded)  # 413 refuses too (size limits)
    check_error_shape(response)
    assert took < CALL_LIMIT_S, f"{case.method} {case.path} took {took:.1f} s"
    made = set(scheduler.specs) - before
    if response.status_code in (200, 201) and (case.method.upper(), case.path) in CREATES:
        assert made == {response.json()["id"]}, (made, response.text)
    else:
        assert not made, (case.method, case.path, response.status_code, made)


# --------------------------------------------------------------------------- what a schema fuzzer never sends

RAW_BODIES: list[tuple[str, bytes, str, int, str, str | None]] = [
    ("nested 100000 deep", b"[" * 30000 + b"]" * 30000, "application/json", 400, "invalid_json", None),
    ("a 5000-digit number", b'{"avatar": {"image": "AAAA"}, "seed": 1' + b"0" * 5000 + b"}", "application/json", 400,
     "invalid_json", None),
    ("not UTF-8", b'\xff\xfe{"avatar": 1}', "application/json", 400, "invalid_json", None),
    ("empty field name", b'{"": 1, "avatar": {"image": "AAAA"}}', "application/json", 422, "invalid_field", "''"),
    ("form body", b"avatar=x", "application/x-www-form-urlencoded", 422, "invalid_field", None),
    ("NaN seed", b'{"avatar": {"image": "AAAA"}, "seed": NaN}', "application/json", 422, "invalid_field", "seed"),
    ("Infinity maxDuration", b'{"avatar": {"image": "AAAA"}, "maxDuration": Infinity}', "application/json", 422,
     "invalid_field", "maxDuration"),
]


def test_unparseable_and_odd_bodies() -> None:
    from starlette.testclient import TestClient

    from deployments.api.requests import ApiConfig

    local = MemoryScheduler()
    with TestClient(build_http_app(SessionFrontend(local, ApiConfig(max_body_bytes=128 * 1024)))) as client:
        for name, raw, ctype, status, code, field in RAW_BODIES:
            for path in ("/v1/sessions", "/v1/realtime_sessions", "/v1/avatars"):
                resp = client.post(path, content=raw, headers={"content-type": ctype})
                check_error_shape(resp)
                got = (resp.status_code, resp.json()["error"]["code"])
                assert got == (status, code), (name, path, resp.text)
                if path == "/v1/sessions":
                    assert resp.json()["error"]["field"] == field, (name, resp.text)
        long_name = "k" * 5000
        resp = client.post("/v1/sessions", json={long_name: 1, "avatar": {"image": "AAAA"}})
        assert resp.json()["error"]["field"] == "k" * 64 + "..." and len(resp.text) < 1000
    assert not local.specs
