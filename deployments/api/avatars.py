"""Avatars: registered reference images (`/v1/avatars`), decoded and resized once at registration.

`AvatarStore` holds them in memory (thread-safe, bounded); `AvatarRegistry` is what the routes call
(async, refusals as `ApiError`s), over an in-process store by default. The Serve application backs it
with one actor for the whole service (`deployments.api.app.SharedAvatars`), so an avatar registered
through one ingress replica is found by every other.
"""

from __future__ import annotations

import datetime
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from deployments.api.errors import ApiError, ErrorCode


def iso(t: float | None) -> str | None:
    """Unix seconds -> RFC 3339 UTC ('...Z'), as Runway's API writes times."""
    return None if t is None else datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat().replace("+00:00", "Z")


class _Out(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, validate_by_name=True, validate_by_alias=True)


class AvatarCreateIn(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, extra="forbid", frozen=True, strict=True)

    image: str = Field(description="The reference image (PNG, JPEG or WebP) in base64; a data URL prefix is "
                                   "accepted.", json_schema_extra={"format": "byte"})
    name: str | None = Field(default=None, max_length=128)


class AvatarOut(_Out):
    id: str
    name: str | None
    width: int
    height: int
    created_at: str | None


@dataclass(frozen=True)
class Avatar:
    id: str
    name: str | None
    image: np.ndarray  # (H, W, 3) uint8 at the served preset's resolution
    created_at: float

    def out(self) -> AvatarOut:
        h, w = self.image.shape[:2]
        return AvatarOut(id=self.id, name=self.name, width=w, height=h, created_at=iso(self.created_at))


class AvatarStore:
    """Registered reference images, in memory, at most `max_avatars` (a full store refuses; nothing is
    evicted). Thread-safe; raises nothing (it also runs inside the shared actor, `deployments.api.avatars`)."""

    def __init__(self, max_avatars: int = 256) -> None:
        self.max_avatars = max_avatars
        self._avatars: OrderedDict[str, Avatar] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, image: np.ndarray, name: str | None, now: float) -> Avatar | None:
        """The new avatar, or None when the store is full."""
        with self._lock:
            if len(self._avatars) >= self.max_avatars:
                return None
            avatar = Avatar(uuid.uuid4().hex, name, image, now)
            self._avatars[avatar.id] = avatar
            return avatar

    def get(self, avatar_id: str) -> Avatar | None:
        with self._lock:
            return self._avatars.get(avatar_id)

    def delete(self, avatar_id: str) -> bool:
        with self._lock:
            return self._avatars.pop(avatar_id, None) is not None


class AvatarRegistry:
    """`/v1/avatars` as the routes see it: async, refusals as ApiErrors. Over an in-process `AvatarStore`
    by default (one process: tests, a single replica); `deployments.api.avatars.SharedAvatars` backs it with
    one actor for the whole service, so an avatar registered through one ingress replica is usable
    through every other."""

    def __init__(self, max_avatars: int = 256) -> None:
        self.max_avatars = max_avatars
        self._store = AvatarStore(max_avatars)

    async def _add(self, image: np.ndarray, name: str | None, now: float) -> Avatar | None:
        return self._store.add(image, name, now)

    async def _get(self, avatar_id: str) -> Avatar | None:
        return self._store.get(avatar_id)

    async def _delete(self, avatar_id: str) -> bool:
        return self._store.delete(avatar_id)

    async def add(self, image: np.ndarray, name: str | None, now: float) -> Avatar:
        avatar = await self._add(image, name, now)
        if avatar is None:
            raise ApiError(422, ErrorCode.REJECTED, f"the avatar registry is full ({self.max_avatars} avatars); "
                           "delete unused ones with DELETE /v1/avatars/{id}")
        return avatar

    async def get(self, avatar_id: str, field: str = "id") -> Avatar:
        avatar = await self._get(avatar_id)
        if avatar is None:
            raise _avatar_not_found(avatar_id, field)
        return avatar

    async def delete(self, avatar_id: str) -> None:
        if not await self._delete(avatar_id):
            raise _avatar_not_found(avatar_id, "id")


def _avatar_not_found(avatar_id: str, field: str) -> ApiError:
    return ApiError(404 if field == "id" else 422, "avatar_not_found",
                    f"no avatar with id {avatar_id[:128]!r}; register the image with POST /v1/avatars", field)
