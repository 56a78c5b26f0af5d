"""One error shape for every refusal the API gives, over HTTP and gRPC.

HTTP: every 4xx/5xx body is ``{"error": {"code": str, "message": str, "field": str | null}}``. `code` is
machine-readable (the table below); `message` says what was wrong, the value or limit, and what to do;
`field` is the dotted path of the request field at fault (``avatar.image``, ``maxDuration``), or null.

| code                    | HTTP | gRPC               | when                                                    |
|-------------------------|------|--------------------|---------------------------------------------------------|
| invalid_json            | 400  | -                  | the body is not JSON (or nested too deeply to parse)    |
| invalid_field           | 422  | INVALID_ARGUMENT   | a field is missing, unknown, of the wrong type or range |
| invalid_image           | 422  | INVALID_ARGUMENT   | avatar.image is not base64 or not a decodable image     |
| image_too_large         | 413  | INVALID_ARGUMENT   | avatar.image over the base64/bytes/pixel limits         |
| body_too_large          | 413  | -                  | the request body is over the size limit                 |
| rejected                | 422  | INVALID_ARGUMENT   | the scheduler refused the request (its message says why)|
| missing_api_key         | 401  | UNAUTHENTICATED    | keys are configured and no Bearer key was sent          |
| invalid_api_key         | 401  | UNAUTHENTICATED    | the Bearer key is not one of the configured keys        |
| not_found               | 404  | -                  | no such route                                           |
| session_not_found       | 404  | NOT_FOUND          | no session with that id (or another API key's)          |
| avatar_not_found        | 404  | -                  | no avatar with that id (or another API key's); 422 when |
|                         |      |                    | a request field names it                                |
| avatar_not_ready        | 422  | -                  | a session asks for an avatar not READY                  |
| missing_session_key,    | 401  | -                  | consume without, or with a wrong / used / expired,      |
|  invalid_session_key    |      |                    | session key                                             |
| session_not_ready       | 409  | -                  | consume of a session not READY                          |
| method_not_allowed      | 405  | -                  | the route exists but not with this method               |
| quota_exceeded          | 429  | RESOURCE_EXHAUSTED | the API key has CHARACTERS_MAX_SESSIONS_PER_KEY live    |
|                         |      |                    | sessions; carries Retry-After                           |
| no_capacity (or the     | 503  | RESOURCE_EXHAUSTED | no whole GPU bundle free and the queue is full; carries |
|  scheduler's own code)  |      |                    | Retry-After (HTTP header / gRPC trailing metadata)      |
| scheduler_unavailable   | 503  | UNAVAILABLE        | the scheduler actor cannot be reached                   |
| internal                | 500  | INTERNAL           | a bug; the message carries no request content           |
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class ErrorCode(enum.StrEnum):
    INVALID_JSON = "invalid_json"
    INVALID_FIELD = "invalid_field"
    INVALID_IMAGE = "invalid_image"
    IMAGE_TOO_LARGE = "image_too_large"
    BODY_TOO_LARGE = "body_too_large"
    MISSING_API_KEY = "missing_api_key"
    INVALID_API_KEY = "invalid_api_key"
    REJECTED = "rejected"
    NOT_FOUND = "not_found"
    SESSION_NOT_FOUND = "session_not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    NO_CAPACITY = "no_capacity"
    QUOTA_EXCEEDED = "quota_exceeded"
    SCHEDULER_UNAVAILABLE = "scheduler_unavailable"
    INTERNAL = "internal"


class ErrorDetail(BaseModel):
    code: str = Field(description="Machine-readable error code, e.g. invalid_field, no_capacity.")
    message: str = Field(description="What was wrong, the value or limit, and what to do next.")
    field: str | None = Field(default=None, description="Dotted path of the request field at fault, or null.")


class ErrorBody(BaseModel):
    """The body of every 4xx/5xx response."""

    error: ErrorDetail


class ApiError(Exception):
    """A refusal with its HTTP status, code, message and field; `retry_after_s` adds Retry-After."""

    def __init__(
        self, status: int, code: str, message: str, field: str | None = None, retry_after_s: float | None = None,
        no_retry: bool = False,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field
        self.retry_after_s, self.no_retry = retry_after_s, no_retry

    @property
    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.retry_after_s is not None:
            out["Retry-After"] = str(retry_after_header(self.retry_after_s))
        if self.status == 401:
            out["WWW-Authenticate"] = "Bearer"
        if self.no_retry:  # the Runway SDKs retry 5xx unless told not to (a configuration error stays one)
            out["x-should-retry"] = "false"
        return out

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "field": self.field}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    @property
    def grpc_code(self) -> grpc.StatusCode:
        if self.status in (400, 413, 422):
            return grpc.StatusCode.INVALID_ARGUMENT
        if self.status == 401:
            return grpc.StatusCode.UNAUTHENTICATED
        if self.status == 404:
            return grpc.StatusCode.NOT_FOUND
        if self.status == 429:
            return grpc.StatusCode.RESOURCE_EXHAUSTED
        if self.status == 503:
            return (grpc.StatusCode.UNAVAILABLE if self.code == ErrorCode.SCHEDULER_UNAVAILABLE
                    else grpc.StatusCode.RESOURCE_EXHAUSTED)
        return grpc.StatusCode.INTERNAL

    def grpc_details(self, field_names: dict[str, str] | None = None) -> str:
        """The gRPC status message: the HTTP message, prefixed with the field (named as in the proto)."""
        if self.field is None:
            return f"{self.code}: {self.message}"
        name = (field_names or {}).get(self.field, self.field)
        return f"{self.code}: {name}: {self.message}"


def retry_after_header(seconds: float) -> int:
    """Retry-After is whole seconds (RFC 9110); round up, at least 1."""
    return max(1, math.ceil(seconds)) if math.isfinite(seconds) else 1


# ------------------------------------------------------------------------------------ request validation


MAX_FIELD_NAME_CHARS = 64  # a field name echoed in an error is cut here (names are client input)


def field_name(part: Any) -> str:
    """A client-given name as an error names it: '' for an empty one, cut at MAX_FIELD_NAME_CHARS."""
    text = str(part)
    if not text:
        return "''"
    return text if len(text) <= MAX_FIELD_NAME_CHARS else text[:MAX_FIELD_NAME_CHARS] + "..."


def _field_path(loc: tuple[Any, ...] | list[Any]) -> str | None:
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:]
    return ".".join(field_name(p) for p in parts) or None


def _describe(err: Mapping[str, Any]) -> str:
    kind, msg = err.get("type", ""), err.get("msg", "invalid value")
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        return "is not a known field; remove it (field names are camelCase, see /openapi.json)"
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    return f"is invalid: {msg[0].lower() + msg[1:]}" if msg else "is invalid"


def validation_error(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """Pydantic/FastAPI validation errors -> one ApiError naming the first field (all are listed)."""
    if any(e.get("type") == "json_invalid" for e in errors):
        pos = next((e.get("ctx", {}).get("error") for e in errors if e.get("type") == "json_invalid"), None)
        return ApiError(400, ErrorCode.INVALID_JSON,
                        f"the request body is not valid JSON ({pos or 'parse error'}); send a JSON object "
                        "with Content-Type: application/json")
    if not errors:
        return ApiError(422, ErrorCode.INVALID_FIELD, "the request is invalid")
    parts = []
    for err in errors[:5]:
        field = _field_path(err.get("loc", ()))
        if field is None:
            parts.append("the request body is missing or not a JSON object; send a JSON object with "
                         "Content-Type: application/json"
                         if err.get("type") in ("missing", "model_attributes_type", "dict_type")
                         else f"the request body {_describe(err)}")
        else:
            parts.append(f"{field} {_describe(err)}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return ApiError(422, ErrorCode.INVALID_FIELD, "; ".join(parts) + more, field=_field_path(errors[0].get("loc", ())))


# ----------------------------------------------------------------------------------------- handlers


def _header(headers: Mapping[str, str] | None, name: str) -> str | None:
    return next((v for k, v in (headers or {}).items() if k.lower() == name), None)


def _allowed_methods(app: FastAPI, path: str) -> str:
    """Every method some route serves on `path` (Starlette's own Allow names only the first route's)."""
    methods: set[str] = set()
    for route in app.router.routes:
        regex, route_methods = getattr(route, "path_regex", None), getattr(route, "methods", None)
        if regex is not None and route_methods and regex.match(path):
            methods |= set(route_methods) - {"HEAD"}
    return ", ".join(sorted(methods))


def install_error_handlers(app: FastAPI) -> None:
    """Make every error FastAPI/Starlette produce (404, 405, validation, crashes) take the one shape."""

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return validation_error(exc.errors()).response()

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            err = ApiError(404, ErrorCode.NOT_FOUND,
                           f"no route {request.method} {request.url.path}; see /openapi.json for the endpoints")
        elif exc.status_code == 405:
            allowed = _allowed_methods(app, request.url.path) or _header(exc.headers, "allow") or "see /openapi.json"
            err = ApiError(405, ErrorCode.METHOD_NOT_ALLOWED,
                           f"{request.method} is not allowed on {request.url.path}; allowed: {allowed}")
            exc.headers = {**(exc.headers or {}), "Allow": allowed}
        elif exc.status_code == 400:  # FastAPI could not parse the body: nested too deeply, a number too long
            err = ApiError(400, ErrorCode.INVALID_JSON,
                           "the request body could not be parsed as JSON (nested too deeply, or a number with too "
                           "many digits); send a JSON object as in /openapi.json with Content-Type: application/json")
        else:
            err = ApiError(exc.status_code, "http_error" if exc.status_code < 500 else ErrorCode.INTERNAL,
                           str(exc.detail))
        resp = err.response()
        for key, value in (exc.headers or {}).items():
            resp.headers[key] = value
        return resp

    async def on_crash(request: Request, exc: Exception) -> JSONResponse:
        # The request's content (images, keys) never goes into the log: only the route and the exception type.
        logger.exception("internal error on %s %s (%s)", request.method, request.url.path, type(exc).__name__)
        return ApiError(500, ErrorCode.INTERNAL,
                        "internal error; the server log has the details; retry, and report it if it persists"
                        ).response()

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_crash)


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` entries documenting the error body (and Retry-After) for these statuses."""
    text = {400: "Malformed JSON", 401: "Missing or wrong API key", 404: "Unknown session",
            409: "Not in a state for it",
            413: "Body or image over the size limits", 422: "Invalid field",
            429: "The API key's live-session quota is used up (with Retry-After)",
            503: "No capacity (with Retry-After) or scheduler unavailable", 500: "Internal error"}
    out: dict[int | str, dict[str, Any]] = {}
    for s in statuses:
        out[s] = {"model": ErrorBody, "description": text.get(s, "Error")}
        if s in (429, 503):
            out[s]["headers"] = {"Retry-After": {"description": "Seconds to wait before retrying.",
                                                 "schema": {"type": "integer"}}}
    return out
