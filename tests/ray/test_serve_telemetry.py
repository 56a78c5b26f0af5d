"""The path an SRE runs: `characters serve` as a subprocess with nothing but the standard OTEL_* variables, its
spans through the real OpenTelemetry Collector running the config `k8s/` ships, to a backend.

The collector is `scripts/setup/install_otelcol.sh`'s build of exactly the components of
k8s/base/otel-collector-config.yaml (at the release of the image the manifests pin); the config is used as
shipped, its listeners moved to free loopback ports with `--set`, and its `otlp/traces` exporter pointed (by the
config's own TRACES_BACKEND_ENDPOINT) at an in-process OTLP receiver standing in for the tracing backend.

One session, on the warm slot `characters serve` keeps: the trace must run from the HTTP request through
admission, the session's start, its first chunks with their stages, to its end (deleted); and the server's log
from start to stop must hold nothing alarming (a clean end of session prints no error).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from waiting import wait_for

from characters.media import SAMPLE_IMAGE
from deployments.livekit.server import free_port
from deployments.telemetry import names as N
from deployments.telemetry.receiver import OtlpReceiver, ReceivedSpan, tree

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
COLLECTOR_CONFIG = ROOT / "k8s" / "base" / "otel-collector-config.yaml"
# what must never appear in the server's log around a clean session (each was seen at every session's end)
ALARMING = ("Traceback", "Error cancelling worker task", "Using blocking ray.get", "ActorDiedError",
            "Ack received for unexpected RPC", " ERROR ")


def call(url: str, method: str = "GET", body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


class Collector:
    """The shipped collector config on the tests' build of the collector, exporting traces to `backend`."""

    def __init__(self, binary: Path, backend: OtlpReceiver, workdir: Path) -> None:
        self.grpc_port, self.health_port = free_port(), free_port()
        overrides = {  # listeners only, on loopback: everything else is the shipped config
            "receivers::otlp::protocols::grpc::endpoint": f"127.0.0.1:{self.grpc_port}",
            "receivers::otlp::protocols::http::endpoint": f"127.0.0.1:{free_port()}",
            "exporters::prometheus::endpoint": f"127.0.0.1:{free_port()}",
            "extensions::health_check::endpoint": f"127.0.0.1:{self.health_port}",
            "service::telemetry::metrics::readers":
                f"[{{pull: {{exporter: {{prometheus: {{host: 127.0.0.1, port: {free_port()}}}}}}}}}]",
        }
        backend_endpoint = backend.grpc_endpoint.removeprefix("http://")
        self.log_path = workdir / "otelcol.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [str(binary), f"--config={COLLECTOR_CONFIG}", *(f"--set={k}={v}" for k, v in overrides.items())],
            env={**os.environ, "TRACES_BACKEND_ENDPOINT": backend_endpoint}, stdout=self._log,
            stderr=subprocess.STDOUT)
        wait_for(self._healthy, 60, "the collector's health check")

    def _healthy(self) -> bool:
        assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/", timeout=1) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Collector, OtlpReceiver]]:
    built = subprocess.run([str(ROOT / "scripts" / "setup" / "install_otelcol.sh")], capture_output=True, text=True,
                           timeout=1800)
    assert built.returncode == 0, f"scripts/setup/install_otelcol.sh failed: {built.stderr[-3000:]}"
    with OtlpReceiver() as backend:
        col = Collector(Path(built.stdout.strip().splitlines()[-1]), backend, tmp_path_factory.mktemp("otelcol"))
        try:
            yield col, backend
        finally:
            col.stop()


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


def test_characters_serve_traces_a_session_end_to_end_through_the_shipped_collector(
        collector: tuple[Collector, OtlpReceiver], tmp_path: Path) -> None:
    col, backend = collector
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "CHARACTERS_", "RAY_ADDRESS"))}
    env.update({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{col.grpc_port}",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "deployments.cli.serve", "--port", str(port), "--grpc-port",
                                 "0"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    def up() -> bool:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        return "Ctrl-C to stop" in log_path.read_text()

    try:
        wait_for(up, 240, "characters serve", every_s=0.5)
        started_log = len(log_path.read_text())
        image = base64.b64encode(SAMPLE_IMAGE.read_bytes()).decode()
        status, created = call(f"{base}/v1/sessions", "POST", {"avatar": {"image": image}, "maxDuration": 60})
        assert status == 201, created
        sid = created["id"]
        running = wait_for(lambda: (b := call(f"{base}/v1/sessions/{sid}")[1])["stats"]["chunks"] >= 10 and b, 60,
                           "10 chunks")
        assert running["status"] == "RUNNING" and running["warmStart"] is True, running
        status, ended = call(f"{base}/v1/sessions/{sid}", "DELETE")
        assert status == 200 and ended["status"] == "ENDED" and ended["reason"] == "deleted", ended
        time.sleep(2.0)  # the slot is reset and returned; anything it would log at the session's end is out
        session_log = log_path.read_text()[started_log:]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    def the_trace() -> list[ReceivedSpan] | None:  # the ingress and the session actor export apart: wait for both
        spans = backend.spans()
        ended = any(s.name == N.SESSION_END and s.attributes.get(N.SESSION_ID) == sid for s in spans)
        return spans if ended and any(s.name == "POST /v1/sessions" for s in spans) else None

    spans = wait_for(the_trace, 30, "the request's span and the session's end through the collector")
    request = next(s for s in spans if s.name == "POST /v1/sessions")
    mine = [s for s in spans if s.trace_id == request.trace_id]
    print(f"\ntrace {request.trace_id} (through the collector):\n" + tree(spans, request.trace_id, attributes=(
        N.ADMISSION_DECISION, N.CHUNK_INDEX, N.END_REASON, N.SESSION_CHUNKS)))
    assert not request.parent_id and request.resource[N.COMPONENT] == "ingress"
    assert request.resource["service.name"] == "realtime-characters"  # OTEL_SERVICE_NAME unset: the default
    admission = one(mine, N.ADMISSION)
    assert admission.parent_id == request.span_id and admission.attributes[N.ADMISSION_DECISION] == "warm"
    for name in (N.SESSION_START, N.SESSION_END):
        span = one(mine, name)
        assert span.parent_id == request.span_id and span.resource[N.COMPONENT] == "session", span
        assert span.attributes[N.SESSION_ID] == sid
    start = one(mine, N.SESSION_START)
    assert {s.name for s in mine if s.parent_id == start.span_id} >= {N.SESSION_PREPARE}
    end = one(mine, N.SESSION_END)
    assert end.attributes[N.END_REASON] == "deleted" and end.attributes[N.SESSION_STATUS] == "ENDED"
    chunks = sorted((s for s in mine if s.name == N.CHUNK), key=lambda s: s.attributes[N.CHUNK_INDEX])
    assert len(chunks) >= 10 and [c.attributes[N.CHUNK_INDEX] for c in chunks[:10]] == list(range(10))
    for c in chunks[:10]:
        stages = {s.name for s in mine if s.parent_id == c.span_id}
        assert stages == {N.CHUNK_STAGE[s] for s in ("dit", "handoff", "decode", "publish")}, stages
    by_id = {s.span_id for s in mine}
    assert all(s.parent_id in by_id or s is request for s in mine)  # one tree: no orphans

    alarming = [line for line in session_log.splitlines() if any(a in line for a in ALARMING)]
    assert alarming == [], "the session's end logged:\n" + "\n".join(alarming)
