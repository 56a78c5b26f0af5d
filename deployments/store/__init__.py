"""The service's stored state: avatars, session records and usage in a real database (SQLite in a data
directory by default, PostgreSQL by URL), its schema migrated on open (Alembic, `migrations/`).

Plain classes over a SQLAlchemy engine, no Ray: the scheduler actor holds `SessionRows`, the service's shared
actor `AvatarRows` and `UsageQueries`; `open_engine(database_url(data_dir, url))` gives both the same database.
"""

from __future__ import annotations

from sqlalchemy.exc import SQLAlchemyError as StoreError

from deployments.store.avatars import AvatarRows
from deployments.store.db import close_engines, database_url, describe, open_engine
from deployments.store.queries import UsageQueries
from deployments.store.sessions import SERVICE_RESTARTED, SessionRows, info_from_json
from deployments.store.usage import DayUsage, by_day, runway_usage

__all__ = ["SERVICE_RESTARTED", "AvatarRows", "DayUsage", "SessionRows", "StoreError", "UsageQueries", "by_day",
           "close_engines", "database_url", "describe", "info_from_json", "open_engine", "runway_usage"]
