"""`characters serve` (deployments.cli.serve) as a subprocess: starts, answers HTTP and gRPC, and on
SIGINT exits 0 within seconds, its cluster's processes gone and its ports free, so a second one started at
once on the same ports comes up. Runs its own Ray cluster (the real scheduler)."""

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
import psutil
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


def start_serve(http_port: int, grpc_port: int, log_path: Path) -> subprocess.Popen[bytes]:
    """`characters serve` on the given ports, once it says it is ready (its log in `log_path`)."""
    env = {**os.environ, "CHARACTERS_API_KEYS": "", "RAY_ADDRESS": ""}
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "deployments.cli.serve", "--port", str(http_port),
                                 "--grpc-port", str(grpc_port)], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while "Ctrl-C to stop" not in log_path.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"characters serve did not start within 120 s: {log_path.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc


def stop_serve(proc: subprocess.Popen[bytes]) -> float:
    """SIGINT, then the seconds `characters serve` took to exit (0 required)."""
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    assert proc.wait(timeout=30) == 0
    return time.monotonic() - t0


def test_serve_runs_until_sigint_then_frees_its_ports_and_starts_again_at_once(tmp_path: Path) -> None:
    http_port, grpc_port = free_port(), free_port()
    proc = start_serve(http_port, grpc_port, tmp_path / "serve.log")
    second: subprocess.Popen[bytes] | None = None
    try:
        text = (tmp_path / "serve.log").read_text()
        assert f"http://127.0.0.1:{http_port}/v1/sessions" in text and f"127.0.0.1:{grpc_port}" in text
        assert get(f"http://127.0.0.1:{http_port}/healthz") == (200, {"status": "ok"})
        status, cap = get(f"http://127.0.0.1:{http_port}/v1/capacity")  # the real scheduler, tiny preset on CPU
        assert status == 200 and cap["bundlesTotal"] >= 1 and cap["sessionsRunning"] == 0, cap
        assert cap["warmSlotsFree"] == 1, cap  # its own cluster keeps one slot warm, ready before it says so
        assert "1 warm slot(s) ready in" in text
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            got = pb_grpc.CharactersStub(channel).GetCapacity(pb.GetCapacityRequest(), timeout=30)
            assert got.bundles_total == cap["bundlesTotal"]
        cluster = psutil.Process(proc.pid).children(recursive=True)  # raylet, GCS, Serve's proxies, workers
        assert len(cluster) >= 3, [p.name() for p in cluster]

        took = stop_serve(proc)
        assert took < 15, f"took {took:.1f} s to stop"
        alive = [p for p in cluster if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert alive == [], f"characters serve returned with its cluster's processes alive: {alive}"
        assert port_free(http_port) and port_free(grpc_port)
        assert "stopping" in (tmp_path / "serve.log").read_text()

        # at once, on the same ports (the connections above linger in TIME_WAIT): it comes up
        second = start_serve(http_port, grpc_port, tmp_path / "serve2.log")
        assert get(f"http://127.0.0.1:{http_port}/healthz") == (200, {"status": "ok"})
        assert stop_serve(second) < 15
    finally:
        for p in (proc, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
