"""k8s/base/prestop.py, the Ray pods' preStop hook: which actors hold a pod, and the wait loop on virtual time
(pure CPU, no Ray cluster, no marker)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

K8S = Path(__file__).resolve().parents[2] / "k8s"


def _prestop() -> Any:

    spec = importlib.util.spec_from_file_location("prestop", K8S / "base" / "prestop.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prestop_counts_live_sessions_on_this_node() -> None:
    prestop = _prestop()
    actors = [
        {"state": "ALIVE", "class_name": "SessionActor", "node_id": "a"},
        {"state": "ALIVE", "class_name": "SessionActor", "node_id": "b"},
        {"state": "DEAD", "class_name": "SessionActor", "node_id": "a"},
        {"state": "ALIVE", "class_name": "DiTWorker", "node_id": "a"},  # a warm slot holds no pod
    ]
    classes = frozenset({"SessionActor"})
    assert prestop.live_sessions(actors, classes, frozenset({"a"})) == 1
    assert prestop.live_sessions(actors, classes, None) == 2
    assert prestop.live_sessions(actors, classes, frozenset()) == 0


def test_prestop_waits_until_drained_timeout_or_unreachable() -> None:
    prestop = _prestop()
    now = [0.0]

    def run(counts: list[Any], max_wait_s: float) -> tuple[str, float]:
        now[0] = 0.0
        it = iter(counts)

        def count() -> int:
            value = next(it)
            if isinstance(value, Exception):
                raise value
            return int(value)

        def sleep(s: float) -> None:
            now[0] += s

        out = prestop.wait(count, max_wait_s=max_wait_s, poll_s=5.0, clock=lambda: now[0], sleep=sleep,
                           log=lambda _m: None)
        return out, now[0]

    assert run([2, 1, 0], 100) == ("drained", 10.0)
    assert run([1] * 100, 12) == ("timeout", 12.0)
    assert run([1, ConnectionError("gone"), ConnectionError("gone"), ConnectionError("gone")], 100) == (
        "unreachable", 15.0)
    assert run([ConnectionError("x"), 0], 100) == ("drained", 5.0)
