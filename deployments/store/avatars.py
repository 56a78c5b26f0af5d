"""`AvatarRows`: the avatars in the database, behind the same calls as the in-memory
`deployments.api.avatars.AvatarStore` (no exceptions for refusals: None / False), so the service's shared actor
holds either. Records are made by the `record` class given (the API's `Avatar`: this package does not import
the API). A processed reference image is stored with its avatar as an .npy blob."""

from __future__ import annotations

import io
import threading
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from deployments.store.schema import avatar_artifacts as artifacts
from deployments.store.schema import avatars as table

_FIELDS = ("id", "owner", "name", "personality", "voice", "start_script", "document_ids", "image_processing",
           "created_at", "updated_at", "status", "failure_reason", "version", "seq")
_RECORD = [table.c[f] for f in _FIELDS]


def image_bytes(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(image), allow_pickle=False)
    return buf.getvalue()


def image_from(blob: bytes) -> np.ndarray:
    image = np.load(io.BytesIO(blob), allow_pickle=False)
    image.setflags(write=False)
    return image


def _columns(avatar: Any) -> dict[str, Any]:
    values = {f: getattr(avatar, f) for f in _FIELDS if f != "seq"}
    values["document_ids"] = list(avatar.document_ids)
    return values


class AvatarRows:
    """Avatars in the database: at most `max_avatars` per owner (a tenant's full registry refuses)."""

    def __init__(self, engine: Engine, record: Callable[..., Any], max_avatars: int = 256,
                 cache_images: int = 32) -> None:
        self.engine, self.record, self.max_avatars = engine, record, max_avatars
        self._images: dict[str, tuple[int, np.ndarray]] = {}  # id -> (version, image): what sessions read
        self._cache_max = cache_images
        self._lock = threading.Lock()

    def _avatar(self, row: Any) -> Any:
        values = dict(row._mapping)
        values["document_ids"] = tuple(values["document_ids"] or ())
        return self.record(**values)

    def add(self, avatar: Any) -> Any:
        """Store a new avatar under a fresh id (its seq from the database); None when its owner has max_avatars."""
        with self.engine.begin() as conn:
            owned = conn.execute(sa.select(sa.func.count()).select_from(table).where(
                table.c.owner.is_(None) if avatar.owner is None else table.c.owner == avatar.owner)).scalar_one()
            if owned >= self.max_avatars:
                return None
            values = {**_columns(avatar), "id": uuid.uuid4().hex}
            seq = conn.execute(sa.insert(table).values(**values).returning(table.c.seq)).scalar_one()
        return self.record(**{**values, "document_ids": avatar.document_ids, "seq": seq})

    def get(self, avatar_id: str) -> Any:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(*_RECORD).where(table.c.id == avatar_id)).first()
        return None if row is None else self._avatar(row)

    def image(self, avatar_id: str) -> np.ndarray | None:
        """The processed reference image of a READY avatar ((H, W, 3) uint8, read-only), else None."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(table.c.version, table.c.status).where(table.c.id == avatar_id)).first()
            if row is None or row.status != "READY":
                return None
            with self._lock:
                cached = self._images.get(avatar_id)
            if cached is not None and cached[0] == row.version:
                return cached[1]
            blob = conn.execute(sa.select(table.c.image).where(table.c.id == avatar_id)).scalar_one_or_none()
        if blob is None:
            return None
        image = image_from(blob)
        with self._lock:
            if len(self._images) >= self._cache_max:
                self._images.pop(next(iter(self._images)))
            self._images[avatar_id] = (row.version, image)
        return image

    def update(self, avatar_id: str, changes: dict[str, Any], now: float, new_image: bool = False) -> Any:
        """Apply `changes`; `new_image`: PROCESSING again, the old image dropped and `version` bumped. None: no such
        avatar."""
        with self.engine.begin() as conn:
            row = conn.execute(sa.select(*_RECORD).where(table.c.id == avatar_id).with_for_update()).first()
            if row is None:
                return None
            values: dict[str, Any] = {**changes, "updated_at": now}
            if "document_ids" in values:
                values["document_ids"] = list(values["document_ids"])
            if new_image:
                values.update(status="PROCESSING", failure_reason=None, version=row.version + 1, image=None)
                conn.execute(sa.delete(artifacts).where(artifacts.c.avatar_id == avatar_id))  # made from the old one
            conn.execute(sa.update(table).where(table.c.id == avatar_id).values(**values))
            new = conn.execute(sa.select(*_RECORD).where(table.c.id == avatar_id)).one()
        return self._avatar(new)

    def finish(self, avatar_id: str, version: int, image: np.ndarray | None, failure: str | None,
               now: float) -> Any:
        """The end of processing `version`: READY with `image`, or FAILED with `failure`; None (nothing changed) when
        the avatar is gone or another version is being processed."""
        blob = image_bytes(image) if image is not None else None
        with self.engine.begin() as conn:
            done = conn.execute(sa.update(table).where(
                table.c.id == avatar_id, table.c.version == version, table.c.status == "PROCESSING").values(
                status="READY" if blob is not None else "FAILED", failure_reason=failure, image=blob, updated_at=now))
            if not done.rowcount:
                return None
            row = conn.execute(sa.select(*_RECORD).where(table.c.id == avatar_id)).one()
        return self._avatar(row)

    def delete(self, avatar_id: str) -> bool:
        with self.engine.begin() as conn:
            conn.execute(sa.delete(artifacts).where(artifacts.c.avatar_id == avatar_id))
            gone = conn.execute(sa.delete(table).where(table.c.id == avatar_id)).rowcount > 0
        with self._lock:
            self._images.pop(avatar_id, None)
        return gone

    def put_artifact(self, avatar_id: str, version: int, family: str, name: str, data: bytes, now: float) -> bool:
        """Keep what model family `family` computed from version `version` of the avatar (its reference image) under
        `name`, replacing an older one; False (nothing kept) when the avatar is gone or its image changed since."""
        with self.engine.begin() as conn:
            current = conn.execute(sa.select(table.c.version).where(table.c.id == avatar_id)
                                   .with_for_update()).scalar_one_or_none()
            if current != version:
                return False
            key = (artifacts.c.avatar_id == avatar_id, artifacts.c.family == family, artifacts.c.name == name)
            conn.execute(sa.delete(artifacts).where(*key))
            conn.execute(sa.insert(artifacts).values(avatar_id=avatar_id, family=family, name=name, version=version,
                                                     created_at=now, data=data))
        return True

    def artifact(self, avatar_id: str, family: str, name: str) -> bytes | None:
        """What `put_artifact` kept for the avatar as it is now, else None."""
        query = sa.select(artifacts.c.data).join(table, table.c.id == artifacts.c.avatar_id).where(
            artifacts.c.avatar_id == avatar_id, artifacts.c.family == family, artifacts.c.name == name,
            artifacts.c.version == table.c.version)
        with self.engine.connect() as conn:
            data: bytes | None = conn.execute(query).scalar_one_or_none()
        return data

    def page(self, owner: str | None, everyone: bool, limit: int,
             before: int | None) -> tuple[list[Any], int | None]:
        """Newest first: up to `limit` avatars of `owner` (all with `everyone`) created before seq `before`, and the
        seq to continue from (None: that was the last page)."""
        query = sa.select(*_RECORD).order_by(table.c.seq.desc()).limit(limit + 1)
        if not everyone:
            query = query.where(table.c.owner.is_(None) if owner is None else table.c.owner == owner)
        if before is not None:
            query = query.where(table.c.seq < before)
        with self.engine.connect() as conn:
            rows = [self._avatar(r) for r in conn.execute(query)]
        page = rows[:limit]
        return page, page[-1].seq if len(rows) > limit else None
