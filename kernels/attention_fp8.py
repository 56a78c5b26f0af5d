"""Attention over an FP8 KV cache (written by `kernels.qkv_prep_fp8`): one Triton kernel, FP8 tensor-core GEMMs.

Details: docs/kernels.md (`kernels.attention_fp8`)."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from kernels._triton import (
    HAS_TRITON,
    check_triton_mode,
    interpreter_enabled,
    jit_for_current_mode,
    next_power_of_2,
    to_e4m3,
)
from kernels.fp8 import FP8

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["attention_fp8", "attention_fp8_ref", "attention_fp8_triton"]

# (BLOCK_M, BLOCK_N, num_warps, num_stages): the default tiling (the step runs of the first two H200 runs used
# (128, 128, 8, 3): 1.34 ms against 1.04 for this one at the TP3 shapes); benchmarks sweep others
DEFAULT_CONFIG = (64, 128, 4, 3)  # the best of the sweep on the H200 (benchmarks/h200/attention_fp8.json)


def dequantize_cache(k8: torch.Tensor, vt8: torch.Tensor, v_scale: torch.Tensor, qk_scale: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v), both (B, Hh, S, Dh) float32, from the FP8 cache's k8, vt8 and scales."""
    k = k8.float() * qk_scale[1]
    v = (vt8.float() * v_scale[:, :, None, :]).transpose(-1, -2)  # (B, Hh, S, Dh)
    return k, v


def attention_fp8_ref(q8: torch.Tensor, k8: torch.Tensor, vt8: torch.Tensor, v_scale: torch.Tensor,
                      qk_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Exact softmax attention (float32) over the dequantised operands; see the module docstring."""
    _check(q8, k8, vt8, v_scale, qk_scale, out_dtype, out)
    q = q8.float() * qk_scale[0]
    k, v = dequantize_cache(k8, vt8, v_scale, qk_scale)
    probs = (torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q8.shape[-1])).softmax(dim=-1)  # (B, Hh, Tq, S)
    res = torch.matmul(probs, v)  # (B, Hh, Tq, Dh)
    if out is None:
        return res.to(out_dtype)
    return out.copy_(res)


def _attention_fp8_block(acc, l_i, m_i, c_prev, q, kt, vt, sv, n_ok, qk_scale,
                         MASK: tl.constexpr, INTERPRET: tl.constexpr):
    """One key block of the online softmax (see the module docstring). kt (Dh, BLOCK_N), vt (Dh, BLOCK_N) e4m3."""
    if INTERPRET:  # noqa: SIM108 (a compile-time branch) the interpreter's dot: float32 operands
        s = tl.dot(q.to(tl.float32), kt.to(tl.float32))
    else:
        s = tl.dot(q, kt)  # (BLOCK_M, BLOCK_N) float32
    if MASK:
        s = tl.where(n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])  # one FMA per score
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    c = tl.max(sv, axis=0)  # > 0: every block holds at least one key
    w = to_e4m3(p * (sv * (448.0 / c))[None, :], INTERPRET)  # (BLOCK_M, BLOCK_N) in [0, 448]
    acc = acc * (alpha * (c_prev / c))[:, None]
    if INTERPRET:
        acc += tl.dot(w.to(tl.float32), tl.trans(vt).to(tl.float32))
    else:
        acc = tl.dot(w, tl.trans(vt), acc)  # (BLOCK_M, Dh)
    return acc, l_i, m_new, c


_attention_fp8_block_jit: Any = triton.jit(_attention_fp8_block) if HAS_TRITON else None


def _attention_fp8_kernel(
    q_ptr, k_ptr, vt_ptr, vs_ptr, qks_ptr, o_ptr, k_desc, v_desc,
    Tq, Hh,
    s_qb, s_qh, s_qt,
    s_kb, s_kh, s_ks,
    s_vb, s_vh, s_vd,
    s_sb, s_sh,
    s_ob, s_oh, s_ot,
    sm_scale_log2,  # log2(e) / sqrt(Dh)
    S: tl.constexpr,  # keys: static per captured graph (a few values per session: the warm-up lengths, then one)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM (padding lanes load zeros)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr,  # K and V^T tiles by tensor-memory-access descriptors (k_desc, v_desc)
    INTERPRET: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hh).to(tl.int64)
    h = (bh % Hh).to(tl.int64)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    n0 = tl.arange(0, BLOCK_N)
    m_ok = m < Tq
    q = tl.load(q_ptr + b * s_qb + h * s_qh + m.to(tl.int64)[:, None] * s_qt + d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D) e4m3
    qk_scale = tl.load(qks_ptr) * tl.load(qks_ptr + 1) * sm_scale_log2
    k_base = k_ptr + b * s_kb + h * s_kh + d[:, None]  # (BLOCK_D, 1): K^T tiles, Dh contiguous (K-major)
    v_base = vt_ptr + b * s_vb + h * s_vh + d[:, None] * s_vd  # (BLOCK_D, 1): V^T tiles, keys contiguous
    s_base = vs_ptr + b * s_sb + h * s_sh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    c_prev = tl.full([], 1.0, tl.float32)
    S_FULL: tl.constexpr = S // BLOCK_N * BLOCK_N
    for start in range(0, S_FULL, BLOCK_N):  # whole blocks: no key mask
        n = start + n0
        if USE_TMA:
            kt = tl.trans(tl.reshape(k_desc.load([bh, start, 0]), (BLOCK_N, BLOCK_D)))
            vt = v_desc.load([bh * HEAD_DIM, start])
        else:
            kt = tl.load(k_base + n[None, :].to(tl.int64) * s_ks, mask=d_ok[:, None], other=0.0)  # (BLOCK_D, BLOCK_N)
            vt = tl.load(v_base + n[None, :], mask=d_ok[:, None], other=0.0)
        sv = tl.load(s_base + n)  # (BLOCK_N,)
        acc, l_i, m_i, c_prev = _attention_fp8_block_jit(acc, l_i, m_i, c_prev, q, kt, vt, sv, n < S, qk_scale,
                                                         False, INTERPRET)
    if S_FULL < S:  # the last, partial block
        n = S_FULL + n0
        n_ok = n < S
        kt = tl.load(k_base + n[None, :].to(tl.int64) * s_ks, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        vt = tl.load(v_base + n[None, :], mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        sv = tl.load(s_base + n, mask=n_ok, other=0.0)
        acc, l_i, m_i, c_prev = _attention_fp8_block_jit(acc, l_i, m_i, c_prev, q, kt, vt, sv, n_ok, qk_scale,
                                                         True, INTERPRET)
    out = acc * (c_prev / (448.0 * l_i))[:, None]
    o = o_ptr + b * s_ob + h * s_oh + m.to(tl.int64)[:, None] * s_ot + d[None, :]
    tl.store(o, out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def _tma_ok(k8: torch.Tensor, vt8: torch.Tensor, dh: int) -> bool:
    """Whether K and V^T can be read by TMA descriptors: 16-byte aligned bases and strides, a power-of-two Dh,
    batch and head strides that fold into one (a (B*Hh, S, Dh) view)."""
    b, hh = k8.shape[:2]
    aligned = all(x.data_ptr() % 16 == 0 for x in (k8, vt8)) and all(
        st % 16 == 0 for st in (k8.stride(1), k8.stride(2), vt8.stride(1), vt8.stride(2)))
    folds = (b == 1 or k8.stride(0) == hh * k8.stride(1)) and (b == 1 or vt8.stride(0) == hh * vt8.stride(1))
    return aligned and folds and vt8.stride(2) * dh == vt8.stride(1) and dh & (dh - 1) == 0


def attention_fp8_triton(q8: torch.Tensor, k8: torch.Tensor, vt8: torch.Tensor, v_scale: torch.Tensor,
                         qk_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                         out: torch.Tensor | None = None,
                         config: tuple[int, int, int, int] | None = None, tma: bool | None = None) -> torch.Tensor:
    """The kernel; `config` = (BLOCK_M, BLOCK_N, num_warps, num_stages) (default `DEFAULT_CONFIG`); `tma`: read K and
    V^T through TMA descriptors (default: on CUDA when the layout allows it). CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1. No host syncs: graph-capturable (descriptors are kernel arguments)."""
    b, hh, tq, dh, s = _check(q8, k8, vt8, v_scale, qk_scale, out_dtype, out)
    check_triton_mode("attention_fp8_triton")
    if not q8.is_cuda and not interpreter_enabled():
        raise ValueError(f"attention_fp8_triton: tensors are on {q8.device}; the kernel needs CUDA tensors, or "
                         "TRITON_INTERPRET=1 for CPU tensors; use attention_fp8_ref on CPU")
    block_m, block_n, warps, stages = config or DEFAULT_CONFIG
    block_d = max(16, next_power_of_2(dh))
    use_tma = q8.is_cuda and _tma_ok(k8, vt8, dh) if tma is None else tma
    if use_tma and not (q8.is_cuda and _tma_ok(k8, vt8, dh)):
        raise ValueError(f"attention_fp8_triton: tma=True needs CUDA tensors with 16-byte aligned strides and a "
                         f"power-of-two Dh; got k8 strides {k8.stride()}, vt8 strides {vt8.stride()}, Dh={dh}")
    if out is None:
        out = torch.empty(b, tq, hh, dh, device=q8.device, dtype=out_dtype).transpose(1, 2)  # token-major
    k_desc: Any = 0
    v_desc: Any = 0
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        k_desc = TensorDescriptor(k8, [b * hh, s, dh], [k8.stride(1), k8.stride(2), 1], [1, block_n, dh])
        v_desc = TensorDescriptor(vt8, [b * hh * dh, s], [vt8.stride(2), 1], [dh, block_n])
    kernel = jit_for_current_mode(_attention_fp8_kernel)
    grid = (-(-tq // block_m), b * hh)
    guard = torch.cuda.device(q8.device) if q8.is_cuda else contextlib.nullcontext()
    with guard:
        kernel[grid](
            q8, k8, vt8, v_scale, qk_scale, out, k_desc, v_desc,
            tq, hh,
            q8.stride(0), q8.stride(1), q8.stride(2),
            k8.stride(0), k8.stride(1), k8.stride(2),
            vt8.stride(0), vt8.stride(1), vt8.stride(2),
            v_scale.stride(0), v_scale.stride(1),
            out.stride(0), out.stride(1), out.stride(2),
            math.log2(math.e) / math.sqrt(dh),
            S=s, HEAD_DIM=dh, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, USE_TMA=use_tma,
            INTERPRET=interpreter_enabled(), num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out


def attention_fp8(q8: torch.Tensor, k8: torch.Tensor, vt8: torch.Tensor, v_scale: torch.Tensor,
                  qk_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel on CUDA (when installed), the reference elsewhere."""
    if q8.is_cuda and HAS_TRITON:
        return attention_fp8_triton(q8, k8, vt8, v_scale, qk_scale, out_dtype, out)
    return attention_fp8_ref(q8, k8, vt8, v_scale, qk_scale, out_dtype, out)


def _check(q8: torch.Tensor, k8: torch.Tensor, vt8: torch.Tensor, v_scale: torch.Tensor, qk_scale: torch.Tensor,
           out_dtype: torch.dtype, out: torch.Tensor | None) -> tuple[int, int, int, int, int]:
    def fail(msg: str) -> ValueError:
        return ValueError(f"attention_fp8: {msg}")

    if q8.ndim != 4 or q8.dtype != FP8:
        raise fail(f"q8 is {q8.dtype} {tuple(q8.shape)}; expected {FP8} (B, Hh, Tq, Dh)")
    b, hh, tq, dh = q8.shape
    if k8.ndim != 4 or k8.shape[:2] != (b, hh) or k8.shape[3] != dh or k8.dtype != FP8:
        raise fail(f"k8 is {k8.dtype} {tuple(k8.shape)}; expected {FP8} ({b}, {hh}, S, {dh})")
    s = k8.shape[2]
    if vt8.shape != (b, hh, dh, s) or vt8.dtype != FP8:
        raise fail(f"vt8 is {vt8.dtype} {tuple(vt8.shape)}; expected {FP8} ({b}, {hh}, {dh}, {s}) = (B, Hh, Dh, S)")
    if v_scale.shape != (b, hh, s) or v_scale.dtype != torch.float32:
        raise fail(f"v_scale is {v_scale.dtype} {tuple(v_scale.shape)}; expected float32 ({b}, {hh}, {s})")
    if qk_scale.shape != (2,) or qk_scale.dtype != torch.float32:
        raise fail(f"qk_scale is {qk_scale.dtype} {tuple(qk_scale.shape)}; expected float32 (2,)")
    for name, x in (("q8", q8), ("k8", k8), ("vt8", vt8), ("v_scale", v_scale)):
        if x.stride(-1) != 1:
            raise fail(f"{name} has strides {x.stride()}; its last dim must be contiguous")
        if x.device != q8.device:
            raise fail(f"{name} is on {x.device}, q8 on {q8.device}; put all tensors on one device")
    if s < 1:
        raise fail("S=0 keys; attend over at least one key")
    if out is not None and (out.shape != (b, hh, tq, dh) or out.dtype != out_dtype or out.stride(-1) != 1):
        raise fail(f"out is {out.dtype} {tuple(out.shape)}; expected {out_dtype} ({b}, {hh}, {tq}, {dh}) with a "
                   "contiguous last dim")
    return b, hh, tq, dh, s
