"""A real PostgreSQL server for the tests: Debian's binaries (installed by `scripts/setup.sh --dev`), a fresh
cluster in a temp dir, listening on 127.0.0.1 only, trust auth for loopback; stopped and removed when the block
ends. initdb refuses root: as root the cluster belongs to Debian's `postgres` user and the server runs as it."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

START_S = 60


def pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}")) or ([p] if (p := shutil.which(name)) else [])
    assert found, f"PostgreSQL's {name} is not installed: run scripts/setup.sh --dev (it installs Debian's postgresql)"
    return found[-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_owner(cmd: list[str], user: str | None) -> list[str]:
    return ["runuser", "-u", user, "--", *cmd] if user else cmd


@contextmanager
def postgres_server(database: str = "characters") -> Iterator[str]:
    """Yield the SQLAlchemy URL of database `database` on a new server; stop the server and remove it after."""
    user = None
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError as e:
            raise AssertionError("running as root, and Debian's postgres user is missing: run scripts/setup.sh --dev "
                                 "(it installs the postgresql package, which makes that user)") from e
        user = "postgres"
    work = Path(tempfile.mkdtemp(prefix="characters-pg-"))
    data, port = work / "data", _free_port()
    if user:
        shutil.chown(work, user)
    env = {**os.environ, "LC_ALL": "C.UTF-8"}
    subprocess.run(_as_owner([pg_bin("initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                              "--no-sync"], user), check=True, capture_output=True, env=env, cwd=work)
    ctl = [pg_bin("pg_ctl"), "-D", str(data), "-l", str(work / "server.log"), "-w", "-t", str(START_S)]
    options = f"-h 127.0.0.1 -p {port} -k {work} -c fsync=off -c full_page_writes=off"
    started = subprocess.run(_as_owner([*ctl, "-o", options, "start"], user), capture_output=True, env=env, cwd=work)
    try:
        log = (work / "server.log").read_text() if (work / "server.log").exists() else ""
        assert started.returncode == 0, f"PostgreSQL did not start: {started.stderr.decode()[-2000:]}\n{log[-2000:]}"
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres", autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{database}"')
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/{database}"
    finally:
        subprocess.run(_as_owner([*ctl, "-m", "immediate", "stop"], user), capture_output=True, env=env, cwd=work)
        shutil.rmtree(work, ignore_errors=True)
