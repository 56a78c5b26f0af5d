"""What every HTTP route of the service shares: the API's limits (`ApiConfig`), the reference image's
decoding and validation, session ids, and what a request says of its caller (API key, trace context).

Used by the native routes (`deployments.api.http`), the Runway-compatible ones (`deployments.api.runway`),
the watch page and gRPC; it imports none of them.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import re
from urllib.parse import urlsplit

import numpy as np
from fastapi import Request
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, field_validator

from characters.config import MODEL_PRESETS
from characters.media import MediaError, load_image
from deployments import settings
from deployments.api.auth import Caller
from deployments.api.errors import ApiError, ErrorCode, field_name

MiB = 1024 * 1024
MAX_SESSION_ID_CHARS = 128


class ApiConfig(BaseModel):
    """What the API accepts; one per service (the `api` section of the app args)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # The limits' defaults come from CHARACTERS_* variables (deployments.settings), validated like given values.
    presets: tuple[str, ...] = Field(default=("tiny",), description="Presets served; the first is the default.")
    max_duration_s: float = Field(default_factory=settings.MAX_DURATION_S.get, gt=0, validate_default=True,
                                  description="Largest maxDuration a request may ask for.")
    max_body_bytes: int = Field(default_factory=settings.MAX_BODY_BYTES.get, ge=1024, validate_default=True,
                                description="Largest HTTP request body (413 above).")
    max_image_bytes: int = Field(default_factory=settings.MAX_IMAGE_BYTES.get, ge=1, validate_default=True,
                                 description="Largest decoded reference image file.")
    max_image_pixels: int = Field(default_factory=settings.MAX_IMAGE_PIXELS.get, ge=256, validate_default=True,
                                  description="Largest reference image width x height.")
    file_output: bool = Field(default=True, description="Accept output.kind=file (an MP4 under the service's "
                                                        "output directory); False: refuse it.")
    cors_origins: tuple[str, ...] = Field(default_factory=settings.CORS_ORIGINS.get,
                                          description="Origins allowed by CORS; empty: CORS off.")
    max_audio_chunk_bytes: int = Field(default_factory=settings.MAX_AUDIO_CHUNK_BYTES.get, ge=2, validate_default=True,
                                       description="Largest PCM payload of one AudioChunk.")
    events_wait_s: float = Field(default=10.0, gt=0, description="Long-poll wait of one scheduler events() call.")
    avatar_image_url_prefixes: tuple[str, ...] = Field(
        default=(), description="URL prefixes (scheme://host[:port]/path/) an avatar's referenceImage may be fetched "
                                "from; empty (the default): the server fetches no URL, only data URIs are taken.")
    session_key_ttl_s: float = Field(default=600.0, gt=0, description="How long after its creation a realtime "
                                     "session's sessionKey may be consumed (once).")

    @field_validator("avatar_image_url_prefixes")
    @classmethod
    def _prefixes(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for prefix in value:
            parts = urlsplit(prefix)
            if parts.scheme not in ("https", "http") or not parts.netloc or "@" in parts.netloc \
                    or not parts.path.endswith("/") or parts.query or parts.fragment:
                raise ValueError(f"api.avatar_image_url_prefixes entry {prefix[:120]!r} must be scheme://host[:port]/"
                                 "path/ (https, or http for a trusted internal host), ending in '/', e.g. "
                                 "'https://cdn.example.com/avatars/'")
        return value

    @field_validator("presets")
    @classmethod
    def _known(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [p for p in value if p not in MODEL_PRESETS]
        if not value or unknown:
            raise ValueError(f"api.presets={list(value)} must be non-empty presets from {sorted(MODEL_PRESETS)}")
        return value

    @property
    def max_image_b64_chars(self) -> int:
        return 4 * math.ceil(self.max_image_bytes / 3)


IMAGE_FIELD = "avatar.image"


def decode_base64_image(data: str, config: ApiConfig, field: str = IMAGE_FIELD) -> bytes:
    """`avatar.image` (base64, optional data URL prefix) -> file bytes, under the size limits."""
    if data.startswith("data:"):
        header, sep, data = data.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ApiError(422, ErrorCode.INVALID_IMAGE, "a data URL must look like 'data:image/png;base64,<data>'",
                           field)
    if len(data) > config.max_image_b64_chars + len(data) // 64 + 2:  # slack for line breaks
        raise ApiError(413, ErrorCode.IMAGE_TOO_LARGE,
                       f"is {len(data)} base64 characters, over the limit of {config.max_image_b64_chars} "
                       f"({config.max_image_bytes} bytes decoded); downscale or recompress the image", field)
    try:
        raw = base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ApiError(422, ErrorCode.INVALID_IMAGE,
                       f"is not valid standard base64 ({e}); encode the image file's bytes with base64", field) from e
    return raw


def probe_image(raw: bytes, config: ApiConfig, field: str = IMAGE_FIELD, *, identify: bool = False) -> None:
    """Refuse, from the file's header alone, what `load_avatar` would: empty, too many bytes or pixels and, with
    `identify`, a file that is no image at all (without it, `load_avatar` words that one)."""
    if not raw:
        raise ApiError(422, ErrorCode.INVALID_IMAGE, "is empty; send a PNG, JPEG or WebP file", field)
    if len(raw) > config.max_image_bytes:
        raise ApiError(413, ErrorCode.IMAGE_TOO_LARGE,
                       f"is {len(raw)} bytes, over the limit of {config.max_image_bytes}; downscale or recompress it",
                       field)
    try:  # header only: refuse huge dimensions before anything is decoded
        with Image.open(io.BytesIO(raw)) as im:
            width, height = im.size
    except Image.DecompressionBombError as e:
        raise ApiError(413, ErrorCode.IMAGE_TOO_LARGE,
                       f"has too many pixels (limit {config.max_image_pixels}); downscale it", field) from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        if identify:
            raise ApiError(422, ErrorCode.INVALID_IMAGE, "is not a PNG, JPEG or WebP image (its header is not one); "
                           "send the image file's bytes", field) from e
        width = height = 0  # not an image: load_image gives the precise message
    if width * height > config.max_image_pixels:
        raise ApiError(413, ErrorCode.IMAGE_TOO_LARGE,
                       f"is {width}x{height} = {width * height} pixels, over the limit of {config.max_image_pixels}; "
                       "downscale it", field)


def load_avatar(raw: bytes, preset: str, config: ApiConfig, field: str = IMAGE_FIELD) -> np.ndarray:
    """Image file bytes -> `(H, W, 3)` uint8 at the preset's resolution; refusals name `field`."""
    probe_image(raw, config, field)
    gen = MODEL_PRESETS[preset].generation
    try:
        return load_image(raw, gen.height, gen.width, max_pixels=config.max_image_pixels)
    except MediaError as e:  # Pillow's text may name an in-memory file object: drop that noise
        raise ApiError(422, ErrorCode.INVALID_IMAGE, re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-f]+>", "", str(e)),
                       field) from e


def check_session_id(session_id: str, field: str = "id") -> str:
    if not session_id or len(session_id) > MAX_SESSION_ID_CHARS:
        raise ApiError(404, ErrorCode.SESSION_NOT_FOUND, f"no session with id {session_id[:MAX_SESSION_ID_CHARS]!r}",
                       field)
    return session_id


def key_id(request: Request) -> str | None:
    """The id of the API key that authenticated `request` (`deployments.api.auth`); None with keys off."""
    return getattr(request.state, "api_key_id", None)


def caller(request: Request) -> Caller:
    """Who made `request` (`deployments.api.auth.BearerAuthMiddleware` put it there). A route without an API
    key (open paths, the session-key route) has none: asking for it there is refused, never defaulted."""
    found = getattr(request.state, "caller", None)
    if not isinstance(found, Caller):
        raise ApiError(401, ErrorCode.MISSING_API_KEY, "this route needs an API key: 'Authorization: Bearer <key>'")
    return found


def trace_context(request: Request) -> dict[str, str]:
    """The request's W3C trace headers (traceparent, tracestate), for the session's spans."""
    return {k: v for k in ("traceparent", "tracestate") if (v := request.headers.get(k))}


def known_query(request: Request) -> None:
    """A route dependency: refuse query parameters the route does not take (422 naming the first), as the bodies
    refuse unknown fields, so a misspelt `?limt=` is an error rather than a silent default. An empty name counts too
    (`?=x`)."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None:
        return
    allowed: set[str] = set()
    todo = [dependant]  # the route's own parameters and its dependencies' (FastAPI's Dependant tree)
    while todo:
        node = todo.pop()
        allowed.update(p.alias for p in node.query_params)
        todo.extend(node.dependencies)
    unknown = [name for name in request.query_params if name not in allowed]
    if unknown:
        name, takes = field_name(unknown[0]), ", ".join(sorted(allowed)) or "none"
        raise ApiError(422, ErrorCode.INVALID_FIELD, f"{name} is not a query parameter of this route; remove it (it "
                       f"takes: {takes}; see /openapi.json)", name)
