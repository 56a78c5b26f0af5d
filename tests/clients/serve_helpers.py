"""A real `characters serve --livekit-dev` for the client tests (the official Runway SDKs, the voice agent, the
React call UI): its own Ray cluster, the scheduler, the embedded tiny preset on one warm slot, and a
development LiveKit server, all on free loopback ports; API keys on (two tenants and an operator). Stopped
with SIGINT as a user would (Ctrl-C), and killed only if it does not stop."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from waiting import wait_for

from deployments.livekit.server import ServerPorts, free_port

__all__ = ["ROOT", "Served", "characters_serve", "free_livekit_port", "free_port", "wait_for"]

ROOT = Path(__file__).resolve().parents[2]
START_S = 240.0  # a cold start on a busy 2-core machine (the watch page's test allows 180 s)
STOP_S = 90.0


def free_livekit_port() -> int:
    """An HTTP port whose next two ports (ICE/TCP, UDP) are free too: LiveKit's layout (deployments.livekit)."""
    for _ in range(50):
        port = free_port()
        if port <= 65533 and not ServerPorts.from_http(port).busy():
            return port
    raise AssertionError("no three consecutive free ports for the LiveKit server")


@dataclass(frozen=True)
class Served:
    url: str  # the HTTP API, http://127.0.0.1:PORT
    livekit_url: str
    livekit_key: str
    livekit_secret: str
    keys: dict[str, str]  # key id -> key: "app" and "other" are tenants, "ops" an operator
    log: Path

    def request(self, method: str, path: str, body: Any = None, key: str | None = "app",
                raw: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        """A plain HTTP call (JSON in and out) with key `key`'s bearer."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        h = {"Content-Type": "application/json" if raw is None else "application/octet-stream", **(headers or {})}
        if key is not None:
            h["Authorization"] = f"Bearer {self.keys[key]}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=h)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                text = resp.read()
                return resp.status, json.loads(text) if text else None
        except urllib.error.HTTPError as e:
            text = e.read()
            return e.code, json.loads(text) if text else None

    def session_of(self, key: str = "app", live: bool = True) -> dict[str, Any]:
        """The one (live) session of `key` (native GET /v1/sessions lists a key's own)."""
        status, body = self.request("GET", "/v1/sessions", key=key)
        assert status == 200, body
        found = [s for s in body["sessions"] if not live or s["status"] not in ("ENDED", "FAILED")]
        assert len(found) == 1, found
        return dict(found[0])


@contextmanager
def characters_serve(work: Path, config: str = "service: {queue_max: 1, warm_slots: 1}\n",
                     env: dict[str, str] | None = None) -> Iterator[Served]:
    """Run `characters serve --livekit-dev` until the block ends; fail (with its log) if it does not start."""
    from deployments.livekit.server import install_server

    install_server()  # built once and cached: its first build does not count against the start-up
    keys = {name: f"{name}-{secrets.token_hex(12)}" for name in ("app", "other", "ops")}
    (work / "serve.yaml").write_text(config)
    port, lk_port = free_port(), free_livekit_port()
    environ = {**os.environ, "RAY_ADDRESS": "", "CHARACTERS_DATA_DIR": str(work / "data"),  # this run's own state
               "CHARACTERS_DATABASE_URL": "", "CHARACTERS_API_KEYS": ",".join(
        f"{name}{'@operator' if name == 'ops' else ''}:{key}" for name, key in keys.items()), **(env or {})}
    log_path = work / "serve.log"
    before = set(Path(tempfile.gettempdir()).glob("characters-livekit-*"))  # the dev server's config and log
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "deployments.cli.serve", "--config", str(work / "serve.yaml"),
                                 "--port", str(port), "--grpc-port", "0", "--livekit-dev", "--livekit-port",
                                 str(lk_port)], cwd=ROOT, env=environ, stdout=log, stderr=subprocess.STDOUT)
        try:
            def started() -> bool:
                assert proc.poll() is None, log_path.read_text()[-4000:]
                return "Ctrl-C to stop" in log_path.read_text()

            wait_for(started, START_S, "characters serve to start", every_s=0.5)
            served = Served(f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{lk_port}", "devkey", "secret", keys, log_path)
            status, lk = served.request("GET", "/v1/livekit", key="ops")
            assert status == 200 and lk["url"] == served.livekit_url and lk["apiSecret"] == "secret", lk
            yield served
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=STOP_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    assert proc.returncode == 0, log_path.read_text()[-4000:]
    left = set(Path(tempfile.gettempdir()).glob("characters-livekit-*")) - before
    assert not left, f"characters serve left its LiveKit server's files behind: {sorted(left)}"
