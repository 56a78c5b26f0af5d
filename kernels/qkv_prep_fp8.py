"""Write-time KV-cache work for FP8 attention: `kernels.qkv_prep`'s norm + RoPE, with q, K and V stored in e4m3.

The cache is written once in the form the FP8 attention kernel (`kernels.attention_fp8`) reads:

    q  = rope(rms_norm(q_raw) * q_weight)   -> q8 = e4m3(q / q_scale), returned (B, Hh, T, Dh)
    k  = rope(rms_norm(k_raw) * k_weight)   -> k8 = e4m3(k / k_scale)  into k_cache  (B, Hh, S, Dh)
    v  = v_raw, per (token, head) row:         v_scale = amax(|v|) / 448 into v_scale (B, Hh, S)
                                               v8 = e4m3(v / v_scale)   into vt_cache (B, Hh, Dh, S), TRANSPOSED
    qk_scale <- [q_scale, k_scale]             (2,) float32, what attention multiplies its scores by

or, with ``v_layout="tensor"`` (what cuDNN's FP8 attention reads, `kernels.attention_cudnn_fp8`), V with one scale
for the layer: v8 = e4m3(v / v_scale) into v_cache (B, Hh, S, Dh), not transposed, `v_scale` (1,) given. That
scale is set once per session, on the cache's first write after a reset (`set_v_tensor_scale`): the written V's
largest magnitude times V_HEADROOM (32), over 448. Later chunks' V may grow past the first's up to that headroom
before they saturate; e4m3 being floating point, the headroom costs no precision to values down to 1/900 of the
first write's largest.

q and k need no data-dependent scale: after RMSNorm a head vector's elements are at most sqrt(Dh) * max|w|
(all of its energy in one element), and RoPE rotates pairs without changing their norm, so
`scale = sqrt(Dh) * max|w| / 448` (from the norm weight alone) can never overflow, and e4m3 being a
floating-point format, values far under that bound keep their 3 mantissa bits (they stay normal down to
2^-6 of it, ~1/28700 of the bound). V has no norm, so each row gets its own scale. V is stored transposed
(Dh before S): on Hopper the FP8 tensor-core GEMM P @ V wants its B operand K-major, i.e. contiguous along
the keys.

Norm and RoPE run in float32; the cast rounds to nearest even and saturates at +-448 (as torch's cast of a
clamped value). `offset` is a Python int or an int64 device tensor (CUDA-graph replays writing different
slots), as in `kernels.qkv_prep`; rows landing outside [0, S) are dropped by the kernel.

Public API:
    qk_scale_bound           the static scale of a normed, rotated head vector
    set_v_tensor_scale       the per-tensor V scale, set on a cache's first write (``v_layout="tensor"``)
    qkv_prep_fp8_ref         the readable reference; the CPU path
    qkv_prep_fp8_triton      one Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1)
    qkv_prep_fp8             dispatch
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from kernels._triton import (
    HAS_TRITON,
    interpreter_enabled,
    jit_for_current_mode,
    next_power_of_2,
    to_e4m3,
)
from kernels.fp8 import FP8, FP8_MAX
from kernels.qkv_prep import (
    QKVPrepBackend,
    check_write_inputs,
    launch_prelude,
    norm_rope,
    pick_write_backend,
    rms_norm_ref,
    rope_ref,
    rope_tables,
)

if HAS_TRITON:
    import triton.language as tl

__all__ = ["V_HEADROOM", "VLayout", "qk_scale_bound", "qkv_prep_fp8", "qkv_prep_fp8_ref", "qkv_prep_fp8_triton",
           "set_v_tensor_scale"]

_TINY = 1e-12
V_HEADROOM = 32.0
VLayout = Literal["rows_transposed", "tensor"]


def qk_scale_bound(weight: torch.Tensor) -> torch.Tensor:
    """sqrt(Dh) * max|weight| / 448 as a () float32 tensor: no element of rope(rms_norm(x) * weight) exceeds
    448 times it (see the module docstring). weight: (Dh,)."""
    return weight.float().abs().amax() * (math.sqrt(weight.shape[0]) / FP8_MAX)


def set_v_tensor_scale(v_scale: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
    """Where `v_scale` (1,) is still 0 (a reset cache), set it from this write's V: amax|v| * V_HEADROOM / 448;
    else leave it. In place, no host sync (a CUDA-graph replay keeps the first write's scale). qkv (B, T, 3, Hh,
    Dh)."""
    first = qkv[:, :, 2].abs().amax().float().clamp_min(_TINY) * (V_HEADROOM / FP8_MAX)
    return v_scale.copy_(torch.where(v_scale > 0, v_scale, first))


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def qkv_prep_fp8_ref(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    vt_cache: torch.Tensor,
    v_scale: torch.Tensor,
    qk_scale: torch.Tensor,
    offset: int | torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    v_layout: VLayout = "rows_transposed",
) -> torch.Tensor:
    """Reference: see the module docstring. Returns q8 (B, Hh, T, Dh) e4m3 (`out` if given: any (B, Hh, T, Dh)
    e4m3 tensor with a contiguous last dim, e.g. the transposed view of a token-major buffer). With
    ``v_layout="tensor"`` `vt_cache` is the (B, Hh, S, Dh) V cache and `v_scale` its (1,) scale (read, not set)."""
    b, t, hh, dh, _ = _check(qkv, q_weight, k_weight, cos, sin, k_cache, vt_cache, v_scale, qk_scale, offset, out,
                             v_layout)
    q_raw, k_raw, v_raw = qkv.unbind(2)  # (B, T, Hh, Dh) each
    q = rope_ref(rms_norm_ref(q_raw, q_weight, eps, torch.float32), cos, sin, torch.float32)  # (B, T, Hh, Dh)
    k = rope_ref(rms_norm_ref(k_raw, k_weight, eps, torch.float32), cos, sin, torch.float32)
    sq, sk = qk_scale_bound(q_weight), qk_scale_bound(k_weight)
    qk_scale.copy_(torch.stack([sq, sk]))
    if out is None:
        out = torch.empty((b, hh, t, dh), dtype=FP8, device=qkv.device)
    out.copy_(_e4m3(q / sq).transpose(1, 2))  # (B, Hh, T, Dh)
    vf = v_raw.float()
    idx = (offset.reshape(()) if isinstance(offset, torch.Tensor) else offset) + torch.arange(t, device=qkv.device)
    # fp8 tensors are copied as bytes (index_copy_ has no float8 kernel on every device)
    k_cache.view(torch.uint8).index_copy_(2, idx, _e4m3(k / sk).transpose(1, 2).contiguous().view(torch.uint8))
    if v_layout == "tensor":
        v8 = _e4m3(vf / v_scale)  # (B, T, Hh, Dh)
        vt_cache.view(torch.uint8).index_copy_(2, idx, v8.transpose(1, 2).contiguous().view(torch.uint8))
        return out
    sv = vf.abs().amax(dim=-1).clamp_min(_TINY) / FP8_MAX  # (B, T, Hh)
    v8 = _e4m3(vf / sv[..., None])  # (B, T, Hh, Dh)
    vt_cache.view(torch.uint8).index_copy_(3, idx, v8.permute(0, 2, 3, 1).contiguous().view(torch.uint8))
    v_scale.index_copy_(2, idx, sv.transpose(1, 2).contiguous())  # (B, Hh, T)
    return out


def _qkv_prep_fp8_kernel(
    qkv_ptr,  # (B, T, 3, Hh, Dh), strides (s_qkv_b, s_qkv_t, s_qkv_c, s_qkv_h, 1)
    q_weight_ptr,  # (Dh,)
    k_weight_ptr,  # (Dh,)
    cos_ptr,  # (T, Dh/2) float32, strides (s_rope_t, 1)
    sin_ptr,
    q_out_ptr,  # (B, Hh, T, Dh) e4m3, strides (s_qo_b, s_qo_h, s_qo_t, 1)
    k_cache_ptr,  # (B, Hh, S, Dh) e4m3, strides (s_kc_b, s_kc_h, s_kc_s, 1)
    vt_cache_ptr,  # (B, Hh, Dh, S) e4m3, strides (s_vc_b, s_vc_h, s_vc_d, s_vc_s = 1); V_TENSOR: (B, Hh, S, Dh)
    v_scale_ptr,  # (B, Hh, S) float32, strides (s_vs_b, s_vs_h, 1); V_TENSOR: (1,), read
    qk_scale_ptr,  # (2,) float32
    offset_ptr,
    offset_value,
    T,
    S,
    s_qkv_b, s_qkv_t, s_qkv_c, s_qkv_h,
    s_rope_t,
    s_qo_b, s_qo_h, s_qo_t,
    s_kc_b, s_kc_h, s_kc_s,
    s_vc_b, s_vc_h, s_vc_d, s_vc_s,
    s_vs_b, s_vs_h,
    eps,
    bound,  # sqrt(Dh) / 448
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_T: tl.constexpr,
    OFFSET_FROM_PTR: tl.constexpr,
    V_TENSOR: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_T consecutive tokens of one head of one batch (grid: T blocks, Hh, B). Tokens are
    the tile's first axis, so the transposed V store is contiguous along them."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    t_ok = t < T
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,): lanes past Dh load zeros and store nothing
    d_ok = d < HEAD_DIM
    mask = t_ok[:, None] & d_ok[None, :]  # (BLOCK_T, BLOCK_D)

    src = qkv_ptr + b * s_qkv_b + h * s_qkv_h + t.to(tl.int64)[:, None] * s_qkv_t + d[None, :]  # (BLOCK_T, Dh)
    xq = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    xk = tl.load(src + s_qkv_c, mask=mask, other=0.0).to(tl.float32)
    xv = tl.load(src + 2 * s_qkv_c, mask=mask, other=0.0).to(tl.float32)

    wq = tl.load(q_weight_ptr + d, mask=d_ok, other=0.0).to(tl.float32)  # (BLOCK_D,)
    wk = tl.load(k_weight_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    sq = tl.max(tl.abs(wq), axis=0) * bound  # the static bounds (module docstring)
    sk = tl.max(tl.abs(wk), axis=0) * bound
    first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0) & (tl.program_id(2) == 0)
    tl.store(qk_scale_ptr, sq, mask=first)
    tl.store(qk_scale_ptr + 1, sk, mask=first)

    c, s = rope_tables(cos_ptr, sin_ptr, t, t_ok, s_rope_t, HEAD_DIM, BLOCK_D)  # (BLOCK_T, Dh/2) each
    yq = norm_rope(xq, wq, c, s, eps, HEAD_DIM, BLOCK_T, BLOCK_D)  # (BLOCK_T, BLOCK_D)
    yk = norm_rope(xk, wk, c, s, eps, HEAD_DIM, BLOCK_T, BLOCK_D)

    q_dst = q_out_ptr + b * s_qo_b + h * s_qo_h + t.to(tl.int64)[:, None] * s_qo_t + d[None, :]
    tl.store(q_dst, to_e4m3(yq / sq, INTERPRET), mask=mask)

    if OFFSET_FROM_PTR:  # noqa: SIM108 (a compile-time branch)
        off = tl.load(offset_ptr)
    else:
        off = offset_value
    pos = (off + t).to(tl.int64)  # (BLOCK_T,)
    ok = t_ok & (pos >= 0) & (pos < S)
    k_dst = k_cache_ptr + b * s_kc_b + h * s_kc_h + pos[:, None] * s_kc_s + d[None, :]
    tl.store(k_dst, to_e4m3(yk / sk, INTERPRET), mask=ok[:, None] & d_ok[None, :])

    v_dst = vt_cache_ptr + b * s_vc_b + h * s_vc_h + d[None, :] * s_vc_d + pos[:, None] * s_vc_s  # (BLOCK_T, Dh)
    if V_TENSOR:  # one scale for the layer
        sv_t = tl.load(v_scale_ptr)
        tl.store(v_dst, to_e4m3(xv / sv_t, INTERPRET), mask=ok[:, None] & d_ok[None, :])
    else:
        sv = tl.maximum(tl.max(tl.abs(xv), axis=1), 1e-12) / 448.0  # (BLOCK_T,) per (token, head)
        tl.store(v_dst, to_e4m3(xv / sv[:, None], INTERPRET), mask=ok[:, None] & d_ok[None, :])
        tl.store(v_scale_ptr + b * s_vs_b + h * s_vs_h + pos, sv, mask=ok)


def qkv_prep_fp8_triton(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    vt_cache: torch.Tensor,
    v_scale: torch.Tensor,
    qk_scale: torch.Tensor,
    offset: int | torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    v_layout: VLayout = "rows_transposed",
    block_t: int = 32,
    num_warps: int = 4,
) -> torch.Tensor:
    """`qkv_prep_fp8_ref` in one Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1)."""
    b, t, hh, dh, s = _check(qkv, q_weight, k_weight, cos, sin, k_cache, vt_cache, v_scale, qk_scale, offset, out,
                             v_layout)
    from_ptr, offset_ptr, offset_value, guard = launch_prelude(qkv, offset, "qkv_prep_fp8_triton")
    if block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"qkv_prep_fp8_triton: block_t={block_t} must be a power of two >= 1")
    if out is None:
        out = torch.empty((b, hh, t, dh), dtype=FP8, device=qkv.device)
    kernel = jit_for_current_mode(_qkv_prep_fp8_kernel, do_not_specialize=["offset_value"])
    v_strides = ((vt_cache.stride(0), vt_cache.stride(1), 1, vt_cache.stride(2), 0, 0) if v_layout == "tensor" else
                 (vt_cache.stride(0), vt_cache.stride(1), vt_cache.stride(2), 1, v_scale.stride(0), v_scale.stride(1)))
    grid = (-(-t // block_t), hh, b)
    with guard:
        kernel[grid](
            qkv, q_weight, k_weight, cos, sin, out, k_cache, vt_cache, v_scale, qk_scale, offset_ptr, offset_value,
            t, s,
            qkv.stride(0), qkv.stride(1), qkv.stride(2), qkv.stride(3),
            cos.stride(0),
            out.stride(0), out.stride(1), out.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            *v_strides,
            float(eps), math.sqrt(dh) / FP8_MAX,
            HEAD_DIM=dh, BLOCK_D=next_power_of_2(dh), BLOCK_T=block_t, OFFSET_FROM_PTR=from_ptr,
            V_TENSOR=v_layout == "tensor", INTERPRET=interpreter_enabled(), num_warps=num_warps,
        )  # fmt: skip
    return out


def qkv_prep_fp8(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    vt_cache: torch.Tensor,
    v_scale: torch.Tensor,
    qk_scale: torch.Tensor,
    offset: int | torch.Tensor,
    eps: float,
    backend: QKVPrepBackend = "auto",
    *,
    out: torch.Tensor | None = None,
    v_layout: VLayout = "rows_transposed",
) -> torch.Tensor:
    """The FP8 cache write; "auto" = Triton on CUDA (when installed), the reference elsewhere."""
    args = (qkv, q_weight, k_weight, cos, sin, k_cache, vt_cache, v_scale, qk_scale, offset, eps)
    if pick_write_backend(backend, qkv, "qkv_prep_fp8") == "triton":
        return qkv_prep_fp8_triton(*args, out=out, v_layout=v_layout)
    return qkv_prep_fp8_ref(*args, out=out, v_layout=v_layout)


def _check(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           k_cache: torch.Tensor, vt_cache: torch.Tensor, v_scale: torch.Tensor, qk_scale: torch.Tensor,
           offset: int | torch.Tensor, out: torch.Tensor | None, v_layout: VLayout = "rows_transposed"
           ) -> tuple[int, int, int, int, int]:
    """Validate; return (B, T, Hh, Dh, S). ValueError naming the argument, its value and the fix."""

    def fail(msg: str) -> ValueError:
        return ValueError(f"qkv_prep_fp8: {msg}")

    b, t, hh, dh = check_write_inputs(fail, qkv, q_weight, k_weight, cos, sin)
    if k_cache.ndim != 4 or k_cache.shape[:2] != (b, hh) or k_cache.shape[3] != dh or k_cache.dtype != FP8:
        raise fail(f"k_cache is {k_cache.dtype} {tuple(k_cache.shape)}; expected {FP8} ({b}, {hh}, S, {dh})")
    s = k_cache.shape[2]
    if v_layout == "tensor":
        if vt_cache.shape != (b, hh, s, dh) or vt_cache.dtype != FP8:
            raise fail(f"v_cache is {vt_cache.dtype} {tuple(vt_cache.shape)}; expected {FP8} ({b}, {hh}, {s}, {dh}) "
                       "= (B, Hh, S, Dh) with v_layout='tensor'")
        if v_scale.shape != (1,) or v_scale.dtype != torch.float32:
            raise fail(f"v_scale is {v_scale.dtype} {tuple(v_scale.shape)}; expected float32 (1,) with "
                       "v_layout='tensor'")
    elif v_layout != "rows_transposed":
        raise fail(f"v_layout={v_layout!r} is not one of 'rows_transposed', 'tensor'")
    else:
        if vt_cache.shape != (b, hh, dh, s) or vt_cache.dtype != FP8:
            raise fail(f"vt_cache is {vt_cache.dtype} {tuple(vt_cache.shape)}; expected {FP8} ({b}, {hh}, {dh}, "
                       f"{s}) = (B, Hh, Dh, S), V transposed")
        if v_scale.shape != (b, hh, s) or v_scale.dtype != torch.float32 or v_scale.stride(-1) != 1:
            raise fail(f"v_scale is {v_scale.dtype} {tuple(v_scale.shape)}; expected float32 ({b}, {hh}, {s})")
    if qk_scale.shape != (2,) or qk_scale.dtype != torch.float32:
        raise fail(f"qk_scale is {qk_scale.dtype} {tuple(qk_scale.shape)}; expected float32 (2,)")
    if k_cache.stride(-1) != 1 or vt_cache.stride(-1) != 1:
        raise fail(f"k_cache strides {k_cache.stride()} / vt_cache strides {vt_cache.stride()}: the last dim must "
                   "be contiguous")
    if out is not None and (out.shape != (b, hh, t, dh) or out.dtype != FP8 or out.stride(-1) != 1):
        raise fail(f"out is {out.dtype} {tuple(out.shape)}; expected {FP8} ({b}, {hh}, {t}, {dh}) with a "
                   "contiguous last dim")
    tensors = [q_weight, k_weight, cos, sin, k_cache, vt_cache, v_scale, qk_scale] + ([out] if out is not None else [])
    if isinstance(offset, torch.Tensor):
        tensors.append(offset)
        if offset.dtype != torch.int64 or offset.shape not in ((), (1,)):
            raise fail(f"offset tensor has dtype {offset.dtype}, shape {tuple(offset.shape)}; "
                       "expected int64 () or (1,)")
    elif isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= s - t:
        raise fail(f"offset={offset!r} with T={t} must be an int in [0, {s - t}] (S={s}) or an int64 tensor")
    for x in tensors:
        if x.device != qkv.device:
            raise fail(f"a tensor is on {x.device} but qkv is on {qkv.device}; put all tensors on one device")
    return b, t, hh, dh, s
