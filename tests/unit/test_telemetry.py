"""Telemetry pieces without Ray: config from OTEL_*, the no-op default, chunk sampling, the session's and
the scheduler's spans and metrics, the HTTP middleware, stage timing in the workers. Spans and metrics go
over real OTLP (gRPC, and HTTP/protobuf once) to an in-process receiver."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

import deployments.settings as settings
from characters.audio import chunk_sample_range
from characters.config import session_config
from characters.stage_times import StageRecorder, StageTime
from deployments import telemetry
from deployments.pipeline.messages import ChunkInput, ChunkReport
from deployments.pipeline.output import RoomWorker
from deployments.pipeline.workers import DecoderWorker, DiTWorker, StageTimer
from deployments.settings import TelemetryConfig
from deployments.telemetry import ChunkSampler, SchedulerTelemetry, SessionTelemetry, Telemetry
from deployments.telemetry import http as telemetry_http
from deployments.telemetry import names as N
from deployments.telemetry.receiver import OtlpReceiver, tree
from deployments.types import OutputSpec, SessionStats

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TRACE_ID, PARENT_SPAN = PARENT.split("-")[1:3]


@pytest.fixture(scope="module")
def rx() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver


def config(rx: OtlpReceiver, **fields: object) -> TelemetryConfig:
    base = {"traces_endpoint": rx.grpc_endpoint, "metrics_endpoint": rx.grpc_endpoint,
            "bsp_schedule_delay_ms": 50, "metric_export_interval_ms": 100_000}
    return TelemetryConfig.model_validate(base | fields)


@pytest.fixture
def tel(rx: OtlpReceiver) -> Iterator[Telemetry]:
    """This process's telemetry, exporting to `rx`; the previous one is restored afterwards."""
    t = Telemetry(config(rx), "test", f"unit-{time.monotonic_ns()}")
    previous = telemetry.reset_for_tests(t)
    yield t
    t.shutdown()
    telemetry.reset_for_tests(previous)


def spans_of(rx: OtlpReceiver, tel: Telemetry) -> list:
    tel.flush()
    return [s for s in rx.spans() if s.resource.get("service.instance.id") == tel.instance]


# ------------------------------------------------------------------------------------------ config


def test_off_by_default_and_configured_by_the_standard_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [v.name for v in vars(settings).values() if isinstance(v, settings.EnvVar)]:
        monkeypatch.delenv(name, raising=False)
    off = TelemetryConfig.from_env()
    assert (off.traces, off.metrics, off.enabled) == (False, False, False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    on = TelemetryConfig.from_env()
    assert (on.traces_endpoint, on.metrics_endpoint, on.protocol) == ("http://collector:4317",) * 2 + ("grpc",)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "api-key=s%3Dcret,x=1")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    http = TelemetryConfig.from_env()
    assert (http.traces_endpoint, http.metrics_endpoint) == ("http://collector:4317/v1/traces", "")
    assert http.headers == {"api-key": "s=cret", "x": "1"} and "s=cret" not in repr(http)
    assert (http.sampler, http.sampler_arg) == ("parentbased_traceidratio", 0.25)
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not TelemetryConfig.from_env().enabled
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")  # no endpoint: the protocol's default port
    assert TelemetryConfig.from_env().traces_endpoint == "http://localhost:4318/v1/traces"


def test_bad_values_are_refused_with_the_variable_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "thrift")
    with pytest.raises(ValueError, match=r"OTEL_EXPORTER_OTLP_PROTOCOL='thrift' is invalid \(expected one of grpc"):
        TelemetryConfig.from_env()
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4096")
    with pytest.raises(ValueError, match="OTEL_BSP_MAX_EXPORT_BATCH_SIZE=4096 exceeds OTEL_BSP_MAX_QUEUE_SIZE=2048"):
        TelemetryConfig.from_env()


def test_every_variable_is_documented_in_the_settings_module() -> None:
    declared = {v.name for v in vars(settings).values() if isinstance(v, settings.EnvVar)}
    documented = set(re.findall(r"\b([A-Z][A-Z0-9_]{3,})\b", settings.__doc__ or ""))
    assert declared - {"CHARACTERS_API_KEYS"} <= documented


def test_off_means_no_exporter_no_thread_and_no_op_instruments() -> None:
    before = threading.active_count()
    off = Telemetry(TelemetryConfig(), "test", "off")
    span = off.start_span(N.CHUNK, telemetry.extract({"traceparent": PARENT}))
    assert not span.is_recording() and not off.traces and not off.metrics and not off.enabled
    for spec in N.METRICS:
        inst = off.instrument(spec)
        inst.set_all({(): 1.0}) if spec.kind == "gauge" else inst.record(1.0)
    off.flush()
    assert threading.active_count() == before


def test_the_dashboard_queries_only_metrics_and_labels_that_exist() -> None:
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "k8s" / "dashboards" / "characters.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    names = {m.group(1) for e in exprs for m in re.finditer(r"\$\{prefix\}(characters_[a-z_]+)", e)}
    families = {m.prometheus for m in N.METRICS}
    suffixed = {f"{m.prometheus}_bucket" for m in N.METRICS if m.kind == "histogram"}
    assert names and names <= families | suffixed, sorted(names - families - suffixed)
    assert {n.removesuffix("_bucket") for n in names} == families  # every metric has a panel
    labels = {m.group(1) for e in exprs for m in re.finditer(r"\b(characters_[a-z_]+)\b", e)} - names - families
    keys = {k.replace(".", "_") for m in N.METRICS for k in m.attributes}
    assert labels <= keys, sorted(labels - keys)


def test_ray_metrics_twins_have_prometheus_names() -> None:
    on = Telemetry(TelemetryConfig(ray_metrics=True), "test", "ray")  # no OTLP: Ray's endpoint only
    assert on.metrics and not on.traces
    for spec in N.METRICS:
        inst = on.instrument(spec)
        assert inst._ray is not None and re.fullmatch(r"characters_[a-z_]+", spec.prometheus)
        if spec.kind == "gauge":
            inst.set_all({tuple((k, "x") for k in spec.attributes): 1.0})
        else:
            inst.record(0.0, dict.fromkeys(spec.attributes, "x"))  # Ray's counters refuse 0: skipped, no error
            inst.record(1.0, dict.fromkeys(spec.attributes, "x"))


# ------------------------------------------------------------------------------------------ session


def test_chunk_sampler_keeps_the_start_every_nth_and_a_bounded_share_of_late_chunks() -> None:
    s = ChunkSampler(first=3, every=10, late_per_min=6)  # a burst of 6, then one every 10 s
    kept = [s.keep(k, late=False, now_s=0.0) for k in range(21)]
    assert [k for k, why in enumerate(kept) if why] == [0, 1, 2, 10, 20] and kept[10] == "every"
    late = [s.keep(100 + k, late=True, now_s=k * 0.1) for k in range(20)]
    assert late.count("late") == 6  # ~2 s of always-late chunks: the burst only
    assert s.keep(201, late=True, now_s=1.9 + 10.0) == "late"  # refilled one token
    assert ChunkSampler(0, 0, 0).keep(5, late=True, now_s=0.0) is None


def report(k: int, *, late: bool = False, cuda_of: int | None = None, t0: int = 0) -> ChunkReport:
    base = t0 + k * 166_000_000
    stages = [StageTime(k, "dit", base, 30_000_000, "host"), StageTime(k, "cache_write", base + 20_000_000,
              5_000_000, "host"), StageTime(k, "decode", base + 32_000_000, 50_000_000, "host"),
              StageTime(k, "publish", base + 90_000_000, 1_000_000, "host")]
    if cuda_of is not None:
        c = t0 + cuda_of * 166_000_000
        stages += [StageTime(cuda_of, "dit", c + 1_000_000, 25_000_000, "cuda"),
                   StageTime(cuda_of, "decode", c + 40_000_000, 45_000_000, "cuda")]
    return ChunkReport("s1", k, 4, late, 0.01 if late else 0.0, 24.0, "d", time.monotonic(), tuple(stages),
                       0.2, 0.0)


def test_session_spans_sample_chunks_and_nest_stages(rx: OtlpReceiver, tel: Telemetry) -> None:
    tel = Telemetry(config(rx, trace_chunks_first=2, trace_chunks_every=5, trace_late_per_min=60), "session", "s1")
    st = SessionTelemetry(tel, "s1", {"traceparent": PARENT}, preset="tiny", output_kind="null")
    st.starting()
    st.phase(N.SESSION_PREPARE, time.time_ns() - 1000, time.time_ns())
    t0 = time.time_ns()
    for k in range(12):
        st.on_chunk(report(k, late=k == 7, t0=t0), time.monotonic() - 0.1, {"prepare_s": 0.5})
    st.ended("ENDED", "max_duration", SessionStats(chunks=12, late_chunks=1, fps=23.9), start_ns=time.time_ns(),
             phases={})
    spans = spans_of(rx, tel)
    print("\n" + tree(spans, TRACE_ID, attributes=(N.CHUNK_INDEX, N.CHUNK_SAMPLED_BY)))
    assert {s.trace_id for s in spans} == {TRACE_ID}
    chunks = {s.attributes[N.CHUNK_INDEX]: s for s in spans if s.name == N.CHUNK}
    assert {k: c.attributes[N.CHUNK_SAMPLED_BY] for k, c in chunks.items()} == {
        0: "first", 1: "first", 5: "every", 7: "late", 10: "every"}
    start = next(s for s in spans if s.name == N.SESSION_START)
    assert start.attributes[N.phase_key("prepare_s")] == 0.5 and start.parent_id == PARENT_SPAN
    by_id = {s.span_id: s for s in spans}
    for name in (N.CHUNK_STAGE["dit"], N.CHUNK_STAGE["handoff"], N.CHUNK_STAGE["decode"], N.CHUNK_STAGE["publish"]):
        assert {by_id[s.parent_id].name for s in spans if s.name == name} == {N.CHUNK}
    assert {by_id[s.parent_id].name for s in spans if s.name == N.CHUNK_STAGE["cache_write"]} == {N.CHUNK_STAGE["dit"]}
    handoff = next(s for s in spans if s.name == N.CHUNK_STAGE["handoff"])
    assert handoff.duration_ms == pytest.approx(2.0)  # dit end (30 ms) -> decode start (32 ms)
    end = next(s for s in spans if s.name == N.SESSION_END)
    assert end.attributes[N.SESSION_LATE_CHUNKS] == 1 and end.parent_id == PARENT_SPAN
    tel.flush()
    points = rx.metrics()
    assert sum(p.as_int for p in points[N.LATE_CHUNKS.name] if p.as_int) >= 1
    assert any(p.count == 12 for p in points[N.CHUNK_LATENCY.name])
    tel.shutdown()


def points_of(rx: OtlpReceiver, instance: str, metric: str) -> list[Any]:
    """`metric`'s data points exported by the telemetry of `instance` (the receiver serves the whole module)."""
    out = []
    for req in list(rx.metric_requests):
        for rm in req.resource_metrics:
            if any(a.key == "service.instance.id" and a.value.string_value == instance for a in rm.resource.attributes):
                out += [p for sm in rm.scope_metrics for m in sm.metrics if m.name == metric
                        for p in getattr(m, m.WhichOneof("data") or "gauge").data_points]
    return out


def test_gpu_times_arrive_later_and_win_over_host_times(rx: OtlpReceiver) -> None:
    tel = Telemetry(config(rx, trace_chunks_first=3), "session", "gpu")
    st = SessionTelemetry(tel, "s1", {"traceparent": PARENT}, preset="tiny", output_kind="null", device="cuda")
    t0 = time.time_ns()
    st.on_chunk(report(0, t0=t0), time.monotonic())
    assert st._pending and 0 in st._pending  # waits for its GPU times
    st.on_chunk(report(1, cuda_of=0, t0=t0), time.monotonic())  # chunk 0's GPU times: out it goes
    assert 0 not in st._pending and 1 in st._pending
    for k in range(2, 2 + 4):  # chunk 1's GPU times never come: out with host times after GPU_WAIT_CHUNKS
        st.on_chunk(report(k, t0=t0), time.monotonic())
    assert 1 not in st._pending
    spans = spans_of(rx, tel)
    chunk_ids = {s.attributes[N.CHUNK_INDEX]: s.span_id for s in spans if s.name == N.CHUNK}
    sources = {k: {s.name: s.attributes[N.TIMING_SOURCE] for s in spans if s.parent_id == chunk_ids[k]}
               for k in (0, 1)}
    # chunk 0's handoff from its GPU times: DiT end (26 ms) -> decode start (40 ms); the host times' span (30 ->
    # 32 ms) is the DiT call returning, which on a GPU comes before its kernels are done
    assert sources[0][N.CHUNK_STAGE["dit"]] == "cuda" and sources[0][N.CHUNK_STAGE["handoff"]] == "cuda"
    handoffs = {k: s.duration_ms for k in (0, 1) for s in spans
                if s.parent_id == chunk_ids[k] and s.name == N.CHUNK_STAGE["handoff"]}
    assert handoffs == pytest.approx({0: 14.0, 1: 2.0})
    assert sources[1][N.CHUNK_STAGE["dit"]] == "host" and sources[1][N.CHUNK_STAGE["handoff"]] == "host"
    tel.flush()  # the metric: only GPU-timed handoffs on a GPU session (its host span holds the DiT's queued work)
    handoff_points = [{a.key: a.value.string_value for a in p.attributes} | {"count": p.count}
                      for p in points_of(rx, "gpu", N.CHUNK_STAGE_DURATION.name)
                      if any(a.key == N.STAGE and a.value.string_value == "handoff" for a in p.attributes)]
    # cumulative points, one per export: every one says one handoff, GPU-timed (chunk 0's)
    assert handoff_points and {(p[N.TIMING_SOURCE], p["count"]) for p in handoff_points} == {("cuda", 1)}, \
        handoff_points
    tel.shutdown()


# ------------------------------------------------------------------------------------------ scheduler


def test_admission_roots_a_context_less_session_and_links_to_its_slot(rx: OtlpReceiver) -> None:
    tel = Telemetry(config(rx, metric_export_interval_ms=100_000), "scheduler", "sched")
    st = SchedulerTelemetry(tel)
    adm, carried = st.admission("s2", "tiny", {}, queue_len=0)
    assert carried and carried != {} and telemetry.span_context(telemetry.extract(carried)) is not None
    slot = st.slot_building("slot-1", adm)
    st.slot_built(slot, node_id="n1", device="cpu")
    st.decided(adm, "cold", slot=slot, warm=False)
    st.decided(adm, "ended")  # once only
    st.end_requested(adm, "deleted", {"traceparent": PARENT})  # the DELETE's request
    st.session_ended(adm, "ENDED", "deleted")
    st.session_ended(adm, "FAILED", "late")  # once only
    refused, same = st.admission("s3", "tiny", {"traceparent": PARENT}, queue_len=3)
    assert same == {"traceparent": PARENT}
    st.decided(refused, "rejected")
    st.snapshot(statuses=["RUNNING", "QUEUED", "QUEUED"], queue_len=2, bundles_free=0, bundles_used=1,
                slot_states=["leased"], leaked_pgs=0)
    st.ended("FAILED", "actor_died: DiTWorker rank 0 died (ActorDiedError)")
    spans = spans_of(rx, tel)
    adm_span = next(s for s in spans if s.name == N.ADMISSION and s.attributes[N.SESSION_ID] == "s2")
    build = next(s for s in spans if s.name == N.SLOT_BUILD)
    session = next(s for s in spans if s.name == N.SESSION and s.attributes[N.SESSION_ID] == "s2")
    assert session.parent_id == "" and adm_span.parent_id == session.span_id  # no request context: it roots
    assert adm_span.attributes[N.ADMISSION_DECISION] == "cold"
    assert (build.trace_id, build.span_id) in adm_span.links and (adm_span.trace_id, adm_span.span_id) in build.links
    assert build.trace_id != adm_span.trace_id and build.attributes[N.SLOT_PURPOSE] == "cold"
    assert (session.attributes[N.SESSION_STATUS], session.attributes[N.END_REASON]) == ("ENDED", "deleted")
    delete = next(s for s in spans if s.name == N.SESSION_END_REQUEST)
    assert delete.parent_id == session.span_id and delete.trace_id == session.trace_id
    assert list(delete.links) == [(TRACE_ID, PARENT_SPAN)] and delete.attributes[N.END_REASON] == "deleted"
    rejected = next(s for s in spans if s.name == N.ADMISSION and s.attributes[N.SESSION_ID] == "s3")
    assert rejected.trace_id == TRACE_ID and rejected.attributes[N.ADMISSION_DECISION] == "rejected"
    refused = next(s for s in spans if s.name == N.SESSION and s.attributes[N.SESSION_ID] == "s3")
    assert refused.trace_id == TRACE_ID and refused.parent_id == rejected.parent_id == PARENT_SPAN
    assert refused.attributes[N.END_REASON] == "rejected" and N.SESSION_STATUS not in refused.attributes
    tel.flush()
    points = rx.metrics()
    sessions = {p.attributes[0].value.string_value: p.as_double for p in points[N.SESSIONS.name]}
    assert sessions == {"RUNNING": 1.0, "QUEUED": 2.0}
    ended = {a.key: a.value.string_value for a in points[N.SESSIONS_ENDED.name][-1].attributes}
    assert ended == {N.SESSION_STATUS: "FAILED", N.END_REASON: "actor_died"}  # the code, never the message
    tel.shutdown()


def test_leaked_placement_groups_are_slot_groups_nobody_holds() -> None:
    table = {"a": {"name": "slot-1", "state": "CREATED"}, "b": {"name": "slot-2", "state": "REMOVED"},
             "c": {"name": "slot-3", "state": "PENDING"}, "d": {"name": "other", "state": "CREATED"}}
    assert telemetry.leaked_placement_groups(table, {"slot-1"}) == 1  # slot-3


# ------------------------------------------------------------------------------------------ HTTP


def test_http_requests_get_a_server_span_that_the_routes_carry_on(rx: OtlpReceiver, tel: Telemetry) -> None:
    app = FastAPI()

    @app.post("/v1/things/{thing}")
    async def thing(thing: str, request: Request) -> dict[str, str]:
        return {"traceparent": request.headers.get("traceparent", "")}

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    with TestClient(telemetry_http.install(app)) as client:
        seen = client.post("/v1/things/abc?token=secret-query", headers={"traceparent": PARENT}).json()
        client.get("/healthz")
    spans = spans_of(rx, tel)
    (server,) = [s for s in spans if s.name.startswith("POST")]
    assert server.name == "POST /v1/things/{thing}" and server.parent_id == PARENT_SPAN and server.kind == 2
    assert seen["traceparent"] == f"00-{TRACE_ID}-{server.span_id}-01"  # the route sees the server span
    assert server.attributes == {N.HTTP_METHOD: "POST", N.HTTP_ROUTE: "/v1/things/{thing}", N.HTTP_STATUS: 200}
    assert not [s for s in spans if "healthz" in s.name]


def test_grpc_calls_get_a_server_span_that_the_session_carries_on(rx: OtlpReceiver, tel: Telemetry) -> None:
    from deployments.api.grpc_service import server_span

    with server_span("CreateSession", {"traceparent": PARENT}) as (_, carried):
        pass
    (server,) = [s for s in spans_of(rx, tel) if s.name == "characters.v1.Characters/CreateSession"]
    assert server.parent_id == PARENT_SPAN and server.kind == 2 and server.attributes[N.RPC_METHOD] == "CreateSession"
    assert carried == {"traceparent": f"00-{TRACE_ID}-{server.span_id}-01"}
    telemetry.reset_for_tests(Telemetry(TelemetryConfig(), "test", "off"))  # off: the caller's context, as is
    with server_span("CreateSession", {"traceparent": PARENT}) as (span, carried):
        assert carried == {"traceparent": PARENT} and not span.is_recording()


def test_http_protobuf_exports_too(rx: OtlpReceiver) -> None:
    t = Telemetry(config(rx, protocol="http/protobuf", traces_endpoint=rx.http_endpoint + "/v1/traces",
                         metrics_endpoint=rx.http_endpoint + "/v1/metrics"), "test", "http-proto")
    t.start_span(N.SESSION_END, None).end()
    t.instrument(N.CHUNKS).record(3)
    assert [s.name for s in spans_of(rx, t)] == [N.SESSION_END]
    assert N.CHUNKS.name in rx.metric_names()
    t.shutdown()


# ------------------------------------------------------------------------------------------ workers


def test_stage_recorder_and_stage_timer_on_the_host() -> None:
    rec = StageRecorder("cpu")
    rec.chunk = 4
    mark = rec.begin("dit")
    rec.end(mark)
    (t,) = rec.harvest()
    assert (t.chunk, t.stage, t.source) == (4, "dit", "host") and t.duration_ns >= 0 and rec.harvest() == []
    heard: list[tuple[str, str | None]] = []
    timer = StageTimer(on_stage=lambda stage, a, b, err: heard.append((stage, err)))
    with timer.stage("init_device"):
        pass
    with pytest.raises(ZeroDivisionError), timer.stage("init_process_group"):
        _ = 1 / 0
    assert heard == [("init_device", None), ("init_process_group", "ZeroDivisionError")]


def test_workers_measure_every_chunk_stage_with_telemetry_on(tel: Telemetry) -> None:
    cfg = session_config("tiny", "cpu", model={"dit": {"num_layers": 1}, "generation": {
        "height": 64, "width": 96, "cache_update": "extra_pass"}, "vae": {"num_res_blocks": 0}})
    dit, dec, room = DiTWorker(cfg), DecoderWorker(cfg), RoomWorker(cfg)
    for w in (dit, dec):
        w.init_device()
    dit.init_process_group(0)
    dec.init_process_group()
    for w in (dit, dec):
        w.load_weights()
        w.warm_up()
    image = np.zeros((64, 96, 3), np.uint8)
    dit.start("s", dec.encode_reference("s", image), 0)
    dec.start("s")
    room.open("s", OutputSpec("null"))
    reports = []
    for k in range(3):
        a, b = chunk_sample_range(k, cfg.model.generation.frames_per_chunk)
        inp = ChunkInput("s", k, np.zeros(b - a, np.float32))
        reports.append(room.publish(inp, dec.decode(dit.step(inp))))  # type: ignore[arg-type]
    for k, r in enumerate(reports):
        assert [(t.chunk, t.stage, t.source) for t in r.stages] == [  # in the order they ended
            (k, "cache_write", "host"), (k, "dit", "host"), (k, "decode", "host"), (k, "publish", "host")]
        cache_t, dit_t = r.stages[0], r.stages[1]
        assert dit_t.start_ns <= cache_t.start_ns <= cache_t.end_ns <= dit_t.end_ns
    assert reports[0].buffer_s == pytest.approx(2 * 4 / 24, abs=0.01)  # the 1-chunk jitter buffer + the chunk
    assert replace(reports[1], stages=()) != reports[1]
