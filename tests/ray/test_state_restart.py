"""State outlives the service: `characters serve` is killed with SIGKILL (every process of it: the CLI, Ray's
GCS and raylet, the scheduler, the replicas; no clean stop) and started again on the same database. Every avatar
is READY with the same id and image, every ended session is listed with its duration and reason, the session
that was live ends FAILED `service_restarted`, usage is unchanged, and tenants stay apart. Run once on SQLite in a
data directory and once on a real PostgreSQL (`tests/postgres.py`): there the two services, one after the other,
are what a RayService upgrade does."""

from __future__ import annotations

import base64
import datetime
import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import psutil
import pytest
from PIL import Image
from postgres import postgres_server
from waiting import wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"app": "app-key-0123456789", "other": "other-key-0123456789", "ops": "ops-key-0123456789"}
START_S = 240.0


def _png() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (96, 64), (180, 40, 90)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Service:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def call(self, method: str, path: str, body: Any = None, key: str = "app") -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {KEYS[key]}"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                raw = resp.read()
                return resp.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")


@contextmanager
def serve(work: Path, name: str, state: list[str]) -> Iterator[tuple[Service, subprocess.Popen[bytes]]]:
    """`characters serve` (own Ray cluster, its own process group) on `state` args; yields once it is ready."""
    port, log_path = _free_port(), work / f"{name}.log"
    env = {**os.environ, "RAY_ADDRESS": "", "CHARACTERS_DATABASE_URL": "", "CHARACTERS_DATA_DIR": "",
           "CHARACTERS_API_KEYS": ",".join(f"{k}{'@operator' if k == 'ops' else ''}:{v}" for k, v in KEYS.items())}
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "deployments.cli.serve", "--port", str(port), "--grpc-port", "0",
                                 *state], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        def started() -> bool:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            return "Ctrl-C to stop" in log_path.read_text()

        wait_for(started, START_S, f"characters serve ({name}) to start", every_s=0.5)
        yield Service(port), proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                kill_all(proc)


def kill_all(proc: subprocess.Popen[bytes]) -> int:
    """SIGKILL `proc` and every process under it (Ray's, too), at once; returns how many were killed."""
    family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in family:
        with suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    psutil.wait_procs(family, timeout=30)
    left = []
    for p in psutil.process_iter(["pid", "status"]):
        with suppress(psutil.NoSuchProcess, ProcessLookupError):
            if os.getpgid(p.pid) == proc.pid and p.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(p)
    assert left == [], f"processes of the killed service still run: {left}"
    return len(family)


def _status(svc: Service, sid: str, want: set[str], timeout_s: float = 120) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def reached() -> bool:
        code, body = svc.call("GET", f"/v1/sessions/{sid}", key="ops")
        assert code == 200, body
        seen.update(body)
        return body["status"] in want

    wait_for(reached, timeout_s, f"session {sid} to be {want}", every_s=0.25)
    return seen


def _day_range() -> str:
    today = datetime.datetime.now(datetime.UTC).date()
    return f"startDate={today - datetime.timedelta(days=1)}&endDate={today + datetime.timedelta(days=1)}"


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_sigkill_and_restart_loses_nothing(tmp_path: Path, backend: str) -> None:
    with contextlib_backend(backend, tmp_path) as state:
        with serve(tmp_path, "first", state) as (svc, proc):
            code, avatar = svc.call("POST", "/v1/avatars", {"image": _png(), "name": "Ada"})
            assert code == 201, avatar
            wait_for(lambda: svc.call("GET", f"/v1/avatars/{avatar['id']}")[1]["status"] == "READY", 60,
                     "the avatar to be READY")
            code, s1 = svc.call("POST", "/v1/sessions", {"avatar": {"image": _png()}, "maxDuration": 60})
            assert code == 201, s1
            _status(svc, s1["id"], {"RUNNING"})
            time.sleep(2.0)
            code, ended = svc.call("DELETE", f"/v1/sessions/{s1['id']}")
            assert code == 200 and ended["status"] == "ENDED" and ended["reason"] == "deleted", ended
            ended = _status(svc, s1["id"], {"ENDED"})
            code, s2 = svc.call("POST", "/v1/sessions", {"avatar": {"image": _png()}, "maxDuration": 600},
                                key="other")
            assert code == 201, s2
            _status(svc, s2["id"], {"RUNNING"})
            time.sleep(2.5)  # a heartbeat or two
            usage_before = svc.call("GET", f"/v1/usage?{_day_range()}", key="ops")[1]["data"]
            t_usage = time.time()
            killed = kill_all(proc)
            t_kill = time.time()
        assert killed >= 4  # the CLI, the GCS, the raylet and workers at least

        with serve(tmp_path, "second", state) as (svc, _):
            with urllib.request.urlopen(svc.url + "/readyz", timeout=10) as resp:  # warm again, no key needed
                assert resp.status == 200 and json.loads(resp.read())["status"] == "ready"
            code, again = svc.call("GET", f"/v1/avatars/{avatar['id']}")
            assert code == 200 and again["status"] == "READY" and again["name"] == "Ada", again
            assert svc.call("GET", f"/v1/avatars/{avatar['id']}", key="other")[0] == 404
            assert [a["id"] for a in svc.call("GET", "/v1/avatars")[1]["data"]] == [avatar["id"]]
            assert svc.call("GET", "/v1/avatars", key="other")[1]["data"] == []

            code, s1_after = svc.call("GET", f"/v1/sessions/{s1['id']}")
            assert code == 200 and s1_after == ended, (s1_after, ended)
            assert s1_after["endedAt"] - s1_after["startedAt"] >= 2.0
            assert svc.call("GET", f"/v1/sessions/{s1['id']}", key="other")[0] == 404
            code, s2_after = svc.call("GET", f"/v1/sessions/{s2['id']}", key="other")
            assert code == 200 and s2_after["status"] == "FAILED" and s2_after["reason"] == "service_restarted"
            # ended at its last heartbeat (each second; later on a loaded machine), before the kill
            assert max(s2_after["startedAt"], t_kill - 5.0) <= s2_after["endedAt"] <= t_kill + 0.1, (s2_after, t_kill)
            listed = {s["id"]: s for s in svc.call("GET", "/v1/sessions", key="ops")[1]["sessions"]}
            assert listed[s1["id"]] == ended and listed[s2["id"]]["status"] == "FAILED"
            assert [s["id"] for s in svc.call("GET", "/v1/sessions")[1]["sessions"]] == [s1["id"]]

            usage_after = svc.call("GET", f"/v1/usage?{_day_range()}", key="ops")[1]["data"]
            by = {u["tenant"]: u for u in usage_before}
            after = {u["tenant"]: u for u in usage_after}
            assert after["app"] == by["app"]  # ended before the kill: exactly the same
            assert after["app"]["secondsStreamed"] == round(s1_after["endedAt"] - s1_after["startedAt"])
            assert after["other"]["sessions"] == by["other"]["sessions"] == 1
            late = t_kill - t_usage + 5.0  # its heartbeats between the query and the kill (+ one late beat, rounding)
            assert by["other"]["secondsStreamed"] <= after["other"]["secondsStreamed"] <= \
                by["other"]["secondsStreamed"] + late
            assert svc.call("GET", f"/v1/usage?{_day_range()}", key="other")[1]["data"] == [after["other"]]


@contextmanager
def contextlib_backend(backend: str, tmp_path: Path) -> Iterator[list[str]]:
    if backend == "sqlite":
        yield ["--data-dir", str(tmp_path / "data")]
        assert (tmp_path / "data" / "characters.db").is_file()
        return
    with postgres_server() as url:
        yield ["--database-url", url]
