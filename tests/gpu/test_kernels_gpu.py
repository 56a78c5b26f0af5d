"""Kernels on a CUDA GPU: the qkv_prep Triton kernel vs its reference (bf16 first), CUDA-graph capture with a
changing slot, every attention backend vs `attention_ref`, and the VAE decoder's fused norm + SiLU, bias add and
up-sampling kernels vs their references at its real shapes. Run on the GPU machine: `pytest -m gpu tests/gpu`.

Nothing here touches CUDA at import or collection time, so CPU CI can collect and deselect by marker.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    QKVPrepBackend,
    attention,
    attention_ref,
    available_backends,
    pick_backend,
    qkv_prep,
    qkv_prep_ref,
    qkv_prep_triton,
)
from kernels.testing import make_qkv_prep_inputs, rel_err

pytestmark = pytest.mark.gpu

EPS = 1e-6
REL_TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}

QKV_CASES = [
    # (B, T, Hh, Dh, S, offset, tensor offset, qkv dtype, cache dtype): the 57b rank-local chunk (TP=4) first
    (1, 2992, 18, 128, 5 * 2992, 4 * 2992, True, torch.bfloat16, torch.bfloat16),
    (1, 2992, 18, 128, 5 * 2992, 0, False, torch.bfloat16, torch.bfloat16),
    (1, 1, 3, 48, 16, 15, True, torch.bfloat16, torch.bfloat16),
    (2, 187, 4, 64, 400, 100, False, torch.bfloat16, torch.bfloat16),
    (1, 187, 12, 128, 1000, 513, True, torch.float16, torch.float16),
    (1, 33, 4, 64, 100, 50, False, torch.float32, torch.bfloat16),
    (1, 17, 1, 48, 64, 30, True, torch.float32, torch.float32),
]


@pytest.mark.parametrize(("b", "t", "hh", "dh", "s", "offset", "as_tensor", "dtype", "cache_dtype"), QKV_CASES)
def test_triton_matches_reference_cuda(
    b: int,
    t: int,
    hh: int,
    dh: int,
    s: int,
    offset: int,
    as_tensor: bool,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
) -> None:
    gen = torch.Generator(device="cuda").manual_seed(t * hh + dh)
    inp = make_qkv_prep_inputs(b, t, hh, dh, s, dtype, cache_dtype, device="cuda", pad=8, generator=gen)
    kc_before, vc_before = inp.clone_caches()
    kc_ref, vc_ref = inp.clone_caches()
    args = (inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin)
    q_ref = qkv_prep_ref(*args, kc_ref, vc_ref, offset, EPS)
    out = torch.full((b, hh, t, dh), float("nan"), dtype=dtype, device="cuda")  # poisoned
    off: int | torch.Tensor = torch.tensor(offset, device="cuda") if as_tensor else offset
    q = qkv_prep_triton(*args, inp.k_cache, inp.v_cache, off, EPS, out=out)
    torch.cuda.synchronize()

    assert not q.isnan().any()
    assert rel_err(q, q_ref) < REL_TOL[dtype]
    end = offset + t
    assert rel_err(inp.k_cache[:, :, offset:end], kc_ref[:, :, offset:end]) < REL_TOL[cache_dtype]
    assert torch.equal(inp.v_cache, vc_ref)  # v: a cast only (round to nearest even on both sides), exact
    assert torch.equal(inp.k_cache[:, :, :offset], kc_before[:, :, :offset])
    assert torch.equal(inp.k_cache[:, :, end:], kc_before[:, :, end:])
    assert torch.equal(inp.v_cache[:, :, :offset], vc_before[:, :, :offset])


def test_auto_backend_is_triton_on_cuda() -> None:
    inp = make_qkv_prep_inputs(1, 8, 2, 64, 16, torch.bfloat16, device="cuda")
    args = (inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin)
    kc_ref, vc_ref = inp.clone_caches()
    q_ref = qkv_prep_ref(*args, kc_ref, vc_ref, 4, EPS)
    q = qkv_prep(*args, inp.k_cache, inp.v_cache, 4, EPS)
    assert rel_err(q, q_ref) < REL_TOL[torch.bfloat16] and torch.equal(inp.v_cache, vc_ref)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_graph_replays_write_the_current_slot(backend: QKVPrepBackend) -> None:
    """Captured once with an offset tensor; each replay writes the slot the tensor holds at replay time."""
    t, s = 64, 256
    inp = make_qkv_prep_inputs(1, t, 4, 128, s, torch.bfloat16, device="cuda")
    args = (inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin, inp.k_cache, inp.v_cache)
    slot = torch.zeros((), dtype=torch.long, device="cuda")
    out = torch.empty(1, 4, t, 128, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (JIT compile) outside the capture
        qkv_prep(*args, slot, EPS, backend, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qkv_prep(*args, slot, EPS, backend, out=out)

    kc_ref, vc_ref = inp.clone_caches()
    for value in (3 * t, 0, t + 5):
        slot.fill_(value)
        graph.replay()
        q_ref = qkv_prep_ref(inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin, kc_ref, vc_ref, value, EPS)
        torch.cuda.synchronize()
        assert rel_err(out, q_ref) < REL_TOL[torch.bfloat16]
    assert rel_err(inp.k_cache, kc_ref) < REL_TOL[torch.bfloat16]
    assert torch.equal(inp.v_cache, vc_ref)


ATTN_SHAPES = [
    # (B, Hh, Tq, S, S_max, Dh): the 57b chunk over reference + 3 past + current frames (TP=4), then odd ones
    (1, 18, 2992, 5 * 2992, 5 * 2992, 128),
    (1, 18, 2992, 3 * 2992, 5 * 2992, 128),
    (1, 3, 1, 37, 64, 64),
    (2, 4, 187, 401, 512, 48),
]


def _attention_inputs(
    b: int, hh: int, tq: int, s: int, s_max: int, dh: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(tq + s)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    q = randn(b, hh, tq, dh)  # (B, Hh, Tq, Dh)
    return q, randn(b, hh, s_max, dh)[:, :, :s], randn(b, hh, s_max, dh)[:, :, :s]  # (B, Hh, S, Dh) prefix views


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize(("b", "hh", "tq", "s", "s_max", "dh"), ATTN_SHAPES)
def test_attention_backend_matches_reference_cuda(
    backend: AttentionBackend, dtype: torch.dtype, b: int, hh: int, tq: int, s: int, s_max: int, dh: int
) -> None:
    if backend not in available_backends("cuda", dtype):
        pytest.skip(f"{backend} is not available here for {dtype} (optional package or architecture)")
    q, k, v = _attention_inputs(b, hh, tq, s, s_max, dh, dtype)
    out = attention(q, k, v, backend)
    ref = attention_ref(q, k, v)
    assert out.shape == (b, hh, tq, dh) and out.dtype == dtype
    assert rel_err(out, ref) < 1e-2


def test_attention_float32_backends_cuda() -> None:
    q, k, v = _attention_inputs(1, 3, 29, 100, 128, 64, torch.float32)
    ref = attention_ref(q, k, v)
    for backend in available_backends("cuda", torch.float32):
        assert rel_err(attention(q, k, v, backend), ref) < 2e-3, backend  # tf32 matmuls allowed


def test_pick_backend_cuda_returns_a_working_backend() -> None:
    q, k, v = _attention_inputs(1, 18, 2992, 5 * 2992, 5 * 2992, 128, torch.bfloat16)
    best = pick_backend(q, k, v, iters=5)
    assert best in available_backends("cuda", torch.bfloat16)
    assert rel_err(attention(q, k, v, best), attention_ref(q, k, v)) < 1e-2
    assert pick_backend(q, k, v, candidates=["sdpa_math"], iters=2) == "sdpa_math"


def test_attention_scale_cuda() -> None:
    q, k, v = _attention_inputs(1, 2, 16, 40, 64, 64, torch.bfloat16)
    scale = 0.5 / math.sqrt(64)
    assert rel_err(attention(q, k, v, "sdpa", scale=scale), attention_ref(q, k, v, scale=scale)) < 1e-2


@pytest.mark.parametrize(("c", "t", "h", "w", "past", "residual"),
                         [(96, 4, 88, 136, 2, False), (384, 1, 11, 17, 2, True), (192, 4, 44, 68, 0, True)])
def test_norm_silu_matches_reference_cuda(c: int, t: int, h: int, w: int, past: int, residual: bool) -> None:
    from kernels.norm_silu import norm_silu, norm_silu_ref

    g = torch.Generator(device="cuda").manual_seed(c)
    cl = torch.channels_last_3d
    x = torch.randn(1, c, t, h, w, device="cuda", generator=g).bfloat16().contiguous(memory_format=cl)
    res = torch.randn_like(x) if residual else None
    weight = 1 + 0.3 * torch.randn(c, device="cuda", generator=g)
    window = torch.full((1, c, past + t, h, w), float("nan"), device="cuda", dtype=torch.bfloat16)
    window = window.contiguous(memory_format=cl)
    ref = norm_silu_ref(x, weight, 1e-6, residual=res)
    norm_silu(x, weight, 1e-6, out=window[:, :, past:], residual=res)
    assert window[:, :, :past].isnan().all() and not window[:, :, past:].isnan().any()
    assert rel_err(window[:, :, past:], ref) < REL_TOL[torch.bfloat16]


NORM_TILING_SHAPES = [
    # (c, T, h, w): the 57b decoder's stages at 704x1088 (full resolution with 2 of its 4 frames), then odd widths
    (96, 2, 704, 1088),
    (192, 4, 352, 544),
    (384, 2, 176, 272),
    (384, 1, 88, 136),
    (40, 2, 33, 47),
    (3, 1, 17, 9),
]


@pytest.mark.parametrize(("c", "t", "h", "w"), NORM_TILING_SHAPES)
def test_norm_silu_tiling_matches_reference_cuda(c: int, t: int, h: int, w: int) -> None:
    """The column-chunk tiling (96 = 3 x 32, 192 = 3 x 64, 384 = 3 x 128; one masked block for 40, 3) with a
    folded bias, a residual and the sum written over x in place, into a window's tail."""
    from kernels.norm_silu import norm_silu, norm_silu_ref

    g = torch.Generator(device="cuda").manual_seed(c + t)
    cl = torch.channels_last_3d
    x = torch.randn(1, c, t, h, w, device="cuda", generator=g).bfloat16().contiguous(memory_format=cl)
    res = torch.randn_like(x)
    weight = 1 + 0.3 * torch.randn(c, device="cuda", generator=g)
    bias = torch.randn(c, device="cuda", generator=g).bfloat16()
    window = torch.full((1, c, 2 + t, h, w), float("nan"), device="cuda", dtype=torch.bfloat16)
    window = window.contiguous(memory_format=cl)
    want_sum = x.clone()
    ref = norm_silu_ref(x, weight, 1e-6, residual=res, sum_out=want_sum, bias=bias)
    norm_silu(x, weight, 1e-6, out=window[:, :, 2:], residual=res, sum_out=x, bias=bias)
    torch.cuda.synchronize()
    assert window[:, :, :2].isnan().all() and not window[:, :, 2:].isnan().any()
    assert rel_err(window[:, :, 2:], ref) < REL_TOL[torch.bfloat16]
    assert torch.equal(x, want_sum)  # a float32 sum rounded once to nearest even, on both sides


@pytest.mark.parametrize(("c", "t", "h", "w"), [(768, 2, 176, 272), (8, 4, 704, 1088), (96, 1, 704, 1088)])
def test_bias_add_matches_reference_cuda(c: int, t: int, h: int, w: int) -> None:
    """A time conv's 768-wide output (6 x 128), conv_out padded to 8 channels, a full-resolution residual add."""
    from kernels.norm_silu import bias_add, bias_add_ref

    g = torch.Generator(device="cuda").manual_seed(c)
    y = torch.randn(1, c, t, h, w, device="cuda", generator=g).bfloat16()
    y = y.contiguous(memory_format=torch.channels_last_3d)
    res, bias = torch.randn_like(y), torch.randn(c, device="cuda", generator=g).bfloat16()
    want = bias_add_ref(y, bias, res)
    assert bias_add(y, bias, res, out=y) is y and torch.equal(y, want)


UPSAMPLE_SHAPES = [
    # (c out, fold time, T, h, w, residual): the 57b decoder's three up-samplings at 704x1088, then odd ones
    (192, False, 4, 352, 544, True),
    (384, True, 2, 176, 272, False),
    (384, True, 1, 88, 136, False),
    (40, False, 3, 17, 23, True),
    (3, True, 2, 5, 7, False),
]


@pytest.mark.parametrize(("c", "fold", "t", "h", "w", "residual"), UPSAMPLE_SHAPES)
def test_upsample_matches_reference_cuda(c: int, fold: bool, t: int, h: int, w: int, residual: bool) -> None:
    """The fused add + (time fold) + 2x nearest up-sampling, bit for bit: one float32 sum, rounded once."""
    from kernels.upsample import upsample_nearest, upsample_nearest_ref

    g = torch.Generator(device="cuda").manual_seed(c + t)
    cx = 2 * c if fold else c
    x = torch.randn(1, cx, t, h, w, device="cuda", generator=g).bfloat16()
    x = x.contiguous(memory_format=torch.channels_last_3d)
    res = torch.randn_like(x) if residual else None
    bias = torch.randn(cx, device="cuda", generator=g).bfloat16()
    got = upsample_nearest(x, bias, res, fold_time=fold)
    want = upsample_nearest_ref(x, bias, res, fold_time=fold)
    torch.cuda.synchronize()
    assert got.shape == want.shape == (1, c, (2 if fold else 1) * t, 2 * h, 2 * w)
    assert got.is_contiguous(memory_format=torch.channels_last_3d)
    assert torch.equal(got, want)
