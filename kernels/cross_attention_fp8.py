"""The DiT's audio cross-attention of an FP8 model, from its q and kv projections to the o projection's e4m3 input.

Details: docs/kernels.md (`kernels.cross_attention_fp8`)."""

from __future__ import annotations

import contextlib
import math

import torch

from kernels._triton import HAS_TRITON, check_triton_mode, interpreter_enabled, jit_for_current_mode, next_power_of_2
from kernels.fp8 import FP8, FP8_MAX
from kernels.qkv_prep import rms_norm_ref

if HAS_TRITON:
    import triton.language as tl

    from kernels._triton import to_e4m3

__all__ = ["cross_attention_fp8", "cross_attention_fp8_ref", "cross_attention_fp8_triton"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TINY = 1e-12  # the smallest amax a scale is made from, as kernels.fp8
MAX_AUDIO_TOKENS = 64  # the key tile (BLOCK_A) is at most this wide
MAX_HEAD_DIM = 256
BLOCK_T = 64  # tokens a program (scripts/benchmarks/bench_cross_attention_fp8.py, H200, the 57b rank's shapes)
NUM_WARPS = 4


def _check(q: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
           heads: int) -> tuple[int, int, int, int, int, int]:
    """(B, nF, N, A, Hh, Dh) of valid arguments; ValueError naming the argument otherwise."""
    def fail(msg: str) -> ValueError:
        return ValueError(f"cross_attention_fp8: {msg}")

    if q.ndim != 3 or q.stride(-1) != 1 or q.dtype not in _DTYPES:
        raise fail(f"q must be (B, T, Hh*Dh) in one of {list(_DTYPES)} with a contiguous last dim, got {q.dtype} "
                   f"{tuple(q.shape)} strides {q.stride()}")
    b, t, width = q.shape
    if not isinstance(heads, int) or heads < 1 or width % heads:
        raise fail(f"heads={heads!r} must be a positive int dividing q's last dim {width} (Hh*Dh)")
    hh, dh = heads, width // heads
    if kv.ndim != 4 or kv.shape[0] != b or kv.shape[3] != 2 * width or kv.stride(-1) != 1 or kv.dtype not in _DTYPES:
        raise fail(f"kv must be (B, nF, A, 2*Hh*Dh) = ({b}, nF, A, {2 * width}) in one of {list(_DTYPES)} with a "
                   f"contiguous last dim, got {kv.dtype} {tuple(kv.shape)} strides {kv.stride()}")
    nf, a = kv.shape[1], kv.shape[2]
    if nf < 1 or a < 1 or t % nf:
        raise fail(f"q's T={t} tokens must split into kv's nF={nf} frames of N tokens each, over A={a} >= 1 audio "
                   "tokens; pass the whole chunk's q (every token, frame-major)")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (dh,) or not w.is_floating_point():
            raise fail(f"{name} must be a floating ({dh},) = (Dh,) tensor for heads={hh}, got {w.dtype} "
                       f"{tuple(w.shape)}")
    for name, x in (("kv", kv), ("q_weight", q_weight), ("k_weight", k_weight)):
        if x.device != q.device:
            raise fail(f"{name} is on {x.device}, q on {q.device}; put all tensors on one device")
    return b, nf, t // nf, a, hh, dh


def cross_attention_fp8_ref(q: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                            eps: float, *, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Readable reference, float32 math: (e4m3 values (B, T, Hh*Dh), float32 scales (B, T, 1))."""
    b, nf, n, a, hh, dh = _check(q, kv, q_weight, k_weight, heads)
    qn = rms_norm_ref(q.reshape(b, nf, n, hh, dh), q_weight, eps, out_dtype=torch.float32)  # (B, nF, N, Hh, Dh)
    kv = kv.reshape(b, nf, a, 2, hh, dh)  # (B, nF, A, 2, Hh, Dh)
    kn = rms_norm_ref(kv[:, :, :, 0], k_weight, eps, out_dtype=torch.float32)  # (B, nF, A, Hh, Dh)
    v = kv[:, :, :, 1].float()  # (B, nF, A, Hh, Dh)
    scores = torch.einsum("bfnhd,bfahd->bfhna", qn, kn) / math.sqrt(dh)  # (B, nF, Hh, N, A)
    out = torch.einsum("bfhna,bfahd->bfnhd", scores.softmax(dim=-1), v)  # (B, nF, N, Hh, Dh)
    scale = v.abs().amax(dim=(2, 3, 4)).clamp_min(_TINY) / FP8_MAX  # (B, nF): the frame's bound
    data = (out / scale[:, :, None, None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # (B, nF, N, Hh, Dh)
    return data.reshape(b, nf * n, hh * dh), scale[:, :, None, None].expand(b, nf, n, 1).reshape(b, nf * n, 1)


def _frame_scale_kernel(
    kv_ptr, s_ptr,  # kv (B, nF, A, 2*W); the frames' scales (B*nF,)
    s_kb, s_kf, s_ka, NF,
    A: tl.constexpr, W: tl.constexpr,  # audio tokens, Hh*Dh
    BLOCK: tl.constexpr,
):  # fmt: skip
    bf = tl.program_id(0)  # b * NF + f
    v_rows = kv_ptr + (bf // NF).to(tl.int64) * s_kb + (bf % NF).to(tl.int64) * s_kf + W  # V: each row's 2nd half
    d0 = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for a in range(A):
        for start in range(0, W, BLOCK):
            d = start + d0
            amax = tl.maximum(amax, tl.abs(tl.load(v_rows + a * s_ka + d, mask=d < W, other=0.0).to(tl.float32)))
    tl.store(s_ptr + bf, tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0)


def _cross_attention_kernel(
    q_ptr, kv_ptr, qw_ptr, kw_ptr, fs_ptr,  # q (B, T, Hh*Dh), kv (B, nF, A, 2*Hh*Dh), weights (Dh,), scales (B*nF,)
    o_ptr, s_ptr,  # outputs: e4m3 (B, T, Hh*Dh), scales (B, T), contiguous
    N, NF, A, s_qb, s_qt, s_kb, s_kf, s_ka,
    eps, sm_scale_log2,  # log2(e) / sqrt(Dh)
    HH: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM (padding lanes load zeros)
    BLOCK_A: tl.constexpr,  # next power of two >= max(A, 16): tl.dot's smallest tile
    BLOCK_T: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    pid_t, h, bf = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b = (bf // NF).to(tl.int64)
    f = (bf % NF).to(tl.int64)
    n = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,) token within the frame
    t_ok = n < N
    t = f * N + n.to(tl.int64)  # (BLOCK_T,) token within the chunk
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    a = tl.arange(0, BLOCK_A)
    a_ok = a < A
    col = h * HEAD_DIM + d  # (BLOCK_D,) this head's lanes of a row
    q = tl.load(q_ptr + b * s_qb + t[:, None] * s_qt + col[None, :], mask=t_ok[:, None] & d_ok[None, :],
                other=0.0).to(tl.float32)  # (BLOCK_T, BLOCK_D)
    qw = tl.load(qw_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=1) / HEAD_DIM + eps)[:, None] * qw[None, :]
    kv_rows = kv_ptr + b * s_kb + f * s_kf + a.to(tl.int64) * s_ka  # (BLOCK_A,)
    k = tl.load(kv_rows[:, None] + col[None, :], mask=a_ok[:, None] & d_ok[None, :],
                other=0.0).to(tl.float32)  # (BLOCK_A, BLOCK_D)
    kw = tl.load(kw_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) / HEAD_DIM + eps)[:, None] * kw[None, :]
    v = tl.load(kv_rows[:, None] + HH * HEAD_DIM + col[None, :], mask=a_ok[:, None] & d_ok[None, :],
                other=0.0).to(tl.float32)  # (BLOCK_A, BLOCK_D)
    s = tl.dot(q, tl.trans(k)) * sm_scale_log2  # (BLOCK_T, BLOCK_A), log2 units
    s = tl.where(a_ok[None, :], s, float("-inf"))
    p = tl.math.exp2(s - tl.max(s, axis=1)[:, None])
    o = tl.dot(p, v) / tl.sum(p, axis=1)[:, None]  # (BLOCK_T, BLOCK_D)
    fs = tl.load(fs_ptr + bf)
    rows = (b * NF * N + t) * (HH * HEAD_DIM)  # (BLOCK_T,)
    tl.store(o_ptr + rows[:, None] + col[None, :], to_e4m3(o * (1.0 / fs), INTERPRET),
             mask=t_ok[:, None] & d_ok[None, :])
    if h == 0:
        tl.store(s_ptr + b * NF * N + t, tl.zeros([BLOCK_T], tl.float32) + fs, mask=t_ok)


def cross_attention_fp8_triton(q: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                               eps: float, *, heads: int, block_t: int = BLOCK_T, num_warps: int = NUM_WARPS
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The frames' scales, then the attention over a (cdiv(N, block_t), Hh, B*nF) grid. Same results as
    `cross_attention_fp8_ref` up to the GEMMs' tf32 rounding on the GPU (an e4m3 value may then move by one step
    where it sits at a rounding boundary; exact in float32 under the interpreter). No host syncs: capturable."""
    b, nf, n, a, hh, dh = _check(q, kv, q_weight, k_weight, heads)

    def fail(msg: str) -> ValueError:
        return ValueError(f"cross_attention_fp8_triton: {msg}")

    if a > MAX_AUDIO_TOKENS or dh > MAX_HEAD_DIM:
        raise fail(f"A={a} audio tokens and Dh={dh} must be at most {MAX_AUDIO_TOKENS} and {MAX_HEAD_DIM} (one "
                   "register tile each); use cross_attention_fp8_ref for larger ones")
    if block_t < 16 or block_t & (block_t - 1):
        raise fail(f"block_t={block_t} must be a power of two >= 16")
    if b * nf > 65535 or hh > 65535:
        raise fail(f"B*nF={b * nf} frames and Hh={hh} heads must each be at most 65535 (the grid's limit)")
    check_triton_mode("cross_attention_fp8_triton")
    if not q.is_cuda and not interpreter_enabled():
        raise fail(f"tensors are on {q.device}; the kernels need CUDA tensors, or TRITON_INTERPRET=1 for CPU "
                   "tensors; use cross_attention_fp8_ref on a CPU")
    width = hh * dh
    frame_scale = torch.empty(b * nf, device=q.device, dtype=torch.float32)  # (B*nF,)
    data = torch.empty(b, nf * n, width, device=q.device, dtype=FP8)  # (B, T, Hh*Dh)
    scale = torch.empty(b, nf * n, 1, device=q.device, dtype=torch.float32)  # (B, T, 1)
    guard = torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext()
    with guard:
        jit_for_current_mode(_frame_scale_kernel)[(b * nf,)](
            kv, frame_scale, kv.stride(0), kv.stride(1), kv.stride(2), nf,
            A=a, W=width, BLOCK=min(1024, next_power_of_2(width)),
        )  # fmt: skip
        jit_for_current_mode(_cross_attention_kernel)[(-(-n // block_t), hh, b * nf)](
            q, kv, q_weight, k_weight, frame_scale, data, scale,
            n, nf, a, q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2),
            float(eps), math.log2(math.e) / math.sqrt(dh),
            HH=hh, HEAD_DIM=dh, BLOCK_D=max(16, next_power_of_2(dh)), BLOCK_A=max(16, next_power_of_2(a)),
            BLOCK_T=block_t, INTERPRET=interpreter_enabled(), num_warps=num_warps,
        )  # fmt: skip
    return data, scale


def cross_attention_fp8(q: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                        eps: float, *, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernels where they run (CUDA tensors, or any under TRITON_INTERPRET=1), else the reference."""
    if HAS_TRITON and (q.is_cuda or interpreter_enabled()):
        return cross_attention_fp8_triton(q, kv, q_weight, k_weight, eps, heads=heads)
    return cross_attention_fp8_ref(q, kv, q_weight, k_weight, eps, heads=heads)
