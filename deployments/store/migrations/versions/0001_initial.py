"""avatars and session records

Revision ID: 0001
Revises:
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "avatars",
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(32), nullable=False, unique=True),
        sa.Column("owner", sa.String(128), index=True),
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
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("scheduler", sa.String(128), nullable=False),
        sa.Column("owner", sa.String(128), index=True),
        sa.Column("preset", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False, index=True),
        sa.Column("reason", sa.Text),
        sa.Column("created_at", sa.Float, nullable=False, index=True),
        sa.Column("admitted_at", sa.Float),
        sa.Column("started_at", sa.Float),
        sa.Column("ended_at", sa.Float),
        sa.Column("seen_at", sa.Float),
        sa.Column("gpus", sa.Integer, nullable=False),
        sa.Column("info", sa.JSON, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("sessions")
    op.drop_table("avatars")
