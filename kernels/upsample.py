"""The decoder's 2x nearest up-sampling, fused with the add before it: one read, every copy written once.

Shapes: x and residual are (B, cx, T, h, w), bias (cx,), out (B, c, T', 2h, 2w) with c = cx / 2 and
T' = 2T when folding time, else c = cx and T' = T. The Triton kernel needs x, residual and out in
channels-last-3d memory order: one batch's positions are rows of contiguous channels (out may be a frame
slice of a larger buffer, as for `kernels.norm_silu`). The reference takes any layout.

Details: docs/kernels.md (`kernels.upsample`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import HAS_TRITON, check_triton_mode, jit_for_current_mode
from kernels.norm_silu import _sum_cpu, block_rows_for, channel_blocks

if HAS_TRITON:
    import triton.language as tl

__all__ = ["upsample_nearest", "upsample_nearest_cpu", "upsample_nearest_ref", "upsample_nearest_triton"]

_CL3D = torch.channels_last_3d


def upsample_nearest_ref(x: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None, *,
                         fold_time: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """Readable reference. Returns `out` (allocated channels-last in x's dtype when None)."""
    _check(x, bias, residual, fold_time, out)
    s = x.float()  # (B, cx, T, h, w)
    if bias is not None:
        s = s + bias.float()[:, None, None, None]
    if residual is not None:
        s = s + residual.float()
    if fold_time:
        b, cx, t, h, w = s.shape
        s = s.view(b, 2, cx // 2, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, cx // 2, 2 * t, h, w)  # 2t + i
    up = F.interpolate(s, scale_factor=(1.0, 2.0, 2.0), mode="nearest")  # (B, c, T', 2h, 2w)
    if out is None:
        return up.to(x.dtype).contiguous(memory_format=_CL3D)
    return out.copy_(up)


def upsample_nearest_cpu(x: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None, *,
                         fold_time: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU path (float32): `upsample_nearest_ref`'s contract. The sum (one or two passes at the input's
    size, none without bias and residual), then a single copy from a broadcast view of it into out's
    (B, T', 2h, 2w, c) positions: every output value is written once, no interpolated tensor in between."""
    _check(x, bias, residual, fold_time, out)
    if x.dtype != torch.float32 or (out is not None and (out.dtype != torch.float32 or not _is_rows(out))):
        return upsample_nearest_ref(x, bias, residual, fold_time=fold_time, out=out)
    s = _sum_cpu(x, residual, bias, None)  # (B, cx, T, h, w)
    b, cx, t, h, w = s.shape
    fold = 2 if fold_time else 1
    c = cx // fold
    if out is None:
        out = s.new_empty(b, fold * t, 2 * h, 2 * w, c).permute(0, 4, 1, 2, 3)  # (B, c, T', 2h, 2w) channels-last
    # input position (t, y, x), channel half i -> output frame fold*t + i, rows 2y + dy, columns 2x + dx
    src = s.permute(0, 2, 3, 4, 1).reshape(b, t, h, w, fold, c).permute(0, 1, 4, 2, 3, 5)  # (B, T, fold, h, w, c)
    src = src[:, :, :, :, None, :, None, :].expand(b, t, fold, h, 2, w, 2, c)
    out.permute(0, 2, 3, 4, 1).view(b, t, fold, h, 2, w, 2, c).copy_(src)
    return out


def _upsample_kernel(x_ptr, b_ptr, r_ptr, o_ptr, rows_per_batch, h, w, x_bstride, r_bstride, o_bstride,
                     C: tl.constexpr, FOLD: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK_C: tl.constexpr, CHUNKS: tl.constexpr):
    """Program (i, q, b): input rows [i*ROWS, (i+1)*ROWS) of batch b (its positions (t, y, x), row-major over
    (T, h, w), FOLD*C channels each) and column chunk q: half q // CHUNKS of those channels (frame
    FOLD*t + half of the output), lanes (q % CHUNKS)*BLOCK_C + arange(BLOCK_C) of its C."""
    pid, q, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    half = q // CHUNKS
    cols = (q % CHUNKS) * BLOCK_C + tl.arange(0, BLOCK_C)  # (BLOCK_C,) output channels
    cmask = cols < C
    rows = pid * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    rmask = (rows < rows_per_batch)[:, None]  # (ROWS, 1)
    mask = rmask if CHUNKS * BLOCK_C == C else rmask & cmask[None, :]
    b64 = b.to(tl.int64)
    src = rows.to(tl.int64)[:, None] * (FOLD * C) + (half * C + cols)[None, :]  # (ROWS, BLOCK_C)
    s = tl.load(x_ptr + b64 * x_bstride + src, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        s += tl.load(b_ptr + half * C + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        s += tl.load(r_ptr + b64 * r_bstride + src, mask=mask, other=0.0).to(tl.float32)
    y = s.to(o_ptr.dtype.element_ty)
    col, row = rows % w, (rows // w) % h
    frame = (rows // (w * h)) * FOLD + half
    top_left = (frame.to(tl.int64) * (2 * h) + 2 * row) * (2 * w) + 2 * col  # (ROWS,) output row (position)
    dst = o_ptr + b64 * o_bstride + top_left[:, None] * C + cols[None, :]  # (ROWS, BLOCK_C)
    tl.store(dst, y, mask=mask)
    tl.store(dst + C, y, mask=mask)  # (y, x + 1)
    tl.store(dst + 2 * w * C, y, mask=mask)  # (y + 1, x)
    tl.store(dst + (2 * w + 1) * C, y, mask=mask)  # (y + 1, x + 1)


def upsample_nearest_triton(x: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                            *, fold_time: bool = False, out: torch.Tensor | None = None,
                            block_rows: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """The fused kernel. Same contract as `upsample_nearest_ref`; no host sync (graph-capturable).
    `block_rows` (input rows per program, a power of two) and `num_warps` are tuning knobs."""
    check_triton_mode("upsample_nearest_triton")
    _check(x, bias, residual, fold_time, out)
    b, cx, t, h, w = x.shape
    fold = 2 if fold_time else 1
    c = cx // fold
    if out is None:
        out = x.new_empty(b, fold * t, 2 * h, 2 * w, c).permute(0, 4, 1, 2, 3)  # (B, c, T', 2h, 2w) channels-last
    for name, arg in (("x", x), ("residual", residual), ("out", out)):
        if arg is not None:
            _rows_contiguous(name, arg)
    block_c, chunks = channel_blocks(c)
    rows_per_program = block_rows_for(block_c) if block_rows is None else block_rows
    if rows_per_program < 1 or rows_per_program & (rows_per_program - 1):
        raise ValueError(f"upsample_nearest: block_rows={rows_per_program} must be a power of two (1, 2, 4, ...)")
    rows = t * h * w
    r = residual if residual is not None else x
    grid = (-(-rows // rows_per_program), fold * chunks, b)
    kernel = jit_for_current_mode(_upsample_kernel)
    kernel[grid](x, bias if bias is not None else x, r, out, rows, h, w, x.stride(0), r.stride(0), out.stride(0),
                 C=c, FOLD=fold, HAS_BIAS=bias is not None, HAS_RES=residual is not None, ROWS=rows_per_program,
                 BLOCK_C=block_c, CHUNKS=chunks, num_warps=num_warps)
    return out


def upsample_nearest(x: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None, *,
                     fold_time: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton on CUDA (when installed), the single-copy path on CPU, the reference elsewhere."""
    if x.is_cuda and HAS_TRITON:
        return upsample_nearest_triton(x, bias, residual, fold_time=fold_time, out=out)
    if x.device.type == "cpu":
        return upsample_nearest_cpu(x, bias, residual, fold_time=fold_time, out=out)
    return upsample_nearest_ref(x, bias, residual, fold_time=fold_time, out=out)


def _is_rows(t: torch.Tensor) -> bool:
    try:
        _rows_contiguous("out", t)
    except ValueError:
        return False
    return True


def _rows_contiguous(name: str, t: torch.Tensor) -> None:
    """One batch's (T, h, w, c) block must be dense, channels innermost (channels-last-3d, or a frame slice)."""
    _, c, n, h, w = t.shape
    want = (c * h * w, 1, w * c, c)  # strides of T, c, h, w in a channels-last-3d block
    got = (t.stride(2), t.stride(1), t.stride(3), t.stride(4))
    if any(g != e for g, e, size in zip(got, want, (n, c, h, w), strict=True) if size > 1):
        raise ValueError(f"upsample_nearest: {name} must be channels-last-3d (or a frame slice of such a tensor); "
                         f"got strides {tuple(t.stride())} for shape {tuple(t.shape)}; "
                         "use .contiguous(memory_format=torch.channels_last_3d)")


def _check(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None, fold_time: bool,
           out: torch.Tensor | None) -> None:
    if x.dim() != 5:
        raise ValueError(f"upsample_nearest: x must be (B, c, T, h, w); got shape {tuple(x.shape)}")
    b, cx, t, h, w = x.shape
    if fold_time and cx % 2:
        raise ValueError(f"upsample_nearest: fold_time needs an even channel count (two halves); x has {cx}")
    if bias is not None and bias.shape != (cx,):
        raise ValueError(f"upsample_nearest: bias has shape {tuple(bias.shape)}; expected ({cx},)")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"upsample_nearest: residual has shape {tuple(residual.shape)}; expected {tuple(x.shape)}")
    fold = 2 if fold_time else 1
    want = (b, cx // fold, fold * t, 2 * h, 2 * w)
    if out is not None and tuple(out.shape) != want:
        raise ValueError(f"upsample_nearest: out has shape {tuple(out.shape)}; expected {want}")
    for name, arg in (("bias", bias), ("residual", residual), ("out", out)):
        if arg is not None and arg.device != x.device:
            raise ValueError(f"upsample_nearest: {name} is on {arg.device}; x is on {x.device}")
