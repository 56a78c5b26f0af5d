"""The decoder's pre-convolution step, fused: channel RMSNorm, SiLU, written into a convolution's window.

Shapes: x, residual, sum_out, out are (B, c, T, h, w). The Triton kernel needs them in channels-last-3d
memory order (stored as (B, T, h, w, c)), so one batch's (T, h, w) positions are `T*h*w` rows of `c`
contiguous channels; the batch stride may differ (a window slice has `kt - 1` more frames per batch).
The reference takes any layout. weight is (c,).

Details: docs/kernels.md (`kernels.norm_silu`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import HAS_TRITON, check_triton_mode, jit_for_current_mode, next_power_of_2

if HAS_TRITON:
    import triton.language as tl

__all__ = ["bias_add", "bias_add_cpu", "bias_add_ref", "bias_add_triton", "block_rows_for", "channel_blocks",
           "norm_silu", "norm_silu_cpu", "norm_silu_ref", "norm_silu_triton"]

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


def _channel(v: torch.Tensor) -> torch.Tensor:
    return v.view(1, -1, 1, 1, 1)  # (c,) -> broadcast over (B, c, T, h, w)


def _sum_cpu(x: torch.Tensor, residual: torch.Tensor | None, bias: torch.Tensor | None,
             into: torch.Tensor | None) -> torch.Tensor:
    """x (+ residual) (+ bias) in one or two passes, into `into` (may be x itself) or a new channels-last tensor."""
    if residual is None and bias is None:
        if into is not None and into.data_ptr() != x.data_ptr():
            into.copy_(x)
        return x if into is None else into
    s = into if into is not None else torch.empty_like(x, memory_format=_CL3D)
    if bias is not None:  # the reference's order: (x + bias) + residual
        torch.add(x, _channel(bias), out=s)
        if residual is not None:
            s.add_(residual)
    else:
        assert residual is not None
        torch.add(x, residual, out=s)
    return s


def norm_silu_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, sum_out: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU path (float32): `norm_silu_ref`'s contract and math, in place: the sum once (into `sum_out`
    when given), mean(s^2) from one reduction over the channels, then `out = s * rsqrt(.) * w` and SiLU in
    `out` itself. About five passes over the tensor where the reference makes ten (float copies,
    a decomposed norm, the activation and a final copy)."""
    _check(x, weight, out, residual, sum_out, bias)
    if x.dtype != torch.float32:
        return norm_silu_ref(x, weight, eps, out, residual, sum_out, bias)
    c = x.shape[1]
    s = _sum_cpu(x, residual, bias, sum_out)  # (B, c, T, h, w)
    inv = torch.linalg.vector_norm(s, dim=1, keepdim=True)  # (B, 1, T, h, w): sqrt(sum_c s^2)
    inv.square_().mul_(1.0 / c).add_(eps).rsqrt_()  # rsqrt(mean_c(s^2) + eps), 1/c of the tensor
    if out is None:
        out = torch.empty_like(x, memory_format=_CL3D)
    torch.mul(s, inv, out=out)
    out.mul_(_channel(weight))
    return F.silu(out, inplace=True)


def _norm_silu_kernel(x_ptr, b_ptr, r_ptr, w_ptr, s_ptr, o_ptr, rows_per_batch, x_bstride, r_bstride, s_bstride,
                      o_bstride, eps, C: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                      HAS_SUM: tl.constexpr, NORM: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
                      CHUNKS: tl.constexpr):
    """Program (i, b): rows [i*ROWS, (i+1)*ROWS) of batch b; each row is C contiguous values, taken as CHUNKS
    column chunks of BLOCK_C lanes (masked only where CHUNKS * BLOCK_C > C). Each chunk is loaded once and kept
    in registers while the rows' sums of squares build up, then normalised. C is a compile-time constant so
    that row offsets are known multiples of it (vector loads for any width with a factor of 8).
    Every element is loaded before it is stored by the same program, so sum_out may alias x."""
    pid, b = tl.program_id(0), tl.program_id(1)
    rows = pid * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    rmask = (rows < rows_per_batch)[:, None]  # (ROWS, 1)
    row_offs = rows.to(tl.int64)[:, None] * C  # (ROWS, 1), within one batch
    b64 = b.to(tl.int64)
    sums = ()  # CHUNKS x (ROWS, BLOCK_C) float32
    sq = tl.zeros((ROWS, BLOCK_C), dtype=tl.float32)  # per-lane sums of squares over the chunks
    for k in tl.static_range(CHUNKS):
        cols = k * BLOCK_C + tl.arange(0, BLOCK_C)  # (BLOCK_C,)
        cmask = cols < C
        mask = rmask if CHUNKS * BLOCK_C == C else rmask & cmask[None, :]  # (ROWS, 1) or (ROWS, BLOCK_C)
        offs = row_offs + cols[None, :]  # (ROWS, BLOCK_C)
        s = tl.load(x_ptr + b64 * x_bstride + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            s += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if HAS_RES:
            s += tl.load(r_ptr + b64 * r_bstride + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_SUM:
            tl.store(s_ptr + b64 * s_bstride + offs, s.to(s_ptr.dtype.element_ty), mask=mask)
        if NORM:
            sq += s * s
            sums = sums + (s,)  # type: ignore[assignment]  # noqa: RUF005 (Triton compiles neither `*` nor annotations)
    if NORM:
        inv = tl.rsqrt(tl.sum(sq, axis=1) / C + eps)[:, None]  # (ROWS, 1)
        for k in tl.static_range(CHUNKS):
            cols = k * BLOCK_C + tl.arange(0, BLOCK_C)
            cmask = cols < C
            mask = rmask if CHUNKS * BLOCK_C == C else rmask & cmask[None, :]
            w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)  # (BLOCK_C,)
            y = sums[k] * inv * w[None, :]
            y = y * tl.sigmoid(y)
            tl.store(o_ptr + b64 * o_bstride + row_offs + cols[None, :], y.to(o_ptr.dtype.element_ty), mask=mask)


def channel_blocks(c: int, max_block: int = 128, max_chunks: int = 8) -> tuple[int, int]:
    """How a row of `c` contiguous channels is tiled: (block, chunks), `chunks` power-of-two blocks of `block`
    lanes. Widths with a power-of-two factor of at least 16 (or c itself) split without padding:
    96 = 3 x 32, 192 = 3 x 64, 384 = 3 x 128, 768 = 6 x 128; others (40, 3, 24) get one masked block of
    `next_power_of_2(c)` lanes, as do widths that would need more than `max_chunks` blocks."""
    if c < 1:
        raise ValueError(f"channel_blocks: c={c}; need at least one channel")
    block = min(c & -c, max_block)  # the largest power of two dividing c, capped
    if block >= min(c, 16) and c // block <= max_chunks:
        return block, c // block
    return next_power_of_2(c), 1


def block_rows_for(c: int, elements: int = 4096, max_rows: int = 256) -> int:
    """Default rows per program: a power of two giving about `elements` channel values (of c, not of the
    padded block) per program, between 1 and `max_rows`."""
    rows = max(1, elements // max(c, 1))
    return min(max_rows, 1 << (rows.bit_length() - 1))


def _launch(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out: torch.Tensor | None,
            residual: torch.Tensor | None, sum_out: torch.Tensor | None, bias: torch.Tensor | None,
            block_rows: int | None = None, num_warps: int = 4) -> None:
    for name, arg in (("x", x), ("out", out), ("residual", residual), ("sum_out", sum_out)):
        if arg is not None:
            _rows_contiguous(name, arg, x.shape)
    b, c, t, h, w = x.shape
    rows = t * h * w
    block_c, chunks = channel_blocks(c)
    rows_per_program = block_rows_for(c) if block_rows is None else block_rows
    if rows_per_program < 1 or rows_per_program & (rows_per_program - 1):
        raise ValueError(f"norm_silu: block_rows={rows_per_program} must be a power of two (1, 2, 4, ...)")
    kernel = jit_for_current_mode(_norm_silu_kernel)
    grid = (-(-rows // rows_per_program), b)
    r = residual if residual is not None else x
    o = out if out is not None else x
    s = sum_out if sum_out is not None else o
    kernel[grid](x, bias if bias is not None else x, r, weight if weight is not None else x, s, o, rows,
                 x.stride(0), r.stride(0), s.stride(0), o.stride(0), eps, C=c, HAS_BIAS=bias is not None,
                 HAS_RES=residual is not None, HAS_SUM=sum_out is not None, NORM=out is not None,
                 ROWS=rows_per_program, BLOCK_C=block_c, CHUNKS=chunks, num_warps=num_warps)


def norm_silu_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None, sum_out: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, *, block_rows: int | None = None,
                     num_warps: int = 4) -> torch.Tensor:
    """The fused kernel. Same contract as `norm_silu_ref`; no host sync (graph-capturable).
    `block_rows` (rows per program, a power of two; default `block_rows_for(c)`) and `num_warps` are
    tuning knobs (scripts/benchmarks/bench_kernels.py --sweep)."""
    check_triton_mode("norm_silu_triton")
    _check(x, weight, out, residual, sum_out, bias)
    if out is None:
        out = torch.empty_like(x, memory_format=_CL3D)
    _launch(x, weight, eps, out, residual, sum_out, bias, block_rows, num_warps)
    return out


def bias_add_ref(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x + bias (per channel) + residual, into `out` (may be x itself). The reference."""
    _check(x, None, out, residual, None, bias)
    s = x.float() + bias.float()[:, None, None, None] + (0 if residual is None else residual.float())
    if out is None:
        return s.to(x.dtype).contiguous(memory_format=_CL3D)
    return out.copy_(s)


def bias_add_cpu(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU path (float32): `bias_add_ref` in one pass (two with a residual), into `out` (may be x itself)."""
    _check(x, None, out, residual, None, bias)
    if x.dtype != torch.float32:
        return bias_add_ref(x, bias, residual, out)
    return _sum_cpu(x, residual, bias, out)


def bias_add_triton(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, *, block_rows: int | None = None,
                    num_warps: int = 4) -> torch.Tensor:
    """The fused kernel without the norm; `out` may be x itself."""
    check_triton_mode("bias_add_triton")
    _check(x, None, out, residual, None, bias)
    if out is None:
        out = torch.empty_like(x, memory_format=_CL3D)
    _launch(x, None, 0.0, None, residual, out, bias, block_rows, num_warps)
    return out


def bias_add(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """A convolution's bias (and a residual) added in one pass: the fused kernel on CUDA, else the reference.
    cuDNN convolutions are run without their bias so that it lands here, or in `norm_silu`."""
    if x.is_cuda and HAS_TRITON:
        return bias_add_triton(x, bias, residual, out)
    if x.device.type == "cpu":
        return bias_add_cpu(x, bias, residual, out)
    return bias_add_ref(x, bias, residual, out)


def norm_silu(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
              residual: torch.Tensor | None = None, sum_out: torch.Tensor | None = None,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton on CUDA (when installed), the fewer-pass path on CPU, the reference elsewhere."""
    if x.is_cuda and HAS_TRITON:
        return norm_silu_triton(x, weight, eps, out, residual, sum_out, bias)
    if x.device.type == "cpu":
        return norm_silu_cpu(x, weight, eps, out, residual, sum_out, bias)
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
