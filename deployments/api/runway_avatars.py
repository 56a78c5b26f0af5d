"""The `/v1/avatars` routes as Runway's API has them, and the one-time processing of an avatar's reference image.

    POST   /v1/avatars          {name, personality, referenceImage, voice, startScript?, documentIds?,
                                 imageProcessing?} -> 201 avatar (PROCESSING); the native {image, name?} still works
    GET    /v1/avatars          ?limit=1..100 (20) &cursor= -> {data: [avatar], nextCursor}   newest first
    GET    /v1/avatars/{id}     -> avatar: PROCESSING | READY | FAILED (failureReason)
    PATCH  /v1/avatars/{id}     any of the create fields (at least one; startScript null clears it) -> avatar
    DELETE /v1/avatars/{id}     -> 204

A key sees only its own avatars (another's is 404, as an unknown id; an operator key sees all). The reference
image is a `data:image/...;base64,` URI, checked at once (base64, size, and a header that is an image: 4xx
naming `referenceImage`), or an http(s) URL, which the server fetches only when it lies under one of
`api.avatar_image_url_prefixes` (empty by default: a URL is refused with 422). Processing (fetching, decoding,
resizing to the served preset's resolution) then runs once, in the background: the avatar answers PROCESSING
until it is READY, or FAILED with the reason; a session on a READY avatar uses the processed image as is.
`imageProcessing` is stored: both values get the one cover-resize the model needs, nothing more.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.error
import urllib.request
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from deployments.api.avatars import (
    VOICE_PRESETS,
    Avatar,
    AvatarListOut,
    AvatarOut,
    avatar_out,
)
from deployments.api.errors import ApiError, ErrorCode, error_responses
from deployments.api.frontend import SessionFrontend
from deployments.api.requests import ApiConfig, caller, decode_base64_image, load_avatar, probe_image

logger = logging.getLogger(__name__)

REFERENCE_FIELD = "referenceImage"
FETCH_TIMEOUT_S = 10.0
MAX_TEXT = 20_000  # characters of a personality or start script


class _In(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, extra="forbid", frozen=True, strict=True)


class PresetVoiceIn(_In):
    type: Literal["runway-live-preset"]
    preset_id: Literal[VOICE_PRESETS] = Field(description="A Runway Live preset voice.")  # type: ignore[valid-type]


class CustomVoiceIn(_In):
    type: Literal["custom"]
    id: str = Field(min_length=1, max_length=128, description="A voice id of your own (stored as given).")


VoiceIn = Annotated[PresetVoiceIn | CustomVoiceIn, Field(discriminator="type")]


class AvatarUpdateIn(_In):
    name: str | None = Field(default=None, min_length=1, max_length=128, description="The character's name.")
    personality: str | None = Field(default=None, max_length=MAX_TEXT, description="Stored (your agent's prompt).")
    reference_image: str | None = Field(default=None, description="A data:image/(png|jpeg|webp);base64, URI, or an "
                                        "http(s) URL under the server's allowed prefixes.")
    voice: VoiceIn | None = None
    start_script: str | None = Field(default=None, max_length=MAX_TEXT, description="Stored; null clears it.")
    document_ids: list[Annotated[str, Field(min_length=1, max_length=128)]] | None = Field(default=None, max_length=64)
    image_processing: Literal["optimize", "none"] | None = None


class AvatarCreateIn(AvatarUpdateIn):
    """Runway's body (name, personality, referenceImage and voice required), or the native one ({image, name?})."""

    image: str | None = Field(default=None, description="Native form: the reference image in base64 (a data URL "
                              "prefix is accepted); then name is optional and the Runway fields are not needed.",
                              json_schema_extra={"format": "byte"})


def _required(body: AvatarCreateIn) -> None:
    if body.image is not None:
        if body.reference_image is not None:
            raise ApiError(422, ErrorCode.INVALID_FIELD, "give referenceImage (Runway's form) or image (the native "
                           "form), not both", "image")
        return
    for name, value in (("referenceImage", body.reference_image), ("name", body.name),
                        ("personality", body.personality), ("voice", body.voice)):
        if value is None:
            hint = (" (a data:image/png;base64,... URI; the native form sends image instead)"
                    if name == REFERENCE_FIELD else "")
            raise ApiError(422, ErrorCode.INVALID_FIELD, f"is required{hint}", name)


# ----------------------------------------------------------------------------------------- processing


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:  # a redirect could leave the allowed prefixes
        return None


def fetch_image(url: str, config: ApiConfig) -> bytes:
    """GET an allowed image URL: no redirects, image/* only, at most `max_image_bytes`; ApiError says why not."""
    opener = urllib.request.build_opener(_NoRedirects)
    request = urllib.request.Request(url, headers={"Accept": "image/png, image/jpeg, image/webp",
                                                   "User-Agent": "realtime-characters"})
    try:
        with opener.open(request, timeout=FETCH_TIMEOUT_S) as resp:
            kind = resp.headers.get_content_type()
            if not kind.startswith("image/"):
                raise ApiError(422, ErrorCode.INVALID_IMAGE, f"answered {kind!r}, not an image", REFERENCE_FIELD)
            raw: bytes = resp.read(config.max_image_bytes + 1)
    except urllib.error.HTTPError as e:
        raise ApiError(422, ErrorCode.INVALID_IMAGE, f"answered HTTP {e.code} (redirects are not followed)",
                       REFERENCE_FIELD) from e
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ApiError(422, ErrorCode.INVALID_IMAGE, f"could not be fetched ({type(e).__name__}: {str(reason)[:120]})",
                       REFERENCE_FIELD) from e
    probe_image(raw, config, REFERENCE_FIELD, identify=True)
    return raw


def image_source(value: str, config: ApiConfig, field: str = REFERENCE_FIELD) -> bytes | str:
    """A data URI's file bytes (checked now: 4xx naming `field`), or an allowed URL to fetch while processing."""
    if value.startswith("data:"):
        raw = decode_base64_image(value, config, field)
        probe_image(raw, config, field, identify=True)
        return raw
    if value.startswith(("https://", "http://")):
        if not config.avatar_image_url_prefixes:
            raise ApiError(422, ErrorCode.INVALID_FIELD, "is a URL, and this server fetches none (its "
                           "api.avatar_image_url_prefixes is empty); send a data:image/png;base64,... URI", field)
        if not value.startswith(config.avatar_image_url_prefixes):
            raise ApiError(422, ErrorCode.INVALID_FIELD, "is a URL outside the prefixes this server fetches from "
                           f"({', '.join(config.avatar_image_url_prefixes)}); send a data URI instead", field)
        return value
    raise ApiError(422, ErrorCode.INVALID_FIELD, "must be a data:image/(png|jpeg|webp);base64, URI or an https URL "
                   "(Runway upload URIs are not served here)", field)


class AvatarProcessor:
    """Processes reference images in the background (this replica's event loop), then settles the avatar."""

    def __init__(self, frontend: SessionFrontend) -> None:
        self.frontend = frontend
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, avatar: Avatar, source: bytes | str) -> None:
        task = asyncio.get_running_loop().create_task(self._run(avatar, source), name=f"avatar-{avatar.id[:8]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, avatar: Avatar, source: bytes | str) -> None:
        config, preset = self.frontend.config, self.frontend.resolve_preset(None)
        image, failure = None, None
        try:
            raw = source if isinstance(source, bytes) else await asyncio.to_thread(fetch_image, source, config)
            image = await asyncio.to_thread(load_avatar, raw, preset, config, REFERENCE_FIELD)
        except ApiError as e:
            failure = f"referenceImage {e.message}"
        except Exception as e:  # whatever went wrong, the avatar must settle
            logger.exception("processing avatar %s failed (%s)", avatar.id, type(e).__name__)
            failure = f"processing failed ({type(e).__name__}); the server log has the details"
        try:
            await self.frontend.avatars.finish(avatar.id, avatar.version, image, failure, time.time())
        except ApiError as e:  # the registry is unreachable: the avatar reads FAILED after the timeout
            logger.warning("avatar %s processed but not stored: %s", avatar.id, e.code)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


# --------------------------------------------------------------------------------------------- routes


def _voice(voice: PresetVoiceIn | CustomVoiceIn | None) -> dict[str, str] | None:
    if voice is None:
        return None
    return {"type": "custom", "id": voice.id} if isinstance(voice, CustomVoiceIn) else {
        "type": "runway-live-preset", "presetId": voice.preset_id}


def add_avatar_routes(app: FastAPI, frontend: SessionFrontend, route: dict[str, Any]) -> AvatarProcessor:
    """The routes above on `app` (`route`: the Runway routes' common options: auth, tags, dependencies)."""
    config, processor = frontend.config, AvatarProcessor(frontend)

    @app.post("/v1/avatars", status_code=201, response_model=AvatarOut, **route,
              responses=error_responses(400, 401, 413, 422), summary="Create an avatar (Runway; or the native body)")
    async def create_avatar(body: AvatarCreateIn, request: Request, response: Response) -> Any:
        _required(body)
        who = caller(request)
        source: bytes | str
        if body.image is not None:
            raw = await asyncio.to_thread(decode_base64_image, body.image, config, "image")
            await asyncio.to_thread(probe_image, raw, config, "image", identify=True)
            source = raw
        else:
            assert body.reference_image is not None
            source = await asyncio.to_thread(image_source, body.reference_image, config)
        now = time.time()
        avatar = await frontend.avatars.add(Avatar(
            id="", owner=who.key_id, name=body.name or "", personality=body.personality or "", voice=_voice(body.voice),
            start_script=body.start_script, document_ids=tuple(body.document_ids or ()),
            image_processing=body.image_processing or "optimize", created_at=now, updated_at=now))
        processor.start(avatar, source)
        response.headers["Location"] = f"/v1/avatars/{avatar.id}"
        return avatar_out(avatar, now)

    @app.get("/v1/avatars", response_model=AvatarListOut, **route, responses=error_responses(401, 422),
             summary="List your avatars (newest first)")
    async def list_avatars(request: Request, limit: int = Query(20, ge=1, le=100),
                           cursor: str | None = Query(None, max_length=64)) -> AvatarListOut:
        avatars, next_cursor = await frontend.avatars.page(caller(request), limit, cursor)
        now = time.time()
        return AvatarListOut(data=[avatar_out(a, now) for a in avatars], next_cursor=next_cursor)

    @app.get("/v1/avatars/{avatar_id}", response_model=AvatarOut, **route, responses=error_responses(401, 404, 422),
             summary="Get an avatar")
    async def get_avatar(avatar_id: str, request: Request) -> Any:
        return avatar_out(await frontend.avatars.get(avatar_id, caller(request)), time.time())

    @app.patch("/v1/avatars/{avatar_id}", response_model=AvatarOut, **route,
               responses=error_responses(400, 401, 404, 413, 422), summary="Update an avatar")
    async def update_avatar(avatar_id: str, body: AvatarUpdateIn, request: Request) -> Any:
        given = body.model_fields_set
        if not given:
            raise ApiError(422, ErrorCode.INVALID_FIELD, "the body names no field; give at least one of name, "
                           "personality, referenceImage, voice, startScript, documentIds, imageProcessing")
        for name in given - {"start_script"}:
            if getattr(body, name) is None:
                raise ApiError(422, ErrorCode.INVALID_FIELD, "may not be null (only startScript may)", to_camel(name))
        avatar = await frontend.avatars.get(avatar_id, caller(request))
        source = (await asyncio.to_thread(image_source, body.reference_image, config)
                  if body.reference_image is not None else None)
        changes: dict[str, Any] = {}
        for name in given - {"reference_image"}:
            value = getattr(body, name)
            changes[name] = (_voice(value) if name == "voice" else tuple(value) if name == "document_ids" else value)
        updated = await frontend.avatars.update(avatar, changes, time.time(), new_image=source is not None)
        if source is not None:
            processor.start(updated, source)
        return avatar_out(updated, time.time())

    @app.delete("/v1/avatars/{avatar_id}", status_code=204, **route, responses=error_responses(401, 404, 422),
                summary="Delete an avatar")
    async def delete_avatar(avatar_id: str, request: Request) -> Response:
        await frontend.avatars.delete(avatar_id, caller(request))
        return Response(status_code=204)

    return processor
