"""Write-time KV-cache work, fused: per-head RMSNorm + RoPE on q and k, cache write of k and v.

Self-attention reads a preallocated KV cache "as is" (DESIGN.md section 4): everything the attention kernel
needs (norm, RoPE, dtype, layout) is done once, when a chunk's keys and values are written. This module
does that write in one pass over the fused QKV projection's output:

    q = rope(rms_norm(q_raw) * q_weight)          -> returned, (B, Hh, T, Dh), qkv's dtype
    k = rope(rms_norm(k_raw) * k_weight)          -> k_cache[:, :, offset:offset + T]
    v = v_raw                                      -> v_cache[:, :, offset:offset + T]

Norm and RoPE run in float32 with one rounding at the end. RoPE rotates ADJACENT pairs (2i, 2i+1) by the
angle whose cosine / sine are `cos[t, i]` / `sin[t, i]`.

Dimension names (as in `characters/config.py`): B batch, T tokens written this call, Hh heads (rank-local),
Dh head dim, S cache slots.

Public API:
    rms_norm_ref, rope_ref    building blocks (also used by the model's naive cache path)
    qkv_prep_ref              the readable reference; the CPU path
    qkv_prep_triton           one Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1)
    qkv_prep                  dispatch between the two

`offset` is a Python int or an int64 tensor of shape () or (1,) on qkv's device. With a tensor the call
has no host sync and can be captured in a CUDA graph whose replays write different slots. A tensor offset
is not range-checked on the host (that would need a sync): the kernel drops rows that would land outside
[0, S); the reference raises (CPU) or device-asserts (CUDA) through `index_copy_`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Literal

import torch

from kernels._triton import HAS_TRITON, check_triton_mode, interpreter_enabled, jit_for_current_mode, next_power_of_2

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["QKVPrepBackend", "qkv_prep", "qkv_prep_ref", "qkv_prep_triton", "rms_norm_ref", "rope_ref"]

QKVPrepBackend = Literal["auto", "triton", "torch"]

_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_HEAD_DIM = 256


# ----------------------------------------------------------------------------------------------------------
# References (readable PyTorch; also the CPU path)
# ----------------------------------------------------------------------------------------------------------


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim in float32 (float64 stays float64): `x * rsqrt(mean(x^2) + eps) * weight`.

    x: (..., Dh) any floating dtype; weight: (Dh,). Returns x's shape in `out_dtype` (default x.dtype);
    pass `torch.float32` to keep full precision for a following op (as `qkv_prep_ref` does).
    """
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm_ref: weight has shape {tuple(weight.shape)}; expected ({x.shape[-1]},)")
    ct = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(ct)  # (..., Dh)
    y = xc * torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.to(ct)  # (..., Dh)
    return y.to(out_dtype or x.dtype)


def rope_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Rotary embedding on adjacent pairs, in float32 (float64 stays float64).

    x: (..., T, Hh, Dh), tokens third from last and heads second from last (the (B, T, Hh, Dh) layout of
    the QKV projection; a raw-key cache in (B, S, Hh, Dh) works the same with T = S, and a (B, Hh, S, Dh)
    one through `x.transpose(1, 2)`).
    cos, sin: (T, Dh/2), or (..., T, Dh/2) with leading dims that broadcast with x's; the same angle for
    every head. For pair i: out[2i] = x[2i] cos[i] - x[2i+1] sin[i], out[2i+1] = x[2i] sin[i] + x[2i+1] cos[i].
    Returns x's shape in `out_dtype` (default x.dtype).
    """
    if x.ndim < 3 or x.shape[-1] % 2:
        raise ValueError(f"rope_ref: x has shape {tuple(x.shape)}; expected (..., T, Hh, Dh) with Dh even")
    t, half = x.shape[-3], x.shape[-1] // 2
    for name, table in (("cos", cos), ("sin", sin)):
        if table.ndim < 2 or table.shape[-2:] != (t, half):
            raise ValueError(
                f"rope_ref: {name} has shape {tuple(table.shape)}; expected (..., {t}, {half}) = (T, Dh/2)"
            )
    ct = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(ct)
    xe, xo = xc[..., 0::2], xc[..., 1::2]  # (..., T, Hh, Dh/2) each
    c, s = cos.to(ct).unsqueeze(-2), sin.to(ct).unsqueeze(-2)  # (..., T, 1, Dh/2)
    out = torch.stack((xe * c - xo * s, xe * s + xo * c), dim=-1)  # (..., T, Hh, Dh/2, 2)
    return out.flatten(-2).to(out_dtype or x.dtype)  # (..., T, Hh, Dh)


def qkv_prep_ref(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    offset: int | torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference for the fused write: see the module docstring. Returns q, (B, Hh, T, Dh) in qkv's dtype.

    `out`, if given, is a (B, Hh, T, Dh) tensor of qkv's dtype with a contiguous last dim (e.g. the
    transposed view of a token-major (B, T, Hh, Dh) buffer) that receives q (preallocated
    buffers for graph capture); it is returned.
    """
    b, t, hh, dh, _ = _check_args(qkv, q_weight, k_weight, cos, sin, k_cache, v_cache, offset, eps, out)
    q_raw, k_raw, v_raw = qkv.unbind(2)  # (B, T, Hh, Dh) each
    q = rope_ref(rms_norm_ref(q_raw, q_weight, eps, torch.float32), cos, sin, torch.float32)  # (B, T, Hh, Dh)
    k = rope_ref(rms_norm_ref(k_raw, k_weight, eps, torch.float32), cos, sin, torch.float32)  # (B, T, Hh, Dh)
    if out is None:
        out = torch.empty((b, hh, t, dh), dtype=qkv.dtype, device=qkv.device)  # (B, Hh, T, Dh)
    out.copy_(q.transpose(1, 2))  # (B, Hh, T, Dh)
    _write_cache_ref(k_cache, k.transpose(1, 2), offset)  # (B, Hh, T, Dh) into (B, Hh, S, Dh)
    _write_cache_ref(v_cache, v_raw.transpose(1, 2), offset)
    return out


def _write_cache_ref(cache: torch.Tensor, x: torch.Tensor, offset: int | torch.Tensor) -> None:
    """cache[:, :, offset:offset + T] = x (cast). cache: (B, Hh, S, Dh); x: (B, Hh, T, Dh)."""
    t = x.shape[2]
    if isinstance(offset, int):
        cache[:, :, offset : offset + t].copy_(x)
    else:  # no host sync: slot indices computed on the device
        idx = offset.reshape(()) + torch.arange(t, device=cache.device)  # (T,)
        cache.index_copy_(2, idx, x.to(cache.dtype))


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------


def _rope_tables(cos_ptr, sin_ptr, t, row_ok, s_rope_t, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """cos and sin at each row's token t, (ROWS, BLOCK_D/2) float32; lanes past Dh/2 are 0."""
    i = tl.arange(0, BLOCK_D // 2)  # (HALF,)
    mask = row_ok[:, None] & (i < HEAD_DIM // 2)[None, :]  # (ROWS, HALF)
    off = (t * s_rope_t)[:, None] + i[None, :]  # (ROWS, HALF)
    return tl.load(cos_ptr + off, mask=mask, other=0.0), tl.load(sin_ptr + off, mask=mask, other=0.0)


def _norm_rope(x, w, c, s, eps, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """rope(rms_norm(x) * w) of (ROWS, BLOCK_D) float32 rows: RMSNorm over Dh (masked lanes are 0 and do not
    count), then RoPE on adjacent pairs, each row split into its even and odd lanes. Shared with the FP8 write."""
    x = x * tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None] * w[None, :]  # (ROWS, BLOCK_D)
    xe, xo = tl.split(tl.reshape(x, (ROWS, BLOCK_D // 2, 2)))  # (ROWS, HALF) each
    return tl.reshape(tl.join(xe * c - xo * s, xe * s + xo * c), (ROWS, BLOCK_D))


rope_tables: Any = triton.jit(_rope_tables) if HAS_TRITON else None
norm_rope: Any = triton.jit(_norm_rope) if HAS_TRITON else None


def _qkv_prep_kernel(
    qkv_ptr,  # (B, T, 3, Hh, Dh), strides (s_qkv_b, s_qkv_t, s_qkv_c, s_qkv_h, 1)
    q_weight_ptr,  # (Dh,)
    k_weight_ptr,  # (Dh,)
    cos_ptr,  # (T, Dh/2) float32, strides (s_rope_t, 1)
    sin_ptr,  # (T, Dh/2) float32, strides (s_rope_t, 1)
    q_out_ptr,  # (B, Hh, T, Dh), strides (s_qo_b, s_qo_h, s_qo_t, 1): head- or token-major
    k_cache_ptr,  # (B, Hh, S, Dh), strides (s_kc_b, s_kc_h, s_kc_s, 1)
    v_cache_ptr,  # (B, Hh, S, Dh), strides (s_vc_b, s_vc_h, s_vc_s, 1)
    offset_ptr,  # () int64, read only when OFFSET_FROM_PTR
    offset_value,  # int, used when not OFFSET_FROM_PTR
    n_tokens,  # B * T
    T,
    Hh,
    S,
    s_qkv_b,
    s_qkv_t,
    s_qkv_c,
    s_qkv_h,
    s_rope_t,
    s_qo_b,
    s_qo_h,
    s_qo_t,
    s_kc_b,
    s_kc_h,
    s_kc_s,
    s_vc_b,
    s_vc_h,
    s_vc_s,
    eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_H: tl.constexpr,  # heads per program
    OFFSET_FROM_PTR: tl.constexpr,
):
    """One program: BLOCK_T tokens x BLOCK_H heads, as ROWS = BLOCK_T * BLOCK_H rows of one head vector."""
    ROWS: tl.constexpr = BLOCK_T * BLOCK_H
    r = tl.arange(0, ROWS)  # (ROWS,)
    n = tl.program_id(0).to(tl.int64) * BLOCK_T + r // BLOCK_H  # (ROWS,) flat token b * T + t
    h = tl.program_id(1).to(tl.int64) * BLOCK_H + r % BLOCK_H  # (ROWS,) head
    b = n // T
    t = n % T
    row_ok = (n < n_tokens) & (h < Hh)  # (ROWS,)
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    d_ok = d < HEAD_DIM
    mask = row_ok[:, None] & d_ok[None, :]  # (ROWS, BLOCK_D)

    # Read q, k, v of each (token, head) once.
    src = qkv_ptr + (b * s_qkv_b + t * s_qkv_t + h * s_qkv_h)[:, None] + d[None, :]  # (ROWS, BLOCK_D)
    xq = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    xk = tl.load(src + s_qkv_c, mask=mask, other=0.0).to(tl.float32)
    xv = tl.load(src + 2 * s_qkv_c, mask=mask, other=0.0)

    # RMSNorm in float32, then RoPE on adjacent pairs.
    wq = tl.load(q_weight_ptr + d, mask=d_ok, other=0.0).to(tl.float32)  # (BLOCK_D,)
    wk = tl.load(k_weight_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    c, s = rope_tables(cos_ptr, sin_ptr, t, row_ok, s_rope_t, HEAD_DIM, BLOCK_D)  # (ROWS, HALF) each
    yq = norm_rope(xq, wq, c, s, eps, HEAD_DIM, ROWS, BLOCK_D)  # (ROWS, BLOCK_D)
    yk = norm_rope(xk, wk, c, s, eps, HEAD_DIM, ROWS, BLOCK_D)

    # q out in (B, Hh, T, Dh).
    q_dst = q_out_ptr + (b * s_qo_b + h * s_qo_h + t * s_qo_t)[:, None] + d[None, :]  # (ROWS, BLOCK_D)
    tl.store(q_dst, yq.to(q_out_ptr.dtype.element_ty), mask=mask)

    # k and v into the cache at slot offset + t; rows outside [0, S) are dropped.
    if OFFSET_FROM_PTR:  # noqa: SIM108 (a compile-time branch; the two sides have different types)
        off = tl.load(offset_ptr)
    else:
        off = offset_value
    pos = off + t  # (ROWS,)
    cache_mask = mask & ((pos >= 0) & (pos < S))[:, None]
    k_dst = k_cache_ptr + (b * s_kc_b + h * s_kc_h + pos * s_kc_s)[:, None] + d[None, :]  # (ROWS, BLOCK_D)
    v_dst = v_cache_ptr + (b * s_vc_b + h * s_vc_h + pos * s_vc_s)[:, None] + d[None, :]
    tl.store(k_dst, yk.to(k_cache_ptr.dtype.element_ty), mask=cache_mask)
    tl.store(v_dst, xv.to(v_cache_ptr.dtype.element_ty), mask=cache_mask)


def _block_sizes(hh: int, dh: int, block_t: int | None, block_h: int | None) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_H, BLOCK_D): about 2048 elements per q/k/v tile; heads padded as little as possible."""
    block_d = next_power_of_2(dh)
    rows = max(1, 2048 // block_d)
    if block_h is None:
        cands = [1 << j for j in range(min(rows, next_power_of_2(hh)).bit_length())]  # powers of two <= cap
        block_h = min(cands, key=lambda c: (-(-hh // c) * c, -c))  # least padding, then the largest
    if block_h < 1 or block_h & (block_h - 1):
        raise ValueError(f"qkv_prep_triton: block_h={block_h} must be a power of two >= 1")
    if block_t is None:
        block_t = max(1, rows // block_h)
    if block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"qkv_prep_triton: block_t={block_t} must be a power of two >= 1")
    return block_t, block_h, block_d


def qkv_prep_triton(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    offset: int | torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    block_t: int | None = None,
    block_h: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """`qkv_prep_ref` in one Triton kernel. Returns q, (B, Hh, T, Dh) contiguous in qkv's dtype.

    Runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1. `block_t`, `block_h` (powers of two)
    and `num_warps` override the tiling, for benchmarks.
    """
    b, t, hh, dh, s = _check_args(qkv, q_weight, k_weight, cos, sin, k_cache, v_cache, offset, eps, out)
    from_ptr, offset_ptr, offset_value, guard = launch_prelude(qkv, offset, "qkv_prep_triton")
    bt, bh, bd = _block_sizes(hh, dh, block_t, block_h)
    if out is None:
        out = torch.empty((b, hh, t, dh), dtype=qkv.dtype, device=qkv.device)  # (B, Hh, T, Dh)
    kernel = jit_for_current_mode(_qkv_prep_kernel, do_not_specialize=["offset_value"])
    grid = (-(-(b * t) // bt), -(-hh // bh))
    with guard:
        kernel[grid](
            qkv, q_weight, k_weight, cos, sin, out, k_cache, v_cache, offset_ptr, offset_value,
            b * t, t, hh, s,
            qkv.stride(0), qkv.stride(1), qkv.stride(2), qkv.stride(3),
            cos.stride(0),
            out.stride(0), out.stride(1), out.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            float(eps),
            HEAD_DIM=dh, BLOCK_D=bd, BLOCK_T=bt, BLOCK_H=bh, OFFSET_FROM_PTR=from_ptr,
            num_warps=num_warps,
        )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------------------


def qkv_prep(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    offset: int | torch.Tensor,
    eps: float,
    backend: QKVPrepBackend = "auto",
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused write-time cache work; returns q, (B, Hh, T, Dh). See the module docstring.

    backend: "auto" = Triton on CUDA (when installed), the PyTorch reference on CPU; "triton" forces the
    kernel (on CPU only under TRITON_INTERPRET=1); "torch" forces the reference.
    """
    if pick_write_backend(backend, qkv, "qkv_prep") == "triton":
        return qkv_prep_triton(qkv, q_weight, k_weight, cos, sin, k_cache, v_cache, offset, eps, out=out)
    return qkv_prep_ref(qkv, q_weight, k_weight, cos, sin, k_cache, v_cache, offset, eps, out=out)


def pick_write_backend(backend: QKVPrepBackend, qkv: torch.Tensor, where: str) -> Literal["triton", "torch"]:
    """The backend `backend` means for `qkv` ("auto": Triton on CUDA when installed, else the reference)."""
    if backend == "auto":
        return "triton" if qkv.is_cuda and HAS_TRITON else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"{where}: backend={backend!r} is not one of 'auto', 'triton', 'torch'")
    return backend


def launch_prelude(qkv: torch.Tensor, offset: int | torch.Tensor,
                   where: str) -> tuple[bool, torch.Tensor, int, contextlib.AbstractContextManager[Any]]:
    """What a cache-write launcher does before its kernel: check the mode and the device, pass the offset as
    (from a pointer?, that pointer or a dummy never read, its value), guard the device."""
    check_triton_mode(where)
    if qkv.device.type != "cuda" and not interpreter_enabled():
        raise ValueError(
            f"{where}: tensors are on {qkv.device}; the Triton kernel needs CUDA tensors, or "
            "TRITON_INTERPRET=1 in the environment for CPU tensors; use backend='torch' on CPU"
        )
    guard = torch.cuda.device(qkv.device) if qkv.is_cuda else contextlib.nullcontext()
    if isinstance(offset, torch.Tensor):
        return True, offset, 0, guard
    return False, qkv, offset, guard


# ----------------------------------------------------------------------------------------------------------
# Argument checks (shared by the reference and the launcher)
# ----------------------------------------------------------------------------------------------------------


def _check_args(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    offset: int | torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
) -> tuple[int, int, int, int, int]:
    """Validate everything; return (B, T, Hh, Dh, S). Raises ValueError naming the argument, value and fix."""

    def fail(msg: str) -> ValueError:
        return ValueError(f"qkv_prep: {msg}")

    b, t, hh, dh = check_write_inputs(fail, qkv, q_weight, k_weight, cos, sin)
    dev = qkv.device
    if k_cache.ndim != 4 or k_cache.shape[:2] != (b, hh) or k_cache.shape[3] != dh:
        raise fail(f"k_cache has shape {tuple(k_cache.shape)}; expected ({b}, {hh}, S, {dh}) = (B, Hh, S, Dh)")
    if v_cache.shape != k_cache.shape:
        raise fail(f"v_cache has shape {tuple(v_cache.shape)}; expected k_cache's {tuple(k_cache.shape)}")
    s = k_cache.shape[2]
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype not in _COMPUTE_DTYPES:
            raise fail(f"{name} has dtype {cache.dtype}; expected one of float32, bfloat16, float16")
        if cache.stride(-1) != 1:
            raise fail(f"{name} has strides {cache.stride()}; the last dim (Dh) must be contiguous (stride 1)")
    if out is not None and (out.shape != (b, hh, t, dh) or out.dtype != qkv.dtype or out.stride(-1) != 1):
        raise fail(
            f"out has shape {tuple(out.shape)}, dtype {out.dtype}, strides {out.stride()}; expected a "
            "last-dim-contiguous "
            f"({b}, {hh}, {t}, {dh}) = (B, Hh, T, Dh) tensor of qkv's dtype {qkv.dtype}"
        )
    named = [("q_weight", q_weight), ("k_weight", k_weight), ("cos", cos), ("sin", sin)]
    named += [("k_cache", k_cache), ("v_cache", v_cache)] + ([("out", out)] if out is not None else [])
    if isinstance(offset, torch.Tensor):
        named.append(("offset", offset))
    for name, x in named:
        if x.device != dev:
            raise fail(f"{name} is on {x.device} but qkv is on {dev}; put all tensors on one device")
    if isinstance(offset, torch.Tensor):
        if offset.dtype != torch.int64 or offset.shape not in ((), (1,)):
            raise fail(
                f"offset tensor has dtype {offset.dtype}, shape {tuple(offset.shape)}; "
                "expected int64 of shape () or (1,) (torch.tensor(slot, dtype=torch.long))"
            )
    elif isinstance(offset, bool) or not isinstance(offset, int):
        raise fail(f"offset={offset!r} ({type(offset).__name__}); expected a Python int or an int64 tensor")
    elif not 0 <= offset <= s - t:
        raise fail(f"offset={offset} with T={t} writes slots [{offset}, {offset + t}); the cache has S={s} slots")
    if not eps > 0:
        raise fail(f"eps={eps} must be > 0")
    return b, t, hh, dh, s


def check_write_inputs(fail: Callable[[str], ValueError], qkv: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[int, int, int, int]:
    """The checks of a cache write's inputs (qkv, the norm weights, the RoPE tables), shared by the bf16 and FP8
    writes; returns (B, T, Hh, Dh)."""
    if qkv.ndim != 5 or qkv.shape[2] != 3:
        raise fail(f"qkv has shape {tuple(qkv.shape)}; expected (B, T, 3, Hh, Dh), a view of the fused QKV output")
    b, t, _, hh, dh = qkv.shape
    if min(b, t, hh) < 1:
        raise fail(f"qkv has shape {tuple(qkv.shape)}; B, T and Hh must all be >= 1")
    if dh % 2 or not 2 <= dh <= _MAX_HEAD_DIM:
        raise fail(f"head dim Dh={dh} must be even and in [2, {_MAX_HEAD_DIM}] (RoPE rotates pairs)")
    if qkv.dtype not in _COMPUTE_DTYPES:
        raise fail(f"qkv has dtype {qkv.dtype}; expected one of float32, bfloat16, float16")
    if qkv.stride(-1) != 1:
        raise fail(f"qkv has strides {qkv.stride()}; the last dim (Dh) must be contiguous (stride 1)")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (dh,) or not w.is_floating_point() or w.stride(0) != 1:
            raise fail(
                f"{name} has shape {tuple(w.shape)}, dtype {w.dtype}, strides {w.stride()}; "
                f"expected a contiguous floating tensor of shape ({dh},) = (Dh,)"
            )
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (t, dh // 2) or table.dtype != torch.float32 or table.stride(-1) != 1:
            raise fail(
                f"{name} has shape {tuple(table.shape)}, dtype {table.dtype}, strides {table.stride()}; "
                f"expected float32 ({t}, {dh // 2}) = (T, Dh/2) with a contiguous last dim"
            )
    if cos.stride() != sin.stride():
        raise fail(f"cos strides {cos.stride()} differ from sin strides {sin.stride()}; make both contiguous")
    return b, t, hh, dh
