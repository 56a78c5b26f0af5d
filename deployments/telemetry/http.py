"""HTTP request tracing for the Serve ingress: an ASGI middleware installed by `deployments.api.app`.

Each request (but `/healthz` and CORS preflights) gets a SERVER span named `{method} {route}`, a child of
the caller's W3C `traceparent`/`tracestate` when it sent one. The middleware then *replaces* those two
headers, for the application below it, with the server span's context: the routes copy them into
`SessionSpec.trace_context` unchanged, so the scheduler and every actor of the session continue the
request's trace under its server span. With tracing off the request passes through untouched.

Recorded: method, route template (never the raw path's query string), status code, error type.
Never headers, bodies or the API key.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from opentelemetry.trace import SpanKind
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployments import telemetry
from deployments.telemetry import fail
from deployments.telemetry import names as N

UNTRACED_PATHS = frozenset({"/healthz"})
_TRACE_HEADERS = (b"traceparent", b"tracestate")


class TracingMiddleware:
    """ASGI middleware (see the module docstring); outermost, so its span covers auth and body limits."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.tel = telemetry.setup("ingress")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or not self.tel.traces or scope.get("path") in UNTRACED_PATHS
                or scope.get("method") == "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = list(scope.get("headers", []))
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k in _TRACE_HEADERS}
        method = str(scope.get("method", "GET"))
        span = self.tel.start_span(N.http_span_name(method, "unmatched"), telemetry.extract(carrier),
                                   kind=SpanKind.SERVER, attributes={N.HTTP_METHOD: method})
        downstream = telemetry.inject(telemetry.context_of(span))
        scope = dict(scope)
        scope["headers"] = [(k, v) for k, v in headers if k not in _TRACE_HEADERS] + [
            (k.encode("latin-1"), v.encode("latin-1")) for k, v in downstream.items()]
        status: dict[str, int] = {}

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except BaseException as err:
            fail(span, type(err).__name__)
            raise
        finally:
            _finish(span, scope, method, status.get("code"))


def _finish(span: Any, scope: Scope, method: str, code: int | None) -> None:
    route = getattr(scope.get("route"), "path", None)  # the matched template, set by the router
    if route:
        span.update_name(N.http_span_name(method, route))
        span.set_attribute(N.HTTP_ROUTE, route)
    if code is not None:
        span.set_attribute(N.HTTP_STATUS, code)
        if code >= 500:
            fail(span, str(code))
    span.end()


def install(app: FastAPI) -> FastAPI:
    """Add request tracing as the outermost middleware of `app` (before it serves its first request)."""
    app.add_middleware(TracingMiddleware)
    return app
