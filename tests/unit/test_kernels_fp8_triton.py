"""The FP8 kernels (`kernels.qkv_prep_fp8`, `kernels.attention_fp8`, the e4m3 cast `kernels._triton.to_e4m3`)
against their references on the CPU under Triton's interpreter, in a child process (TRITON_INTERPRET must be set
before triton's first import: see tests/unit/test_kernels_triton.py, which this follows)."""

from __future__ import annotations

import os

import pytest
import torch
from interpreted import run_interpreted

from kernels._triton import HAS_TRITON, interpreter_enabled, jit_for_current_mode, to_e4m3
from kernels.attention_fp8 import attention_fp8, attention_fp8_ref, attention_fp8_triton
from kernels.fp8 import FP8
from kernels.qkv_prep_fp8 import qk_scale_bound, qkv_prep_fp8, qkv_prep_fp8_ref, qkv_prep_fp8_triton
from kernels.testing import make_qkv_prep_inputs, rel_err

if HAS_TRITON:
    import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
EPS = 1e-6

QKV_CASES = [  # (B, T, Hh, Dh, S, offset, offset as tensor, qkv dtype)
    (1, 37, 3, 64, 100, 40, True, torch.bfloat16),
    (2, 16, 2, 48, 64, 0, False, torch.float32),  # tiny's head dim: padded to 64 lanes
    (1, 33, 1, 128, 99, 66, True, torch.float16),
]
ATTN_CASES = [  # (B, Hh, Tq, Dh, S, valid, config)
    (1, 2, 37, 64, 300, 200, (32, 32, 4, 1)),  # a partial last key block
    (2, 3, 16, 32, 64, 64, (16, 16, 4, 1)),  # whole blocks only
    (1, 2, 40, 48, 120, 100, (16, 32, 4, 1)),  # padded head dim
]


def test_interpreted_suite_in_child_process() -> None:
    run_interpreted(__file__, passed=2 * len(QKV_CASES) + len(ATTN_CASES) + 4, at_least=True)


setattr(test_interpreted_suite_in_child_process, "__test__", not INTERPRETED)  # noqa: B010 (pytest's opt-out)


def _cache(b: int, hh: int, s: int, dh: int, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """Random FP8 cache buffers (never zeros: untouched slots must stay recognisable)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hh, s, dh, generator=g).to(FP8), (3 * torch.randn(b, hh, dh, s, generator=g)).to(FP8),
            torch.rand(b, hh, s, generator=g) + 0.01, torch.zeros(2))


def _cast_kernel(x_ptr, o_ptr, N: tl.constexpr, INTERPRET: tl.constexpr):  # type: ignore[no-untyped-def]
    i = tl.arange(0, N)
    tl.store(o_ptr + i, to_e4m3(tl.load(x_ptr + i), INTERPRET))


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == FP8 else x


class TestFp8KernelsInterpreted:
    __test__ = INTERPRETED

    def test_e4m3_cast_matches_torch(self) -> None:
        cast = jit_for_current_mode(_cast_kernel)
        g = torch.Generator().manual_seed(0)
        x = torch.cat([torch.randn(2048, generator=g) * 30, torch.randn(2048 - 16, generator=g) * 0.01,
                       torch.tensor([0.0, -0.0, 500.0, -1e4, 448.0, 0.0117, 2.0**-10, 1.0625, 1.1875, 31.9, -15.99,
                                     2.0**-9 * 1.5, 2.0**-9 * 2.5, 240.0, 232.0, 1e-30])])
        x = torch.cat([x, (torch.randn(4096, generator=g) * 3).bfloat16().float()])  # bf16 inputs: many ties
        out = torch.empty(x.numel(), dtype=FP8)
        cast[(1,)](x, out, x.numel(), interpreter_enabled())
        want = x.clamp(-448, 448).to(FP8)
        bad = out.float() != want.float()  # by value: the interpreter's cast writes -0 as +0
        assert not bad.any(), (x[bad][:8], out.float()[bad][:8], want.float()[bad][:8])

    @pytest.mark.parametrize(("b", "t", "hh", "dh", "s", "offset", "as_tensor", "dtype"), QKV_CASES)
    def test_qkv_prep_fp8_matches_reference(self, b: int, t: int, hh: int, dh: int, s: int, offset: int,
                                            as_tensor: bool, dtype: torch.dtype) -> None:
        inp = make_qkv_prep_inputs(b, t, hh, dh, s, dtype, pad=3, generator=torch.Generator().manual_seed(t))
        args = (inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin)
        got, ref, before = _cache(b, hh, s, dh), _cache(b, hh, s, dh), _cache(b, hh, s, dh)
        out = torch.full((b, t, hh, dh), 1.0).to(FP8).transpose(1, 2)  # token-major, every element rewritten
        q = qkv_prep_fp8_triton(*args, *got, torch.tensor(offset) if as_tensor else offset, EPS, out=out)
        q_ref = qkv_prep_fp8_ref(*args, *ref, offset, EPS)
        assert q.data_ptr() == out.data_ptr()
        torch.testing.assert_close(got[3], torch.stack([qk_scale_bound(inp.q_weight), qk_scale_bound(inp.k_weight)]))
        assert torch.equal(got[3], ref[3])
        # the same float32 math; a rare 1-ulp e4m3 flip where rsqrt rounds differently
        for a, r in ((q, q_ref), (got[0], ref[0]), (got[1], ref[1])):
            assert (_bytes(a) != _bytes(r)).float().mean() < 1e-3
        assert rel_err(q.float(), q_ref.float()) < 1e-3 and torch.equal(got[2], ref[2])
        end = offset + t
        for i, axis in ((0, 2), (1, 3), (2, 2)):  # outside the written slots: untouched
            keep = torch.ones(s, dtype=torch.bool)
            keep[offset:end] = False
            idx = [slice(None)] * got[i].ndim
            idx[axis] = keep  # type: ignore[call-overload]
            assert torch.equal(_bytes(got[i])[tuple(idx)], _bytes(before[i])[tuple(idx)])

    @pytest.mark.parametrize(("b", "t", "hh", "dh", "s", "offset", "as_tensor", "dtype"), QKV_CASES)
    def test_qkv_prep_fp8_tensor_v_matches_reference(self, b: int, t: int, hh: int, dh: int, s: int, offset: int,
                                                     as_tensor: bool, dtype: torch.dtype) -> None:
        """v_layout="tensor" (the cuDNN form): V (B, Hh, S, Dh) with one given scale, untouched elsewhere."""
        inp = make_qkv_prep_inputs(b, t, hh, dh, s, dtype, pad=3, generator=torch.Generator().manual_seed(t))
        args = (inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin)

        def cache() -> list[torch.Tensor]:
            k, _, _, qks = _cache(b, hh, s, dh)
            v = (2 * torch.randn(b, hh, s, dh, generator=torch.Generator().manual_seed(5))).to(FP8)
            return [k, v, torch.tensor([0.0125]), qks]

        got, ref, before = cache(), cache(), cache()
        off = torch.tensor(offset) if as_tensor else offset
        q = qkv_prep_fp8_triton(*args, *got, off, EPS, v_layout="tensor")
        q_ref = qkv_prep_fp8_ref(*args, *ref, offset, EPS, v_layout="tensor")
        want_v = (inp.qkv[:, :, 2].float() / 0.0125).clamp(-448, 448).to(FP8).transpose(1, 2)  # (B, Hh, T, Dh)
        assert torch.equal(_bytes(ref[1][:, :, offset:offset + t]), _bytes(want_v))
        assert torch.equal(_bytes(got[1]), _bytes(ref[1])) and torch.equal(got[2], ref[2])
        for a, r in ((q, q_ref), (got[0], ref[0])):
            assert (_bytes(a) != _bytes(r)).float().mean() < 1e-3
        keep = torch.ones(s, dtype=torch.bool)
        keep[offset:offset + t] = False
        assert torch.equal(_bytes(got[1])[:, :, keep], _bytes(before[1])[:, :, keep])

    def test_qkv_prep_fp8_drops_out_of_range_rows(self) -> None:
        inp = make_qkv_prep_inputs(1, 5, 2, 64, 10, torch.float32, generator=torch.Generator().manual_seed(2))
        got, before = _cache(1, 2, 10, 64), _cache(1, 2, 10, 64)
        qkv_prep_fp8_triton(inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin, *got, torch.tensor(8), EPS)
        assert torch.equal(_bytes(got[0])[:, :, :8], _bytes(before[0])[:, :, :8])
        assert not torch.equal(_bytes(got[0])[:, :, 8:], _bytes(before[0])[:, :, 8:])

    @pytest.mark.parametrize(("b", "hh", "tq", "dh", "s", "valid", "config"), ATTN_CASES)
    def test_attention_fp8_matches_reference(self, b: int, hh: int, tq: int, dh: int, s: int, valid: int,
                                             config: tuple[int, int, int, int]) -> None:
        inp = make_qkv_prep_inputs(b, tq, hh, dh, s, torch.bfloat16, generator=torch.Generator().manual_seed(dh))
        k8, vt8, vs, qks = _cache(b, hh, s, dh)
        q8 = qkv_prep_fp8_ref(inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin, k8, vt8, vs, qks, 0, EPS)
        args = (q8, k8[:, :, :valid], vt8[..., :valid], vs[..., :valid], qks)
        out = torch.full((b, tq, hh, dh), float("nan")).transpose(1, 2)  # poisoned, token-major
        got = attention_fp8_triton(*args, torch.float32, out=out, config=config)
        assert got is out and not out.isnan().any()
        # P's e4m3 rounding: ~2.6% on random data (every key weighs alike); a wrong scale or mask is off by far more
        assert rel_err(out, attention_fp8_ref(*args, torch.float32)) < 4e-2

    def test_attention_fp8_is_exact_where_p_is_representable(self) -> None:
        """q = 0 and equal V scales: p = 1 and w = 448 for every key, so P's cast is exact and the kernel must equal
        the reference to float32 rounding (the V path, the scales, the tail mask, the row sums)."""
        k8, vt8, vs, qks = _cache(1, 2, 120, 48)
        q8 = torch.zeros(1, 2, 40, 48).to(FP8)
        vs.fill_(0.37)
        qks.copy_(torch.tensor([0.5, 0.25]))
        args = (q8, k8[:, :, :100], vt8[..., :100], vs[..., :100], qks)
        got = attention_fp8_triton(*args, torch.float32, config=(16, 32, 4, 1))
        assert rel_err(got, attention_fp8_ref(*args, torch.float32)) < 1e-5

    def test_attention_fp8_one_key_dominates(self) -> None:
        """A query aligned with one key far above the rest: the output is that key's dequantised value row."""
        k8, vt8, vs, _ = _cache(1, 1, 64, 32)
        vs.fill_(0.37)  # equal V scales: the dominant key's weight is 448 exactly (else one e4m3 rounding of it)
        k8.view(torch.uint8).zero_()
        k8[0, 0, 17] = torch.full((32,), 448.0).to(FP8)
        q8 = torch.full((1, 1, 16, 32), 448.0).to(FP8)
        qks = torch.tensor([1.0, 1.0])  # scores of 32 * 448^2 / sqrt(32) for key 17, 0 for the rest
        got = attention_fp8_triton(q8, k8, vt8, vs, qks, torch.float32, config=(16, 16, 4, 1))
        want = (vt8[0, 0, :, 17].float() * vs[0, 0, 17]).expand(16, 32)
        assert rel_err(got[0, 0], want) < 1e-6

    def test_dispatch_uses_the_reference_on_cpu(self) -> None:
        k8, vt8, vs, qks = _cache(1, 1, 32, 32)
        q8 = torch.randn(1, 1, 8, 32).to(FP8)
        assert torch.equal(attention_fp8(q8, k8, vt8, vs, qks, torch.float32),
                           attention_fp8_ref(q8, k8, vt8, vs, qks, torch.float32))
        inp = make_qkv_prep_inputs(1, 4, 1, 32, 32, torch.float32)
        with pytest.raises(ValueError, match="backend='cuda' is not one of"):
            qkv_prep_fp8(inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin, k8, vt8, vs, qks, 0, EPS,
                         backend="cuda")  # type: ignore[arg-type]

    def test_launchers_reject_bad_inputs(self) -> None:
        k8, vt8, vs, qks = _cache(1, 2, 32, 64)
        q8 = torch.zeros(1, 2, 8, 64).to(FP8)
        with pytest.raises(ValueError, match=r"vt8 is .* expected .* \(B, Hh, Dh, S\)"):
            attention_fp8_triton(q8, k8, vt8.transpose(-1, -2), vs, qks)
        with pytest.raises(ValueError, match="tma=True needs CUDA tensors"):
            attention_fp8_triton(q8, k8, vt8, vs, qks, tma=True)
        inp = make_qkv_prep_inputs(1, 4, 2, 64, 32, torch.float32)
        with pytest.raises(ValueError, match=r"offset=30 with T=4 must be an int in \[0, 28\]"):
            qkv_prep_fp8_triton(inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin, k8, vt8, vs, qks, 30, EPS)
