"""The local Ray clusters that `characters serve`, tests, benchmarks and the soak run on, all on loopback:
`init_local` / `stop_local` (one node, in this process's Ray) and `LoopbackCluster` (a head and worker nodes,
each a real raylet in a process group of its own, so that one can be killed alone); and whether a cluster
has GPUs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import ray
from ray._private import ray_constants

from deployments.types import NAMESPACE

# Ray binds GCS and raylet to the machine's outward interface even when asked for 127.0.0.1; this
# keeps a local cluster on loopback (see NOTES.md).
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Ray starts every worker process at nice 15 (its `worker_niceness`), so the DiT, decoder and room workers of a
# session yield the CPU to anything else on the host at nice 0 (the LiveKit server, a voice agent, a viewer): on
# the embedded default's two cores, the agent's burst at each speech onset starved the chunk that carries it
# (measured: scripts/benchmarks/bench_latency.py). The chunk path is real-time work: its workers start at nice 0.
# A value set in the environment wins.
WORKER_ENV = {"RAY_worker_niceness": "0"}
log = logging.getLogger(__name__)


def init_local(*, num_cpus: int | None = None, num_gpus: int = 0, dashboard: bool = False, attempts: int = 2,
               **kwargs: Any) -> None:
    """Start a local single-node Ray on 127.0.0.1 with `num_gpus` logical GPUs (tests, benchmarks, CLI).

    Ray gives its raylet 30 s to register with the GCS; on a loaded small machine it can miss that and
    `ray.init` raises, leaving the GCS and whatever else it started running. Such an attempt is
    cleaned up (its processes killed, with their state logged) and retried, `attempts` times in all.
    """
    os.environ.update(LOOPBACK_ENV)
    for key, value in WORKER_ENV.items():
        os.environ.setdefault(key, value)
    for attempt in range(1, attempts + 1):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        try:
            ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=dashboard,
                     _node_ip_address="127.0.0.1", namespace=NAMESPACE, **kwargs)
            return
        except Exception as e:  # Ray raises a bare Exception for the startup timeout
            if "timed out during startup" not in str(e) or attempt == attempts:
                raise
            started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
            log.warning("local Ray did not start (attempt %d of %d: %s); killing what it started: %s",
                        attempt, attempts, e, "; ".join(_describe(p) for p in started))
            ray.shutdown()
            for proc in started:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            psutil.wait_procs(started, timeout=30)


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {proc.status()} {' '.join(proc.cmdline())[:120]}"
    except psutil.Error as e:
        return f"{proc.pid} ({type(e).__name__})"


def stop_local(timeout_s: float = 60.0) -> None:
    """`ray.shutdown()` that returns only once the cluster's processes are gone, workers included.

    Plain `ray.shutdown()` returns while the raylet, GCS and dashboard are still exiting and the
    raylet's workers (each with torch loaded) are still tearing down; on a small machine the next
    `init_local` then competes with them and its raylet can miss Ray's 30 s registration deadline.
    The processes are the node's own and their descendants, taken before the shutdown; whatever is
    still alive after `timeout_s` is killed.
    """
    procs = _cluster_processes()
    ray.shutdown(wait_for_processes=True)
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def _cluster_processes() -> list[psutil.Process]:
    node = ray._private.worker._global_node
    if node is None:
        return []
    found: dict[int, psutil.Process] = {}
    for infos in node.all_processes.values():
        for info in infos:
            with contextlib.suppress(psutil.Error):
                top = psutil.Process(info.process.pid)
                for proc in (top, *top.children(recursive=True)):
                    found[proc.pid] = proc
    return list(found.values())


def cluster_has_gpus() -> bool:
    return float(ray.cluster_resources().get("GPU", 0.0)) > 0


# ------------------------------------------------------------------------------ several nodes on loopback

#: GCS health checks of a loopback cluster: a raylet that stops answering is marked dead after ~3 s
#: (Ray's defaults, 3 s x 5 failures, take ~15 s; KubeRay clusters keep those unless told otherwise).
LOOPBACK_HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3,
                          "health_check_timeout_ms": 1000}
NODE_OBJECT_STORE_BYTES = 256 * 2**20
NODE_UP = "loopback node up:"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LoopbackNode:
    """One node of a `LoopbackCluster`: its own raylet (and agents) in a process group of its own."""

    name: str
    num_gpus: int
    num_cpus: int
    proc: subprocess.Popen[bytes]
    log: Path
    node_id: str = ""  # hex, once registered with the GCS
    registered_at: float = 0.0  # time.time() when the GCS was first seen to list it alive

    @property
    def pgid(self) -> int:
        return self.proc.pid  # started with start_new_session: the leader of its own group

    def processes(self) -> list[psutil.Process]:
        """The node's processes: its group (raylet, agents) and every descendant (the raylet's workers,
        which the raylet starts in process groups of their own)."""
        try:
            top = psutil.Process(self.proc.pid)
            return [top, *top.children(recursive=True)]
        except psutil.Error:
            return []


class LoopbackCluster:
    """A real multi-node Ray cluster on this machine's loopback (tests, soak): a head without GPUs, like a
    KubeRay head, and worker nodes with logical GPUs, each a real raylet in a process group of its own, so
    that one node can be killed alone (`kill_node`) while the others run on.

    The head is `ray start --head --block`. Worker nodes are started by this module's `node` command, which
    does what `ray start --address ... --block` does, because Ray's CLI refuses a worker node under
    `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` and, without it, resolves 127.0.0.1 to the machine's outward
    address (NOTES.md). Every port is picked free; sockets and logs live under one temporary directory that
    `stop` removes. The driver (this process) connects to the head's raylet.
    """

    def __init__(self, *, head_cpus: int = 2, system_config: Mapping[str, Any] | None = None,
                 object_store_bytes: int = NODE_OBJECT_STORE_BYTES, autoscaler_v2: bool = True) -> None:
        self.head_cpus, self.object_store_bytes = head_cpus, object_store_bytes
        self.system_config = dict(LOOPBACK_HEALTH_CHECKS if system_config is None else system_config)
        self.root = Path(tempfile.mkdtemp(prefix="rlc-", dir="/tmp"))  # short: socket paths are <= 107 bytes
        # Token auth on, as Ray's default for a local cluster and as our RayService runs it (`authOptions`), with
        # this process's token (`_set_auth_mode`). Autoscaler v2, as our RayService runs it
        # (`autoscalerOptions.version: v2`): demand published with `request_resources` is kept in the GCS
        # as a cluster resource constraint, where KubeRay's autoscaler reads it.
        self.env = {**WORKER_ENV, **os.environ, **LOOPBACK_ENV, "RAY_USAGE_STATS_ENABLED": "0",
                    "RAY_AUTH_MODE": "token", **({"RAY_enable_autoscaler_v2": "1"} if autoscaler_v2 else {})}
        self.head: LoopbackNode | None = None
        self.nodes: list[LoopbackNode] = []
        self.address = ""
        self._driver_auth: str | None = None

    def __enter__(self) -> LoopbackCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 90.0, attempts: int = 2) -> str:
        """Start the head and connect this process to it; returns the GCS address. A head that exits while
        starting (its raylet missed Ray's 30 s registration on a loaded machine) is killed and started
        again, `attempts` times in all."""
        os.environ.update(LOOPBACK_ENV)
        self._driver_auth = _set_auth_mode("token")
        # Ray read RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it was imported; without this, connecting to
        # "127.0.0.1:port" resolves it to the machine's outward address, where this GCS does not listen.
        ray_constants.ENABLE_RAY_CLUSTER = False
        for attempt in range(1, attempts + 1):
            self.head = self._spawn("head", self._head_command(), num_gpus=0, num_cpus=self.head_cpus)
            deadline = time.monotonic() + timeout_s
            while self.head.proc.poll() is None:
                try:
                    ray.init(address=self.address, _node_ip_address="127.0.0.1", namespace=NAMESPACE,
                             configure_logging=False, log_to_driver=False)
                    self.head.node_id = ray.get_runtime_context().get_node_id()
                    return self.address
                except ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            tail = self.head.log.read_text(errors="replace").splitlines()[-5:]
            if attempt == attempts:
                raise RuntimeError(f"the head exited ({self.head.proc.returncode}); the end of {self.head.log}: {tail}")
            log.warning("the loopback head did not start (attempt %d of %d): %s", attempt, attempts, tail)
            _kill_group(self.head.pgid)
            self.head.log.rename(self.head.log.with_suffix(f".{attempt}.log"))
        raise AssertionError("unreachable")

    def _head_command(self) -> list[str]:
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        ports = {flag: free_port() for flag in ("--dashboard-port", "--dashboard-agent-listen-port",
                                                "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
                                                "--metrics-export-port", "--ray-client-server-port",
                                                "--node-manager-port", "--object-manager-port")}
        config = [f"--system-config={json.dumps(self.system_config)}"] if self.system_config else []
        return [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--disable-usage-stats",
                "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", str(self.head_cpus),
                "--num-gpus", "0", "--include-dashboard", "false", "--temp-dir", str(self.root),
                "--object-store-memory", str(self.object_store_bytes), "--min-worker-port", "0",
                "--max-worker-port", "0", *config, *(x for flag, p in ports.items() for x in (flag, str(p)))]

    def add_node(self, *, num_gpus: int, num_cpus: int = 4, resources: Mapping[str, float] | None = None,
                 name: str | None = None, timeout_s: float = 90.0, attempts: int = 2) -> LoopbackNode:
        """Start a worker node with `num_gpus` logical GPUs; return once the GCS lists it alive. Ray gives a
        raylet 30 s to register; on a loaded small machine it can miss that and the node exits: its processes
        are then killed and it is started again, `attempts` times in all (the failed try's log kept beside)."""
        name = name or f"node{len(self.nodes) + 1}"
        for attempt in range(1, attempts + 1):
            sockets = self.root / name
            sockets.mkdir()
            args = {"address": self.address, "num_cpus": num_cpus, "num_gpus": num_gpus,
                    "resources": dict(resources or {}), "sockets": str(sockets),
                    "object_store_bytes": self.object_store_bytes}
            node = self._spawn(name, [sys.executable, "-m", "deployments.sessions.cluster", "node", json.dumps(args)],
                               num_gpus=num_gpus, num_cpus=num_cpus)
            try:
                self.wait_registered(node, timeout_s)
            except RuntimeError as err:
                if attempt == attempts:
                    raise
                log.warning("loopback node %s did not start (attempt %d of %d): %s", name, attempt, attempts, err)
                _kill_group(node.pgid)
                node.proc.wait(10)
                node.log.rename(node.log.with_suffix(f".{attempt}.log"))
                shutil.rmtree(sockets, ignore_errors=True)
                continue
            self.nodes.append(node)
            return node
        raise AssertionError("unreachable")

    def wait_registered(self, node: LoopbackNode, timeout_s: float = 90.0) -> str:
        """The node's id, once the GCS lists its raylet alive (`registered_at`: when this first saw that) and
        the node's processes are all started."""
        raylet = str(self.root / node.name / "raylet")
        deadline = time.monotonic() + timeout_s
        while not node.node_id:
            if not node.registered_at and any(n.get("Alive") and n.get("RayletSocketName") == raylet
                                              for n in ray.nodes()):
                node.registered_at = time.time()
            up = [line.split()[-1] for line in node.log.read_text(errors="replace").splitlines()
                  if line.startswith(NODE_UP)]
            if up and node.registered_at:
                node.node_id = up[0]
            elif node.proc.poll() is not None or time.monotonic() > deadline:
                tail = node.log.read_text(errors="replace").splitlines()[-5:]
                raise RuntimeError(f"node {node.name} did not register within {timeout_s:.0f} s (exit code "
                                   f"{node.proc.poll()}); the end of its log {node.log}: {tail}")
            else:
                time.sleep(0.05)
        return node.node_id

    def kill_node(self, node: LoopbackNode, *, workers: bool = False) -> None:
        """SIGKILL the node's process group: its raylet, object store and agents die at once, and its
        workers (in groups of their own) notice and exit. `workers=True` kills them too, at the same time
        (a machine or pod that vanishes)."""
        procs = node.processes() if workers else []
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pgid, signal.SIGKILL)
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        node.proc.wait(30)

    def stop(self, timeout_s: float = 30.0, keep_logs: Path | None = None) -> None:
        """Disconnect, stop every node (workers first, then the head), kill what is left after `timeout_s`,
        and remove the cluster's directory (its logs moved to `keep_logs` first, when given): nothing of it
        is left running."""
        nodes = [*self.nodes, *([self.head] if self.head else [])]
        procs = {p.pid: p for node in nodes for p in node.processes()}
        ray.shutdown()
        for node in nodes:  # the leader stops its node's processes in order (SIGTERM to the whole group at
            if node.proc.poll() is None:  # once keeps the head's raylet waiting ~30 s on its agents)
                node.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout_s)
        _, alive = psutil.wait_procs(list(procs.values()), timeout=timeout_s)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=10)
        for node in nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(10)
        if keep_logs is not None:
            keep_logs.mkdir(parents=True, exist_ok=True)
            for path in self.root.glob("*.log"):
                shutil.move(str(path), keep_logs / path.name)
            for path in self.root.glob("session_*"):
                if not path.is_symlink() and (path / "logs").is_dir():
                    shutil.move(str(path / "logs"), keep_logs / "logs")
        shutil.rmtree(self.root, ignore_errors=True)
        self.nodes, self.head = [], None
        if self._driver_auth != "token":  # this process's mode as it was (a later local `ray.init`)
            _set_auth_mode(self._driver_auth)

    def _spawn(self, name: str, cmd: list[str], *, num_gpus: int, num_cpus: int) -> LoopbackNode:
        log = self.root / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        return LoopbackNode(name, num_gpus, num_cpus, proc, log)


def _set_auth_mode(mode: str | None) -> str | None:
    """Set this process's Ray token-auth mode (None: unset) and return the one it had. A driver must match
    its cluster's mode, and cannot change it once it has connected to a cluster: a process that ran a local
    `ray.init` (which turns token auth on by default) keeps refusing calls from a cluster without auth
    ("Missing authorization header": the workers' results it owns are lost, OwnerDiedError) even after
    RAY_AUTH_MODE changes. Ray caches the mode in its config, so that is read again. With token mode the
    token must exist: Ray's own (RAY_AUTH_TOKEN, or ~/.ray/auth_token, made here as a local `ray.init`
    makes it when it is missing), so this process and the cluster's use the same one."""
    from ray._private.authentication.authentication_token_setup import generate_and_save_token
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    before = os.environ.get("RAY_AUTH_MODE")
    if mode is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = mode
    Config.initialize("")
    if mode == "token" and not AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
        generate_and_save_token()
    return before


def _kill_group(pgid: int, timeout_s: float = 10.0) -> None:
    """SIGKILL every process of group `pgid` (its leader may be gone already) and wait until none is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        members = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                    members.append(proc)
        if not members:
            return
        time.sleep(0.1)


def _run_node(args: Mapping[str, Any]) -> None:
    """`python -m deployments.sessions.cluster node '<json>'`: one worker node of a LoopbackCluster, until
    SIGTERM (its processes stopped in order) or until one of them dies (the rest killed): what
    `ray start --address ... --block` does for a worker node, on loopback. Prints `node <id> up` when its
    processes are all started."""
    import threading

    from ray._private.node import Node
    from ray._private.parameter import RayParams

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # also during start-up: stop once started
    params = RayParams(node_ip_address="127.0.0.1", gcs_address=args["address"], num_cpus=args["num_cpus"],
                       num_gpus=args["num_gpus"], resources=args["resources"],
                       object_store_memory=args["object_store_bytes"], min_worker_port=0, max_worker_port=0,
                       node_manager_port=0, dashboard_agent_listen_port=None,
                       include_log_monitor=False,  # type: ignore[arg-type]  # (Ray's annotation says str; it is a flag)
                       plasma_store_socket_name=f"{args['sockets']}/plasma",
                       raylet_socket_name=f"{args['sockets']}/raylet")
    node = Node(params, head=False, shutdown_at_exit=False, spawn_reaper=False)
    print(f"{NODE_UP} {node.node_id}", flush=True)
    while not stop.wait(1.0):
        if node.dead_processes():
            print(f"a process of the node died: {node.dead_processes()}", flush=True)
            node.kill_all_processes(check_alive=False, allow_graceful=False)
            os._exit(1)
    node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)


if __name__ == "__main__":
    if sys.argv[1:2] != ["node"] or len(sys.argv) != 3:
        raise SystemExit("usage: python -m deployments.sessions.cluster node '<json>' (started by LoopbackCluster)")
    _run_node(json.loads(sys.argv[2]))
