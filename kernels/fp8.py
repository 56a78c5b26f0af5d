"""FP8 (e4m3) building blocks: row-wise quantisation and the scaled GEMM of the DiT's linear layers.

Details: docs/kernels.md (`kernels.fp8`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = [
    "FP8",
    "FP8_MAX",
    "Fp8Act",
    "check_fp8_device",
    "dequantize_rows",
    "fp8_linear",
    "fp8_linear_ref",
    "fp8_supported",
    "quantize_rows",
    "quantize_rows_ref",
    "quantize_weight",
]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_TINY = 1e-12  # the smallest amax a scale is made from (an all-zero row quantises to zeros, scale 1e-12/448)


class Fp8Act(NamedTuple):
    """An activation in FP8: `data` (..., K) e4m3 and `scale` (..., 1) float32, data * scale ~ the activation."""

    data: torch.Tensor
    scale: torch.Tensor


def quantize_rows_ref(x: torch.Tensor) -> Fp8Act:
    """Per-row e4m3 quantisation over the last dim (float32 math). x (..., K) -> (x8 (..., K), scale (..., 1)).

    Pure PyTorch ops with static shapes: compiled inside a producing kernel it becomes that kernel's epilogue
    (an amax reduction over the row, a multiply and a cast)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(_TINY) / FP8_MAX  # (..., 1)
    x8 = (xf * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # (..., K)
    return Fp8Act(x8, scale)


def _quantize_rows_tuple(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    act = quantize_rows_ref(x)
    return act.data, act.scale


@functools.cache
def _compiled_quantize_rows() -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    fn: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = torch.compile(_quantize_rows_tuple,
                                                                                     dynamic=False)
    return fn


def quantize_rows(x: torch.Tensor) -> Fp8Act:
    """`quantize_rows_ref` as a pass of its own: on CUDA compiled into one kernel (specialised per shape on first
    use: warm up before a graph capture), elsewhere the reference. For an activation whose producer cannot take
    the quantisation as its epilogue (an attention kernel's output); every other one is quantised inside the
    kernel that makes it."""
    if not x.is_cuda:
        return quantize_rows_ref(x)
    return Fp8Act(*_compiled_quantize_rows()(x))


def dequantize_rows(act: Fp8Act, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """data * scale in `dtype`. (..., K)"""
    return (act.data.float() * act.scale).to(dtype)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A (N, K) linear weight -> (w8 (N, K) e4m3, scale (N,) float32), per output channel."""
    if weight.ndim != 2:
        raise ValueError(f"quantize_weight: weight has shape {tuple(weight.shape)}; expected (N, K)")
    w8, scale = quantize_rows_ref(weight)
    return w8, scale[:, 0].contiguous()


def fp8_linear_ref(x8: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor,
                   bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Reference: (x8 * sx) @ (w8 * sw)^T + bias in float32, cast to `out_dtype`.
    x8 (..., K) e4m3, sx (..., 1) float32, w8 (N, K) e4m3, sw (N,) float32, bias (N,) -> (..., N)."""
    _check(x8, sx, w8, sw, bias)
    y = (x8.float() * sx) @ (w8.float() * sw[:, None]).t()  # (..., N)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_linear(x8: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The scaled GEMM: `torch._scaled_mm` on CUDA (row-wise scales, bias in the epilogue), else the reference.
    Shapes as `fp8_linear_ref`; leading dims of x8 are flattened into M. No host syncs: graph-capturable.
    `out`: a contiguous (..., N) tensor of `out_dtype` written in place and returned (on CUDA, by the GEMM)."""
    if out is not None and (out.shape != (*x8.shape[:-1], w8.shape[0]) or out.dtype != out_dtype
                            or not out.is_contiguous()):
        raise ValueError(f"fp8_linear: out is {tuple(out.shape)} {out.dtype} (contiguous: {out.is_contiguous()}); "
                         f"expected a contiguous {(*x8.shape[:-1], w8.shape[0])} {out_dtype}")
    if not x8.is_cuda:
        y = fp8_linear_ref(x8, sx, w8, sw, bias, out_dtype)
        return y if out is None else out.copy_(y)
    _check(x8, sx, w8, sw, bias)
    lead, k = x8.shape[:-1], x8.shape[-1]
    a = x8.reshape(-1, k)  # (M, K) row-major
    kw: dict[str, torch.Tensor] = {} if out is None else {"out": out.view(-1, w8.shape[0])}
    y = torch._scaled_mm(a, w8.t(), scale_a=sx.reshape(-1, 1), scale_b=sw[None, :],
                         bias=None if bias is None else bias.to(out_dtype), out_dtype=out_dtype,
                         use_fast_accum=True, **kw)  # (M, N); w8.t() is the column-major (K, N) operand
    return y.view(*lead, w8.shape[0]) if out is None else out


def fp8_supported(device: torch.device | str) -> bool:
    """Whether `device` has FP8 tensor cores (CUDA compute capability 8.9 or newer)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def check_fp8_device(device: torch.device | str, field: str, *, emulate: bool = False) -> None:
    """Raise a ValueError naming `field` when FP8 cannot run on `device` (unless `emulate`, the reference)."""
    device = torch.device(device)
    if emulate:
        return
    if device.type != "cuda":
        raise ValueError(
            f"{field}='fp8' needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9: L4, H100, H200, "
            f"B200); this runner is on {device}, where FP8 runs only as its float32 reference emulation: use "
            f"{field}='bf16' here (or emulate_fp8=True in tests)"
        )
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise ValueError(
            f"{field}='fp8' needs compute capability >= 8.9 (FP8 tensor cores); "
            f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}: use {field}='bf16' on this GPU"
        )


def _check(x8: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x8.dtype != FP8 or w8.dtype != FP8:
        raise ValueError(f"fp8_linear: x8 is {x8.dtype} and w8 {w8.dtype}; both must be {FP8}")
    if w8.ndim != 2 or x8.shape[-1] != w8.shape[1]:
        raise ValueError(f"fp8_linear: x8 {tuple(x8.shape)} and w8 {tuple(w8.shape)}; expected (..., K) and (N, K)")
    if sx.shape != (*x8.shape[:-1], 1) or sx.dtype != torch.float32:
        raise ValueError(f"fp8_linear: sx has shape {tuple(sx.shape)}, dtype {sx.dtype}; expected float32 "
                         f"{(*x8.shape[:-1], 1)} (one scale per row of x8)")
    if sw.shape != (w8.shape[0],) or sw.dtype != torch.float32:
        raise ValueError(f"fp8_linear: sw has shape {tuple(sw.shape)}, dtype {sw.dtype}; expected float32 "
                         f"({w8.shape[0]},) (one scale per output channel)")
    if bias is not None and bias.shape != (w8.shape[0],):
        raise ValueError(f"fp8_linear: bias has shape {tuple(bias.shape)}; expected ({w8.shape[0]},)")
