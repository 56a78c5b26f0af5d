"""Placement-group bundles for one session: the only place bundle lists are made.

One session is one STRICT_PACK placement group (its DiT ranks and decoder on one node, over NVLink): DiT
bundles first, then the decoder's, then the room's CPU bundle; every other module asks this one.

Details: docs/placement.md (`placement.bundles`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from characters.config import SessionConfig, TopologyConfig

Strategy = Literal["STRICT_PACK"]
RoleKind = Literal["dit", "decoder", "room"]

#: Share of a node's ``accelerator_type:<name>`` resource that one GPU bundle asks for.
ACCELERATOR_SHARE = 0.001
#: Ray's resource granularity: amounts are fixed-point with this many units per 1.0.
RESOURCE_UNITS = 10_000


def accelerator_resource(name: str) -> str:
    """Ray's per-node resource name for a GPU type, e.g. ``accelerator_type:H100``."""
    return f"accelerator_type:{name}"


def to_units(amount: float) -> int:
    """A resource amount in Ray's fixed-point units (1e-4), so sums and comparisons are exact."""
    return round(amount * RESOURCE_UNITS)


@dataclass(frozen=True, order=True)
class Role:
    """What runs in a bundle: DiT rank ``rank``, the decoder, or the room worker + session actor."""

    kind: RoleKind
    rank: int = 0

    def __str__(self) -> str:
        return f"dit:{self.rank}" if self.kind == "dit" else self.kind


@dataclass(frozen=True)
class PlacementSpec:
    """One session's placement group: bundles, strategy and which role sits in which bundle."""

    topology: str
    bundles: tuple[dict[str, float], ...]
    roles: tuple[tuple[Role, ...], ...]
    strategy: Strategy = "STRICT_PACK"

    def __post_init__(self) -> None:
        if len(self.roles) != len(self.bundles):
            raise ValueError(
                f"PlacementSpec for topology={self.topology!r} has {len(self.bundles)} bundles but "
                f"{len(self.roles)} role entries; give one role tuple per bundle"
            )
        seen = [role for roles in self.roles for role in roles]
        if len(seen) != len(set(seen)):
            raise ValueError(f"PlacementSpec roles={self.roles} name a role twice; each role lives in one bundle")
        for i, bundle in enumerate(self.bundles):
            bad = {k: v for k, v in bundle.items() if v < 0 or (v > 0 and to_units(v) == 0)}
            if bad or not bundle:
                raise ValueError(
                    f"bundle {i}={bundle} of topology={self.topology!r} is empty or has amounts that are negative "
                    f"or below Ray's resolution 1/{RESOURCE_UNITS}: {bad}"
                )

    @property
    def gpus(self) -> float:
        """GPUs the whole placement group reserves."""
        return self.demand().get("GPU", 0.0)

    @property
    def cpus(self) -> float:
        """CPUs the whole placement group reserves."""
        return self.demand().get("CPU", 0.0)

    def demand(self) -> dict[str, float]:
        """Sum of every bundle's resources: what STRICT_PACK needs free on one node."""
        units: dict[str, int] = {}
        for bundle in self.bundles:
            for key, amount in bundle.items():
                units[key] = units.get(key, 0) + to_units(amount)
        return {key: u / RESOURCE_UNITS for key, u in sorted(units.items())}

    def role_of(self, bundle_index: int) -> tuple[Role, ...]:
        """The roles placed in bundle ``bundle_index`` (two when the decoder shares DiT rank 0's GPU)."""
        if not 0 <= bundle_index < len(self.bundles):
            raise IndexError(
                f"bundle_index={bundle_index} is out of range for topology={self.topology!r} "
                f"with {len(self.bundles)} bundles (0..{len(self.bundles) - 1})"
            )
        return self.roles[bundle_index]

    def bundle_of(self, kind: RoleKind, rank: int = 0) -> int:
        """The bundle index that hosts a role: ``bundle_of("dit", 2)``, ``bundle_of("decoder")``."""
        wanted = Role(kind, rank)
        for index, roles in enumerate(self.roles):
            if wanted in roles:
                return index
        raise KeyError(f"role {wanted} is not in topology={self.topology!r}; its roles are {self.roles}")

    @property
    def dit_ranks(self) -> int:
        return sum(role.kind == "dit" for roles in self.roles for role in roles)

    @property
    def decoder_shares_gpu(self) -> bool:
        """True when the decoder runs in DiT rank 0's bundle (no GPU of its own)."""
        return self.bundle_of("decoder") == self.bundle_of("dit", 0)

    def ray_bundles(self) -> list[dict[str, float]]:
        """Fresh copies of the bundles, to pass to ``ray.util.placement_group``."""
        return [dict(bundle) for bundle in self.bundles]


def bundles_for(config: SessionConfig | TopologyConfig, *, use_gpus: bool = True) -> PlacementSpec:
    """The placement group of one session of ``config`` (see the module docstring for the layout)."""
    topo = config.topology if isinstance(config, SessionConfig) else config
    device: dict[str, float] = {"GPU": 1.0} if use_gpus else {"CPU": 1.0}
    if use_gpus and topo.accelerator:
        device[accelerator_resource(topo.accelerator)] = ACCELERATOR_SHARE

    bundles: list[dict[str, float]] = []
    roles: list[tuple[Role, ...]] = []
    for rank in range(topo.dit_ranks):
        bundles.append(dict(device))
        shares = rank == 0 and topo.decoder_gpus == 0
        roles.append((Role("dit", rank), Role("decoder")) if shares else (Role("dit", rank),))
    if topo.decoder_gpus == 1:
        bundles.append(dict(device))
        roles.append((Role("decoder"),))
    bundles.append({"CPU": float(topo.room_cpus)})
    roles.append((Role("room"),))
    return PlacementSpec(topology=topo.name, bundles=tuple(bundles), roles=tuple(roles))
