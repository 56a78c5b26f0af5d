"""FP8 on a CUDA GPU with FP8 tensor cores (the H200): the scaled GEMM, the quantising compiled elementwise steps,
the FP8 cache write and attention kernels against their references at the 57b rank's shapes, and the FP8 engine
(graph replay equals eager; no error growth along 100 chunks against bf16). `pytest -m gpu tests/gpu`.

Nothing here touches CUDA at import or collection time.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from characters.config import session_config
from characters.dit import CausalDiT, ElementwiseOps
from characters.engine import DiTRunner
from characters.weights import materialize_dit
from kernels.attention_cudnn_fp8 import attention_cudnn_fp8, attention_fp8_tensor_ref, cudnn_fp8_supported, padded_keys
from kernels.attention_fp8 import attention_fp8_ref, attention_fp8_triton
from kernels.fp8 import FP8, Fp8Act, dequantize_rows, fp8_linear, fp8_linear_ref, quantize_rows_ref, quantize_weight
from kernels.qkv_prep_fp8 import qkv_prep_fp8_ref, qkv_prep_fp8_triton, set_v_tensor_scale
from kernels.scatter_rows import scatter_rows_ref, scatter_rows_triton
from kernels.testing import make_qkv_prep_inputs, rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("m", "k", "n", "bias"), [(2992, 9216, 6912, True), (2992, 2304, 9216, False),
                                                    (187, 192, 768, True), (17, 64, 48, True)])
def test_scaled_mm_matches_reference(m: int, k: int, n: int, bias: bool) -> None:
    g = torch.Generator(device="cuda").manual_seed(m + n)
    x = quantize_rows_ref(torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16))
    w8, sw = quantize_weight(torch.randn(n, k, device="cuda", generator=g) / k**0.5)
    b = torch.randn(n, device="cuda", generator=g, dtype=torch.bfloat16) if bias else None
    y = fp8_linear(x.data, x.scale, w8, sw, b)
    ref = fp8_linear_ref(x.data, x.scale, w8, sw, b, torch.float32)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert rel_err(y, ref) < 1e-2  # the same quantised operands: only accumulation and the bf16 output differ


def test_scaled_mm_writes_its_rows_into_a_padded_buffer() -> None:
    """`out=`: the GEMM writes the first T rows of a buffer padded past them (a row layer under sequence
    parallelism when the ranks do not divide T), equal to the plain call, the padding untouched, in a graph too."""
    x = quantize_rows_ref(torch.randn(1, 997, 512, device="cuda", dtype=torch.bfloat16))
    w8, sw = quantize_weight(torch.randn(256, 512, device="cuda") / 512**0.5)
    b = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    buf = torch.full((1, 999, 256), 7.0, device="cuda", dtype=torch.bfloat16)
    y = fp8_linear(x.data, x.scale, w8, sw, b, out=buf[:, :997])
    assert y.data_ptr() == buf.data_ptr() and y.shape == (1, 997, 256)
    assert torch.equal(buf[:, :997], fp8_linear(x.data, x.scale, w8, sw, b))
    assert torch.all(buf[:, 997:] == 7.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_linear(x.data, x.scale, w8, sw, b, out=buf[:, :997])
    buf.zero_()
    graph.replay()
    assert torch.equal(buf[:, :997], fp8_linear(x.data, x.scale, w8, sw, b)) and not buf[:, 997:].any()
    with pytest.raises(ValueError, match="out is"):
        fp8_linear(x.data, x.scale, w8, sw, b, out=buf[:, :997, :128])


def test_scaled_mm_replays_in_a_graph() -> None:
    x = quantize_rows_ref(torch.randn(64, 256, device="cuda"))
    w8, sw = quantize_weight(torch.randn(128, 256, device="cuda"))
    out = fp8_linear(x.data, x.scale, w8, sw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8_linear(x.data, x.scale, w8, sw)
    x.data.copy_(quantize_rows_ref(torch.randn(64, 256, device="cuda")).data)
    graph.replay()
    assert not torch.equal(captured, out)
    assert rel_err(captured, fp8_linear_ref(x.data, x.scale, w8, sw, None, torch.float32)) < 1e-2


@pytest.mark.parametrize("rows", [False, True])
def test_compiled_quantising_steps_match_plain(rows: bool) -> None:
    """Inductor's fused steps, and the single-pass row kernels (`kernels.row_quant`, the default with Triton)."""
    fused, plain = ElementwiseOps(True, fp8=True, row_kernels=rows), ElementwiseOps(False, fp8=True)
    assert fused.row_kernels == rows
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 748, 9216, device="cuda", generator=g, dtype=torch.bfloat16)
    shift, scale = (0.1 * torch.randn(1, 1, 9216, device="cuda", generator=g, dtype=torch.bfloat16) for _ in "ab")
    a, b = fused.modulate(x, shift, scale, 1e-6), plain.modulate(x, shift, scale, 1e-6)
    assert a.data.dtype == FP8 and a.scale.shape == (1, 748, 1)
    assert rel_err(dequantize_rows(a), dequantize_rows(b)) < 2e-2
    y = torch.randn(1, 2992, 6144, device="cuda", generator=g, dtype=torch.bfloat16)
    assert rel_err(dequantize_rows(fused.gelu(y)), dequantize_rows(plain.gelu(y))) < 2e-2
    r = torch.randn(1, 748, 9216, device="cuda", generator=g, dtype=torch.bfloat16)
    mod = 0.1 * torch.randn(1, 1, 6, 9216, device="cuda", generator=g, dtype=torch.bfloat16)  # views, as a block's
    w = (1 + 0.1 * torch.randn(9216, device="cuda", generator=g)).bfloat16()  # the model's norm, in its dtype
    bias = (0.1 * torch.randn(9216, device="cuda", generator=g)).bfloat16()
    (xa, ha), (xb, hb) = (ops.gated_add_norm(x, r, mod[:, :, 2], w, bias, 1e-6) for ops in (fused, plain))
    # the new residual: a float32 sum rounded once against eager's bf16 steps (gate * y rounded first): within
    # a bf16 step of the operands (2^-7 at |x| ~ 1), even where the sum cancels to ~0
    torch.testing.assert_close(xa, xb, rtol=1.6e-2, atol=1e-2)
    assert rel_err(dequantize_rows(ha), dequantize_rows(hb)) < 2e-2
    (xa, ha), (xb, hb) = (ops.add_modulate(x, r, mod[:, :, 3], mod[:, :, 4], 1e-6) for ops in (fused, plain))
    torch.testing.assert_close(xa, xb, rtol=1.6e-2, atol=1e-2)
    assert rel_err(dequantize_rows(ha), dequantize_rows(hb)) < 2e-2
    (xa, ha), (xb, hb) = (ops.gated_add_modulate(x, r, mod[:, :, 5], mod[:, :, 0], mod[:, :, 1], 1e-6)
                          for ops in (fused, plain))
    torch.testing.assert_close(xa, xb, rtol=1.6e-2, atol=1e-2)
    assert rel_err(dequantize_rows(ha), dequantize_rows(hb)) < 2e-2


@pytest.mark.parametrize("mode", ["modulate", "add_modulate", "gated_add_norm", "gelu", "gated_add_modulate"])
@pytest.mark.parametrize(("t", "d", "per_token"), [(998, 9216, False), (2992, 8192, False), (998, 24576, False),
                                                   (187, 192, True)])
def test_row_quant_kernel_matches_reference(mode: str, t: int, d: int, per_token: bool) -> None:
    """`kernels.row_quant` at the 57b TP3 rank's shapes (998 rows of 9216; the GELU over 2992 x 8192, and over 998 x
    24576 with `topology.local_layers`) and tiny's:
    the new residual exact (both round a float32 sum once), the e4m3 codes equal but where float32 reduction order
    moves a value across a rounding boundary, scales within float32 rounding."""
    from kernels.row_quant import row_quant_ref, row_quant_triton

    g = torch.Generator(device="cuda").manual_seed(t + d)
    x, y = (torch.randn(1, t, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in "xy")
    mod = torch.randn(1, t if per_token else 1, 6, d, device="cuda", generator=g, dtype=torch.bfloat16)
    w, b = torch.randn(d, device="cuda", generator=g), torch.randn(d, device="cuda", generator=g)
    kw = {"modulate": {"shift": mod[:, :, 0], "scale": mod[:, :, 1]},
          "add_modulate": {"y": y, "shift": mod[:, :, 0], "scale": mod[:, :, 1]},
          "gated_add_norm": {"y": y, "gate": mod[:, :, 2], "weight": w, "bias": b}, "gelu": {},
          "gated_add_modulate": {"y": y, "gate": mod[:, :, 5], "shift": mod[:, :, 0], "scale": mod[:, :, 1]}}[mode]
    ref, got = row_quant_ref(mode, x, **kw), row_quant_triton(mode, x, **kw)  # type: ignore[arg-type]
    if ref[0] is not None:
        assert got[0] is not None and torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=0)
    assert (got[1].float() != ref[1].float()).float().mean() < 1e-3
    assert rel_err(dequantize_rows(Fp8Act(*got[1:])), dequantize_rows(Fp8Act(*ref[1:]))) < 1e-3


@pytest.mark.parametrize(("b", "nf", "n", "a", "hh", "dh"), [(1, 1, 2992, 8, 24, 128), (1, 1, 2992, 8, 18, 128),
                                                         (1, 3, 187, 8, 4, 48), (2, 2, 70, 5, 3, 64)])
def test_cross_attention_fp8_kernel_matches_reference(b: int, nf: int, n: int, a: int, hh: int, dh: int) -> None:
    """`kernels.cross_attention_fp8` at the 57b TP3/TP4 rank's shapes and tiny's: scales exact (the frame's max|v|),
    values to the GEMMs' tf32 rounding (a code moves by one step at a rounding boundary)."""
    from kernels.cross_attention_fp8 import cross_attention_fp8_ref, cross_attention_fp8_triton

    g = torch.Generator(device="cuda").manual_seed(n + hh)
    q = torch.randn(b, nf * n, hh * dh, device="cuda", generator=g, dtype=torch.bfloat16)
    kv = torch.randn(b, nf, a, 2 * hh * dh, device="cuda", generator=g, dtype=torch.bfloat16)
    qw, kw = (1 + 0.1 * torch.randn(dh, device="cuda", generator=g) for _ in "qk")
    ref, got = (f(q, kv, qw, kw, 1e-6, heads=hh) for f in (cross_attention_fp8_ref, cross_attention_fp8_triton))
    assert got[0].shape == ref[0].shape and got[1].shape == (b, nf * n, 1)
    assert torch.equal(got[1], ref[1])
    assert (got[0].view(torch.uint8) != ref[0].view(torch.uint8)).float().mean() < 2e-2
    assert rel_err(dequantize_rows(Fp8Act(*got)), dequantize_rows(Fp8Act(*ref))) < 1e-2


def _fp8_cache(b: int, hh: int, s: int, dh: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(3)
    k8 = torch.randn(b, hh, s, dh, device="cuda", generator=g).to(FP8)
    vt8 = torch.randn(b, hh, dh, s, device="cuda", generator=g).to(FP8)
    return k8, vt8, torch.rand(b, hh, s, device="cuda", generator=g) + 0.01, torch.zeros(2, device="cuda")


@pytest.mark.parametrize(("t", "hh", "s", "offset"), [(2992, 18, 14960, 11968), (2992, 24, 14960, 2992),
                                                      (187, 4, 935, 374)])
def test_qkv_prep_fp8_kernel_matches_reference(t: int, hh: int, s: int, offset: int) -> None:
    inp = make_qkv_prep_inputs(1, t, hh, 128 if hh > 4 else 64, s, torch.bfloat16, device="cuda", pad=8,
                               generator=torch.Generator(device="cuda").manual_seed(t))
    args = (inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin)
    dh = inp.qkv.shape[-1]
    got, ref = _fp8_cache(1, hh, s, dh), _fp8_cache(1, hh, s, dh)
    q = qkv_prep_fp8_triton(*args, *got, torch.tensor(offset, device="cuda"), 1e-6)
    q_ref = qkv_prep_fp8_ref(*args, *ref, offset, 1e-6)
    torch.testing.assert_close(got[3], ref[3])  # the static q / k scales
    assert rel_err(q.float(), q_ref.float()) < 1e-2  # GPU rsqrt / division: a rounding flip here and there
    end = offset + t
    assert rel_err(got[0][:, :, offset:end].float(), ref[0][:, :, offset:end].float()) < 1e-2
    assert rel_err(got[1][..., offset:end].float() * got[2][:, :, None, offset:end],
                   ref[1][..., offset:end].float() * ref[2][:, :, None, offset:end]) < 1e-2
    for i in (0, 1):  # outside the written slots: untouched
        other = torch.ones(s, dtype=torch.bool, device="cuda")
        other[offset:end] = False
        sl = (slice(None), slice(None), other) if i == 0 else (slice(None), slice(None), slice(None), other)
        assert torch.equal(got[i][sl].view(torch.uint8), ref[i][sl].view(torch.uint8))


def _attention_inputs(hh: int, tq: int, s: int, dh: int = 128) -> tuple[torch.Tensor, ...]:
    inp = make_qkv_prep_inputs(1, tq, hh, dh, s, torch.bfloat16, device="cuda",
                               generator=torch.Generator(device="cuda").manual_seed(hh))
    k8, vt8, vs, qks = _fp8_cache(1, hh, s, dh)
    q8 = qkv_prep_fp8_ref(inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin, k8, vt8, vs, qks, s - tq, 1e-6)
    return q8, k8, vt8, vs, qks


@pytest.mark.parametrize(("hh", "tq", "s"), [(18, 2992, 14960), (24, 2992, 8976), (4, 187, 935), (2, 100, 128)])
def test_attention_fp8_kernel_matches_reference(hh: int, tq: int, s: int) -> None:
    q8, k8, vt8, vs, qks = _attention_inputs(hh, tq, s)
    out = torch.full((1, tq, hh, 128), float("nan"), device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    got = attention_fp8_triton(q8, k8, vt8, vs, qks, out=out)
    assert got is out and not out.isnan().any()
    heads = slice(0, min(hh, 4))
    ref = attention_fp8_ref(q8[:, heads], k8[:, heads], vt8[:, heads], vs[:, heads], qks, torch.float32)
    assert rel_err(out[:, heads], ref) < 4e-2  # P in e4m3: ~2.5% on random data, where every key counts alike
    if s % 16 == 0:  # K and V^T by TMA descriptors: the same arithmetic
        assert rel_err(attention_fp8_triton(q8, k8, vt8, vs, qks, tma=True), attention_fp8_triton(
            q8, k8, vt8, vs, qks, tma=False)) < 1e-3


@pytest.mark.parametrize(("hh", "tq", "valid"), [(24, 2992, 14960), (18, 2992, 8976), (3, 187, 935)])
def test_cudnn_fp8_attention_matches_reference(hh: int, tq: int, valid: int) -> None:
    """cuDNN's FP8 attention over the per-tensor cache form, written by the Triton cache write (`v_layout="tensor"`,
    its V scale set by that write), at the 57b TP3 / TP4 rank's shapes: against the float32 reference, keys past
    `valid` (up to the padded 64-multiple it reads) never counted, and replayed from a CUDA graph."""
    _needs_cudnn()
    s = padded_keys(valid) + 64
    inp = make_qkv_prep_inputs(1, tq, hh, 128, s, torch.bfloat16, device="cuda",
                               generator=torch.Generator(device="cuda").manual_seed(hh))
    g = torch.Generator(device="cuda").manual_seed(7)
    k8 = (4 * torch.randn(1, hh, s, 128, device="cuda", generator=g)).to(FP8)  # the older keys of the cache
    v8 = (40 * torch.randn(1, hh, s, 128, device="cuda", generator=g)).to(FP8)
    vs, qks = torch.zeros(1, device="cuda"), torch.ones(2, device="cuda")
    set_v_tensor_scale(vs, inp.qkv)
    q8 = qkv_prep_fp8_triton(inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin, k8, v8, vs, qks, valid - tq, 1e-6,
                             v_layout="tensor")
    out = torch.empty(1, tq, hh, 128, device="cuda", dtype=FP8).transpose(1, 2)  # token-major
    got = attention_cudnn_fp8(q8, k8, v8, valid, qks, vs, out)
    assert got is out
    heads = slice(0, min(hh, 4))
    ref = torch.empty(1, heads.stop, tq, 128, device="cuda", dtype=FP8)
    attention_fp8_tensor_ref(q8[:, heads], k8[:, heads], v8[:, heads], valid, qks, vs, ref)
    assert rel_err(out[:, heads].float(), ref.float()) < 6e-2  # P and the output in e4m3: ~4% on random data
    k8[:, :, valid:] = torch.full_like(k8[:, :, valid:], 400.0)  # past `valid`: masked, however large
    v8[:, :, valid:] = torch.full_like(v8[:, :, valid:], 400.0)
    again = attention_cudnn_fp8(q8, k8, v8, valid, qks, vs, torch.empty_like(out))
    assert torch.equal(again.view(torch.uint8), out.view(torch.uint8))
    graph_out = torch.empty_like(out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attention_cudnn_fp8(q8, k8, v8, valid, qks, vs, graph_out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out.view(torch.uint8), out.view(torch.uint8))


def test_attention_fp8_kernel_is_exact_where_p_is_representable() -> None:
    """q = 0: every key weighs the same (p = 1) and with equal V scales P's e4m3 cast is exact, so the kernel
    must equal the reference up to the FP8 tensor cores' accumulation (1e-3 where P rounding alone costs 2.5%):
    this checks the V path, the scales, the mask and the sums."""
    q8, k8, vt8, vs, qks = _attention_inputs(3, 200, 1000)
    q8.view(torch.uint8).zero_()
    vs.fill_(0.37)
    out = attention_fp8_triton(q8, k8, vt8, vs, qks, torch.float32)
    assert rel_err(out, attention_fp8_ref(q8, k8, vt8, vs, qks, torch.float32)) < 1e-3


def _tiny(precision: str, attention: str, heads: int | None = None) -> DiTRunner:
    model: dict[str, object] = {"precision": precision, "attention_precision": attention}
    if heads:
        model["dit"] = {"num_heads": heads}
    if attention == "fp8-cudnn":  # cuDNN's FP8 attention takes head_dim 64 or 128: tiny with 3 heads of 64
        _needs_cudnn()
        model.update(attention_precision="fp8", attention_fp8_kernel="cudnn", dit={"num_heads": 3})
    cfg = session_config("tiny", "gpu1", seed=2, dtype="bfloat16", weights="random", model=model)
    return DiTRunner(cfg, device="cuda")


def _needs_cudnn() -> None:
    pytest.importorskip("cudnn", reason="the optional `cudnn` extra (nvidia-cudnn-frontend) is not installed")
    if not cudnn_fp8_supported("cuda", 128):
        pytest.skip("cuDNN's FP8 attention with an FP8 output runs on Hopper (compute capability 9.0)")


def _session(runner: DiTRunner, graphs: bool, chunks: int) -> list[torch.Tensor]:
    if graphs:
        runner.capture_graphs()
    h, w = runner.cfg.model.latent_hw
    ref = torch.randn(1, runner.cfg.model.dit.latent_channels, h, w, generator=torch.Generator().manual_seed(1))
    runner.start(ref.cuda(), seed=5)
    rng = np.random.default_rng(0)
    return [runner.step(rng.uniform(-0.5, 0.5, runner.frontend.expected_samples).astype(np.float32))
            for _ in range(chunks)]


@pytest.mark.parametrize("attention", ["bf16", "fp8", "fp8-cudnn"])
def test_fp8_graph_replay_equals_eager(attention: str) -> None:
    eager = _session(_tiny("fp8", attention), graphs=False, chunks=6)
    graphed = _session(_tiny("fp8", attention), graphs=True, chunks=6)
    for a, b in zip(eager, graphed, strict=True):
        assert rel_err(b, a) < 2e-2


@pytest.mark.parametrize("attention", ["bf16", "fp8", "fp8-cudnn"])
def test_fp8_error_does_not_grow_along_the_cache(attention: str) -> None:
    base = _session(_tiny("bf16", "bf16", heads=3 if attention == "fp8-cudnn" else None), graphs=True, chunks=100)
    fp8 = _session(_tiny("fp8", attention), graphs=True, chunks=100)
    errs = np.array([rel_err(b, a) for a, b in zip(base, fp8, strict=True)])
    assert errs.max() < 0.2, errs
    assert errs[75:].mean() < 1.5 * errs[:25].mean() + 1e-3, errs  # carried through the cache, it would grow


@pytest.mark.parametrize(("n", "heads"), [(3, 72), (4, 72)])
def test_scatter_rows_kernel_matches_reference_in_a_graph(n: int, heads: int) -> None:
    """`topology.local_attention`'s copy of the gathered K/V rows (57b: 2992 tokens, e4m3 rows of 128 bytes) into a
    cuDNN-form cache at a device offset, replayed from a CUDA graph at two ring slots: byte-equal to the reference."""
    t, dh = 2992, 128
    m = -(-t // n)
    g = torch.Generator(device="cuda").manual_seed(0)
    blocks = (torch.randn(n, 2, 1, heads, m, dh, device="cuda", generator=g) * 8).to(FP8)
    k, v = ((torch.randn(1, heads, 14976, dh, device="cuda", generator=g) * 8).to(FP8) for _ in range(2))
    want_k, want_v, got_k, got_v = k.clone(), v.clone(), k.clone(), v.clone()
    offset = torch.zeros((), dtype=torch.int64, device="cuda")
    scatter_rows_triton(blocks, got_k, got_v, offset, t)  # compiled outside the capture (slot 0)
    scatter_rows_ref(blocks, want_k, want_v, 0, t)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scatter_rows_triton(blocks, got_k, got_v, offset, t)
    for slot in (2992, 8976):
        offset.fill_(slot)
        graph.replay()
        scatter_rows_ref(blocks, want_k, want_v, slot, t)
    torch.cuda.synchronize()
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))


def test_fp8_dit_build_holds_a_block_in_bf16_not_the_whole_share() -> None:
    """16 of 57b's blocks made in FP8 (`materialize_dit`, as `DiTRunner` does): the build's peak is the FP8 weights
    plus about one block in bf16 and its float32 temporaries, well under the bf16 share the whole-model build held
    (57b's rank with layers kept whole: 89-115 GB at 3 ranks, more than an H100's 80)."""
    cfg = session_config("57b", "gpu1", weights="random", model={"precision": "fp8", "dit": {"num_layers": 16}})
    with torch.device("meta"):
        dit = CausalDiT(cfg.model)
    dit.to(torch.bfloat16)
    params = sum(p.numel() for p in dit.parameters())
    block = sum(p.numel() for p in dit.blocks[0].parameters())
    largest = max(p.numel() for p in dit.blocks[0].parameters())
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    materialize_dit(dit, cfg.seed, "cuda", fp8=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    made = sum(t.numel() * t.element_size() for t in dit.state_dict().values())
    assert dit.fp8 and made < 0.6 * 2 * params  # e4m3 blocks (the modules beside them stay bf16)
    assert peak <= made + 2 * block + 4 * 4 * largest, (peak / 1e9, made / 1e9, block * 2 / 1e9)
    assert peak < 0.75 * 2 * params, (peak / 1e9, 2 * params / 1e9)  # the whole share in bf16: the old build's floor
