"""`kernels.cross_attention_fp8`: the reference against an independent float64 computation, the argument checks,
and the Triton kernels against the reference on the CPU under Triton's interpreter (in a child process:
TRITON_INTERPRET must be set before triton's first import, as in tests/unit/test_kernels_fp8_triton.py).

Run alone under the interpreter: TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/unit/test_cross_attention_fp8.py
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from interpreted import run_interpreted

from kernels._triton import HAS_TRITON
from kernels.cross_attention_fp8 import cross_attention_fp8, cross_attention_fp8_ref, cross_attention_fp8_triton
from kernels.fp8 import FP8

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
EPS = 1e-6
CASES = [  # (B, nF, N, A, Hh, Dh, dtype, padded rows): odd token counts; tiny's heads (4 x 48, 3 x 64); 57b's Dh
    (1, 1, 19, 8, 3, 64, torch.bfloat16, False),
    (2, 2, 19, 5, 4, 48, torch.float32, True),
    (1, 2, 13, 8, 2, 128, torch.bfloat16, True),
    (1, 1, 7, 1, 1, 48, torch.float16, False),
]


def _inputs(b: int, nf: int, n: int, a: int, hh: int, dh: int, dtype: torch.dtype, padded: bool = False,
            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, T, Hh*Dh), kv (B, nF, A, 2*Hh*Dh) ~ N(0, 1) (views of wider buffers with `padded`: other strides),
    norm weights 1 + 0.3 N(0, 1) in float32."""
    g = torch.Generator().manual_seed(seed)
    pad = 5 if padded else 0
    q = torch.randn(b, nf * n, hh * dh + pad, generator=g).to(dtype)[..., : hh * dh]  # (B, T, Hh*Dh)
    kv = torch.randn(b, nf, a, 2 * hh * dh + pad, generator=g).to(dtype)[..., : 2 * hh * dh]  # (B, nF, A, 2*Hh*Dh)
    qw, kw = (1.0 + 0.3 * torch.randn(dh, generator=g) for _ in "qk")
    return q, kv, qw, kw


def _attention_float64(q: torch.Tensor, kv: torch.Tensor, qw: torch.Tensor, kw: torch.Tensor,
                       hh: int) -> torch.Tensor:
    """The unquantised output (B, T, Hh*Dh) in float64, written out apart from the module: norms by hand, SDPA per
    frame."""
    b, t, width = q.shape
    nf, a, dh = kv.shape[1], kv.shape[2], width // hh

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x / (x.pow(2).mean(dim=-1, keepdim=True) + EPS).sqrt() * w.double()

    qh = rms(q.double().reshape(b * nf, t // nf, hh, dh), qw).transpose(1, 2)  # (B*nF, Hh, N, Dh)
    k = rms(kv.double().reshape(b * nf, a, 2, hh, dh)[:, :, 0], kw).transpose(1, 2)  # (B*nF, Hh, A, Dh)
    v = kv.double().reshape(b * nf, a, 2, hh, dh)[:, :, 1].transpose(1, 2)  # (B*nF, Hh, A, Dh)
    out = F.scaled_dot_product_attention(qh, k, v)  # (B*nF, Hh, N, Dh)
    return out.transpose(1, 2).reshape(b, t, width)


def _frame_scale_float64(kv: torch.Tensor, t: int) -> torch.Tensor:
    """The module's scale, (B, T, 1) float64: max |v| over each frame's A x Hh*Dh values of V, / 448."""
    b, nf = kv.shape[:2]
    v = kv.double()[..., kv.shape[-1] // 2:]  # (B, nF, A, Hh*Dh)
    s = v.abs().amax(dim=(2, 3)).clamp_min(1e-12) / 448.0  # (B, nF)
    return s[:, :, None].expand(b, nf, t // nf).reshape(b, t, 1)


def _e4m3_step(y: torch.Tensor) -> torch.Tensor:
    """The e4m3 grid's step at |y| (y in units of the scale): 2^(floor(log2 |y|) - 3), 2^-9 below 2^-6."""
    e = torch.floor(torch.log2(y.abs().clamp_min(2.0**-6)))
    return torch.exp2(e - 3)


@pytest.mark.parametrize(("b", "nf", "n", "a", "hh", "dh", "dtype", "padded"), CASES)
def test_reference_matches_float64_attention(b: int, nf: int, n: int, a: int, hh: int, dh: int, dtype: torch.dtype,
                                             padded: bool) -> None:
    """Each value is the float64 output rounded to the e4m3 grid of its scale: within half a step (plus float32's
    rounding of the math before it), the scales to float32 rounding."""
    q, kv, qw, kw = _inputs(b, nf, n, a, hh, dh, dtype, padded, seed=1)
    data, scale = cross_attention_fp8_ref(q, kv, qw, kw, EPS, heads=hh)
    assert data.dtype == FP8 and data.shape == (b, nf * n, hh * dh)
    assert scale.dtype == torch.float32 and scale.shape == (b, nf * n, 1)
    exact = _attention_float64(q, kv, qw, kw, hh)  # (B, T, Hh*Dh)
    want_scale = _frame_scale_float64(kv, nf * n)  # (B, T, 1)
    torch.testing.assert_close(scale.double(), want_scale, rtol=1e-6, atol=0)
    y = exact / want_scale  # in units of the scale: |y| <= 448
    assert y.abs().max() <= 448.0 * (1 + 1e-6)
    err = (data.double() - y).abs()
    assert (err <= 0.5 * _e4m3_step(y) + 1e-5 * y.abs() + 1e-9).all(), err.max()


def test_interpreted_suite_in_child_process() -> None:
    run_interpreted(__file__, passed=len(CASES) + 1, k="interpreted_kernel")


setattr(test_interpreted_suite_in_child_process, "__test__", not INTERPRETED)  # noqa: B010 (pytest's opt-out)


class TestCrossAttentionInterpreted:
    __test__ = INTERPRETED  # collected in the child process of test_interpreted_suite_in_child_process

    @pytest.mark.parametrize(("b", "nf", "n", "a", "hh", "dh", "dtype", "padded"), CASES)
    def test_interpreted_kernel_matches_reference(self, b: int, nf: int, n: int, a: int, hh: int, dh: int,
                                                  dtype: torch.dtype, padded: bool) -> None:
        """Scales to float32 rounding; each e4m3 value the reference's or one grid step from it (float32 math in
        another order can cross a rounding boundary), and such steps rare."""
        q, kv, qw, kw = _inputs(b, nf, n, a, hh, dh, dtype, padded)
        got, ref = cross_attention_fp8_triton(q, kv, qw, kw, EPS, heads=hh), cross_attention_fp8_ref(
            q, kv, qw, kw, EPS, heads=hh)
        assert got[0].dtype == FP8 and got[0].shape == ref[0].shape and got[0].is_contiguous()
        assert got[1].dtype == torch.float32 and got[1].shape == ref[1].shape
        torch.testing.assert_close(got[1], ref[1], rtol=1e-6, atol=0)
        yg, yr = got[0].double(), ref[0].double()  # in units of the (equal) scales
        assert ((yg - yr).abs() <= _e4m3_step(torch.maximum(yg.abs(), yr.abs())) + 1e-12).all()
        differing = (got[0].view(torch.uint8) != ref[0].view(torch.uint8)).double().mean().item()
        assert differing <= 1e-3, differing

    def test_interpreted_kernel_dispatch_is_the_kernel(self) -> None:
        q, kv, qw, kw = _inputs(1, 1, 5, 3, 2, 64, torch.bfloat16)
        got, want = cross_attention_fp8(q, kv, qw, kw, EPS, heads=2), cross_attention_fp8_triton(
            q, kv, qw, kw, EPS, heads=2)
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])


def test_bad_arguments_are_named() -> None:
    q, kv, qw, kw = _inputs(1, 2, 4, 3, 2, 16, torch.float32)
    with pytest.raises(ValueError, match=r"heads=3 must be a positive int dividing"):
        cross_attention_fp8_ref(q, kv, qw, kw, EPS, heads=3)
    with pytest.raises(ValueError, match=r"kv must be \(B, nF, A, 2\*Hh\*Dh\)"):
        cross_attention_fp8_ref(q, kv[..., :-2], qw, kw, EPS, heads=2)
    with pytest.raises(ValueError, match=r"T=7 tokens must split into kv's nF=2 frames"):
        cross_attention_fp8_ref(q[:, :7], kv, qw, kw, EPS, heads=2)
    with pytest.raises(ValueError, match=r"q_weight must be a floating \(16,\)"):
        cross_attention_fp8_ref(q, kv, qw[:8], kw, EPS, heads=2)
    with pytest.raises(ValueError, match=r"q must be \(B, T, Hh\*Dh\)"):
        cross_attention_fp8_ref(q.transpose(1, 2).contiguous().transpose(1, 2), kv, qw, kw, EPS, heads=2)
    with pytest.raises(ValueError, match=r"q must be \(B, T, Hh\*Dh\)"):
        cross_attention_fp8_ref(q.to(torch.float64), kv, qw, kw, EPS, heads=2)
    wide = torch.zeros(1, 1, 65, 64)  # A=65 audio tokens: past the kernel's key tile
    with pytest.raises(ValueError, match=r"A=65 audio tokens"):
        cross_attention_fp8_triton(torch.zeros(1, 3, 32), wide, qw[:16], kw[:16], EPS, heads=2)


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="the CPU path: no interpreter, Triton installed")
def test_cpu_tensors_take_the_reference() -> None:
    """Without the interpreter, CPU tensors are the reference's (dispatch) and the kernel refuses them clearly."""
    q, kv, qw, kw = _inputs(1, 1, 6, 4, 2, 16, torch.bfloat16)
    got, want = cross_attention_fp8(q, kv, qw, kw, EPS, heads=2), cross_attention_fp8_ref(q, kv, qw, kw, EPS, heads=2)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="tensors are on cpu"):
        cross_attention_fp8_triton(q, kv, qw, kw, EPS, heads=2)
