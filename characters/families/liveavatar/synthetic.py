"""Deterministic synthetic weights for LiveAvatar checkpoints (tests and the parity oracle).

A tensor depends only on ``(seed, name)`` and its shape and dtype, never on the order in which a state
dict is walked, so the authors' model (run by ``scripts/liveavatar/golden.py``) and ours get the same
numbers for the same key, and a single key can be regenerated on its own.

The rule, by key name (``name`` is the checkpoint key, e.g. ``blocks.3.self_attn.q.weight``):

- ``*modulation`` (adaLN tables, ``(1, 6, dim)`` or ``(1, 2, dim)``): ``randn / sqrt(dim)``, as the
  authors initialise them.
- a 1-D ``*.weight`` whose name contains ``norm`` (RMSNorm / affine LayerNorm gains): ``1 + 0.1 * randn``.
- ``*.bias`` and any other 1-D tensor: ``0.02 * randn``.
- everything else with two or more dimensions (linear, conv, embedding tables, ``padding_tokens``,
  the audio encoder's layer ``weights``): ``randn / sqrt(fan_in)``, ``fan_in = prod(shape[1:])``.

Values are drawn in float32 from a ``torch.Generator`` seeded with ``seed ^ crc32(name)`` on the given
device (CPU by default; a CUDA generator gives different numbers, which only timing runs use), then cast.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence

import torch

__all__ = ["synthetic_state_dict", "synthetic_tensor"]

_SEED_MASK = (1 << 63) - 1


def _scale_and_offset(name: str, shape: Sequence[int]) -> tuple[float, float]:
    """(scale, offset) of ``offset + scale * randn`` for the key ``name`` of ``shape``."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "modulation" or name.endswith("modulation"):
        return 1.0 / math.sqrt(shape[-1]), 0.0
    if len(shape) == 1:
        if leaf == "weight" and "norm" in name:
            return 0.1, 1.0
        return 0.02, 0.0
    if len(shape) == 0:
        return 0.02, 0.0
    fan_in = math.prod(shape[1:])
    return 1.0 / math.sqrt(max(fan_in, 1)), 0.0


def synthetic_tensor(
    name: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    seed: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The synthetic value of checkpoint key ``name``: a function of ``(seed, name)``, shape and dtype only."""
    shape = tuple(int(s) for s in shape)
    generator = torch.Generator(device=device)
    generator.manual_seed((int(seed) ^ zlib.crc32(name.encode("utf-8"))) & _SEED_MASK)
    scale, offset = _scale_and_offset(name, shape)
    values = torch.randn(shape, generator=generator, dtype=torch.float32, device=device)
    values.mul_(scale)
    if offset:
        values.add_(offset)
    return values.to(dtype)


def synthetic_state_dict(
    spec: Mapping[str, tuple[Sequence[int], torch.dtype]],
    seed: int,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """``{name: synthetic_tensor(name, shape, dtype, seed)}`` for every ``name: (shape, dtype)`` of ``spec``."""
    return {name: synthetic_tensor(name, shape, dtype, seed, device) for name, (shape, dtype) in spec.items()}
