"""The local Ray cluster that `characters serve`, tests and benchmarks run on: start it on loopback, stop it
and wait for its processes, and ask whether it has GPUs.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import psutil
import ray

from deployments.types import NAMESPACE

# Ray binds GCS and raylet to the machine's outward interface even when asked for 127.0.0.1; this
# keeps a local cluster on loopback (see NOTES.md).
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
log = logging.getLogger(__name__)


def init_local(*, num_cpus: int | None = None, num_gpus: int = 0, dashboard: bool = False, attempts: int = 2,
               **kwargs: Any) -> None:
    """Start a local single-node Ray on 127.0.0.1 with `num_gpus` logical GPUs (tests, benchmarks, CLI).

    Ray gives its raylet 30 s to register with the GCS; on a loaded small machine it can miss that and
    `ray.init` raises, leaving the GCS and whatever else it started running. Such an attempt is
    cleaned up (its processes killed, with their state logged) and retried, `attempts` times in all.
    """
    os.environ.update(LOOPBACK_ENV)
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
