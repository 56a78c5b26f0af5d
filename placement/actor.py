"""Ray-side placement: the capacity ledger from `ray.nodes()`, placement groups created, awaited and
removed, and pending demand published to the autoscaler. The decisions stay in `placement.policy`.

Details: docs/placement.md (`placement.actor`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, Literal

import grpc
import ray
from ray.exceptions import RayError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from placement.bundles import RESOURCE_UNITS, PlacementSpec, to_units
from placement.policy import NodeCapacity

log = logging.getLogger(__name__)


class PlacementTimeout(RuntimeError):
    """A placement group did not become ready in time; it has been removed."""


def ledger(nodes: Iterable[Mapping[str, Any]], used: Mapping[str, Sequence[Mapping[str, float]]]) -> tuple[
        NodeCapacity, ...]:
    """Alive nodes of `ray.nodes()` with free = total - the demands in `used[node_id]` (fixed-point exact)."""
    out = []
    for node in nodes:
        if not node.get("Alive", False):
            continue
        node_id = str(node["NodeID"])
        total = {k: float(v) for k, v in dict(node.get("Resources", {})).items()}
        units = {k: to_units(v) for k, v in total.items()}
        for demand in used.get(node_id, ()):
            for key, amount in demand.items():
                units[key] = units.get(key, 0) - to_units(amount)
        free = {k: u / RESOURCE_UNITS for k, u in units.items()}
        labels = {str(k): str(v) for k, v in dict(node.get("Labels", {}) or {}).items()}
        out.append(NodeCapacity(node_id, free, total, labels))
    return tuple(sorted(out, key=lambda n: n.node_id))


def alive_nodes() -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n.get("Alive")]


def node_table() -> tuple[list[dict[str, Any]], set[str]]:
    """Every node the GCS lists (`ray.nodes()`, dead ones included), and the ids of those it marks draining
    (empty when the cluster state cannot be read: draining is a hint, the table is the truth)."""
    rows = list(ray.nodes())
    try:
        from ray._raylet import GcsClient  # type: ignore[attr-defined]  # (not in Ray's stubs)
        from ray.autoscaler.v2.sdk import get_cluster_resource_state
        from ray.core.generated.autoscaler_pb2 import NodeStatus  # type: ignore[attr-defined]

        state = get_cluster_resource_state(GcsClient(address=ray.get_runtime_context().gcs_address))
        draining = {n.node_id.hex() if isinstance(n.node_id, bytes) else str(n.node_id)
                    for n in state.node_states if n.status == NodeStatus.DRAINING}
    except (RayError, RuntimeError, OSError, ValueError, ImportError) as err:
        log.warning("could not read which nodes drain: %s", err)
        draining = set()
    return rows, draining


class RayletProbe:
    """The gRPC health check of a node's raylet (`grpc.health.v1.Health/Check`, what the GCS sends it), one
    channel per node kept open: "ok" for any answer, a refusal of the call included (e.g. under token
    authentication); "refused" when nothing listens there (the connection is refused: the raylet is gone);
    "silent" when no answer came within the timeout (a slow raylet, or a machine gone from the network)."""

    METHOD = "/grpc.health.v1.Health/Check"

    def __init__(self, timeout_s: float = 1.0) -> None:
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def __call__(self, address: str) -> Literal["ok", "refused", "silent"]:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        check = channel.unary_unary(self.METHOD, request_serializer=_raw, response_deserializer=_raw)
        try:
            await check(b"", timeout=self.timeout_s, wait_for_ready=False)  # HealthCheckRequest(service="")
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                return "refused"
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return "silent"
        return "ok"

    async def forget(self, keep: Iterable[str]) -> None:
        """Close the channels of addresses not in `keep`."""
        keep = set(keep)
        for address in [a for a in self._channels if a not in keep]:
            await self._channels.pop(address).close()


def _raw(data: bytes) -> bytes:
    return data


async def reserve(spec: PlacementSpec, *, name: str, node_id: str | None, timeout_s: float,
                  detached: bool = False) -> PlacementGroup:
    """Create the session's placement group (STRICT_PACK, from `spec`), preferring `node_id`, and wait
    until it is ready. On timeout or cancellation it is removed before the error propagates.
    `detached`: the group outlives the process that made it (a scheduler that crashes and restarts
    finds it again by `name`); otherwise Ray removes it when that process dies."""
    pg = placement_group(spec.ray_bundles(), strategy=spec.strategy, name=name, _soft_target_node_id=node_id,
                         lifetime="detached" if detached else None)
    try:
        await asyncio.wait_for(asyncio.wrap_future(pg.ready().future()), timeout_s)
    except TimeoutError as err:
        release(pg)
        raise PlacementTimeout(
            f"placement group {name!r} ({list(spec.bundles)}, STRICT_PACK) was not ready after {timeout_s:.0f} s "
            "and has been removed; something outside the scheduler holds those resources, or a node left: "
            "check `ray status`"
        ) from err
    except BaseException:
        release(pg)
        raise
    return pg


def node_of(pg: PlacementGroup) -> str | None:
    """The node a ready placement group sits on (STRICT_PACK: one node)."""
    table = placement_group_table(pg)
    nodes = set((table.get("bundles_to_node_id") or {}).values())
    return next(iter(nodes)) if len(nodes) == 1 else None


def state_of(pg: PlacementGroup) -> str:
    return str(placement_group_table(pg).get("state", "UNKNOWN"))


def release(pg: PlacementGroup) -> None:
    """Remove a placement group (and with it every actor in it). Idempotent."""
    with contextlib.suppress(ValueError, ray.exceptions.RaySystemError):  # already removed
        remove_placement_group(pg)


def publish_demand(specs: Sequence[PlacementSpec]) -> bool:
    """Tell the autoscaler the cluster should hold these sessions (replaces the previous request).
    False (logged) when it could not: demand is a hint, never a reason to fail a session."""
    from ray.autoscaler.sdk import request_resources

    try:
        request_resources(bundles=[dict(s.demand()) for s in specs])
    except (ray.exceptions.RayError, RuntimeError, ValueError, OSError) as err:
        log.warning("could not publish the demand of %d sessions to the autoscaler: %s", len(specs), err)
        return False
    return True


class DemandPublisher:
    """`publish_demand` of the latest demand, one call at a time, off the event loop: calls racing in threads
    could leave an older request in the GCS than the last one made. `spawn` runs a coroutine as a task."""

    def __init__(self, spawn: Callable[[Coroutine[Any, Any, Any]], None]) -> None:
        self.spawn = spawn
        self.want: list[PlacementSpec] = []
        self._asked = False  # nothing asked yet: the first call publishes even an empty demand
        self._busy = False

    def publish(self, specs: Sequence[PlacementSpec]) -> None:
        if self._asked and list(specs) == self.want:
            return
        self.want, self._asked = list(specs), True
        if not self._busy:
            self._busy = True
            self.spawn(self._run())

    async def _run(self) -> None:
        sent: list[PlacementSpec] | None = None
        try:
            while sent != self.want:
                sent = self.want
                await asyncio.to_thread(publish_demand, sent)
        finally:
            self._busy = False
