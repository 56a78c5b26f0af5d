"""Model families the engine serves. A family is a module of its own: its config, its checkpoint mapping, its
block forward and its conditioning encoders. What serves a model (caches, runner, parallelism, FP8 kernels,
decoder worker, deployments/) is shared, never copied into a family (docs/models.md).

    reference    the engine's own architecture (characters.dit, characters.config): presets tiny, wan-1.3b, 57b
    liveavatar   Alibaba-Quark/LiveAvatar (Wan2.2-S2V-14B + its LoRA): preset liveavatar-14b
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    module: str  # where its config, model and checkpoint mapping live
    presets: tuple[str, ...]
    source: str  # the authors' code or our own


FAMILIES: dict[str, Family] = {
    "reference": Family("reference", "characters.dit", ("tiny", "wan-1.3b", "57b"), "this project"),
    "liveavatar": Family("liveavatar", "characters.families.liveavatar", ("liveavatar-14b",),
                         "Alibaba-Quark/LiveAvatar (Apache-2.0)"),
}


def family_of(preset: str) -> Family:
    """The family that serves `preset`."""
    for fam in FAMILIES.values():
        if preset in fam.presets:
            return fam
    known = sorted(p for f in FAMILIES.values() for p in f.presets)
    raise ValueError(f"preset={preset!r} belongs to no model family; choose one of {known}")
