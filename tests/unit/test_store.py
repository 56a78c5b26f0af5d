"""The service's database (`deployments.store`) on SQLite and on a real PostgreSQL server (started on loopback by
`tests/postgres.py`): migrations on open, avatars with their images, session records through a restart, usage
by tenant, tenants kept apart in every query."""

from __future__ import annotations

import datetime
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from postgres import postgres_server

from deployments.api.avatars import Avatar
from deployments.store import AvatarRows, SessionRows, UsageQueries, close_engines, database_url, open_engine
from deployments.store.db import MEMORY_URL, MIGRATIONS, current_revision, head_revision
from deployments.store.schema import metadata
from deployments.types import SessionInfo, SessionStatus

T0 = 1_796_688_000.0  # 2026-12-08 00:00:00 UTC
DAY = datetime.date(2026, 12, 8)


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with postgres_server() as url:
        yield url
    close_engines()


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    if request.param == "sqlite":
        yield database_url(str(tmp_path / "data"))
    else:
        pg = request.getfixturevalue("pg_url")
        engine = open_engine(pg)
        with engine.begin() as conn:  # each test on empty tables
            for table in reversed(metadata.sorted_tables):
                conn.execute(table.delete())
        yield pg


def _avatar(owner: str | None, name: str = "Ada") -> Avatar:
    return Avatar(id="", owner=owner, name=name, personality="kind", voice={"type": "custom", "id": "v1"},
                  start_script=None, document_ids=("d1", "d2"), image_processing="optimize", created_at=T0,
                  updated_at=T0)


def test_the_schema_is_migrated_on_open_and_matches_the_tables(url):
    engine = open_engine(url)
    assert current_revision(engine) == head_revision() == "0002"
    inspector = sa.inspect(engine)
    for table in metadata.sorted_tables:
        assert {c["name"] for c in inspector.get_columns(table.name)} == set(table.c.keys()), table.name


def test_a_data_dir_is_made_and_reopened_by_another_process(tmp_path):
    url = database_url(str(tmp_path / "a" / "b"))
    assert url == f"sqlite:///{tmp_path}/a/b/characters.db" and (tmp_path / "a" / "b").is_dir()
    rows = AvatarRows(open_engine(url), Avatar)
    made = rows.add(_avatar("app"))
    assert made is not None
    code = ("import sys; from deployments.store import AvatarRows, open_engine; from deployments.api.avatars import "
            f"Avatar; a = AvatarRows(open_engine({url!r}), Avatar).get({made.id!r}); print(a.name, a.seq, a.owner)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["Ada", str(made.seq), "app"]


def test_a_database_of_the_first_revision_is_upgraded_on_open_with_its_data(url):
    engine = sa.create_engine(url)
    with engine.begin() as conn:  # back to revision 0001, as a service of that release left it (one avatar in it)
        for name in ("avatar_artifacts", "sessions", "avatars", "alembic_version"):
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0001")
        conn.execute(sa.text("INSERT INTO avatars (id, owner, name, personality, document_ids, image_processing, "
                             "created_at, updated_at, status, version) VALUES ('a1', 'app', 'Old', '', '[]', "
                             "'optimize', 1.0, 1.0, 'READY', 0)"))
    assert current_revision(engine) == "0001" and "avatar_artifacts" not in sa.inspect(engine).get_table_names()
    engine.dispose()
    close_engines()  # the next open is a new process's
    rows = AvatarRows(open_engine(url), Avatar)
    assert current_revision(rows.engine) == "0002" and rows.get("a1").name == "Old"
    assert rows.put_artifact("a1", 0, "liveavatar", "prompt", b"\x01\x02", T0)


def test_memory_databases_are_apart():
    a, b = AvatarRows(open_engine(MEMORY_URL), Avatar), AvatarRows(open_engine(MEMORY_URL), Avatar)
    made = a.add(_avatar("app"))
    assert made is not None and a.get(made.id) == made and b.get(made.id) is None


def test_avatars_round_trip_with_their_images_and_tenants_apart(url):
    rows = AvatarRows(open_engine(url), Avatar, max_avatars=2)
    ada, bob, eve = rows.add(_avatar("app")), rows.add(_avatar("app", "Bob")), rows.add(_avatar("other", "Eve"))
    assert ada and bob and eve and ada.id != bob.id and ada.seq < bob.seq
    assert rows.add(_avatar("app", "Cy")) is None  # "app" has its 2; "other" may still add
    assert rows.get(ada.id) == ada and ada.document_ids == ("d1", "d2") and ada.voice == {"type": "custom", "id": "v1"}
    image = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    assert rows.image(ada.id) is None  # PROCESSING
    assert rows.finish(ada.id, ada.version + 1, image, None, T0 + 1) is None  # a stale version changes nothing
    ready = rows.finish(ada.id, ada.version, image, None, T0 + 2)
    assert ready is not None and ready.status == "READY" and ready.updated_at == T0 + 2
    got = rows.image(ada.id)
    assert got is not None and got.dtype == np.uint8 and np.array_equal(got, image) and not got.flags.writeable
    fresh = AvatarRows(open_engine(url), Avatar)  # another process's view: from the database, not a cache
    assert np.array_equal(fresh.image(ada.id), image)
    assert rows.finish(eve.id, eve.version, None, "not an image", T0 + 3).status == "FAILED"
    assert rows.get(eve.id).failure_reason == "not an image"
    page, more = rows.page("app", False, 1, None)
    assert [a.name for a in page] == ["Bob"] and more == bob.seq
    page, more = rows.page("app", False, 1, more)
    assert [a.name for a in page] == ["Ada"] and more is None
    assert [a.name for a in rows.page("other", False, 10, None)[0]] == ["Eve"]
    assert [a.name for a in rows.page(None, True, 10, None)[0]] == ["Eve", "Bob", "Ada"]
    updated = rows.update(ada.id, {"name": "Ada 2", "document_ids": ("x",)}, T0 + 4, new_image=True)
    assert updated.name == "Ada 2" and updated.status == "PROCESSING" and updated.version == ada.version + 1
    assert updated.document_ids == ("x",) and rows.image(ada.id) is None
    assert rows.update("nope", {"name": "x"}, T0) is None
    assert rows.delete(bob.id) and not rows.delete(bob.id) and rows.get(bob.id) is None


def test_what_a_family_keeps_per_avatar_follows_its_reference_image(url):
    rows = AvatarRows(open_engine(url), Avatar)
    ada, eve = rows.add(_avatar("app")), rows.add(_avatar("other", "Eve"))
    assert rows.put_artifact(ada.id, ada.version, "liveavatar", "prompt", b"p0", T0)
    assert rows.put_artifact(ada.id, ada.version, "liveavatar", "prompt", b"p1", T0 + 1)  # replaced
    assert rows.put_artifact(ada.id, ada.version, "liveavatar", "latents", b"L" * 100_000, T0)
    assert rows.put_artifact(eve.id, eve.version, "liveavatar", "prompt", b"eve", T0)
    assert not rows.put_artifact(ada.id, ada.version + 1, "liveavatar", "prompt", b"future", T0)  # no such version
    assert not rows.put_artifact("gone", 0, "liveavatar", "prompt", b"x", T0)
    assert rows.artifact(ada.id, "liveavatar", "prompt") == b"p1"
    assert rows.artifact(ada.id, "liveavatar", "latents") == b"L" * 100_000
    assert rows.artifact(ada.id, "other-family", "prompt") is None
    rows.update(ada.id, {}, T0 + 2, new_image=True)  # a new reference image: what was made from the old one goes
    assert rows.artifact(ada.id, "liveavatar", "prompt") is None
    assert not rows.put_artifact(ada.id, ada.version, "liveavatar", "prompt", b"stale", T0)  # a late old result
    assert rows.put_artifact(ada.id, ada.version + 1, "liveavatar", "prompt", b"new", T0)
    assert rows.artifact(ada.id, "liveavatar", "prompt") == b"new"
    assert rows.delete(eve.id) and rows.artifact(eve.id, "liveavatar", "prompt") is None
    with open_engine(url).connect() as conn:
        left = conn.execute(sa.text("SELECT avatar_id FROM avatar_artifacts")).scalars().all()
    assert left == [ada.id]


def _info(sid: str, owner: str, status: SessionStatus, created: float, **kw: object) -> SessionInfo:
    return SessionInfo(sid, status, "tiny", owner=owner, created_at=created, **kw)  # type: ignore[arg-type]


def test_live_sessions_end_failed_service_restarted_at_their_last_heartbeat(url):
    rows = SessionRows(open_engine(url), "characters-scheduler")
    ended = _info("s1", "app", SessionStatus.QUEUED, T0)
    rows.save(ended, 5, T0 + 1)
    ended.status = SessionStatus.RUNNING
    ended.started_at = T0 + 3
    rows.save(ended, 5, T0 + 2)  # admitted (STARTING was skipped): GPU time from here
    ended.status, ended.reason, ended.ended_at = SessionStatus.ENDED, "deleted", T0 + 63.4
    rows.save(ended, 5, T0 + 63.4)
    live = _info("s2", "other", SessionStatus.STARTING, T0 + 100)
    rows.save(live, 5, T0 + 100)
    live.status, live.started_at = SessionStatus.RUNNING, T0 + 102
    rows.save(live, 5, T0 + 102)
    rows.touch(["s2"], T0 + 130)
    kept = _info("s3", "app", SessionStatus.RUNNING, T0 + 110, started_at=T0 + 111)
    rows.save(kept, 5, T0 + 111)
    queued = _info("s4", "app", SessionStatus.QUEUED, T0 + 120)
    rows.save(queued, 5, T0 + 120)
    SessionRows(open_engine(url), "another-service").save(_info("x1", "app", SessionStatus.RUNNING, T0), 5, T0)
    usage = UsageQueries(open_engine(url))
    before = usage.native(None, True, DAY, DAY + datetime.timedelta(days=1))

    again = SessionRows(open_engine(url), "characters-scheduler")  # the next service, on the same data
    failed = {i.id: i for i in again.restarted(keep=["s3"])}  # s3 was adopted again (its actor lived)
    assert sorted(failed) == ["s2", "s4"]
    assert failed["s2"].status is SessionStatus.FAILED and failed["s2"].reason == "service_restarted"
    assert failed["s2"].ended_at == T0 + 130 and failed["s4"].ended_at == T0 + 120
    assert again.get("s2") == failed["s2"] and again.get("s3").status is SessionStatus.RUNNING
    assert again.get("x1").status is SessionStatus.RUNNING  # another service's session is not ours to end
    assert [i.id for i in again.ended(10)] == ["s4", "s2", "s1"]
    assert [i.id for i in again.ended(10, exclude=["s4"])] == ["s2", "s1"]
    assert again.ended(1) == [failed["s4"]]

    after = usage.native(None, True, DAY, DAY + datetime.timedelta(days=1))
    assert after == before == [  # the live s2 counted to its heartbeat before, ended there after: the same
        {"tenant": "app", "preset": "tiny", "date": "2026-12-08", "secondsStreamed": 60, "gpuSeconds": 307,
         "sessions": 4, "sessionsStarted": 2},
        {"tenant": "other", "preset": "tiny", "date": "2026-12-08", "secondsStreamed": 28, "gpuSeconds": 150,
         "sessions": 1, "sessionsStarted": 1}]
    assert usage.native("other", False, DAY, DAY + datetime.timedelta(days=1)) == after[1:]
    assert usage.native("app", False, DAY + datetime.timedelta(days=1), DAY + datetime.timedelta(days=3)) == []
    assert usage.runway("app", False, DAY - datetime.timedelta(days=1), DAY + datetime.timedelta(days=1)) == {
        "totalSeconds": 60, "totalSessions": 4, "avgDurationSeconds": 60,
        "byDay": [{"date": "2026-12-07", "seconds": 0, "sessions": 0},
                  {"date": "2026-12-08", "seconds": 60, "sessions": 4}]}
    assert usage.runway("nobody", False, DAY, DAY + datetime.timedelta(days=1))["totalSessions"] == 0


def test_the_schedulers_book_writes_its_records_and_reads_ended_ones_back(tmp_path):
    """`SessionBook` over `SessionRows` (what the scheduler actor holds): every status change is a write; a new book
    on the same database ends the old live ones, lists the ended ones it no longer holds and gets them by id."""
    from deployments.sessions.book import SessionBook
    from deployments.settings import TelemetryConfig
    from deployments.telemetry import SchedulerTelemetry, Telemetry
    from deployments.types import SessionSpec, UnknownSession

    url = database_url(str(tmp_path / "data"))
    tele = SchedulerTelemetry(Telemetry(TelemetryConfig(), "test", "scheduler"))  # off
    book = SessionBook(tele, events_max=16, ended_max=2, records=SessionRows(open_engine(url), "sched"))
    image = np.zeros((4, 4, 3), np.uint8)
    for sid in ("a", "b", "c"):
        sess = book.add(book.new(SessionSpec(sid, image, api_key_id="app"), SessionStatus.QUEUED))
        book.status(sess, SessionStatus.STARTING)
        sess.info.started_at = time.time()
        book.status(sess, SessionStatus.RUNNING)
    for sid in ("a", "b"):
        book.terminal(book.get(sid), SessionStatus.ENDED, "deleted")
    book.heartbeat()
    assert [s.info.id for s in book.live()] == ["c"] and len(book.listed()) == 3  # ended_max in memory: no read

    again = SessionBook(tele, events_max=16, ended_max=2, records=SessionRows(open_engine(url), "sched"))
    assert [i.id for i in again.restored(gpus=5)] == ["c"] and again.gpus == 5
    listed = again.listed()  # nothing in memory: the newest 2 ended, from the database
    assert [(i.id, i.status, i.reason) for i in listed] == [("c", SessionStatus.FAILED, "service_restarted"),
                                                           ("b", SessionStatus.ENDED, "deleted")]
    old = again.get("a")
    assert old.terminal and old.info.reason == "deleted" and old.info.owner == "app" and old.spec.api_key_id == "app"
    with pytest.raises(UnknownSession):
        again.get("nope")
