"""LiveKit tokens and secrets never reach logs, spans or responses: real sessions over Ray + Serve + HTTP
publishing into a real LiveKit server, with telemetry exported to our own OTLP receiver.

Three sessions carry recognisable credentials: one native create with a LiveKit token, one through the
Runway-compatible route with another token, and one with an API key and a wrong, recognisable API secret
(the server refuses the minted token, so the session fails and its reason is returned). Afterwards every
HTTP response (bodies and headers), the driver's log records and output, every file under the Ray
session's log directory (each worker's stdout/stderr, the Serve replica's and the proxy's logs) and every
span attribute, event and resource value the receiver got are searched for the tokens (whole, their
claims and their signatures) and the secret. The search is shown to see the right material: the room
worker's log of the refused join (where the LiveKit SDK writes the token it sent, redacted by us), the
sessions' spans and the failed join's reason must be in it.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on 127.0.0.1 (before importing ray)

import base64
import json
import logging
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray import serve

from characters.media import SAMPLE_IMAGE
from deployments.api.app import APP_NAME, build_app
from deployments.livekit import LiveKitServer
from deployments.livekit.config import mint_token
from deployments.livekit.server import free_port
from deployments.sessions.cluster import init_local, stop_local
from deployments.telemetry.receiver import OtlpReceiver
from deployments.types import NAMESPACE, SCHEDULER_NAME

pytestmark = [pytest.mark.livekit, pytest.mark.ray]

KEY = "secrets-key-" + secrets.token_hex(16)
BAD_SECRET = "lk-NOT-the-server-secret-" + secrets.token_hex(12)
MODEL = {"dit": {"num_layers": 1}, "vae": {"num_res_blocks": 0}}
ENV = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_SERVICE_NAME": "secrets-test",
       "CHARACTERS_API_KEYS": f"sec:{KEY}"}


class Api:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.seen: list[str] = []  # every response, headers and body, as text

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode() if body is not None else None,
                                     method=method, headers={"Content-Type": "application/json",
                                                             "Authorization": f"Bearer {KEY}"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                status, headers, raw = resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as e:
            status, headers, raw = e.code, dict(e.headers), e.read()
        self.seen.append(f"{status} {headers} {raw.decode(errors='replace')}")
        return status, json.loads(raw) if raw else None

    def wait(self, sid: str, statuses: tuple[str, ...], timeout_s: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while (body := self.call("GET", f"/v1/sessions/{sid}")[1])["status"] not in statuses:
            assert time.monotonic() < deadline, body
            time.sleep(0.5)
        return body  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def cluster(livekit_server: LiveKitServer) -> Iterator[tuple[Api, OtlpReceiver, Path]]:
    saved = {k: os.environ.get(k) for k in [*ENV, "OTEL_EXPORTER_OTLP_ENDPOINT"]}
    with OtlpReceiver(http=False) as rx:
        os.environ.update(ENV, OTEL_EXPORTER_OTLP_ENDPOINT=rx.grpc_endpoint)  # inherited through the raylet
        init_local(num_cpus=4, num_gpus=2, configure_logging=False)
        try:
            logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
            serve.start(http_options={"host": "127.0.0.1", "port": (port := free_port())})
            serve.run(build_app({"service": {"topology": "gpu1", "queue_max": 0, "model_overrides": MODEL,
                                             "placement_timeout_s": 60.0}}), name=APP_NAME, route_prefix="/")
            yield Api(port), rx, logs
        finally:
            try:
                ray.get(ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE).shutdown.remote(), timeout=60)
            finally:
                serve.shutdown()
                stop_local()
                for k, v in saved.items():
                    os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def test_tokens_and_secrets_stay_out_of_logs_spans_and_responses(
        cluster: tuple[Api, OtlpReceiver, Path], livekit_server: LiveKitServer, caplog: pytest.LogCaptureFixture,
        capfd: pytest.CaptureFixture[str]) -> None:
    api, rx, logs = cluster
    caplog.set_level(logging.DEBUG)
    lk = livekit_server
    native_token = mint_token(lk.api_key, lk.api_secret, room="sec-native", identity="character")
    runway_token = mint_token(lk.api_key, lk.api_secret, room="sec-runway", identity="runway-avatar-agent")
    image = base64.b64encode(SAMPLE_IMAGE.read_bytes()).decode()

    status, native = api.call("POST", "/v1/sessions", {"avatar": {"image": image}, "maxDuration": 60, "output": {
        "kind": "livekit", "url": lk.url, "roomName": "sec-native", "token": native_token}})
    assert status == 201, native
    status, runway = api.call("POST", "/v1/realtime_sessions", {
        "model": "gwm1_avatars", "avatar": {"type": "runway-preset", "presetId": "sample-face"}, "maxDuration": 60,
        "livekit": {"url": lk.url, "token": runway_token, "roomName": "sec-runway"}})
    assert status == 200, runway
    for sid in (native["id"], runway["id"]):
        api.wait(sid, ("RUNNING",))
    time.sleep(2.0)
    assert api.call("DELETE", f"/v1/sessions/{native['id']}")[1]["status"] == "ENDED"
    assert api.call("DELETE", f"/v1/realtime_sessions/{runway['id']}")[0] == 204
    api.call("GET", "/v1/sessions")

    status, bad = api.call("POST", "/v1/sessions", {"avatar": {"image": image}, "maxDuration": 60, "output": {
        "kind": "livekit", "url": lk.url, "roomName": "sec-bad", "apiKey": lk.api_key, "apiSecret": BAD_SECRET}})
    assert status == 201, bad
    failed = api.wait(bad["id"], ("FAILED", "ENDED"))
    assert failed["status"] == "FAILED" and "could not join room 'sec-bad'" in failed["reason"], failed
    api.call("GET", f"/v1/realtime_sessions/{runway['id']}")
    api.call("GET", "/v1/sessions")

    time.sleep(3.0)  # span batches (200 ms) and log files flushed
    spans = rx.spans()
    span_text = [*rx.attribute_values(), *(s.name for s in spans)]
    assert any(native["id"] in v for v in span_text) and any(bad["id"] in v for v in span_text)
    log_text = [p.read_text(errors="replace") for p in sorted(logs.rglob("*")) if p.is_file()
                and p.suffix in (".log", ".out", ".err", "")]
    # The room worker's log is searched: the LiveKit SDK logged the rejected join, with the token redacted.
    assert any("401 Unauthorized - invalid token: <token redacted>" in t for t in log_text)
    out, err = capfd.readouterr()
    corpus = {"responses": api.seen, "spans": span_text, "ray logs": log_text,
              "driver": [out, err, *(r.getMessage() for r in caplog.records)]}
    needles = {"native token": native_token, "runway token": runway_token, "bad secret": BAD_SECRET}
    for name, token in (("native", native_token), ("runway", runway_token)):
        _, claims, signature = token.split(".")
        needles |= {f"{name} claims": claims, f"{name} signature": signature}
    leaks = [(where, what) for where, texts in corpus.items() for what, needle in needles.items()
             if any(needle in t for t in texts)]
    assert not leaks, leaks
