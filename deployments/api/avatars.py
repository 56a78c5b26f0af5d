"""Avatars as Runway's API has them (`/v1/avatars`): the records, their store, and the shapes the routes answer.

An avatar is a name, a personality, a voice, an optional start script and document ids (all stored, see
docs/api.md for what a self-hosted character does with them) and a reference image, *processed once*:
decoded and resized to the served preset's resolution (`PROCESSING` -> `READY`, or `FAILED` with a reason). A
session on a READY avatar takes that processed image as it is; nothing is decoded again per session.

`AvatarStore` holds the records and processed images in memory (thread-safe, bounded, no exceptions); the
service's one shared actor (`deployments.api.app`) holds `deployments.store.AvatarRows` instead, the same calls
over the service's database. `AvatarRegistry` is what the routes call:
async, refusals as `ApiError`s, scoped to the caller (another tenant's avatar is 404, as an unknown one).
The routes and the processing are `deployments.api.runway_avatars`.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from deployments.api.auth import Caller
from deployments.api.errors import ApiError, ErrorCode

AvatarStatus = Literal["PROCESSING", "READY", "FAILED"]
PROCESSING_TIMEOUT_S = 60.0  # a PROCESSING avatar older than this reads FAILED (its replica died mid-way)
#: Runway Live's preset voices (the ids its SDKs accept). A self-hosted character does not speak by itself: the
#: voice is the user's agent's TTS; the id is kept so an application reads back what it set.
VOICE_PRESETS = ("victoria", "vincent", "clara", "drew", "skye", "max", "morgan", "felix", "mia", "marcus", "summer",
                 "ruby", "aurora", "jasper", "leo", "adrian", "nina", "emma", "blake", "david", "maya", "nathan", "sam",
                 "georgia", "petra", "adam", "zach", "violet", "roman", "luna")
AVATAR_NOT_FOUND = "avatar_not_found"


def iso(t: float | None) -> str | None:
    """Unix seconds -> RFC 3339 UTC ('...Z'), as Runway's API writes times."""
    return None if t is None else datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat().replace("+00:00", "Z")


# ------------------------------------------------------------------------------------------ records


@dataclass(frozen=True)
class Avatar:
    """One avatar (no image: the store keeps processed images apart, so lists never carry them)."""

    id: str
    owner: str | None  # the API key id that made it (its tenant)
    name: str
    personality: str
    voice: dict[str, str] | None  # {"type": "runway-live-preset", "presetId"} | {"type": "custom", "id"}; None: native
    start_script: str | None
    document_ids: tuple[str, ...]
    image_processing: Literal["optimize", "none"]
    created_at: float
    updated_at: float
    status: AvatarStatus = "PROCESSING"
    failure_reason: str | None = None
    version: int = 0  # bumped when the reference image changes: a stale processing result is dropped
    seq: int = 0  # creation order (the list's cursor), set by the store

    def settled(self, now: float) -> Avatar:
        """As of `now`: an avatar PROCESSING past the timeout reads FAILED."""
        if self.status == "PROCESSING" and now - self.updated_at > PROCESSING_TIMEOUT_S:
            return replace(self, status="FAILED", failure_reason=f"processing the reference image did not finish "
                           f"within {PROCESSING_TIMEOUT_S:g} s; send referenceImage again (PATCH) to retry")
        return self


@dataclass
class AvatarStore:
    """Avatars by id, at most `max_avatars` (a full store refuses; nothing is evicted). Thread-safe."""

    max_avatars: int = 256
    _avatars: dict[str, Avatar] = field(default_factory=dict)
    _images: dict[str, np.ndarray] = field(default_factory=dict)
    _seq: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, avatar: Avatar) -> Avatar | None:
        """Store a new avatar (given a fresh id and the next seq); None when the store is full."""
        with self._lock:
            if len(self._avatars) >= self.max_avatars:
                return None
            self._seq += 1
            avatar = replace(avatar, id=uuid.uuid4().hex, seq=self._seq)
            self._avatars[avatar.id] = avatar
            return avatar

    def get(self, avatar_id: str) -> Avatar | None:
        with self._lock:
            return self._avatars.get(avatar_id)

    def image(self, avatar_id: str) -> np.ndarray | None:
        """The processed reference image of a READY avatar ((H, W, 3) uint8, read-only), else None."""
        with self._lock:
            return self._images.get(avatar_id)

    def update(self, avatar_id: str, changes: dict[str, Any], now: float, new_image: bool = False) -> Avatar | None:
        """Apply `changes` (field -> value); `new_image`: the reference changed, so PROCESSING again (the old
        processed image is dropped and `version` bumped). None: no such avatar."""
        with self._lock:
            old = self._avatars.get(avatar_id)
            if old is None:
                return None
            if new_image:
                changes = {**changes, "status": "PROCESSING", "failure_reason": None, "version": old.version + 1}
                self._images.pop(avatar_id, None)
            new = self._avatars[avatar_id] = replace(old, **changes, updated_at=now)
            return new

    def finish(self, avatar_id: str, version: int, image: np.ndarray | None, failure: str | None,
               now: float) -> Avatar | None:
        """The end of processing `version`: READY with `image`, or FAILED with `failure`. Ignored (None) when the
        avatar is gone, or its reference changed since (another version is being processed)."""
        with self._lock:
            old = self._avatars.get(avatar_id)
            if old is None or old.version != version or old.status != "PROCESSING":
                return None
            if image is not None:
                image = np.ascontiguousarray(image)
                image.setflags(write=False)
                self._images[avatar_id] = image
            new = self._avatars[avatar_id] = replace(old, status="READY" if image is not None else "FAILED",
                                                     failure_reason=failure, updated_at=now)
            return new

    def delete(self, avatar_id: str) -> bool:
        with self._lock:
            self._images.pop(avatar_id, None)
            return self._avatars.pop(avatar_id, None) is not None

    def page(self, owner: str | None, everyone: bool, limit: int,
             before: int | None) -> tuple[list[Avatar], int | None]:
        """Newest first: up to `limit` avatars of `owner` (all of them with `everyone`) created before seq `before`,
        and the seq to continue from (None: that was the last page)."""
        with self._lock:
            mine = [a for a in sorted(self._avatars.values(), key=lambda a: -a.seq)
                    if (everyone or a.owner == owner) and (before is None or a.seq < before)]
        page = mine[:limit]
        return page, page[-1].seq if len(mine) > limit else None


# ----------------------------------------------------------------------------------------- registry


def encode_cursor(seq: int) -> str:
    return base64.urlsafe_b64encode(f"avatars:{seq}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    try:
        kind, _, seq = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode().partition(":")
        if kind == "avatars" and seq.isdigit():
            return int(seq)
    except (binascii.Error, UnicodeDecodeError, ValueError):
        pass
    raise ApiError(422, ErrorCode.INVALID_FIELD, "is not a cursor this server gave out; pass the nextCursor of the "
                   "previous page, or none for the first", "cursor")


class AvatarRegistry:
    """`/v1/avatars` as the routes see it: async, refusals as ApiErrors, scoped to the caller. Over an in-process
    `AvatarStore` by default (one process: tests, a single replica); `deployments.api.app.SharedAvatars` sends
    the same calls to the service's one shared actor, so every ingress replica sees every avatar."""

    def __init__(self, max_avatars: int = 256) -> None:
        self.max_avatars = max_avatars
        self._store = AvatarStore(max_avatars)

    async def _store_call(self, method: str, *args: Any) -> Any:
        return getattr(self._store, method)(*args)

    async def add(self, avatar: Avatar) -> Avatar:
        added = await self._store_call("add", avatar)
        if added is None:
            raise ApiError(422, ErrorCode.REJECTED, f"the avatar registry is full ({self.max_avatars} avatars, per "
                           "key in the service's database); delete unused ones with DELETE /v1/avatars/{id}")
        return added

    async def get(self, avatar_id: str, caller: Caller, field: str = "id") -> Avatar:
        """The avatar if `caller` may use it; unknown and another tenant's alike: 404 (422 for a request field)."""
        avatar = await self._store_call("get", avatar_id) if 0 < len(avatar_id) <= 128 else None
        if avatar is None or not caller.owns(avatar.owner):
            raise avatar_not_found(avatar_id, field)
        return avatar

    async def image(self, avatar_id: str, caller: Caller, field: str) -> np.ndarray:
        """The processed reference image of the caller's READY avatar; 422 while PROCESSING or when FAILED."""
        avatar = (await self.get(avatar_id, caller, field)).settled(time.time())
        image = await self._store_call("image", avatar_id) if avatar.status == "READY" else None
        if image is None:
            detail = (f"is {avatar.status} ({avatar.failure_reason})" if avatar.status == "FAILED" else
                      f"is {avatar.status}; poll GET /v1/avatars/{{id}} until its status is READY")
            raise ApiError(422, "avatar_not_ready", f"avatar {avatar_id!r} {detail}", field)
        return image

    async def update(self, avatar: Avatar, changes: dict[str, Any], now: float, new_image: bool) -> Avatar:
        updated = await self._store_call("update", avatar.id, changes, now, new_image)
        if updated is None:
            raise avatar_not_found(avatar.id, "id")
        return updated

    async def finish(self, avatar_id: str, version: int, image: np.ndarray | None, failure: str | None,
                     now: float) -> Avatar | None:
        return await self._store_call("finish", avatar_id, version, image, failure, now)

    async def delete(self, avatar_id: str, caller: Caller) -> None:
        await self.get(avatar_id, caller)
        if not await self._store_call("delete", avatar_id):
            raise avatar_not_found(avatar_id, "id")

    async def page(self, caller: Caller, limit: int, cursor: str | None) -> tuple[list[Avatar], str | None]:
        before = decode_cursor(cursor) if cursor else None
        avatars, more = await self._store_call("page", caller.key_id, caller.sees_all, limit, before)
        return avatars, encode_cursor(more) if more is not None else None


def avatar_not_found(avatar_id: str, field: str) -> ApiError:
    return ApiError(404 if field == "id" else 422, AVATAR_NOT_FOUND,
                    f"no avatar with id {avatar_id[:128]!r}; create one with POST /v1/avatars", field)


# -------------------------------------------------------------------------------------------- shapes
# The response bodies, field for field as the official SDKs' models read them (runwayml 5.24.0, @runwayml/sdk
# 4.20.1): a union on `status`, each member with exactly its own fields.


class _Out(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, validate_by_alias=True)


class PresetVoiceOut(_Out):
    type: Literal["runway-live-preset"] = "runway-live-preset"
    preset_id: str
    name: str
    description: str


class CustomVoiceOut(_Out):
    type: Literal["custom"] = "custom"
    id: str
    deleted: bool = False
    name: str | None = None
    description: str | None = None


VoiceOut = Annotated[PresetVoiceOut | CustomVoiceOut, Field(discriminator="type")]


class _AvatarOut(_Out):
    id: str
    created_at: str
    updated_at: str
    name: str
    personality: str
    voice: VoiceOut | None = Field(description="null only for an avatar registered with the native {image, name} "
                                               "body.")
    start_script: str | None
    document_ids: list[str]
    reference_image_uri: str | None = Field(default=None, description="Not kept here (null).")
    processed_image_uri: str | None = Field(default=None, description="Not kept here (null).")


class ProcessingAvatarOut(_AvatarOut):
    status: Literal["PROCESSING"] = "PROCESSING"


class ReadyAvatarOut(_AvatarOut):
    status: Literal["READY"] = "READY"


class FailedAvatarOut(_AvatarOut):
    status: Literal["FAILED"] = "FAILED"
    failure_reason: str = Field(description="What went wrong, for people (not a stable code).")


AvatarOut = Annotated[ProcessingAvatarOut | ReadyAvatarOut | FailedAvatarOut, Field(discriminator="status")]


class AvatarListOut(_Out):
    data: list[AvatarOut]
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page; null: this was the last.")


def voice_out(voice: dict[str, str] | None) -> PresetVoiceOut | CustomVoiceOut | None:
    if voice is None:
        return None
    if voice["type"] == "custom":
        return CustomVoiceOut(id=voice["id"])
    preset = voice["presetId"]
    return PresetVoiceOut(preset_id=preset, name=preset.capitalize(),
                          description=f"Runway Live preset voice {preset!r}; a self-hosted character speaks with the "
                                      "voice of your agent's TTS")


def avatar_out(avatar: Avatar, now: float) -> ProcessingAvatarOut | ReadyAvatarOut | FailedAvatarOut:
    a = avatar.settled(now)
    common: dict[str, Any] = {"id": a.id, "created_at": iso(a.created_at), "updated_at": iso(a.updated_at),
                              "name": a.name, "personality": a.personality, "voice": voice_out(a.voice),
                              "start_script": a.start_script, "document_ids": list(a.document_ids)}
    if a.status == "FAILED":
        return FailedAvatarOut(**common, failure_reason=a.failure_reason or "processing failed")
    return ReadyAvatarOut(**common) if a.status == "READY" else ProcessingAvatarOut(**common)
