"""Every session has its span, whatever its end: `characters serve` with only OTEL_* set (through the real
OpenTelemetry Collector running the shipped config, `test_serve_telemetry`'s fixture), a session created right
after start, while the warm slot is still being built (readiness says so: /healthz 200, /readyz 503), and
deleted before it got a slot. Its trace holds the `session` span (ENDED, deleted) under the POST, the
admission, and the DELETE reaching the scheduler (`session.end_request`), linked to the DELETE's own span."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from test_serve_telemetry import Collector, call, collector  # noqa: F401 (the fixture)
from waiting import wait_for

from characters.media import SAMPLE_IMAGE
from deployments.livekit.server import free_port
from deployments.telemetry import names as N
from deployments.telemetry.receiver import OtlpReceiver, ReceivedSpan, tree

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_a_session_deleted_before_its_slot_is_warm_has_one_trace_at_the_collector(
        collector: tuple[Collector, OtlpReceiver], tmp_path: Path) -> None:  # noqa: F811
    col, backend = collector
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "CHARACTERS_", "RAY_ADDRESS"))}
    env.update({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{col.grpc_port}",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_BSP_SCHEDULE_DELAY": "500"})
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "deployments.cli.serve", "--port", str(port), "--grpc-port",
                                 "0", "--data-dir", str(tmp_path / "data")], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        def answers() -> bool:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/healthz", timeout=5) as resp:
                    return resp.status == 200
            except OSError:  # not listening yet, or the proxy's 404 before the application is deployed
                return False

        wait_for(answers, 240, "characters serve's HTTP", every_s=0.2)
        status, body = call(f"{base}/readyz")
        assert status == 503 and body["error"]["code"] == "not_ready", body  # live, not ready: the slot builds
        assert "Ctrl-C to stop" not in log_path.read_text()
        image = base64.b64encode(SAMPLE_IMAGE.read_bytes()).decode()
        status, created = call(f"{base}/v1/sessions", "POST", {"avatar": {"image": image}, "maxDuration": 60})
        assert status == 201 and created["status"] in ("QUEUED", "STARTING"), created
        sid = created["id"]
        status, ended = call(f"{base}/v1/sessions/{sid}", "DELETE")
        assert status == 200 and ended["status"] == "ENDED" and ended["reason"] == "deleted", ended
        assert ended["startedAt"] is None  # it never got its slot
        wait_for(lambda: "Ctrl-C to stop" in log_path.read_text(), 240, "the warm slot", every_s=0.5)
        assert call(f"{base}/readyz")[0] == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    def the_trace() -> list[ReceivedSpan] | None:
        spans = backend.spans()
        names = {s.name for s in spans}
        done = any(s.name == N.SESSION and s.attributes.get(N.SESSION_ID) == sid for s in spans)
        return spans if done and {"POST /v1/sessions", "DELETE /v1/sessions/{session_id}"} <= names else None

    spans = wait_for(the_trace, 30, "the session's span and both requests' through the collector")
    post = next(s for s in spans if s.name == "POST /v1/sessions")
    delete = next(s for s in spans if s.name == "DELETE /v1/sessions/{session_id}")
    mine = [s for s in spans if s.trace_id == post.trace_id]
    print(f"\ntrace {post.trace_id}:\n" + tree(spans, post.trace_id, attributes=(N.END_REASON, N.SESSION_STATUS)))
    session = next(s for s in mine if s.name == N.SESSION)
    assert session.parent_id == post.span_id and session.attributes[N.SESSION_ID] == sid
    assert (session.attributes[N.SESSION_STATUS], session.attributes[N.END_REASON]) == ("ENDED", "deleted")
    admission = next(s for s in mine if s.name == N.ADMISSION)
    assert admission.parent_id == post.span_id and admission.attributes[N.ADMISSION_DECISION] == "ended"
    request = next(s for s in mine if s.name == N.SESSION_END_REQUEST)
    assert request.parent_id == session.span_id and request.attributes[N.END_REASON] == "deleted"
    assert (delete.trace_id, delete.span_id) in request.links and delete.trace_id != post.trace_id
    assert session.start_ns <= request.start_ns <= session.end_ns
