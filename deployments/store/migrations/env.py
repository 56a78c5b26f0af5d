"""Alembic's environment: always run by `deployments.store.db.migrate` on a connection it holds (and has locked)."""

from __future__ import annotations

from alembic import context

from deployments.store.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run the migrations through deployments.store.db.migrate(engine), which holds the lock that "
                       "keeps two starting services from migrating at once")
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
