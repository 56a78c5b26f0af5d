"""Telemetry end to end: a real session over Ray + Serve + HTTP exports OTLP to a receiver of our own.

One local cluster for the module, its processes inheriting OTEL_* from this one (set before `ray.init`),
so the ingress replica, the scheduler, the slot's workers and the session actor each set up their own
exporter. The tiny preset with 1 DiT layer and the extra cache-update pass (so every chunk stage exists).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on 127.0.0.1 (before importing ray)

import base64
import json
import secrets
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
from ray import serve

from characters.media import SAMPLE_IMAGE
from deployments.api.app import APP_NAME, build_app
from deployments.sessions.cluster import init_local, stop_local
from deployments.telemetry import names as N
from deployments.telemetry.receiver import OtlpReceiver, ReceivedSpan, tree
from deployments.types import NAMESPACE, SCHEDULER_NAME

pytestmark = pytest.mark.ray

KEY = "telemetry-key-" + "0123456789abcdef" * 2
MODEL = {"dit": {"num_layers": 1}, "generation": {"cache_update": "extra_pass"}}
ENV = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_SERVICE_NAME": "characters-test", "OTEL_BSP_SCHEDULE_DELAY": "200",
       "OTEL_METRIC_EXPORT_INTERVAL": "500", "CHARACTERS_API_KEYS": f"tester:{KEY}", "CHARACTERS_RAY_METRICS": "true"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    def __init__(self, rx: OtlpReceiver, port: int, metrics_port: int) -> None:
        self.rx, self.base = rx, f"http://127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"  # Ray's Prometheus endpoint

    def call(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode() if body is not None else None,
                                     method=method, headers={"Content-Type": "application/json",
                                                             "Authorization": f"Bearer {KEY}", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    saved = {k: os.environ.get(k) for k in [*ENV, "OTEL_EXPORTER_OTLP_ENDPOINT"]}
    with OtlpReceiver(http=False) as rx:
        os.environ.update(ENV, OTEL_EXPORTER_OTLP_ENDPOINT=rx.grpc_endpoint)  # inherited through the raylet
        init_local(num_cpus=2, configure_logging=False, _metrics_export_port=(metrics_port := free_port()))
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": (port := free_port())})
            serve.run(build_app({"service": {"queue_max": 0, "model_overrides": MODEL}}), name=APP_NAME,
                      route_prefix="/")
            yield Cluster(rx, port, metrics_port)
        finally:
            try:
                ray.get(ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE).shutdown.remote(), timeout=60)
            finally:
                serve.shutdown()
                stop_local()
                for k, v in saved.items():
                    os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def wait_for(what: str, fn: Callable[[], Any], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := fn()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.25)
    return value


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


def test_one_trace_from_the_http_request_to_every_chunk_stage(cluster: Cluster) -> None:
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    image = base64.b64encode(SAMPLE_IMAGE.read_bytes()).decode()
    status, created = cluster.call("POST", "/v1/sessions", {"avatar": {"image": image}, "maxDuration": 4},
                                   headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
    assert status == 201, created
    sid = created["id"]
    deadline = time.monotonic() + 180
    while (body := cluster.call("GET", f"/v1/sessions/{sid}")[1])["status"] not in ("ENDED", "FAILED"):
        assert time.monotonic() < deadline, body
        time.sleep(0.5)
    assert body["status"] == "ENDED" and body["reason"] == "max_duration", body

    rx = cluster.rx
    spans = wait_for("the session's end span", lambda: (s := rx.spans()) and any(x.name == N.SESSION_END for x in s)
                     and any(x.name == N.ADMISSION for x in s) and s, 30)
    mine = [s for s in spans if s.trace_id == trace_id]
    request = one(mine, "POST /v1/sessions")
    print(f"\nsession trace {trace_id}:\n" + tree(spans, trace_id, attributes=(
        N.ADMISSION_DECISION, N.CHUNK_INDEX, N.CHUNK_LATE, N.TIMING_SOURCE, N.END_REASON, N.SESSION_CHUNKS)))

    # one trace, parented right: the caller's span -> the request -> the session's spans -> chunk stages
    assert request.parent_id == client_span and request.attributes[N.HTTP_STATUS] == 201
    assert request.resource[N.COMPONENT] == "ingress" and request.resource["service.name"] == "characters-test"
    by_id = {s.span_id: s for s in mine}
    for name, component in ((N.ADMISSION, "scheduler"), (N.SESSION_START, "session"), (N.SESSION_END, "session")):
        span = one(mine, name)
        assert span.parent_id == request.span_id and span.resource[N.COMPONENT] == component, span
        assert span.attributes[N.SESSION_ID] == sid
    start = one(mine, N.SESSION_START)
    for name in (N.SESSION_PREPARE, N.SESSION_COMPILE):
        assert one(mine, name).parent_id == start.span_id
    admission = one(mine, N.ADMISSION)
    assert admission.attributes[N.ADMISSION_DECISION] == "cold" and admission.attributes[N.WARM_START] is False
    end = one(mine, N.SESSION_END)
    assert end.attributes[N.END_REASON] == "max_duration" and end.attributes[N.SESSION_STATUS] == "ENDED"
    chunks = sorted((s for s in mine if s.name == N.CHUNK), key=lambda s: s.attributes[N.CHUNK_INDEX])
    assert chunks and [c.attributes[N.CHUNK_INDEX] for c in chunks] == list(range(len(chunks)))  # the first ones
    assert all(c.parent_id == request.span_id and c.attributes[N.CHUNK_SAMPLED_BY] == "first" for c in chunks)
    assert end.attributes[N.SESSION_CHUNKS] == len(chunks)  # < 24 chunks: every one is traced
    for c in chunks:
        kids = {s.name: s for s in mine if s.parent_id == c.span_id}
        assert set(kids) == {N.CHUNK_STAGE[s] for s in ("dit", "handoff", "decode", "publish")}, kids
        cache = [s for s in mine if s.parent_id == kids[N.CHUNK_STAGE["dit"]].span_id]
        assert [s.name for s in cache] == [N.CHUNK_STAGE["cache_write"]]
        for stage in (*kids.values(), *cache):
            assert stage.attributes[N.STAGE] == stage.name.removeprefix("chunk.")
            assert stage.attributes[N.TIMING_SOURCE] == "host"  # CPU workers
            assert c.start_ns <= stage.start_ns <= stage.end_ns <= c.end_ns + 1_000_000, (c, stage)
        assert {kids[N.CHUNK_STAGE["dit"]].resource[N.COMPONENT]} == {"session"}  # made where the report lands
        assert {N.CHUNK_LATE, N.CHUNK_LATENCY_S, N.BUFFER_S, N.DELIVERED_FPS} <= set(c.attributes)
    assert all(by_id.get(s.parent_id) is not None or s is request for s in mine)  # no orphans

    # the slot has its own trace (placement and every worker stage, in the workers' processes), linked
    build = one(spans, N.SLOT_BUILD)
    assert build.trace_id != trace_id and (trace_id, admission.span_id) in build.links
    assert (build.trace_id, build.span_id) in admission.links
    slot_spans = [s for s in spans if s.trace_id == build.trace_id]
    print(f"\nslot trace {build.trace_id}:\n" + tree(spans, build.trace_id, attributes=(N.WORKER_ROLE, N.SLOT_ID)))
    assert one(slot_spans, N.SLOT_PLACEMENT).parent_id == build.span_id
    assert one(slot_spans, N.SLOT_ACTORS).parent_id == build.span_id
    for stage in N.WORKER_STAGES:
        workers = {s.resource[N.COMPONENT] for s in slot_spans if s.name == N.WORKER_STAGE[stage]
                   and s.parent_id == build.span_id}
        assert workers == {"dit", "decoder"}, (stage, workers)

    # nothing secret or user-supplied in any attribute or resource value, anywhere
    values = list(rx.attribute_values())
    forbidden = (KEY, "Bearer", image[:48], image[-48:])
    assert values and not [v for v in values if any(f in v for f in forbidden)]
    assert max(len(v) for v in values) < 512  # no blobs

    # metrics: every family arrived, with data
    want = {m.name for m in N.METRICS} - {N.LEAKED_PGS.name}  # leak counting starts after the first node refresh
    got = wait_for("every metric", lambda: want <= (names := rx.metric_names()) and names, 30)
    assert want <= got
    points = rx.metrics()
    assert sum(p.as_int for p in points[N.CHUNKS.name]) >= len(chunks)
    stages = {a.value.string_value for p in points[N.CHUNK_STAGE_DURATION.name] for a in p.attributes
              if a.key == N.STAGE}
    assert stages == {"dit", "cache_write", "handoff", "decode", "publish"}
    decisions = {a.value.string_value for p in points[N.ADMISSION_WAIT.name] for a in p.attributes}
    assert "cold" in decisions
    ended = [p for p in points[N.SESSIONS_ENDED.name] if p.as_int >= 1]
    assert ended and {a.key: a.value.string_value for a in ended[-1].attributes}[N.END_REASON] == "max_duration"


def test_the_same_metrics_on_rays_prometheus_endpoint(cluster: Cluster) -> None:
    """CHARACTERS_RAY_METRICS=true: every process also records through ray.util.metrics (prefix ray_)."""
    want = {"ray_characters_chunks_total", "ray_characters_chunk_stage_duration_seconds_bucket",
            "ray_characters_sessions", "ray_characters_bundles_free", "ray_characters_admission_wait_seconds_bucket"}

    def scrape() -> set[str]:
        try:
            with urllib.request.urlopen(cluster.metrics_url, timeout=10) as resp:
                text = resp.read().decode()
        except OSError:
            return set()
        found = {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if line.startswith("ray_char")}
        return found if want <= found else set()

    found = wait_for("Ray's Prometheus endpoint to show our metrics", scrape, 60)
    assert want <= found
