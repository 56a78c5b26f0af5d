"""Cluster membership as the scheduler sees it: the GCS's node table and the scheduler's own probes of the
raylets that hold its slots, merged into one view. `Membership` takes plain values and returns changes;
`NodeWatch` reads the table every `refresh_s` and probes every `probe_s` through functions it is given
(on the cluster `placement.actor.node_table` and `placement.actor.RayletProbe`; plain ones in tests), and
hands the changes to the scheduler, which applies them.

A node is one of

    live      listed alive by the GCS and answering its probes: slots may be built on it
    draining  the GCS marks it draining (a preemption notice, a scale-down, `ray drain-node`): its
              sessions run on, but no slot is built there and its free warm slots are retired, so it can go
    lost      the GCS lists it dead or no longer lists it, or its raylet stopped answering its probes:
              refused `failures` of them in a row (the process is gone: nothing listens on its port), or
              gave no answer for `silent_s` (a machine gone from the network; a raylet that is merely slow
              still answers within that): every slot on it is gone (its sessions end FAILED
              `node_lost: ...`, or resume elsewhere)

Why probe: Ray marks a node dead only once its health checks fail (`health_check_period_ms` x
`health_check_failure_threshold`, 3 s x 5 by default, so ~15 s), and the workers of a node whose raylet
died run on for ~2.5 s before they notice; the scheduler's own probe of the raylet's gRPC health service
(the check the GCS itself makes) tells within about a second. A node lost by its probes that the GCS
still lists, and that answers again, is live again (`joined`, "answering again"); one the GCS has
declared dead never comes back (a restarted raylet registers under a new node id).

Each change is reported once, as a `NodeChange`; the first table (the scheduler starting) is the
baseline and reports none.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ray.exceptions import RayError

log = logging.getLogger(__name__)

NodeState = Literal["live", "draining", "lost"]
ChangeKind = Literal["joined", "draining", "lost"]
Answer = Literal["ok", "refused", "silent"]  # a probe's: answered; connection refused; no answer in time

NODE_LOST = "node_lost"  # the reason code of a session whose node was lost


@dataclass(frozen=True)
class NodeChange:
    """A node joined, started draining or was lost; `by` says who saw it first (the GCS's table or a probe)."""

    kind: ChangeKind
    node_id: str
    detail: str
    by: Literal["gcs", "probe"]
    gpus: float = 0.0

    @property
    def reason(self) -> str:
        """The end reason of a session that was on this node."""
        return f"{NODE_LOST}: node {self.node_id[:12]} {self.detail}"


@dataclass
class _Node:
    row: Mapping[str, Any]  # the GCS's row (`ray.nodes()`)
    state: NodeState
    failures: int = 0  # probes failed in a row
    failing_since: float | None = None  # when the first of them was made


class Membership:
    """The nodes of the cluster and their states (see the module docstring)."""

    def __init__(self, failures: int = 2, silent_s: float = 10.0) -> None:
        if failures < 1 or silent_s <= 0:
            raise ValueError(f"failures={failures} must be >= 1 (refused probes in a row that make a node lost) and "
                             f"silent_s={silent_s} > 0 (seconds without an answer that do)")
        self.failures, self.silent_s = failures, silent_s
        self._nodes: dict[str, _Node] = {}
        self._draining: set[str] = set()
        self._synced = False

    # ------------------------------------------------------------------------------ queries
    def state(self, node_id: str) -> NodeState | None:
        node = self._nodes.get(node_id)
        return None if node is None else node.state

    def states(self) -> dict[str, str]:
        return {nid: node.state for nid, node in self._nodes.items()}

    def placeable(self) -> list[Mapping[str, Any]]:
        """The GCS rows of the nodes slots may be built on (live ones), for the capacity ledger."""
        return [n.row for n in self._nodes.values() if n.state == "live"]

    def counts(self) -> dict[str, int]:
        """Nodes by state (those the GCS declared dead are forgotten, so `lost` counts only the ones lost by
        their probes that the GCS still lists)."""
        out: dict[str, int] = {"live": 0, "draining": 0, "lost": 0}
        for node in self._nodes.values():
            out[node.state] += 1
        return out

    def raylet(self, node_id: str) -> str | None:
        """host:port of the node's raylet (its gRPC server, which serves the health check)."""
        node = self._nodes.get(node_id)
        if node is None or not node.row.get("NodeManagerPort"):
            return None
        return f"{node.row.get('NodeManagerAddress', '127.0.0.1')}:{node.row['NodeManagerPort']}"

    def to_probe(self, holding: Iterable[str]) -> dict[str, str]:
        """node id -> raylet address of the nodes in `holding` (those with the scheduler's slots) worth a
        probe: known and not dead by the GCS's word (a node lost by its probes is probed on: it may answer
        again). Nodes the GCS declared dead are forgotten, so the view does not grow with the cluster's churn."""
        return {nid: addr for nid in set(holding) if (addr := self.raylet(nid)) is not None}

    # ------------------------------------------------------------------------------ changes
    def sync(self, table: Sequence[Mapping[str, Any]], draining: Iterable[str] = ()) -> list[NodeChange]:
        """The GCS's node table (`ray.nodes()`, dead rows included or not) and the ids it marks draining."""
        draining = self._draining = set(draining)
        changes: list[NodeChange] = []
        seen: set[str] = set()
        for row in table:
            nid = str(row["NodeID"])
            seen.add(nid)
            node = self._nodes.get(nid)
            if not row.get("Alive", False):
                if node is not None:  # dead for good: reported (unless its probes already did) and forgotten
                    if node.state != "lost":
                        why = str(row.get("DeathReasonMessage") or "") or "no reason given"
                        changes.append(NodeChange("lost", nid, f"left the cluster (the GCS lists it dead: {why})",
                                                  "gcs", _gpus(node.row)))
                    del self._nodes[nid]
                continue
            if node is None:
                node = self._nodes[nid] = _Node(row, "draining" if nid in draining else "live")
                if self._synced:
                    changes.append(NodeChange("joined", nid, f"registered with {_gpus(row):g} GPUs", "gcs",
                                              _gpus(row)))
                continue
            node.row = row
            if node.state == "live" and nid in draining:
                node.state = "draining"
                changes.append(NodeChange("draining", nid, "is draining (the GCS marks it)", "gcs", _gpus(row)))
            elif node.state == "draining" and nid not in draining:
                node.state = "live"
                changes.append(NodeChange("joined", nid, "is no longer draining", "gcs", _gpus(row)))
        for nid in [nid for nid in self._nodes if nid not in seen]:
            node = self._nodes.pop(nid)
            if node.state != "lost":
                changes.append(NodeChange("lost", nid, "left the cluster (the GCS no longer lists it)", "gcs",
                                          _gpus(node.row)))
        self._synced = True
        return changes

    def probed(self, node_id: str, answer: Answer, now: float) -> NodeChange | None:
        """A probe of the node's raylet (made at `now`, on the caller's clock) got `answer`; the change it
        makes, if any."""
        node = self._nodes.get(node_id)
        if node is None:
            return None
        if answer == "ok":
            node.failures, node.failing_since = 0, None
            if node.state == "lost":
                node.state = "draining" if node_id in self._draining else "live"
                return NodeChange("joined", node_id, "is answering again", "probe", _gpus(node.row))
            return None
        node.failures += 1
        node.failing_since = now if node.failing_since is None else node.failing_since
        if node.state == "lost":
            return None
        if answer == "refused" and node.failures >= self.failures:
            detail = f"stopped answering (its raylet refused {node.failures} health checks in a row)"
        elif now - node.failing_since >= self.silent_s:
            detail = f"stopped answering (no answer to its raylet's health checks for {now - node.failing_since:.1f} s)"
        else:
            return None
        node.state = "lost"
        return NodeChange("lost", node_id, detail, "probe", _gpus(node.row))


def _gpus(row: Mapping[str, Any]) -> float:
    return float(dict(row.get("Resources") or {}).get("GPU", 0.0))


Table = tuple[list[dict[str, Any]], set[str]]  # the GCS's rows and the ids of the nodes it marks draining


class NodeWatch:
    """`Membership` kept current: the table read every `refresh_s` (off the event loop), the raylets of the
    nodes holding slots probed every `probe_s`; `poll` returns what changed since the last call."""

    def __init__(self, table: Callable[[], Table], probe: Callable[[str], Awaitable[Answer]], *,
                 refresh_s: float = 1.0, probe_s: float = 0.5, failures: int = 2, silent_s: float = 10.0,
                 forget: Callable[[Iterable[str]], Awaitable[None]] | None = None) -> None:
        self.members = Membership(failures, silent_s)
        self.table, self.probe, self.forget = table, probe, forget
        self.refresh_s, self.probe_s = refresh_s, probe_s
        self._read_at = self._probed_at = float("-inf")

    async def start(self) -> None:
        """The first table: the baseline (no changes reported)."""
        self.members.sync(*await asyncio.to_thread(self.table))
        self._read_at = time.monotonic()

    def due(self) -> bool:
        """Is the table due for a read (the scheduler's other once-a-refresh housekeeping goes with it)?"""
        return time.monotonic() - self._read_at >= self.refresh_s

    async def poll(self, holding: Iterable[str]) -> list[NodeChange]:
        """Read the table and probe the nodes in `holding`, each if it is due; the changes seen."""
        changes: list[NodeChange] = []
        if self.due():
            self._read_at = time.monotonic()
            try:
                changes += self.members.sync(*await asyncio.to_thread(self.table))
            except (RayError, OSError) as err:  # a GCS hiccup: keep the last view, read again later
                log.warning("could not read the cluster's nodes: %s", err)
        if time.monotonic() - self._probed_at >= self.probe_s:
            self._probed_at = time.monotonic()
            targets = self.members.to_probe(holding)
            answers = await asyncio.gather(*(self.probe(a) for a in targets.values()))
            if self.forget is not None:
                await self.forget(targets.values())
            now = time.monotonic()
            changes += [c for nid, answer in zip(targets, answers, strict=True)
                        if (c := self.members.probed(nid, answer, now))]
        return changes

    async def close(self) -> None:
        if self.forget is not None:
            await self.forget(())
