"""Pure admission policy: (free capacity, queue, request, now) -> decision. No Ray, no I/O, no clock.

Details: docs/placement.md (`placement.policy`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from placement.bundles import RESOURCE_UNITS, PlacementSpec, to_units

#: Retry-After (seconds) for a rejection when nothing is queued to estimate from.
DEFAULT_RETRY_AFTER_S = 5.0


@dataclass(frozen=True)
class NodeCapacity:
    """One node's resources in the scheduler's ledger (Ray names: ``GPU``, ``CPU``, ``accelerator_type:X``)."""

    node_id: str
    free: Mapping[str, float]
    total: Mapping[str, float]
    labels: Mapping[str, str] = field(default_factory=dict)  # informational: matching is by resources

    def fits(self, demand: Mapping[str, float]) -> bool:
        """Whether ``demand`` fits this node's free resources, per resource."""
        return fits(self.free, demand)

    def used(self) -> dict[str, float]:
        return {key: (to_units(amount) - to_units(self.free.get(key, 0.0))) / RESOURCE_UNITS
                for key, amount in self.total.items()}


@dataclass(frozen=True)
class Request:
    """A session waiting for a bundle; times are on the caller's clock (e.g. ``time.monotonic()``)."""

    request_id: str
    spec: PlacementSpec
    arrived_at: float
    deadline: float

    def expired(self, now: float) -> bool:
        return now >= self.deadline


Nodes = tuple[NodeCapacity, ...]


@dataclass(frozen=True)
class AdmissionQueue:
    """Immutable bounded FIFO of waiting requests; `push` and `remove` return a new queue."""

    max_len: int
    requests: tuple[Request, ...] = ()

    def __post_init__(self) -> None:
        if self.max_len < 0:
            raise ValueError(f"AdmissionQueue max_len={self.max_len} must be >= 0 (0: never queue)")
        if len(self.requests) > self.max_len:
            raise ValueError(f"AdmissionQueue holds {len(self.requests)} requests, above max_len={self.max_len}")

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def __contains__(self, request_id: object) -> bool:
        return any(r.request_id == request_id for r in self.requests)

    @property
    def full(self) -> bool:
        return len(self.requests) >= self.max_len

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(r.request_id for r in self.requests)

    def push(self, request: Request) -> AdmissionQueue:
        if request.request_id in self:
            raise ValueError(f"request_id={request.request_id!r} is already queued; request ids must be unique")
        if self.full:
            raise ValueError(
                f"AdmissionQueue is full ({len(self)}/{self.max_len}); push only after decide() returned Enqueue"
            )
        return replace(self, requests=(*self.requests, request))

    def remove(self, request_id: str) -> AdmissionQueue:
        """The queue without ``request_id`` (unchanged when it is not queued)."""
        return replace(self, requests=tuple(r for r in self.requests if r.request_id != request_id))


# ------------------------------------------------------------------------------------------------ decisions


@dataclass(frozen=True)
class Admit:
    """Place the request's whole bundle on ``node_id``, consuming ``demand`` there."""

    request_id: str
    node_id: str
    demand: Mapping[str, float]


@dataclass(frozen=True)
class Enqueue:
    """Wait in the queue; ``position`` is the 1-based place in line (1: next)."""

    request_id: str
    position: int


@dataclass(frozen=True)
class Reject:
    """Refuse now (HTTP 503); ``reason`` is a machine-readable code, ``retry_after_s`` whole seconds."""

    request_id: str
    reason: Literal["queue_full"]
    retry_after_s: float


@dataclass(frozen=True)
class Expire:
    """The request reached its deadline without a bundle: drop it (HTTP 503/504 to its caller)."""

    request_id: str


Decision = Admit | Enqueue | Reject | Expire


# ------------------------------------------------------------------------------------------------ functions


def fits(free: Mapping[str, float], demand: Mapping[str, float]) -> bool:
    """Whether ``demand`` fits in ``free``, per resource, in Ray's fixed-point units (1e-4)."""
    return all(to_units(free.get(key, 0.0)) >= to_units(amount) for key, amount in demand.items())


def best_fit(nodes: Iterable[NodeCapacity], demand: Mapping[str, float]) -> NodeCapacity | None:
    """The node that fits ``demand`` whole with the fewest GPUs left over (ties: smallest node_id)."""
    need_gpu = to_units(demand.get("GPU", 0.0))
    candidates = [n for n in nodes if n.fits(demand)]
    if not candidates:
        return None
    return min(candidates, key=lambda n: (to_units(n.free.get("GPU", 0.0)) - need_gpu, n.node_id))


def _index(nodes: Sequence[NodeCapacity], node_id: str) -> int | None:
    ids = [n.node_id for n in nodes]
    if len(set(ids)) != len(ids):
        raise ValueError(f"node ids {sorted(ids)} repeat; the ledger needs one NodeCapacity per node")
    return ids.index(node_id) if node_id in ids else None


def _shift(free: Mapping[str, float], demand: Mapping[str, float], sign: int) -> dict[str, float]:
    out = dict(free)
    for key, amount in demand.items():
        out[key] = (to_units(out.get(key, 0.0)) + sign * to_units(amount)) / RESOURCE_UNITS
    return out


def apply(nodes: Sequence[NodeCapacity], admit: Admit) -> Nodes:
    """The ledger after ``admit``; raises ValueError rather than over-commit (a stale decision)."""
    i = _index(nodes, admit.node_id)
    if i is None:
        raise ValueError(
            f"Admit of request {admit.request_id!r} names node_id={admit.node_id!r}, which is not in the ledger "
            f"{[n.node_id for n in nodes]}; decide again against the current ledger"
        )
    node = nodes[i]
    if not node.fits(admit.demand):
        raise ValueError(
            f"refusing to over-commit node {node.node_id!r}: request {admit.request_id!r} needs {dict(admit.demand)} "
            f"but only {dict(node.free)} is free; the Admit is stale, decide again against the current ledger"
        )
    return (*nodes[:i], replace(node, free=_shift(node.free, admit.demand, -1)), *nodes[i + 1 :])


def release(nodes: Sequence[NodeCapacity], admit: Admit) -> Nodes:
    """The ledger after the session admitted by ``admit`` ended (unchanged if its node has left)."""
    i = _index(nodes, admit.node_id)
    if i is None:
        return tuple(nodes)
    node = nodes[i]
    free = _shift(node.free, admit.demand, +1)
    over = {k: v for k, v in free.items() if k in admit.demand and to_units(v) > to_units(node.total.get(k, 0.0))}
    if over:
        raise ValueError(
            f"releasing request {admit.request_id!r} on node {node.node_id!r} would raise free {over} above total "
            f"{dict(node.total)}; was it released twice?"
        )
    return (*nodes[:i], replace(node, free=free), *nodes[i + 1 :])


def _plan(nodes: Sequence[NodeCapacity], queue: AdmissionQueue, now: float) -> tuple[list[Decision], Nodes]:
    """Walk the queue in order: expire, admit what fits (best fit), pass over the rest."""
    ledger = tuple(nodes)
    decisions: list[Decision] = []
    for request in queue:
        if request.expired(now):
            decisions.append(Expire(request.request_id))
            continue
        demand = request.spec.demand()
        node = best_fit(ledger, demand)
        if node is not None:
            admit = Admit(request.request_id, node.node_id, demand)
            ledger = apply(ledger, admit)
            decisions.append(admit)
    return decisions, ledger


def drain(nodes: Sequence[NodeCapacity], queue: AdmissionQueue, now: float) -> list[Decision]:
    """Decisions for the queued requests, in queue order: `Expire` past deadline, `Admit` what now fits."""
    return _plan(nodes, queue, now)[0]


def retry_after(queue: AdmissionQueue, now: float, fallback_s: float = DEFAULT_RETRY_AFTER_S) -> float:
    """Seconds until a queue place is sure to free: the earliest live deadline (>= 1 s, whole seconds)."""
    deadlines = [r.deadline for r in queue if not r.expired(now)]
    wait = min(deadlines) - now if deadlines else fallback_s
    return float(max(1, math.ceil(wait)))


def decide(
    nodes: Sequence[NodeCapacity],
    queue: AdmissionQueue,
    request: Request,
    now: float,
    *,
    fallback_retry_after_s: float = DEFAULT_RETRY_AFTER_S,
) -> Decision:
    """What to do with a newly arrived ``request`` (see the module docstring for the rules)."""
    if request.request_id in queue:
        raise ValueError(f"request_id={request.request_id!r} is already queued; request ids must be unique")
    if request.expired(now):
        return Expire(request.request_id)
    planned, ledger = _plan(nodes, queue, now)
    demand = request.spec.demand()
    node = best_fit(ledger, demand)
    if node is not None:
        admit = Admit(request.request_id, node.node_id, demand)
        # Admit only if every queued request that fits now still fits after this one is placed.
        owed = {d.request_id for d in planned if isinstance(d, Admit)}
        after = _plan(apply(nodes, admit), queue, now)[0]
        if owed <= {d.request_id for d in after if isinstance(d, Admit)}:
            return admit
    if not queue.full:
        return Enqueue(request.request_id, len(queue) + 1)
    return Reject(request.request_id, "queue_full", retry_after(queue, now, fallback_retry_after_s))


def commit(
    nodes: Sequence[NodeCapacity],
    queue: AdmissionQueue,
    decisions: Iterable[Decision],
    *,
    incoming: Request | None = None,
) -> tuple[Nodes, AdmissionQueue]:
    """The ledger and queue after ``decisions`` in order; ``incoming`` is the request an `Enqueue` names."""
    ledger = tuple(nodes)
    for decision in decisions:
        if isinstance(decision, Admit):
            ledger = apply(ledger, decision)
            queue = queue.remove(decision.request_id)
        elif isinstance(decision, Enqueue):
            if incoming is None or incoming.request_id != decision.request_id:
                raise ValueError(
                    f"Enqueue of {decision.request_id!r} needs the request itself: pass incoming=<that Request>"
                )
            queue = queue.push(incoming)
        elif isinstance(decision, Expire):
            queue = queue.remove(decision.request_id)
    return ledger, queue


def explain_fit(nodes: Iterable[NodeCapacity], demand: Mapping[str, float]) -> str:
    """Why a request for ``demand`` is not admitted now, in words, for refusals and queue events: no node
    has the whole bundle free (what the roomiest node and all nodes together have free, so that a cluster
    whose free GPUs add up but are spread over nodes says so), or it fits but is owed to requests ahead."""
    nodes = list(nodes)
    want = _fmt(demand)
    if not nodes:
        return f"no node is live to place a bundle of {want} on"
    if best_fit(nodes, demand) is not None:
        return f"a bundle of {want} is free, but it is owed to the requests queued ahead (FIFO)"
    main = "GPU" if to_units(demand.get("GPU", 0.0)) > 0 else next(iter(sorted(demand)), "CPU")
    order = [main, *sorted(k for k in demand if k != main)]
    roomiest = max(nodes, key=lambda n: (*(to_units(n.free.get(k, 0.0)) for k in order), n.node_id))
    total = {k: sum(to_units(n.free.get(k, 0.0)) for n in nodes) / RESOURCE_UNITS for k in demand}
    return (f"no node has a whole bundle of {want} free (a session's bundle must fit one node, STRICT_PACK): the "
            f"roomiest of {len(nodes)} nodes has {_fmt({k: roomiest.free.get(k, 0.0) for k in demand})} free, "
            f"all of them together {_fmt(total)}")


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def free_bundles(nodes: Iterable[NodeCapacity], spec: PlacementSpec) -> int:
    """How many more whole sessions of ``spec`` the free capacity could host (for capacity reports)."""
    demand = {k: to_units(v) for k, v in spec.demand().items() if to_units(v) > 0}
    return sum(min(to_units(n.free.get(k, 0.0)) // need for k, need in demand.items()) for n in nodes)
