"""Opening the service's database: the URL from the config, the engine, and the schema migrated on open.

    database_url(data_dir, url) -> str     url if given; else SQLite in data_dir (created); else in memory
    open_engine(url) -> Engine              engine for that URL, its schema upgraded to the newest revision

SQLite (the embedded default) runs in WAL mode with synchronous=FULL: a transaction that returned survives a
SIGKILL of every process. PostgreSQL is reached through psycopg 3 (`postgresql+psycopg://`). Two services that
start at once on one database (a RayService upgrade) migrate one after the other: a PostgreSQL advisory lock,
or a file lock beside the SQLite file.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine
from sqlalchemy.pool import StaticPool

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
SQLITE_FILE = "characters.db"
MEMORY_URL = "sqlite://"
MIGRATION_LOCK_ID = 0x63686172  # "char": the PostgreSQL advisory lock the migrations are run under
SQLITE_BUSY_MS = 30_000

_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()


def database_url(data_dir: str = "", url: str = "") -> str:
    """`url` when given; else SQLite in `data_dir` (made if missing); else an in-memory database of this process."""
    if url:
        return url
    if data_dir:
        path = Path(data_dir).expanduser().resolve()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"data_dir={data_dir!r} cannot be created ({e.strerror or e}); give a writable "
                             "directory (characters serve --data-dir)") from e
        return f"sqlite:///{path / SQLITE_FILE}"
    return MEMORY_URL


def describe(url: str) -> str:
    """The URL for logs: no password."""
    return sa.engine.make_url(url).render_as_string(hide_password=True)


def _sqlite_pragmas(dbapi_conn: Any, _: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_MS}")
    if cur.execute("PRAGMA database_list").fetchone()[2]:  # a file (not :memory:)
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=FULL")
    cur.close()


def _engine(url: str) -> Engine:
    parsed = sa.engine.make_url(url)
    if parsed.get_backend_name() == "sqlite":
        memory = parsed.database in (None, "", ":memory:")
        engine = sa.create_engine(url, connect_args={"check_same_thread": False},
                                  poolclass=StaticPool if memory else None)
        sa.event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if parsed.get_backend_name() != "postgresql":
        raise ValueError(f"database_url {describe(url)!r}: only sqlite:/// and postgresql+psycopg:// are supported")
    return sa.create_engine(url, pool_pre_ping=True, pool_size=4, max_overflow=4)


@contextlib.contextmanager
def _migration_lock(engine: Engine, conn: sa.Connection) -> Iterator[None]:
    if engine.dialect.name == "postgresql":
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_ID})
        yield
        return
    database = engine.url.database
    if not database or database == ":memory:":
        yield
        return
    with open(f"{database}.migrate-lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def head_revision() -> str:
    head = ScriptDirectory(str(MIGRATIONS)).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def migrate(engine: Engine) -> None:
    """Upgrade the schema to the newest revision (nothing to do: nothing changes), under the migration lock."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn, _migration_lock(engine, conn):
        before = MigrationContext.configure(conn).get_current_revision()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    head = head_revision()
    if before != head:
        log.info("database %s migrated from revision %s to %s", describe(str(engine.url)), before, head)


def open_engine(url: str) -> Engine:
    """This process's engine for `url` (one per URL), migrated to the newest schema on first open. ValueError
    names a URL that cannot be used and why (the password left out)."""
    with _engines_lock:
        engine = _engines.get(url)
        if engine is None or url == MEMORY_URL:  # in memory: a database of its own each time
            engine = _engine(url)
            try:
                migrate(engine)
            except sa.exc.SQLAlchemyError as e:
                engine.dispose()
                raise ValueError(f"database {describe(url)} cannot be opened and migrated ({type(e).__name__}: "
                                 f"{str(e.orig if isinstance(e, sa.exc.DBAPIError) else e).strip()[:300]}); check "
                                 "that it is up and the URL's user may create tables") from e
            if url != MEMORY_URL:
                _engines[url] = engine
        return engine


def close_engines() -> None:
    """Dispose of every engine this process opened (tests; a process exiting needs no call)."""
    with _engines_lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()
