"""Per-process OpenTelemetry: providers from `TelemetryConfig`, W3C context helpers, metric instruments.

`setup(component)` runs once per process (every Ray actor calls it on start; later calls return the
same `Telemetry`). With telemetry off (the default: no OTLP endpoint, no exporter asked for) it builds
nothing: the tracer and meter are OpenTelemetry's no-op ones and callers skip their work on
`tel.traces` / `tel.metrics`, so the cost is an attribute read.

With it on, spans go through a `BatchSpanProcessor` and metrics through a
`PeriodicExportingMetricReader`: a background thread each, a bounded span queue (beyond it spans are
dropped, never waited for), and export failures retried or dropped off the caller's thread. Our own
providers are used, not the global ones, so nothing else in the process (Ray's tracing hook, a
library) changes what we export. The providers are not registered globally for the same reason.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from deployments.settings import TelemetryConfig
from deployments.telemetry import names as N

log = logging.getLogger(__name__)

Attributes = Mapping[str, str | bool | int | float]
_PROPAGATOR = TraceContextTextMapPropagator()
_NOISY_LOGGERS = ("opentelemetry.sdk._shared_internal", "opentelemetry.exporter.otlp.proto.grpc.exporter",
                  "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                  "opentelemetry.exporter.otlp.proto.http.metric_exporter",
                  "opentelemetry.sdk.metrics._internal.export")


class _EveryMinute(logging.Filter):
    """Let one record per message template through per minute: a dead collector must not flood the logs."""

    def __init__(self, period_s: float = 60.0) -> None:
        super().__init__()
        self.period_s = period_s
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        now, key = time.monotonic(), str(record.msg)
        if now - self._last.get(key, float("-inf")) < self.period_s:
            return False
        self._last[key] = now
        return True


# ------------------------------------------------------------------------------------------ context


def extract(carrier: Mapping[str, str] | None) -> otel_context.Context:
    """A W3C `traceparent`/`tracestate` carrier -> a context (empty when absent or malformed)."""
    return _PROPAGATOR.extract(dict(carrier or {}), context=otel_context.Context())


def inject(ctx: otel_context.Context) -> dict[str, str]:
    """A context -> its W3C `traceparent`/`tracestate` carrier (empty when it holds no valid span)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


def span_context(ctx: otel_context.Context) -> SpanContext | None:
    sc = trace.get_current_span(ctx).get_span_context()
    return sc if sc.is_valid else None


def context_of(span: Span) -> otel_context.Context:
    return trace.set_span_in_context(span, otel_context.Context())


def fail(span: Span, error_type: str) -> None:
    """Mark `span` failed with a machine-readable `error.type` (never an exception message: it may hold data)."""
    span.set_status(Status(StatusCode.ERROR))
    span.set_attribute(N.ERROR_TYPE, error_type)


def links_to(*contexts: otel_context.Context | None) -> list[Link]:
    return [Link(sc) for c in contexts if c is not None and (sc := span_context(c)) is not None]


# ------------------------------------------------------------------------------------------ metrics


class Instrument:
    """One metric of `names.METRICS`, recorded into OpenTelemetry and, when asked, `ray.util.metrics`.

    Gauges are observable: `set_all` replaces every current value at once (an atomic swap the export
    thread reads), so a gauge reports exactly the series its owner holds now and no stale ones."""

    def __init__(self, spec: N.MetricSpec, meter: otel_metrics.Meter, ray_metrics: bool) -> None:
        self.spec = spec
        self._values: dict[tuple[tuple[str, Any], ...], float] = {}
        self._otel: Any
        if spec.kind == "histogram":
            self._otel = meter.create_histogram(spec.name, spec.unit, spec.description,
                                                explicit_bucket_boundaries_advisory=spec.buckets or None)
        elif spec.kind == "counter":
            self._otel = meter.create_counter(spec.name, spec.unit, spec.description)
        else:
            self._otel = meter.create_observable_gauge(spec.name, [self._observe], spec.unit, spec.description)
        self._ray: Any = _ray_twin(spec) if ray_metrics else None

    def record(self, value: float, attributes: Attributes | None = None) -> None:
        """A histogram sample or a counter increment."""
        if self.spec.kind == "histogram":
            self._otel.record(value, attributes)
        else:
            self._otel.add(value, attributes)
        if self._ray is not None:
            tags = _tags(attributes)
            if self.spec.kind == "histogram":
                self._ray.observe(value, tags=tags)
            elif value > 0:  # ray.util.metrics counters refuse 0 (OTel's make the series exist)
                self._ray.inc(value, tags=tags)

    def set_all(self, values: Mapping[tuple[tuple[str, Any], ...], float]) -> None:
        """A gauge's current series: {((key, value), ...): number}; series not named stop reporting."""
        self._values = dict(values)
        if self._ray is not None:
            for attrs, value in self._values.items():
                self._ray.set(value, tags=_tags(dict(attrs)))

    def _observe(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(v, dict(a)) for a, v in self._values.items()]


def _tags(attributes: Attributes | None) -> dict[str, str] | None:
    return {k.replace(".", "_"): str(v) for k, v in attributes.items()} if attributes else None


def _ray_twin(spec: N.MetricSpec) -> Any:
    from ray.util import metrics as ray_metrics

    keys = tuple(k.replace(".", "_") for k in spec.attributes) or None
    name = spec.prometheus.removesuffix("_total") if spec.kind == "counter" else spec.prometheus
    if spec.kind == "histogram":
        return ray_metrics.Histogram(name, spec.description, list(spec.buckets), tag_keys=keys)
    if spec.kind == "counter":
        return ray_metrics.Counter(name, spec.description, tag_keys=keys)
    return ray_metrics.Gauge(name, spec.description, tag_keys=keys)


# ------------------------------------------------------------------------------------------ the process


class Telemetry:
    """This process's tracer, meter and instruments (see the module docstring)."""

    def __init__(self, config: TelemetryConfig, component: str, instance: str) -> None:
        self.config, self.component, self.instance = config, component, instance
        self.traces, self.metrics, self.enabled = config.traces, config.metrics, config.enabled
        self._tracer_provider: Any = None
        self._meter_provider: Any = None
        self.tracer: trace.Tracer = trace.NoOpTracer()
        self.meter: otel_metrics.Meter = otel_metrics.NoOpMeter("characters")
        if config.enabled:
            self._start()
        self.instruments = {s.name: Instrument(s, self.meter, config.ray_metrics) for s in N.METRICS}

    def instrument(self, spec: N.MetricSpec) -> Instrument:
        return self.instruments[spec.name]

    def _start(self) -> None:
        from opentelemetry.sdk.resources import Resource

        resource = Resource.create({**self.config.resource, "service.name": self.config.service_name,
                                    "service.instance.id": self.instance, N.COMPONENT: self.component})
        for name in _NOISY_LOGGERS:
            logging.getLogger(name).addFilter(_EveryMinute())
        if self.config.traces:
            self._tracer_provider = _tracer_provider(self.config, resource)
            self.tracer = self._tracer_provider.get_tracer("characters")
        if self.config.metrics_endpoint:
            self._meter_provider = _meter_provider(self.config, resource)
            self.meter = self._meter_provider.get_meter("characters")

    def start_span(self, name: str, parent: otel_context.Context | None, *, start_ns: int | None = None,
                   kind: SpanKind = SpanKind.INTERNAL, attributes: Attributes | None = None,
                   links: Sequence[Link] = ()) -> Span:
        """A span under `parent` (None or an empty context: a new trace), optionally back-dated."""
        return self.tracer.start_span(name, context=parent or otel_context.Context(), kind=kind,
                                      attributes=attributes, links=links, start_time=start_ns)

    def flush(self, timeout_s: float = 2.0) -> None:
        """Export what is queued now, waiting at most about `timeout_s` per signal (call it off the loop)."""
        ms = int(timeout_s * 1000)
        for provider in (self._tracer_provider, self._meter_provider):
            if provider is not None:
                try:
                    provider.force_flush(ms)
                except Exception as err:  # noqa: BLE001 - an exporter's failure must never fail the caller
                    log.warning("telemetry flush failed: %s", type(err).__name__)

    def flush_in_background(self, timeout_s: float = 2.0) -> None:
        if self._tracer_provider is not None or self._meter_provider is not None:
            threading.Thread(target=self.flush, args=(timeout_s,), name="telemetry-flush", daemon=True).start()

    def shutdown(self) -> None:
        for provider in (self._tracer_provider, self._meter_provider):
            if provider is not None:
                provider.shutdown()


def _sampler(config: TelemetryConfig) -> Any:
    from opentelemetry.sdk.trace import sampling

    root = {"always_on": sampling.ALWAYS_ON, "always_off": sampling.ALWAYS_OFF,
            "traceidratio": sampling.TraceIdRatioBased(config.sampler_arg)}
    name = config.sampler.removeprefix("parentbased_")
    return sampling.ParentBased(root[name]) if config.sampler.startswith("parentbased_") else root[name]


def _tracer_provider(config: TelemetryConfig, resource: Any) -> Any:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpans

        exporter: Any = GrpcSpans(endpoint=config.traces_endpoint, headers=config.headers or None,
                                  timeout=config.timeout_s, insecure=config.traces_endpoint.startswith("http://"))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpans

        exporter = HttpSpans(endpoint=config.traces_endpoint, headers=config.headers or None,
                             timeout=config.timeout_s)
    provider = TracerProvider(resource=resource, sampler=_sampler(config))
    provider.add_span_processor(BatchSpanProcessor(
        exporter, max_queue_size=config.bsp_max_queue_size, schedule_delay_millis=config.bsp_schedule_delay_ms,
        max_export_batch_size=config.bsp_max_export_batch_size))
    return provider


def _meter_provider(config: TelemetryConfig, resource: Any) -> Any:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetrics

        exporter: Any = GrpcMetrics(endpoint=config.metrics_endpoint, headers=config.headers or None,
                                    timeout=config.timeout_s, insecure=config.metrics_endpoint.startswith("http://"))
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetrics

        exporter = HttpMetrics(endpoint=config.metrics_endpoint, headers=config.headers or None,
                               timeout=config.timeout_s)
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=config.metric_export_interval_ms,
                                           export_timeout_millis=config.metric_export_timeout_ms)
    return MeterProvider(resource=resource, metric_readers=[reader])


_lock = threading.Lock()
_current: Telemetry | None = None


def setup(component: str, *, instance: str | None = None, config: TelemetryConfig | None = None) -> Telemetry:
    """This process's telemetry, built on the first call from `config` (default: the environment)."""
    global _current
    with _lock:
        if _current is None:
            _current = Telemetry(config or TelemetryConfig.from_env(), component, instance or _instance(component))
        return _current


def current() -> Telemetry:
    """This process's telemetry (set up as `component="process"` if nobody did yet)."""
    return _current if _current is not None else setup("process")


def reset_for_tests(replacement: Telemetry | None = None) -> Telemetry | None:
    """Swap this process's telemetry (unit tests and benchmarks); returns the previous one, not shut down."""
    global _current
    with _lock:
        previous, _current = _current, replacement
        return previous


def _instance(component: str) -> str:
    """service.instance.id: the Ray actor's name where it has one (stable per slot), else unique."""
    try:
        import ray

        if ray.is_initialized():
            name = ray.get_runtime_context().get_actor_name()
            if name:
                return str(name)
    except (ImportError, RuntimeError, AttributeError):  # no Ray context: a unique id
        pass
    return f"{component}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def time_ns_of(monotonic_s: float) -> int:
    """A `time.monotonic()` reading (any process of this node) -> epoch nanoseconds, for back-dated spans."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


__all__ = ["Attributes", "Instrument", "Telemetry", "context_of", "current", "extract", "fail", "inject",
           "links_to", "reset_for_tests", "setup", "span_context", "time_ns_of"]
