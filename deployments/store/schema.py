"""The tables of the service's database (SQLAlchemy Core). The schema itself is made and upgraded by the
migrations under `migrations/versions/` (Alembic), never by `metadata.create_all`: these definitions are what
the code reads and writes, and `tests/unit/test_store.py` checks that the migrated schema has them.

Times are Unix seconds (float64): the scheduler's own clock (`time.time()`), the same on SQLite and PostgreSQL.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

#: Avatars (`/v1/avatars`) with their processed reference image (an .npy blob: (H, W, 3) uint8).
avatars = sa.Table(
    "avatars", metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),  # creation order: the list's cursor
    sa.Column("id", sa.String(32), nullable=False, unique=True),
    sa.Column("owner", sa.String(128), index=True),  # the API key id that made it (its tenant); NULL: keys off
    sa.Column("name", sa.String(128), nullable=False),
    sa.Column("personality", sa.Text, nullable=False),
    sa.Column("voice", sa.JSON),
    sa.Column("start_script", sa.Text),
    sa.Column("document_ids", sa.JSON, nullable=False),
    sa.Column("image_processing", sa.String(16), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("failure_reason", sa.Text),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("image", sa.LargeBinary),
)

#: What a model family computes once per avatar and keeps with it (reference latents, prompt embeddings, ...), by
#: family and name; `version` is the avatar's when it was made: a new reference image makes it stale (dropped).
avatar_artifacts = sa.Table(
    "avatar_artifacts", metadata,
    sa.Column("avatar_id", sa.String(32), primary_key=True),
    sa.Column("family", sa.String(64), primary_key=True),
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("data", sa.LargeBinary, nullable=False),
)

#: Every session a scheduler took (queued, live or ended): the record a team bills and audits from.
sessions = sa.Table(
    "sessions", metadata,
    sa.Column("id", sa.String(128), primary_key=True),
    sa.Column("scheduler", sa.String(128), nullable=False),  # the scheduler actor's name (one service)
    sa.Column("owner", sa.String(128), index=True),
    sa.Column("preset", sa.String(64), nullable=False),
    sa.Column("status", sa.String(16), nullable=False, index=True),
    sa.Column("reason", sa.Text),
    sa.Column("created_at", sa.Float, nullable=False, index=True),
    sa.Column("admitted_at", sa.Float),  # given a slot (STARTING): from here on it holds `gpus` GPUs
    sa.Column("started_at", sa.Float),  # first chunk out: from here on it streams
    sa.Column("ended_at", sa.Float),
    sa.Column("seen_at", sa.Float),  # the scheduler's last heartbeat while it was live
    sa.Column("gpus", sa.Integer, nullable=False),
    sa.Column("info", sa.JSON, nullable=False),  # SessionInfo.to_json() as last written (stats, warm_start, ...)
)
