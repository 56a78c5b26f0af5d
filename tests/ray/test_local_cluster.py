"""`init_local` / `stop_local`: a local cluster starts again after a failed start, and stops without leftovers.

Ray's startup timeout (its raylet missing the 30 s registration deadline on a loaded machine) is the one
thing injected: the first `ray.init` starts a real cluster and then raises Ray's own message, as Ray does
after starting the GCS and raylet. Everything else is real processes.
"""

from __future__ import annotations

from typing import Any

import psutil
import pytest
import ray

from deployments.sessions import cluster as runtime
from deployments.sessions.cluster import init_local, stop_local

pytestmark = pytest.mark.ray


@ray.remote(num_cpus=0)
def pid() -> int:
    import os

    return os.getpid()


def alive(pids: set[int]) -> set[int]:
    left = set()
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                left.add(p)
        except psutil.NoSuchProcess:
            pass
    return left


@ray.remote(num_cpus=0)
def start_child() -> int:
    import subprocess

    return subprocess.Popen(["sleep", "600"]).pid  # a worker's own child (an encoder, say), left running


def test_stop_local_returns_once_the_cluster_and_its_workers_are_gone() -> None:
    init_local(num_cpus=1, dashboard=True)  # the dashboard's subprocesses outlive a plain ray.shutdown()
    try:
        worker, child = ray.get(pid.remote()), ray.get(start_child.remote())
        cluster = {p.pid for p in runtime._cluster_processes()}
        assert {worker, child} <= cluster  # the raylet's workers and their children, not only Ray's own
    finally:
        stop_local(timeout_s=5)
    assert alive(cluster) == set()
    assert not ray.is_initialized()


def test_a_start_that_timed_out_is_cleaned_up_and_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    real_init = ray.init
    first: dict[str, Any] = {}

    def flaky_init(**kwargs: Any) -> Any:
        if first:
            return real_init(**kwargs)
        real_init(**kwargs)  # a real GCS, raylet and the rest, as a timed-out start leaves them
        first["pids"] = {p.pid for p in runtime._cluster_processes()}
        ray._private.worker._global_node = None  # Ray had not recorded the node when it raised
        raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(ray, "init", flaky_init)
    init_local(num_cpus=1)
    try:
        assert alive(first["pids"]) == set()  # the failed attempt's processes were killed
        assert ray.get(pid.remote()) > 0  # the second attempt is a working cluster
    finally:
        stop_local()


def test_other_start_errors_are_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def bad_init(**kwargs: Any) -> Any:
        calls.append(kwargs)
        raise ValueError("num_cpus must be >= 0")

    monkeypatch.setattr(ray, "init", bad_init)
    with pytest.raises(ValueError, match="num_cpus"):
        init_local(num_cpus=-1)
    assert len(calls) == 1


@ray.remote(num_cpus=0)
class Holder:
    """A worker that borrows a driver-owned object: it asks the owner (the driver) where that object is."""

    def size(self, refs: list[Any]) -> int:
        return int(ray.get(refs[0]).nbytes)


def test_a_driver_left_in_token_auth_mode_still_gets_a_loopback_clusters_results(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A local `ray.init` earlier in this process (the whole suite: every `ray` test before this one) turned
    token auth on for it, for good. A loopback cluster without token auth then loses what its workers need
    from this driver (the driver refuses their calls, "Missing authorization header": OwnerDiedError, or
    the actor is cancelled). `LoopbackCluster` runs with token auth, the driver's own token."""
    import numpy as np

    from deployments.sessions.cluster import LoopbackCluster

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)  # (restored after the test)
    init_local(num_cpus=1)  # a new local cluster turns token auth on for this process, as Ray's default is
    stop_local(timeout_s=5)
    import os

    assert os.environ["RAY_AUTH_MODE"] == "token"
    c = LoopbackCluster(head_cpus=1)
    try:
        c.start()
        node = c.add_node(num_gpus=0, num_cpus=1, name="w")
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        holder = Holder.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)).remote()
        big = ray.put(np.zeros(2**20, np.uint8))  # in the object store: the borrower asks its owner for it
        assert ray.get(holder.size.remote([big]), timeout=60) == 2**20
    finally:
        c.stop()
    assert os.environ["RAY_AUTH_MODE"] == "token"
