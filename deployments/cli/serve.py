"""`characters serve`: run the Serve application on a local Ray cluster (or the one in RAY_ADDRESS).

Details: docs/operations.md (`deployments.cli.serve`)."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

import yaml

from deployments.types import NAMESPACE, SCHEDULER_NAME, Capacity

if TYPE_CHECKING:
    from deployments.livekit.server import LiveKitServer

DEFAULT_HOST, DEFAULT_PORT, DEFAULT_GRPC_PORT, DEFAULT_LIVEKIT_PORT = "127.0.0.1", 8000, 9000, 7880
SCHEDULER_SHUTDOWN_S = 15.0
LOCAL_WARM_SLOTS = 1  # own cluster, warm_slots not given: one slot kept warm
WARM_WAIT_S = 300.0  # how long start-up waits for it (a cold slot of `tiny` takes 10-20 s on 2 cores)
GRPC_MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # Serve's default is 2 GiB: cap what its proxy will buffer


def _say(text: str) -> None:
    print(f"characters serve: {text}", file=sys.stderr, flush=True)


def _load_args(config_path: str | None) -> dict[str, Any]:
    if config_path is None:
        return {}
    path = Path(config_path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise ValueError(f"cannot read config {path}: {e.strerror or e}; check the path") from e
    except yaml.YAMLError as e:
        raise ValueError(f"config {path} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"config {path} must be a mapping of app args (service, api, ingress), got "
                         f"{type(data).__name__}")
    return data


def _with_local_warm_slot(args: dict[str, Any]) -> dict[str, Any]:
    """The app args with `service.warm_slots = LOCAL_WARM_SLOTS`, unless the args or CHARACTERS_WARM_SLOTS set it."""
    from deployments.settings import WARM_SLOTS

    service = dict(args.get("service") or {})
    if "warm_slots" in args or "warm_slots" in service or os.environ.get(WARM_SLOTS.name):
        return args
    return {**args, "service": {**service, "warm_slots": LOCAL_WARM_SLOTS}}


def default_data_dir() -> str:
    """CHARACTERS_DATA_DIR, else $XDG_DATA_HOME/characters (~/.local/share/characters)."""
    from deployments.settings import DATA_DIR

    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return DATA_DIR.get() or str(Path(base) / "characters")


def _with_state(args: dict[str, Any], data_dir: str | None, database_url: str | None) -> dict[str, Any]:
    """The app args with the service's database: `database_url`, else `data_dir` (default `default_data_dir()`),
    unless the config names one (or CHARACTERS_DATABASE_URL is set)."""
    from deployments.settings import DATABASE_URL

    service = dict(args.get("service") or {})
    if database_url:
        service["database_url"] = database_url
    elif not (service.get("database_url") or service.get("data_dir") or DATABASE_URL.get()):
        service["data_dir"] = str(Path(data_dir or default_data_dir()).expanduser().resolve())
    return {**args, "service": service}


def _wait_warm(scheduler: Any, want: int, timeout_s: float) -> Capacity:
    """Poll the scheduler's capacity until `want` warm slots are free (or `timeout_s`); the last answer."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        cap = cast(Capacity, ray.get(scheduler.capacity.remote(), timeout=60))
        if cap.warm_slots_free >= want or cap.bundles_total == 0 or time.monotonic() > deadline:
            return cap
        time.sleep(0.5)


def _port_in_use(host: str, port: int) -> bool:
    """Does something listen on `port`? Probed as the servers bind (SO_REUSEADDR, as uvicorn and gRPC do), so
    the connections a server that just stopped leaves in TIME_WAIT do not count: only a live listener does."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _end_sessions(ray: Any) -> None:
    """Our own cluster is going away: let the scheduler end its sessions (MP4 outputs get finished)."""
    try:
        handle = ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE)
        ray.get(handle.shutdown.remote(), timeout=SCHEDULER_SHUTDOWN_S)
    except ValueError:
        return  # no scheduler was started
    except ray.exceptions.RayError as e:
        _say(f"the scheduler did not shut down cleanly ({type(e).__name__}); stopping anyway")


def _start_livekit_dev(http_port: int) -> LiveKitServer:
    """A development LiveKit server on loopback at `http_port` (+1 ICE/TCP, +2 UDP); the service's
    CHARACTERS_LIVEKIT_* point at it. RuntimeError when its ports are taken or it does not start."""
    from deployments.livekit.server import LiveKitServer, ServerPorts, install_server
    from deployments.settings import LIVEKIT_API_KEY, LIVEKIT_API_SECRET, LIVEKIT_DEV, LIVEKIT_PUBLIC_URL, LIVEKIT_URL

    ports = ServerPorts.from_http(http_port)
    if busy := ports.busy():
        raise RuntimeError(f"the LiveKit ports {', '.join(busy)} are in use (another LiveKit server?); stop it, or "
                           "pass another --livekit-port (its next two ports must be free too)")
    _say("--livekit-dev: installing the LiveKit server (cached after the first build)")
    server = LiveKitServer(install_server(), Path(tempfile.mkdtemp(prefix="characters-livekit-")), ports)
    server.start()
    os.environ.update({LIVEKIT_URL.name: server.url, LIVEKIT_PUBLIC_URL.name: server.url,
                       LIVEKIT_API_KEY.name: server.api_key, LIVEKIT_API_SECRET.name: server.api_secret,
                       LIVEKIT_DEV.name: "true"})
    return server


def run_serve(config_path: str | None = None, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
              grpc_port: int = DEFAULT_GRPC_PORT, livekit_dev: bool = False,
              livekit_port: int = DEFAULT_LIVEKIT_PORT, data_dir: str | None = None,
              database_url: str | None = None) -> int:
    """Serve until Ctrl-C / SIGTERM (see the module docstring). Returns the process exit code."""
    address = os.environ.get("RAY_ADDRESS") or None
    if livekit_dev and address is not None:
        _say(f"--livekit-dev starts a local LiveKit server for a local cluster; RAY_ADDRESS={address} is set: unset "
             "it, or set CHARACTERS_LIVEKIT_URL/_API_KEY/_API_SECRET on that cluster instead")
        return 2
    if address is None:  # before Ray is imported: keep our own cluster on loopback
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", str(GRPC_MAX_MESSAGE_BYTES))
    try:
        args = _load_args(config_path)
        if address is None:
            args = _with_local_warm_slot(args)
        args = _with_state(args, data_dir, database_url)
        from deployments.api.app import parse_args  # imports Ray: after the environment is set
        from deployments.store import database_url as resolve_url
        from deployments.store import describe, open_engine

        service, _, _ = parse_args(args)
        url = resolve_url(service.data_dir, service.database_url)
        open_engine(url)  # made and migrated now: a database that cannot be used stops the start here
        _say(f"state in {describe(url)}")
    except ValueError as e:
        _say(str(e))
        return 2
    for name, p in (("--port", port), ("--grpc-port", grpc_port)):
        if p and address is None and _port_in_use(host if name == "--port" else "0.0.0.0", p):
            _say(f"port {p} is already in use; pass another {name} or stop what holds it")
            return 2

    import ray
    from ray import serve

    from deployments.api.app import APP_NAME, GRPC_SERVICER_FUNCTIONS, build_app, connect_scheduler
    from deployments.sessions.cluster import init_local, stop_local

    stop = threading.Event()
    livekit: LiveKitServer | None = None
    try:
        if livekit_dev:
            try:
                livekit = _start_livekit_dev(livekit_port)  # before Ray: its processes inherit the environment
            except (RuntimeError, ValueError) as e:
                _say(f"--livekit-dev: {e}")
                return 2
        if address is None:
            init_local()
        else:
            ray.init(address=address, namespace=NAMESPACE)

        def on_signal(signum: int, _: FrameType | None) -> None:
            stop.set()

        signal.signal(signal.SIGINT, on_signal)  # after ray.init, which installs its own SIGTERM handler
        signal.signal(signal.SIGTERM, on_signal)
        grpc = {"port": grpc_port, "grpc_servicer_functions": list(GRPC_SERVICER_FUNCTIONS)} if grpc_port else None
        serve.start(http_options={"host": host, "port": port}, grpc_options=grpc)
        serve.run(build_app(args), name=APP_NAME, route_prefix="/")
        try:
            t0 = time.monotonic()
            if service.warm_slots:
                _say(f"warming {service.warm_slots} slot(s) of {service.preset} (warm_slots)")
            cap = _wait_warm(connect_scheduler(service), min(service.warm_slots, 1), WARM_WAIT_S)
            warm = f", {cap.warm_slots_free} warm slot(s) ready in {time.monotonic() - t0:.1f} s" \
                if service.warm_slots else ""
            _say(f"scheduler ready: {cap.bundles_free}/{cap.bundles_total} bundles free, preset {service.preset}{warm}")
        except (ray.exceptions.RayError, ImportError, ValueError) as e:  # the API still answers (503 until then)
            _say(f"scheduler not ready ({type(e).__name__}: {e}); the API answers 503 scheduler_unavailable")
        _say(f"HTTP  http://{host}:{port}/v1/sessions   docs http://{host}:{port}/docs")
        if grpc_port:
            _say(f"gRPC  {host}:{grpc_port}  service characters.v1.Characters")
        _say(f"Watch http://{host}:{port}/watch/")
        if livekit is not None:
            _say(f"LiveKit {livekit.url}  API key {livekit.api_key}  secret {livekit.api_secret}  (development "
                 f"server; GET /v1/livekit; log {livekit.log_path})")
        _say("Ctrl-C to stop")
        while not stop.wait(0.5):
            pass
        _say("stopping")
    except KeyboardInterrupt:
        _say("interrupted during start-up; stopping")
    finally:
        if ray.is_initialized():
            if address is None:
                _end_sessions(ray)
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
            stop_local()
        if livekit is not None:
            livekit.stop()
            shutil.rmtree(livekit.workdir, ignore_errors=True)  # its config and log: made for this run only
    return 0


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The `serve` command's arguments (on `parser`, e.g. a subparser of `characters`)."""
    p = parser or argparse.ArgumentParser(prog="characters serve", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="YAML file of app args (service, api, ingress); default: built-in + CHARACTERS_*")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"HTTP bind address (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"HTTP port (default {DEFAULT_PORT})")
    p.add_argument("--grpc-port", type=int, default=DEFAULT_GRPC_PORT,
                   help=f"gRPC port (default {DEFAULT_GRPC_PORT}; 0: no gRPC)")
    p.add_argument("--livekit-dev", action="store_true",
                   help="also start a development LiveKit server on loopback as the service's own (the watch "
                        "page's; its URL and keys: GET /v1/livekit)")
    p.add_argument("--livekit-port", type=int, default=DEFAULT_LIVEKIT_PORT,
                   help=f"--livekit-dev's HTTP/WebSocket port (default {DEFAULT_LIVEKIT_PORT}; ICE/TCP and UDP take "
                        "the next two)")
    p.add_argument("--data-dir", default=None,
                   help="directory of the embedded SQLite database (avatars, sessions, usage; created on first run; "
                        "default CHARACTERS_DATA_DIR, else ~/.local/share/characters)")
    p.add_argument("--database-url", default=None,
                   help="PostgreSQL instead: postgresql+psycopg://user:pw@host/db (prefer CHARACTERS_DATABASE_URL: "
                        "a flag's password shows in the process list)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return run(a)


def run(a: argparse.Namespace) -> int:
    """`run_serve` with the parsed arguments of `build_parser`."""
    return run_serve(a.config, a.host, a.port, a.grpc_port, a.livekit_dev, a.livekit_port, a.data_dir,
                     a.database_url)


if __name__ == "__main__":
    sys.exit(main())
