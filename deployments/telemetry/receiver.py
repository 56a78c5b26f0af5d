"""A tiny in-process OTLP receiver on loopback (gRPC and HTTP/protobuf) that keeps what it receives.

For tests, benchmarks and local debugging (`python -m deployments.telemetry.receiver` prints span
trees as they arrive): it implements the collector's TraceService/Export and MetricsService/Export
and stores every request; `spans()`, `metric_names()` and `tree()` read them back. Not a collector:
no auth, no TLS, no limits beyond gRPC's message size. Binds 127.0.0.1 only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as mpb
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as mgrpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tgrpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    links: tuple[tuple[str, str], ...]  # (trace id, span id)
    status: int  # 0 unset, 1 ok, 2 error
    kind: int

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


class OtlpReceiver:
    """`with OtlpReceiver() as rx:` serves OTLP on `rx.grpc_endpoint` and `rx.http_endpoint` until exit."""

    def __init__(self, http: bool = True) -> None:
        self.trace_requests: list[tpb.ExportTraceServiceRequest] = []
        self.metric_requests: list[mpb.ExportMetricsServiceRequest] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                                   options=[("grpc.max_receive_message_length", 64 << 20)])
        tgrpc.add_TraceServiceServicer_to_server(_Traces(self), self._server)
        mgrpc.add_MetricsServiceServicer_to_server(_Metrics(self), self._server)
        self.grpc_port = self._server.add_insecure_port("127.0.0.1:0")
        self._http: ThreadingHTTPServer | None = _http_server(self) if http else None

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        assert self._http is not None, "started with http=False"
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        if self._http is not None:
            threading.Thread(target=self._http.serve_forever, name="otlp-http", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()

    def add(self, request: Any) -> None:
        with self._lock:
            (self.trace_requests if isinstance(request, tpb.ExportTraceServiceRequest)
             else self.metric_requests).append(request)

    # ----------------------------------------------------------------------------- reading back
    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            requests = list(self.trace_requests)
        out = []
        for req in requests:
            for rs in req.resource_spans:
                resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out.append(ReceivedSpan(
                            s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name, s.start_time_unix_nano,
                            s.end_time_unix_nano, {a.key: _value(a.value) for a in s.attributes}, resource,
                            tuple((lk.trace_id.hex(), lk.span_id.hex()) for lk in s.links), s.status.code, s.kind))
        return out

    def metrics(self) -> dict[str, list[Any]]:
        """Metric name -> every data point received (of any kind), oldest first."""
        with self._lock:
            requests = list(self.metric_requests)
        out: dict[str, list[Any]] = {}
        for req in requests:
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        data = getattr(m, m.WhichOneof("data") or "gauge")
                        out.setdefault(m.name, []).extend(data.data_points)
        return out

    def metric_names(self) -> set[str]:
        return set(self.metrics())

    def attribute_values(self) -> Iterator[str]:
        """Every attribute and resource value received (spans, span events, links, metric points), as text."""
        for s in self.spans():
            yield from (str(v) for v in (*s.attributes.values(), *s.resource.values()))
        with self._lock:
            requests = list(self.trace_requests)
        for req in requests:
            for rs in req.resource_spans:
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        for ev in sp.events:
                            yield ev.name
                            yield from (str(_value(a.value)) for a in ev.attributes)
        for points in self.metrics().values():
            for p in points:
                yield from (str(_value(a.value)) for a in p.attributes)


def tree(spans: Iterable[ReceivedSpan], trace_id: str, *, attributes: tuple[str, ...] = ()) -> str:
    """One trace as an indented text tree (start offset and duration in ms), children in start order."""
    mine = sorted((s for s in spans if s.trace_id == trace_id), key=lambda s: s.start_ns)
    ids = {s.span_id for s in mine}
    kids: dict[str, list[ReceivedSpan]] = {}
    for s in mine:
        kids.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)
    t0 = mine[0].start_ns if mine else 0
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for s in kids.get(parent, []):
            extra = " ".join(f"{k.rsplit('.', 1)[-1]}={s.attributes[k]}" for k in attributes if k in s.attributes)
            where = s.resource.get("characters.component", "?")
            lines.append(f"{'  ' * depth}{s.name:<{max(1, 34 - 2 * depth)}} +{(s.start_ns - t0) / 1e6:9.1f} ms "
                         f"{s.duration_ms:9.2f} ms  [{where}]{' ' + extra if extra else ''}")
            walk(s.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)


class _Traces(tgrpc.TraceServiceServicer):
    def __init__(self, rx: OtlpReceiver) -> None:
        self.rx = rx

    def Export(self, request: tpb.ExportTraceServiceRequest, context: Any) -> tpb.ExportTraceServiceResponse:
        self.rx.add(request)
        return tpb.ExportTraceServiceResponse()


class _Metrics(mgrpc.MetricsServiceServicer):
    def __init__(self, rx: OtlpReceiver) -> None:
        self.rx = rx

    def Export(self, request: mpb.ExportMetricsServiceRequest, context: Any) -> mpb.ExportMetricsServiceResponse:
        self.rx.add(request)
        return mpb.ExportMetricsServiceResponse()


def _http_server(rx: OtlpReceiver) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # the http.server interface
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            kind = {"/v1/traces": (tpb.ExportTraceServiceRequest, tpb.ExportTraceServiceResponse),
                    "/v1/metrics": (mpb.ExportMetricsServiceRequest, mpb.ExportMetricsServiceResponse)}.get(self.path)
            if kind is None:
                self.send_error(404)
                return
            request = kind[0]()
            request.ParseFromString(body)
            rx.add(request)
            reply = kind[1]().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


def main() -> None:
    """`python -m deployments.telemetry.receiver [--summary]`: print each new trace's tree as it arrives; with
    --summary print only the endpoints, then, when stdin closes, one JSON line of counts (benchmarks)."""
    import json
    import sys
    import time

    summary = "--summary" in sys.argv
    with OtlpReceiver() as receiver:
        print(json.dumps({"grpc": receiver.grpc_endpoint, "http": receiver.http_endpoint}), flush=True)
        if summary:
            sys.stdin.read()  # until the parent closes it
            print(json.dumps({"spans": len(receiver.spans()),
                              "metric_points": sum(len(p) for p in receiver.metrics().values())}), flush=True)
            return
        seen = 0
        while True:
            time.sleep(2.0)
            received = receiver.spans()
            for tid in sorted({s.trace_id for s in received[seen:]}):
                print(tree(received, tid), "\n", flush=True)
            seen = len(received)


if __name__ == "__main__":
    main()
