"""A local LiveKit server for tests, benchmarks and development: config, start, readiness, stop.

The binary comes from `scripts/setup/install_livekit.sh` (built once from the Go module, cached). The config
keeps everything on loopback: HTTP/WebSocket, ICE/TCP and one UDP port chosen free at run time,
`rtc.node_ip: 127.0.0.1`, a local STUN entry (the default names public STUN servers), `--bind
127.0.0.1`, and the `--dev` keys (`devkey` / `secret`). One node, no Redis.
"""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import yaml

DEV_API_KEY = "devkey"
DEV_API_SECRET = "secret"  # the server's --dev secret: public, for loopback development only
REPO = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = REPO / "scripts" / "setup" / "install_livekit.sh"


def install_server(timeout_s: float = 900.0) -> Path:
    """Run `scripts/setup/install_livekit.sh` (a no-op when the cached binary is current); the binary's path."""
    try:
        done = subprocess.run([str(INSTALL_SCRIPT)], check=True, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{INSTALL_SCRIPT.name} failed (exit {e.returncode}): {e.stderr.strip()[-2000:]}; "
                           "it needs Go >= 1.26 and the Go module proxy") from e
    return Path(done.stdout.strip().splitlines()[-1])


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


DEV_HTTP_PORT = 7880  # LiveKit's own defaults: HTTP/WebSocket 7880, ICE/TCP 7881, UDP 7882


@dataclass(frozen=True)
class ServerPorts:
    http: int
    rtc_tcp: int
    rtc_udp: int

    @classmethod
    def pick(cls) -> ServerPorts:
        """Free ports (tests, benchmarks: several servers may run side by side)."""
        return cls(free_port(), free_port(), free_port(socket.SOCK_DGRAM))

    @classmethod
    def from_http(cls, http: int = DEV_HTTP_PORT) -> ServerPorts:
        """LiveKit's layout from its HTTP port: ICE/TCP on the next port, UDP on the one after (7880, 7881, 7882
        by default, as the LiveKit docs and examples assume)."""
        if not 1 <= http <= 65533:
            raise ValueError(f"LiveKit HTTP port {http} must be 1..65533 (ICE/TCP and UDP take the next two)")
        return cls(http, http + 1, http + 2)

    def busy(self) -> list[str]:
        """The ports something on this machine already holds, e.g. ['7880/tcp']."""
        out = []
        for port, kind, name in ((self.http, socket.SOCK_STREAM, "tcp"), (self.rtc_tcp, socket.SOCK_STREAM, "tcp"),
                                 (self.rtc_udp, socket.SOCK_DGRAM, "udp")):
            with socket.socket(socket.AF_INET, kind) as s:
                if kind == socket.SOCK_STREAM:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    out.append(f"{port}/{name}")
        return out


def server_config(ports: ServerPorts, log_level: str = "warn") -> dict[str, Any]:
    return {
        "port": ports.http,
        "rtc": {"tcp_port": ports.rtc_tcp, "udp_port": ports.rtc_udp, "use_external_ip": False,
                "node_ip": "127.0.0.1", "stun_servers": ["127.0.0.1:3478"], "enable_loopback_candidate": True},
        "logging": {"level": log_level},
    }


class LiveKitServer:
    """One `livekit-server --dev` process on loopback. `start()` waits until it answers; `stop()` ends it
    (SIGTERM, then SIGKILL) and is idempotent. Also a context manager."""

    def __init__(self, binary: Path, workdir: Path, ports: ServerPorts | None = None, log_level: str = "warn") -> None:
        self.binary, self.workdir = binary, workdir
        self.ports = ports or ServerPorts.pick()
        self.log_level = log_level
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.ports.http}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.http}"

    api_key = DEV_API_KEY
    api_secret = DEV_API_SECRET

    @property
    def log_path(self) -> Path:
        return self.workdir / "livekit-server.log"

    def start(self, timeout_s: float = 20.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "livekit.yaml"
        config.write_text(yaml.safe_dump(server_config(self.ports, self.log_level)))
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (kept open for the process's lifetime)
        proc = self.proc = subprocess.Popen(
            [str(self.binary), "--config", str(config), "--bind", "127.0.0.1", "--dev"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"livekit-server exited with {proc.returncode} at start; log tail:\n{tail}")
            try:
                with urllib.request.urlopen(self.http_url, timeout=1.0) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"livekit-server did not answer on {self.http_url} within {timeout_s:g} s; "
                                   f"see {self.log_path}")
            time.sleep(0.1)

    def stop(self, timeout_s: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> LiveKitServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
