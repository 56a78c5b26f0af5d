"""`characters serve` (deployments.cli.serve) as a subprocess: starts, answers HTTP and gRPC, and on
SIGINT exits 0 within seconds with its ports free. Runs its own Ray cluster (the real scheduler)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from deployments.api.proto import characters_pb2 as pb
from deployments.api.proto import characters_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_free(port: int) -> bool:
    """A new server can listen on `port` (with SO_REUSEADDR, as servers do: closed connections may linger)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_config_exits_2(tmp_path: Path) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("service: {preset: enormous}\n")
    for args in (["--config", str(tmp_path / "missing.yaml")], ["--config", str(cfg)]):
        proc = subprocess.run([sys.executable, "-m", "deployments.cli.serve", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert "characters serve:" in proc.stderr and ("missing.yaml" in proc.stderr or "enormous" in proc.stderr)


def test_serve_runs_until_sigint_then_frees_its_ports(tmp_path: Path) -> None:
    http_port, grpc_port = free_port(), free_port()
    env = {**os.environ, "CHARACTERS_API_KEYS": "", "RAY_ADDRESS": ""}
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "deployments.cli.serve", "--port", str(http_port),
                             "--grpc-port", str(grpc_port)], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "Ctrl-C to stop" not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "characters serve did not start within 120 s"
            time.sleep(0.5)
        text = (tmp_path / "serve.log").read_text()
        assert f"http://127.0.0.1:{http_port}/v1/sessions" in text and f"127.0.0.1:{grpc_port}" in text
        assert get(f"http://127.0.0.1:{http_port}/healthz") == (200, {"status": "ok"})
        status, cap = get(f"http://127.0.0.1:{http_port}/v1/capacity")  # the real scheduler, tiny preset on CPU
        assert status == 200 and cap["bundlesTotal"] >= 1 and cap["sessionsRunning"] == 0, cap
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            got = pb_grpc.CharactersStub(channel).GetCapacity(pb.GetCapacityRequest(), timeout=30)
            assert got.bundles_total == cap["bundlesTotal"]

        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        assert proc.wait(timeout=30) == 0
        took = time.monotonic() - t0
        assert took < 15, f"took {took:.1f} s to stop"
        assert port_free(http_port) and port_free(grpc_port)
        assert "stopping" in (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
