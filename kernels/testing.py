"""Fresh random inputs and error measures for kernel tests and benchmarks (no pytest dependency)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["QKVPrepInputs", "make_qkv_prep_inputs", "rel_err"]


@dataclass
class QKVPrepInputs:
    """Arguments of `qkv_prep` (without offset / eps). Shapes: see `kernels.qkv_prep`."""

    qkv: torch.Tensor  # (B, T, 3, Hh, Dh), a view of a (B, T, 3 * Hh * Dh + pad) buffer
    q_weight: torch.Tensor  # (Dh,)
    k_weight: torch.Tensor  # (Dh,)
    cos: torch.Tensor  # (T, Dh/2) float32
    sin: torch.Tensor  # (T, Dh/2) float32
    k_cache: torch.Tensor  # (B, Hh, S, Dh)
    v_cache: torch.Tensor  # (B, Hh, S, Dh)

    def clone_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache.clone(), self.v_cache.clone()


def make_qkv_prep_inputs(
    b: int,
    t: int,
    hh: int,
    dh: int,
    s: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    pad: int = 0,
    generator: torch.Generator | None = None,
) -> QKVPrepInputs:
    """Random inputs on `device`.

    qkv ~ N(0, 1), a view of the fused linear's output whose rows are padded by `pad` elements (so its
    strides are not the contiguous ones when pad > 0); norm weights 1 + 0.3 N(0, 1); RoPE angles uniform
    in [0, 2 pi); caches ~ N(0, 1), never zeros, so that untouched slots are distinguishable.
    """
    cache_dtype = cache_dtype or dtype

    def randn(*shape: int, dt: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dt)

    rows = randn(b, t, 3 * hh * dh + pad, dt=dtype)  # (B, T, 3 * Hh * Dh + pad)
    qkv = rows[..., : 3 * hh * dh].view(b, t, 3, hh, dh)  # (B, T, 3, Hh, Dh)
    angle = torch.rand(t, dh // 2, generator=generator, device=device) * (2 * math.pi)  # (T, Dh/2)
    return QKVPrepInputs(
        qkv=qkv,
        q_weight=1.0 + 0.3 * randn(dh),
        k_weight=1.0 + 0.3 * randn(dh),
        cos=angle.cos(),
        sin=angle.sin(),
        k_cache=randn(b, hh, s, dh, dt=cache_dtype),
        v_cache=randn(b, hh, s, dh, dt=cache_dtype),
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives NaN (which fails any `<` check)."""
    diff = (out.double() - ref.double()).norm()
    return float(diff / ref.double().norm().clamp_min(1e-300))
