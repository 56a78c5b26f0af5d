"""preStop hook of the Ray pods: wait until no character session runs here, then return.

Kubernetes runs this before it sends SIGTERM to the Ray container, and kills the pod anyway once
``terminationGracePeriodSeconds`` has passed, so ``--max-wait-s`` stays below that grace period.

- ``--scope node`` (GPU workers): wait while a session actor is alive on this pod's Ray node.
  An idle node (what the autoscaler removes) has none and returns at once.
- ``--scope cluster`` (head): wait while a session actor is alive anywhere in the cluster: the
  GCS on the head must outlive every session, or the workers lose the cluster under them.

A session is an ALIVE actor whose class is one of ``$CHARACTERS_SESSION_ACTOR_CLASSES``
(comma-separated, default ``SessionActor``): the per-session actor of ``deployments/``. Warm slots
(workers with loaded weights but no session) do not hold the pod.

If the Ray state API cannot be reached a few times in a row, the cluster is already going away and
there is nothing left to protect: return. Progress goes to the container's log (PID 1's stdout).
Runs inside the Ray image with its Python; needs ``ray`` and nothing else.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

DEFAULT_CLASSES = "SessionActor"
UNREACHABLE_LIMIT = 3


def live_sessions(actors: Iterable[Mapping[str, Any]], classes: frozenset[str], node_ids: frozenset[str] | None) -> int:
    """Sessions that hold the pod: ALIVE actors of a session class, on ``node_ids`` (None: anywhere)."""
    return sum(
        1
        for a in actors
        if a.get("state") == "ALIVE"
        and a.get("class_name") in classes
        and (node_ids is None or a.get("node_id") in node_ids)
    )


def wait(
    count: Callable[[], int],
    *,
    max_wait_s: float,
    poll_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    log: Callable[[str], None] = print,
) -> str:
    """Poll ``count`` until it is 0 ("drained"), fails UNREACHABLE_LIMIT times ("unreachable"), or time ends."""
    deadline = clock() + max_wait_s
    failures = 0
    while True:
        try:
            n = count()
            failures = 0
        except Exception as e:  # noqa: BLE001 - any failure of the state API counts as "unreachable"
            failures += 1
            log(f"prestop: Ray state API failed ({failures}/{UNREACHABLE_LIMIT}): {type(e).__name__}: {e}")
            if failures >= UNREACHABLE_LIMIT:
                return "unreachable"
            n = -1
        if n == 0:
            return "drained"
        left = deadline - clock()
        if left <= 0:
            return "timeout"
        if n > 0:
            log(f"prestop: {n} session(s) still running; waiting up to {left:.0f} s more")
        sleep(min(poll_s, left))


def _ray_counter(scope: str, classes: frozenset[str]) -> Callable[[], int]:
    from ray.util.state import list_actors, list_nodes

    pod_ip = os.environ.get("POD_IP") or os.environ.get("MY_POD_IP", "")

    def count() -> int:
        node_ids: frozenset[str] | None = None
        if scope == "node":
            nodes = list_nodes(address="auto", filters=[("node_ip", "=", pod_ip)], raise_on_missing_output=False)
            node_ids = frozenset(n.node_id for n in nodes)
        actors = list_actors(
            address="auto", filters=[("state", "=", "ALIVE")], limit=100_000, raise_on_missing_output=False
        )
        return live_sessions(
            ({"state": a.state, "class_name": a.class_name, "node_id": a.node_id} for a in actors), classes, node_ids
        )

    return count


def _log(message: str) -> None:
    line = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {message}\n"
    try:
        with open("/proc/1/fd/1", "a") as out:  # the container log; preStop output is otherwise discarded
            out.write(line)
    except OSError:
        sys.stderr.write(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scope", choices=("node", "cluster"), required=True)
    parser.add_argument("--max-wait-s", type=float, required=True, help="stay below terminationGracePeriodSeconds")
    parser.add_argument("--poll-s", type=float, default=5.0)
    args = parser.parse_args(argv)
    raw = os.environ.get("CHARACTERS_SESSION_ACTOR_CLASSES", DEFAULT_CLASSES)
    classes = frozenset(c.strip() for c in raw.split(",") if c.strip())
    _log(f"prestop: scope={args.scope}, waiting up to {args.max_wait_s:.0f} s for sessions of {sorted(classes)}")
    outcome = wait(_ray_counter(args.scope, classes), max_wait_s=args.max_wait_s, poll_s=args.poll_s, log=_log)
    _log(f"prestop: {outcome}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
