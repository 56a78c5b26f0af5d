"""One avatar registry for the whole service: `/v1/avatars` held by a detached, named Ray actor.

Every ingress replica's `SessionFrontend.avatars` is a `SharedAvatars`: an avatar registered through one
replica (`POST /v1/avatars`) is found by every other (`GET`, `DELETE`, and `/v1/realtime_sessions` with
`{"type": "custom", "avatarId": ...}`). The image is decoded, validated and resized to the served preset
once, at registration; sessions on it skip that work.

The actor (`AvatarStoreActor`, name `avatars` in the service namespace) holds an `AvatarStore` in memory,
at most `max_avatars` images. It restarts if its process dies, empty (registrations are not persisted:
clients register again, as after a service restart). When it cannot be reached, calls answer 503 with
Retry-After, like the scheduler.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import ray

from deployments.errors import ApiError
from deployments.livekit.runway import Avatar, AvatarRegistry, AvatarStore
from deployments.types import NAMESPACE

ACTOR_NAME = "avatars"
RETRY_AFTER_S = 2.0


@ray.remote(num_cpus=0, max_restarts=-1)
class AvatarStoreActor:
    def __init__(self, max_avatars: int) -> None:
        self.store = AvatarStore(max_avatars)

    def add(self, image: np.ndarray, name: str | None, now: float) -> Avatar | None:
        return self.store.add(image, name, now)

    def get(self, avatar_id: str) -> Avatar | None:
        return self.store.get(avatar_id)

    def delete(self, avatar_id: str) -> bool:
        return self.store.delete(avatar_id)


class SharedAvatars(AvatarRegistry):
    """`AvatarRegistry` over the service's one `AvatarStoreActor` (created by the first replica to ask)."""

    def __init__(self, max_avatars: int = 256) -> None:
        super().__init__(max_avatars)
        self._actor: Any = None

    def _handle(self) -> Any:
        if self._actor is None:
            self._actor = AvatarStoreActor.options(  # type: ignore[attr-defined]
                name=ACTOR_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
            ).remote(self.max_avatars)
        return self._actor

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self._handle(), method).remote(*args)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            self._actor = None  # look it up (or create it) again next time
            raise ApiError(503, "avatar_registry_unavailable", "the avatar registry is not reachable "
                           f"({type(e).__name__}); retry in {RETRY_AFTER_S:g} s", retry_after_s=RETRY_AFTER_S) from e

    async def _add(self, image: np.ndarray, name: str | None, now: float) -> Avatar | None:
        return await self._call("add", image, name, now)

    async def _get(self, avatar_id: str) -> Avatar | None:
        return await self._call("get", avatar_id)

    async def _delete(self, avatar_id: str) -> bool:
        return await self._call("delete", avatar_id)
