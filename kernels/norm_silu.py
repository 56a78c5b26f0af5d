"""The decoder's pre-convolution step, fused: channel RMSNorm, SiLU, written into a convolution's window.

Every causal convolution of the VAE decoder (`characters.vae`) reads `silu(rms_norm(x) * weight)` over its
`kt - 1` cached frames followed by this chunk's frames. Unfused, that is a norm pass, an activation pass,
a concatenation with the cache and a copy back of the cache. Here one pass reads `x` (plus an optional
residual, whose sum it can also store) and writes the result straight into the chunk part of the
convolution's preallocated window, in the window's channels-last layout, so the convolution reads the
window as is:

    s   = x (+ bias) (+ residual)                 -> sum_out (optional; may be x itself)
    out = silu(s * rsqrt(mean_c(s^2) + eps) * w)  -> out, e.g. window[:, :, kt - 1:]

`bias` is the previous convolution's, run without it, so that its broadcast add costs no pass of its
own; `bias_add` is the same kernel without the norm (a bias and a residual added in one pass).

in float32 with one rounding at the end.

Shapes: x, residual, sum_out, out are (B, c, T, h, w). The Triton kernel needs them in channels-last-3d
memory order (stored as (B, T, h, w, c)), so one batch's (T, h, w) positions are `T*h*w` rows of `c`
contiguous channels; the batch stride may differ (a window slice has `kt - 1` more frames per batch).
The reference takes any layout. weight is (c,).

Public API:
    norm_silu_ref      the readable reference; the CPU path
    norm_silu_triton   one Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1)
    norm_silu          dispatch between the two (Triton on CUDA when installed)
    bias_add_ref, bias_add_triton, bias_add   the kernel without the norm: x + bias (+ residual)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import HAS_TRITON, check_triton_mode, jit_for_current_mode, next_power_of_2

if HAS_TRITON:
    import triton.language as tl

__all__ = ["bias_add", "bias_add_ref", "bias_add_triton", "norm_silu", "norm_silu_ref", "norm_silu_triton"]

_CL3D = torch.channels_last_3d


def norm_silu_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, sum_out: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """Readable reference. Returns `out` (allocated channels-last like x when None)."""
    _check(x, weight, out, residual, sum_out, bias)
    s = x.float()
    if bias is not None:
        s = s + bias.float()[:, None, None, None]
    if residual is not None:
        s = s + residual.float()
    if sum_out is not None:
        sum_out.copy_(s)
    y = F.silu(F.rms_norm(s.float().movedim(1, -1), (x.shape[1],), weight.float(), eps)).movedim(-1, 1)
    if out is None:
        return y.to(x.dtype).contiguous(memory_format=_CL3D)
    out.copy_(y)
    return out


def _norm_silu_kernel(x_ptr, b_ptr, r_ptr, w_ptr, s_ptr, o_ptr, rows_per_batch, channels, x_bstride, r_bstride,
                      s_bstride, o_bstride, eps, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                      HAS_SUM: tl.constexpr, NORM: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (i, b): rows [i*ROWS, (i+1)*ROWS) of batch b; each row is `channels` contiguous values.
    Every element is loaded before it is stored by the same program, so sum_out may alias x."""
    pid, b = tl.program_id(0), tl.program_id(1)
    rows = pid * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    cols = tl.arange(0, BLOCK_C)  # (BLOCK_C,)
    cmask = cols < channels
    mask = (rows < rows_per_batch)[:, None] & cmask[None, :]  # (ROWS, BLOCK_C)
    offs = rows.to(tl.int64)[:, None] * channels + cols[None, :]  # within one batch
    b64 = b.to(tl.int64)
    s = tl.load(x_ptr + b64 * x_bstride + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        s += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        s += tl.load(r_ptr + b64 * r_bstride + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SUM:
        tl.store(s_ptr + b64 * s_bstride + offs, s.to(s_ptr.dtype.element_ty), mask=mask)
    if NORM:
        inv = tl.rsqrt(tl.sum(s * s, axis=1) / channels + eps)  # (ROWS,)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)  # (BLOCK_C,)
        y = s * inv[:, None] * w[None, :]
        y = y * tl.sigmoid(y)
        tl.store(o_ptr + b64 * o_bstride + offs, y.to(o_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out: torch.Tensor | None,
            residual: torch.Tensor | None, sum_out: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    for name, arg in (("x", x), ("out", out), ("residual", residual), ("sum_out", sum_out)):
        if arg is not None:
            _rows_contiguous(name, arg, x.shape)
    b, c, t, h, w = x.shape
    rows = t * h * w
    block_c = next_power_of_2(c)
    rows_per_program = max(1, min(64, 4096 // block_c))
    kernel = jit_for_current_mode(_norm_silu_kernel)
    grid = (-(-rows // rows_per_program), b)
    r = residual if residual is not None else x
    o = out if out is not None else x
    s = sum_out if sum_out is not None else o
    kernel[grid](x, bias if bias is not None else x, r, weight if weight is not None else x, s, o, rows, c,
                 x.stride(0), r.stride(0), s.stride(0), o.stride(0), eps, HAS_BIAS=bias is not None,
                 HAS_RES=residual is not None, HAS_SUM=sum_out is not None, NORM=out is not None,
                 ROWS=rows_per_program, BLOCK_C=block_c, num_warps=4)


def norm_silu_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None, sum_out: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """The fused kernel. Same contract as `norm_silu_ref`; no host sync (graph-capturable)."""
    check_triton_mode("norm_silu_triton")
    _check(x, weight, out, residual, sum_out, bias)
    if out is None:
        out = torch.empty_like(x, memory_format=_CL3D)
    _launch(x, weight, eps, out, residual, sum_out, bias)
    return out


def bias_add_ref(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x + bias (per channel) + residual, into `out` (may be x itself). The reference."""
    _check(x, None, out, residual, None, bias)
    s = x.float() + bias.float()[:, None, None, None] + (0 if residual is None else residual.float())
    if out is None:
        return s.to(x.dtype).contiguous(memory_format=_CL3D)
    return out.copy_(s)


def bias_add_triton(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The fused kernel without the norm; `out` may be x itself."""
    check_triton_mode("bias_add_triton")
    _check(x, None, out, residual, None, bias)
    if out is None:
        out = torch.empty_like(x, memory_format=_CL3D)
    _launch(x, None, 0.0, None, residual, out, bias)
    return out


def bias_add(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """A convolution's bias (and a residual) added in one pass: the fused kernel on CUDA, else the reference.
    cuDNN convolutions are run without their bias so that it lands here, or in `norm_silu`."""
    if x.is_cuda and HAS_TRITON:
        return bias_add_triton(x, bias, residual, out)
    return bias_add_ref(x, bias, residual, out)


def norm_silu(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
              residual: torch.Tensor | None = None, sum_out: torch.Tensor | None = None,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton on CUDA (when installed), the reference elsewhere."""
    if x.is_cuda and HAS_TRITON:
        return norm_silu_triton(x, weight, eps, out, residual, sum_out, bias)
    return norm_silu_ref(x, weight, eps, out, residual, sum_out, bias)


def _rows_contiguous(name: str, t: torch.Tensor, shape: torch.Size) -> None:
    """One batch's (T, h, w, c) block must be dense, channels innermost (a channels-last-3d tensor or a
    frame slice of one)."""
    if t.shape != shape:
        raise ValueError(f"norm_silu: {name} has shape {tuple(t.shape)}; expected {tuple(shape)}")
    _, c, _, h, w = shape
    want = (c * h * w, 1, w * c, c)  # strides of T, c, h, w in a channels-last-3d block
    got = (t.stride(2), t.stride(1), t.stride(3), t.stride(4))
    dims = (shape[2], c, h, w)
    if any(g != e for g, e, n in zip(got, want, dims, strict=True) if n > 1):
        raise ValueError(f"norm_silu: {name} must be channels-last-3d (or a frame slice of such a tensor); "
                         f"got strides {tuple(t.stride())}")


def _check(x: torch.Tensor, weight: torch.Tensor | None, out: torch.Tensor | None, residual: torch.Tensor | None,
           sum_out: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    if x.dim() != 5:
        raise ValueError(f"norm_silu: x must be (B, c, T, h, w); got shape {tuple(x.shape)}")
    for name, vec in (("weight", weight), ("bias", bias)):
        if vec is not None and vec.shape != (x.shape[1],):
            raise ValueError(f"norm_silu: {name} has shape {tuple(vec.shape)}; expected ({x.shape[1]},)")
    for name, t in (("out", out), ("residual", residual), ("sum_out", sum_out)):
        if t is not None and t.shape != x.shape:
            raise ValueError(f"norm_silu: {name} has shape {tuple(t.shape)}; expected {tuple(x.shape)}")
        if t is not None and t.device != x.device:
            raise ValueError(f"norm_silu: {name} is on {t.device}; x is on {x.device}")
