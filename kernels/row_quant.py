"""The DiT block's quantising elementwise steps as single-pass row kernels (the inputs of its FP8 linear layers).

Shapes: x, y (B, T, D), last dim contiguous; shift, scale, gate (B, L, D) with L = 1 (one row for every token)
or L = T (a row per token), last dim contiguous (the block's modulation rows are views: any other strides);
weight, bias (D,). Outputs: the new residual (B, T, D) in x's dtype, q (B, T, D) e4m3, scale (B, T, 1) float32.

Details: docs/kernels.md (`kernels.row_quant`)."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from kernels._triton import HAS_TRITON, check_triton_mode, interpreter_enabled, jit_for_current_mode, next_power_of_2
from kernels.fp8 import FP8, quantize_rows_ref

if HAS_TRITON:
    import triton
    import triton.language as tl

    from kernels._triton import to_e4m3

__all__ = ["MODES", "Mode", "row_quant", "row_quant_ref", "row_quant_triton"]

Mode = Literal["modulate", "add_modulate", "gated_add_norm", "gelu", "gated_add_modulate"]
MODES: tuple[Mode, ...] = ("modulate", "add_modulate", "gated_add_norm", "gelu", "gated_add_modulate")
_CODE = {m: i for i, m in enumerate(MODES)}


def _check(mode: str, x: torch.Tensor, y: torch.Tensor | None, gate: torch.Tensor | None,
           shift: torch.Tensor | None, scale: torch.Tensor | None, weight: torch.Tensor | None,
           bias: torch.Tensor | None) -> None:
    if mode not in _CODE:
        raise ValueError(f"row_quant: mode={mode!r} is unknown; expected one of {list(MODES)}")
    if x.ndim != 3 or x.stride(-1) != 1:
        raise ValueError(f"row_quant: x must be (B, T, D) with a contiguous last dim, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    need = {"modulate": ("shift", "scale"), "add_modulate": ("y", "shift", "scale"),
            "gated_add_norm": ("y", "gate", "weight", "bias"), "gelu": (),
            "gated_add_modulate": ("y", "gate", "shift", "scale")}[mode]
    given = {"y": y, "gate": gate, "shift": shift, "scale": scale, "weight": weight, "bias": bias}
    for name, t in given.items():
        if (t is not None) != (name in need):
            raise ValueError(f"row_quant: mode={mode!r} takes {list(need) or 'x alone'}; {name} is "
                             f"{'missing' if t is None else 'not one of them'}")
    b, n, d = x.shape
    if y is not None and (y.shape != x.shape or y.stride(-1) != 1):
        raise ValueError(f"row_quant: y {tuple(y.shape)} must match x {tuple(x.shape)}, last dim contiguous")
    for name, t in (("gate", gate), ("shift", shift), ("scale", scale)):
        if t is not None and (t.ndim != 3 or t.shape[0] != b or t.shape[1] not in (1, n) or t.shape[2] != d
                              or t.stride(-1) != 1):
            raise ValueError(f"row_quant: {name} must be (B, 1 or T, D) = ({b}, 1 or {n}, {d}) with a contiguous "
                             f"last dim, got {tuple(t.shape)} strides {t.stride()}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.shape != (d,):
            raise ValueError(f"row_quant: {name} must be ({d},), got {tuple(t.shape)}")


def row_quant_ref(mode: Mode, x: torch.Tensor, *, y: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                  shift: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                  weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-6
                  ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Readable reference: (the new residual or None, e4m3 values, float32 scales)."""
    _check(mode, x, y, gate, shift, scale, weight, bias)
    new: torch.Tensor | None = None
    if mode == "gelu":
        h = F.gelu(x.float(), approximate="tanh")
    else:
        s = x.float()
        if mode == "add_modulate":
            assert y is not None
            s = s + y.float()
        elif mode in ("gated_add_norm", "gated_add_modulate"):
            assert y is not None and gate is not None
            s = s + gate.float() * y.float()
        if mode != "modulate":
            new = s.to(x.dtype)
            s = new.float()
        n = F.layer_norm(s, s.shape[-1:], eps=eps)
        if mode == "gated_add_norm":
            assert weight is not None and bias is not None
            h = n * weight.float() + bias.float()
        else:
            assert shift is not None and scale is not None
            h = n * (1 + scale.float()) + shift.float()
    act = quantize_rows_ref(h)
    return new, act.data, act.scale


def _gelu_tanh(x):
    """gelu (tanh form) in float32: x * sigmoid(2u), u = sqrt(2/pi) * (x + 0.044715 x^3)."""
    return x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))  # 2 * sqrt(2 / pi)


def _residual_part(x_ptr, y_ptr, gate_ptr, new_ptr, xo, yo, go, no, d, ok, MODE: tl.constexpr):
    """One part of a row, float32: the norm's input. MODE != 0: the new residual, stored, and read as stored."""
    x = tl.load(x_ptr + xo + d, mask=ok, other=0.0).to(tl.float32)
    if MODE == 1:
        x = x + tl.load(y_ptr + yo + d, mask=ok, other=0.0).to(tl.float32)
    if MODE == 2 or MODE == 4:
        y = tl.load(y_ptr + yo + d, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(gate_ptr + go + d, mask=ok, other=0.0).to(tl.float32)
        x = x + g * y
    if MODE != 0:
        rounded = x.to(new_ptr.dtype.element_ty)
        tl.store(new_ptr + no + d, rounded, mask=ok)
        x = rounded.to(tl.float32)
    return tl.where(ok, x, 0.0)


def _affine_part(n, shift_ptr, scale_ptr, w_ptr, b_ptr, mo, d, ok, MODE: tl.constexpr):
    """One part of a normalised row through its affine step: weight and bias (MODE 2), else the modulation."""
    if MODE == 2:
        h = n * tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32) + tl.load(b_ptr + d, mask=ok, other=0.0).to(
            tl.float32)
    else:
        sh = tl.load(shift_ptr + mo + d, mask=ok, other=0.0).to(tl.float32)
        sc = tl.load(scale_ptr + mo + d, mask=ok, other=0.0).to(tl.float32)
        h = n * (1.0 + sc) + sh
    return tl.where(ok, h, 0.0)


if HAS_TRITON:  # helpers the kernel calls, in the mode of triton's import (as kernels._triton.to_e4m3)
    _gelu_tanh = triton.jit(_gelu_tanh)
    _residual_part = triton.jit(_residual_part)
    _affine_part = triton.jit(_affine_part)


def _row_quant_kernel(
    x_ptr, y_ptr, gate_ptr, shift_ptr, scale_ptr, w_ptr, b_ptr,  # inputs (unused ones: any pointer)
    new_ptr, q_ptr, s_ptr,  # outputs: the new residual (B*T, D), e4m3 (B*T, D), scales (B*T,)
    T, D, s_xb, s_xt, s_yb, s_yt, s_mb, s_mt, s_gb, s_gt, eps,
    MODE: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, INTERPRET: tl.constexpr,
):
    """A program per row, held in registers as two power-of-two parts: [0, BLOCK_A) and [BLOCK_A, BLOCK_A +
    BLOCK_B), masked at D. BLOCK_A is the largest power of two <= D, so a width such as 9216 = 8192 + 1024 has no
    masked lanes (one block of next_power_of_2(D) = 16384 left 44% of them idle)."""
    row = tl.program_id(0).to(tl.int64)
    b, t = row // T, row % T
    da = tl.arange(0, BLOCK_A)
    db = BLOCK_A + tl.arange(0, BLOCK_B)
    oka, okb = da < D, db < D
    xo = b * s_xb + t * s_xt
    if MODE == 3:
        ha = tl.where(oka, _gelu_tanh(tl.load(x_ptr + xo + da, mask=oka, other=0.0).to(tl.float32)), 0.0)
        hb = tl.where(okb, _gelu_tanh(tl.load(x_ptr + xo + db, mask=okb, other=0.0).to(tl.float32)), 0.0)
    else:
        yo, go, no, mo = b * s_yb + t * s_yt, b * s_gb + t * s_gt, row * D, b * s_mb + t * s_mt
        xa = _residual_part(x_ptr, y_ptr, gate_ptr, new_ptr, xo, yo, go, no, da, oka, MODE)
        xb = _residual_part(x_ptr, y_ptr, gate_ptr, new_ptr, xo, yo, go, no, db, okb, MODE)
        mean = (tl.sum(xa, axis=0) + tl.sum(xb, axis=0)) / D
        ca = tl.where(oka, xa - mean, 0.0)
        cb = tl.where(okb, xb - mean, 0.0)
        rstd = tl.rsqrt((tl.sum(ca * ca, axis=0) + tl.sum(cb * cb, axis=0)) / D + eps)
        ha = _affine_part(ca * rstd, shift_ptr, scale_ptr, w_ptr, b_ptr, mo, da, oka, MODE)
        hb = _affine_part(cb * rstd, shift_ptr, scale_ptr, w_ptr, b_ptr, mo, db, okb, MODE)
    amax = tl.maximum(tl.max(tl.abs(ha), axis=0), tl.max(tl.abs(hb), axis=0))
    scale = tl.maximum(amax, 1e-12) / 448.0
    inv = 1.0 / scale
    tl.store(q_ptr + row * D + da, to_e4m3(ha * inv, INTERPRET), mask=oka)
    tl.store(q_ptr + row * D + db, to_e4m3(hb * inv, INTERPRET), mask=okb)
    tl.store(s_ptr + row, scale)


def row_blocks(d: int) -> tuple[int, int]:
    """(BLOCK_A, BLOCK_B) of a row of width d: the largest power of two <= d, then the rest rounded up to one
    (at least 16: a power-of-two width has an all-masked second part)."""
    a = 1 << (d.bit_length() - 1)
    return a, max(16, next_power_of_2(d - a))


def _warps(d: int) -> int:
    """Warps per row: up to ~96 float32 values a thread (4 warps to a width of 12288, 8 at 24576), from
    `scripts/benchmarks/bench_row_quant.py` on an H200 (`benchmarks/h200/row_quant.json`):
    at 998 x 9216 the norms take 25-26 us
    with 4 warps against 29-30 with 16; the GELU over 998 x 24576 31 us with 8 or 16 against 57 with 4."""
    a, b = row_blocks(d)
    return min(16, max(4, next_power_of_2((a + b) // 3072)))


def _row_strides(t: torch.Tensor | None, n: int) -> tuple[int, int]:
    """(batch stride, token stride) of a (B, L, D) tensor read per token: a single row (L = 1) repeats."""
    if t is None:
        return 0, 0
    return t.stride(0), (t.stride(1) if t.shape[1] == n and n > 1 else 0)


def row_quant_triton(mode: Mode, x: torch.Tensor, *, y: torch.Tensor | None = None,
                     gate: torch.Tensor | None = None, shift: torch.Tensor | None = None,
                     scale: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, eps: float = 1e-6, num_warps: int | None = None
                     ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """One Triton launch, a program per row. Same results as `row_quant_ref` up to float32 rounding order (the
    e4m3 values may differ by one step where a value sits at a rounding boundary). No host syncs: capturable."""
    _check(mode, x, y, gate, shift, scale, weight, bias)
    check_triton_mode("row_quant_triton")
    b, n, d = x.shape
    new = torch.empty(b, n, d, device=x.device, dtype=x.dtype) if mode not in ("modulate", "gelu") else None
    q = torch.empty(b, n, d, device=x.device, dtype=FP8)
    s = torch.empty(b, n, 1, device=x.device, dtype=torch.float32)
    block_a, block_b = row_blocks(d)
    s_mb, s_mt = _row_strides(shift, n)
    if _row_strides(scale, n) != (s_mb, s_mt):
        raise ValueError("row_quant: shift and scale must have the same batch and token strides")
    s_gb, s_gt = _row_strides(gate, n)
    kernel = jit_for_current_mode(_row_quant_kernel)
    dummy = x
    kernel[(b * n,)](
        x, y if y is not None else dummy, gate if gate is not None else dummy, shift if shift is not None else dummy,
        scale if scale is not None else dummy, weight if weight is not None else dummy,
        bias if bias is not None else dummy, new if new is not None else dummy, q, s,
        n, d, x.stride(0), x.stride(1), *(y.stride()[:2] if y is not None else (0, 0)), s_mb, s_mt, s_gb, s_gt,
        float(eps), MODE=_CODE[mode], BLOCK_A=block_a, BLOCK_B=block_b, INTERPRET=interpreter_enabled(),
        num_warps=num_warps or _warps(d),
    )
    return new, q, s


def row_quant(mode: Mode, x: torch.Tensor, *, y: torch.Tensor | None = None, gate: torch.Tensor | None = None,
              shift: torch.Tensor | None = None, scale: torch.Tensor | None = None,
              weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-6
              ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The Triton kernel where it runs (CUDA tensors, or any under TRITON_INTERPRET=1), else the reference."""
    kw = {"y": y, "gate": gate, "shift": shift, "scale": scale, "weight": weight, "bias": bias, "eps": eps}
    if HAS_TRITON and (x.is_cuda or interpreter_enabled()):
        return row_quant_triton(mode, x, **kw)  # type: ignore[arg-type]
    return row_quant_ref(mode, x, **kw)  # type: ignore[arg-type]
