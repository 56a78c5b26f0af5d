"""Every rank's K/V rows into the KV cache in token order: `topology.local_attention`'s copy after its gather.

    blocks (n, 2, B, Hh, m, Dh)   rank c's m rows of K (index 0) and of V (1), every head, as gathered
    k, v   (B, Hh, S, Dh)         the layer's cache (rows of Dh contiguous), the blocks' dtype

Row i of rank c lands at key offset + c*m + i, for c*m + i < T (padding rows past T stay out); the rest of the
cache is left as it is. `offset` is a host int or a 0-dim int64 device tensor (CUDA-graph replays writing different
ring slots). The Triton kernel does both K and V of every rank in one launch, in place of 2n indexed copies; rows
move as 4-byte words where their bytes allow (e4m3's 128-byte rows: 32 words).

Public API:
    scatter_axis         the reference for one buffer along any axis (the Triton FP8 cache's three buffers)
    scatter_rows_ref     the readable reference (torch copies); the CPU path
    scatter_rows_triton  one Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1)
    scatter_rows         dispatch
"""

from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, check_triton_mode, interpreter_enabled, jit_for_current_mode, next_power_of_2

if HAS_TRITON:
    import triton.language as tl

__all__ = ["scatter_axis", "scatter_rows", "scatter_rows_ref", "scatter_rows_triton"]


def _check(blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: int) -> None:
    def fail(msg: str) -> ValueError:
        return ValueError(f"scatter_rows: {msg}")

    if blocks.ndim != 6 or blocks.shape[1] != 2:
        raise fail(f"blocks is {tuple(blocks.shape)}; expected (n, 2, B, Hh, m, Dh)")
    n, _, b, hh, m, dh = blocks.shape
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 4 or x.shape[:2] != (b, hh) or x.shape[3] != dh or x.dtype != blocks.dtype:
            raise fail(f"{name} is {x.dtype} {tuple(x.shape)}; expected {blocks.dtype} ({b}, {hh}, S, {dh})")
        if x.device != blocks.device:
            raise fail(f"{name} is on {x.device}, blocks on {blocks.device}")
    if not 0 < tokens <= n * m:
        raise fail(f"tokens={tokens} must be in [1, {n * m}] (n * m rows)")


def scatter_axis(dst: torch.Tensor, blocks: torch.Tensor, offset: int | torch.Tensor, tokens: int, axis: int) -> None:
    """The reference for one buffer of any layout: rank c's rows of `blocks` (n, ...dst's dims, with m along
    `axis`) into `dst` along `axis` at offset + c*m, the first min(m, tokens - c*m) of each (an indexed copy for a
    tensor offset). The Triton FP8 cache's V (transposed: keys last) and V scales go through it."""
    n, m = blocks.shape[0], blocks.shape[axis + 1]
    if dst.element_size() == 1:  # copied as bytes: index_copy_ has no FP8 kernels
        dst, blocks = dst.view(torch.uint8), blocks.view(torch.uint8)
    for c in range(n):
        count = min(m, tokens - c * m)
        if count <= 0:
            break
        src = blocks[c].narrow(axis, 0, count)
        if isinstance(offset, int):
            dst.narrow(axis, offset + c * m, count).copy_(src)
        else:
            rows = torch.arange(c * m, c * m + count, device=dst.device) + offset
            dst.index_copy_(axis, rows, src)


def scatter_rows_ref(blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int | torch.Tensor,
                     tokens: int) -> None:
    """Reference: K's and V's blocks, each along the keys (`scatter_axis`)."""
    _check(blocks, k, v, tokens)
    scatter_axis(k, blocks[:, 0], offset, tokens, axis=2)
    scatter_axis(v, blocks[:, 1], offset, tokens, axis=2)


def _scatter_rows_kernel(
    src_ptr,  # (n, 2, BH, m, W) words
    k_ptr,  # (BH, S, W) words, head stride `stride_h`, key stride `stride_s`
    v_ptr,  # the same layout
    offset_ptr,  # () int64 device offset (OFFSET_IS_PTR), else `offset_value`
    offset_value,
    tokens,
    rows,  # m
    heads,  # B * Hh
    stride_h,
    stride_s,
    W: tl.constexpr,  # words per row
    BLOCK_W: tl.constexpr,  # next power of two >= W
    BLOCK_M: tl.constexpr,
    OFFSET_IS_PTR: tl.constexpr,
):
    tiles = tl.cdiv(rows, BLOCK_M)
    pid = tl.program_id(0)  # rank c's row tile
    bh = tl.program_id(1)
    which = tl.program_id(2)  # 0: K, 1: V
    c = pid // tiles
    r = (pid % tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = c * rows + r
    cols = tl.arange(0, BLOCK_W)
    ok = ((r < rows) & (tok < tokens))[:, None] & (cols < W)[None, :]
    if OFFSET_IS_PTR:  # noqa: SIM108 (a compile-time branch of the kernel)
        off = tl.load(offset_ptr)
    else:
        off = offset_value
    src = src_ptr + (((c * 2 + which) * heads + bh) * rows + r[:, None]).to(tl.int64) * W + cols[None, :]
    x = tl.load(src, mask=ok)
    dst = bh.to(tl.int64) * stride_h + (off + tok)[:, None].to(tl.int64) * stride_s + cols[None, :]
    if which == 0:
        tl.store(k_ptr + dst, x, mask=ok)
    else:
        tl.store(v_ptr + dst, x, mask=ok)


def _words(x: torch.Tensor) -> torch.Tensor:
    """x with its last dim as 4-byte words where its bytes allow (else as it is)."""
    nbytes = x.shape[-1] * x.element_size()
    if nbytes % 4 == 0 and x.element_size() != 4:
        return x.view(torch.uint8).view(torch.int32) if x.element_size() == 1 else x.view(torch.int32)
    return x


def scatter_rows_triton(blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int | torch.Tensor,
                        tokens: int, *, block_m: int = 64) -> None:
    """One Triton kernel for both K and V and every rank. k and v must be laid out alike, with B and Hh
    flattenable (the cache's per-layer views are)."""
    check_triton_mode("scatter_rows_triton")
    _check(blocks, k, v, tokens)
    n, _, b, hh, m, _ = blocks.shape
    if k.stride() != v.stride() or k.stride(-1) != 1 or k.stride(0) != hh * k.stride(1) or not blocks.is_contiguous():
        raise ValueError(f"scatter_rows_triton: k {k.stride()} and v {v.stride()} must share a layout with contiguous "
                         "rows and flattenable (B, Hh); blocks must be contiguous")
    src, kw, vw = _words(blocks), _words(k), _words(v)
    w = kw.shape[-1]
    is_ptr = isinstance(offset, torch.Tensor)
    grid = (n * -(-m // block_m), b * hh, 2)
    jit_for_current_mode(_scatter_rows_kernel)[grid](
        src, kw, vw, offset if is_ptr else src, 0 if is_ptr else offset, tokens, m, b * hh, kw.stride(1),
        kw.stride(2), W=w, BLOCK_W=next_power_of_2(w), BLOCK_M=block_m, OFFSET_IS_PTR=is_ptr)


def scatter_rows(blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int | torch.Tensor,
                 tokens: int) -> None:
    """Dispatch: the Triton kernel on CUDA (and under the interpreter), else the reference."""
    if HAS_TRITON and (blocks.is_cuda or interpreter_enabled()):
        scatter_rows_triton(blocks, k, v, offset, tokens)
    else:
        scatter_rows_ref(blocks, k, v, offset, tokens)
