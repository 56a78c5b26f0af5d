"""API keys without Ray: parsing CHARACTERS_API_KEYS, hashing, constant-time checks, and the HTTP middleware."""

from __future__ import annotations

import base64
import hashlib
import io
from collections.abc import Iterator

import pytest
from PIL import Image
from starlette.testclient import TestClient

import deployments.api.auth as auth
from deployments.api.auth import API_KEYS_ENV, ApiKeys
from deployments.api.errors import ApiError
from deployments.api.frontend import SessionFrontend
from deployments.api.http import build_http_app
from deployments.api.requests import ApiConfig
from deployments.types import Capacity, SessionInfo, SessionSpec, SessionStatus

K1, K2 = "backend-key-0123456789", "ops-key-abcdefghijklmn"


def test_parse_ids_and_digests_only() -> None:
    keys = ApiKeys.parse(f" backend:{K1} , {K2} ,")
    bare_id = f"key-{hashlib.sha256(K2.encode()).hexdigest()[:8]}"
    assert keys.enabled and keys.ids == ("backend", bare_id)
    assert keys.entries[0] == ("backend", hashlib.sha256(K1.encode()).digest())
    assert K1 not in repr(keys) and K2 not in repr(keys)  # only digests are kept
    assert not ApiKeys.parse("").enabled and not ApiKeys.parse(" , ").enabled


@pytest.mark.parametrize(("spec", "message"), [
    ("a:short", "at least 16 characters"),
    ("a:has a space in the key!!", "at least 16 characters"),
    ("bad id!:" + K1, "key id 'bad id!'"),
    (f"a:{K1},a:{K2}", "appears twice"),
])
def test_parse_refusals_never_echo_the_key(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        ApiKeys.parse(spec)
    assert K1 not in str(info.value) and K2 not in str(info.value) and "short" not in str(info.value)


def test_roles_make_tenants_and_operators() -> None:
    keys = ApiKeys.parse(f"backend:{K1},ops@operator:{K2}")
    assert keys.ids == ("backend", "ops") and keys.operators == frozenset({"ops"})
    assert keys.caller(f"Bearer {K1}") == auth.Caller("backend", False)
    assert keys.caller(f"Bearer {K2}") == auth.Caller("ops", True)
    assert ApiKeys().caller(None) is auth.ANYONE
    tenant, operator = keys.caller(f"Bearer {K1}"), keys.caller(f"Bearer {K2}")
    assert tenant.owns("backend") and not tenant.owns("ops") and not tenant.owns(None)
    assert operator.owns("backend") and operator.owns(None) and auth.ANYONE.owns("anyone")
    with pytest.raises(ValueError, match="role 'admin' is unknown") as info:
        ApiKeys.parse(f"ops@admin:{K2}")
    assert K2 not in str(info.value)


def test_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEYS_ENV, f"backend:{K1}")
    assert ApiKeys.from_env().ids == ("backend",)
    monkeypatch.delenv(API_KEYS_ENV)
    assert not ApiKeys.from_env().enabled
    assert ApiKeys.from_env({API_KEYS_ENV: f"x:{K2}"}).ids == ("x",)


def test_authenticate() -> None:
    keys = ApiKeys.from_keys([("backend", K1), ("ops", K2)])
    assert keys.authenticate(f"Bearer {K1}") == "backend"
    assert keys.authenticate(f"bearer   {K2} ") == "ops"
    assert ApiKeys().authenticate(None) is None  # auth off
    for header, code in ((None, "missing_api_key"), ("", "missing_api_key"), (f"Basic {K1}", "missing_api_key"),
                         ("Bearer ", "missing_api_key"), ("Bearer wrong-key-0123456789", "invalid_api_key"),
                         (f"Bearer {K1}x", "invalid_api_key")):
        with pytest.raises(ApiError) as info:
            keys.authenticate(header)
        assert (info.value.status, info.value.code) == (401, code), header
        assert info.value.headers["WWW-Authenticate"] == "Bearer"
        assert K1 not in info.value.message


def test_every_digest_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return a == b

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    keys = ApiKeys.from_keys([("a", K1), ("b", K2), ("c", K1 + "z")])
    assert keys.key_id(K1) == "a"
    assert len(calls) == 3  # no early exit on the first match
    assert all(len(x) == len(y) == 32 for x, y in calls)  # digests, never the raw key


class Scheduler:
    def __init__(self) -> None:
        self.specs: list[SessionSpec] = []

    async def create_session(self, spec: SessionSpec) -> SessionInfo:
        self.specs.append(spec)
        return SessionInfo(spec.session_id, SessionStatus.QUEUED, spec.preset, queue_position=1)

    async def capacity(self) -> Capacity:
        return Capacity(1, 1, 0, 0)


@pytest.fixture()
def sched() -> Scheduler:
    return Scheduler()


@pytest.fixture()
def client(sched: Scheduler) -> Iterator[TestClient]:
    keys = ApiKeys.from_keys([("backend", K1)])
    cfg = ApiConfig(cors_origins=("https://app.example",))
    with TestClient(build_http_app(SessionFrontend(sched, cfg), keys)) as c:  # type: ignore[arg-type]
        yield c


def test_middleware_requires_a_key_everywhere_but_healthz(client: TestClient) -> None:
    assert client.get("/healthz").status_code == 200
    for path in ("/v1/capacity", "/v1/sessions", "/openapi.json", "/docs", "/not-a-route"):
        resp = client.get(path)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "missing_api_key", path
        assert resp.headers["www-authenticate"] == "Bearer"
    resp = client.get("/v1/capacity", headers={"Authorization": "Bearer not-the-key-0000000"})
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/capacity", headers={"Authorization": f"Bearer {K1}"}).status_code == 200
    # CORS preflights carry no credentials: answered before auth.
    pre = client.options("/v1/sessions", headers={"Origin": "https://app.example",
                                                  "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200


def test_key_id_not_key_reaches_the_scheduler(client: TestClient, sched: Scheduler) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32)).save(buf, "PNG")
    resp = client.post("/v1/sessions", json={"avatar": {"image": base64.b64encode(buf.getvalue()).decode()}},
                       headers={"Authorization": f"Bearer {K1}"})
    assert resp.status_code == 201 and resp.json()["queuePosition"] == 1
    assert sched.specs[0].api_key_id == "backend"
    assert K1 not in repr(sched.specs[0])
