"""The fused qkv_prep Triton kernel against its reference, on CPU under Triton's interpreter.

Isolation of TRITON_INTERPRET: Triton fixes the mode of its own library (`tl.sum`, ...) when it is first
imported, and pytest runs every module in one process, where `kernels` (hence triton) is imported in compiled
mode while collecting. Setting the variable at the top of this module would be too late for that import, and
would leak into every later test (and into a GPU run's Triton kernels, and into subprocesses). So:

- in the ordinary test process, this module collects one test, `test_interpreted_suite_in_child_process`,
  which runs this same file in a child pytest with TRITON_INTERPRET=1 set from the start and requires all
  of it to pass;
- in that child (or whenever TRITON_INTERPRET=1 is set before pytest starts:
  `TRITON_INTERPRET=1 pytest tests/unit/test_kernels_triton.py`), the class `TestQKVPrepTriton` is collected,
  case by case, and the wrapper is not.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from interpreted import run_interpreted

from kernels import qkv_prep, qkv_prep_ref, qkv_prep_triton
from kernels._triton import interpreter_enabled
from kernels.norm_silu import (
    bias_add_ref,
    bias_add_triton,
    block_rows_for,
    channel_blocks,
    norm_silu_ref,
    norm_silu_triton,
)
from kernels.testing import make_qkv_prep_inputs, rel_err
from kernels.upsample import upsample_nearest_ref, upsample_nearest_triton

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # as the process started
EPS = 1e-6
REL_TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}  # ||out - ref|| / ||ref|| by dtype


def test_interpreted_suite_in_child_process() -> None:
    run_interpreted(__file__, passed=len(CASES) + len(NORM_CASES), at_least=True)


setattr(test_interpreted_suite_in_child_process, "__test__", not INTERPRETED)  # noqa: B010 (pytest's opt-out)


CASES = [
    # (B, T, Hh, Dh, S, offset, offset kind, qkv dtype, cache dtype, qkv row padding)
    (1, 1, 1, 64, 8, 0, "int", torch.float32, torch.float32, 0),
    (1, 1, 3, 48, 16, 15, "tensor0d", torch.float16, torch.float16, 3),
    (2, 187, 4, 128, 400, 100, "tensor1d", torch.float16, torch.float16, 0),
    (1, 187, 3, 48, 187, 0, "int", torch.float32, torch.float32, 8),
    (1, 33, 4, 64, 100, 50, "int", torch.bfloat16, torch.bfloat16, 0),
    (2, 7, 3, 128, 20, 13, "tensor0d", torch.float32, torch.bfloat16, 2),
    (1, 17, 1, 48, 64, 30, "int", torch.float16, torch.float32, 0),
]


def _offset(value: int, kind: str) -> int | torch.Tensor:
    if kind == "int":
        return value
    return torch.tensor(value) if kind == "tensor0d" else torch.tensor([value])


class TestQKVPrepTriton:
    """Run where TRITON_INTERPRET=1 was set before the process started (the child process)."""

    __test__ = INTERPRETED

    @pytest.mark.parametrize(
        ("b", "t", "hh", "dh", "s", "offset", "kind", "dtype", "cache_dtype", "pad"),
        CASES,
        ids=[f"B{c[0]}-T{c[1]}-H{c[2]}-D{c[3]}-S{c[4]}-off{c[5]}{c[6]}-{str(c[7])[6:]}-{str(c[8])[6:]}" for c in CASES],
    )
    def test_triton_matches_reference(
        self,
        b: int,
        t: int,
        hh: int,
        dh: int,
        s: int,
        offset: int,
        kind: str,
        dtype: torch.dtype,
        cache_dtype: torch.dtype,
        pad: int,
    ) -> None:
        assert interpreter_enabled()
        inp = make_qkv_prep_inputs(
            b, t, hh, dh, s, dtype, cache_dtype, pad=pad, generator=torch.Generator().manual_seed(t)
        )
        kc_before, vc_before = inp.clone_caches()
        kc_ref, vc_ref = inp.clone_caches()
        args = (inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin)
        q_ref = qkv_prep_ref(*args, kc_ref, vc_ref, offset, EPS)

        out = torch.full((b, hh, t, dh), float("nan"), dtype=dtype)  # poisoned: every element must be written
        q = qkv_prep_triton(*args, inp.k_cache, inp.v_cache, _offset(offset, kind), EPS, out=out)

        assert q is out and not q.isnan().any()
        assert rel_err(q, q_ref) < REL_TOL[dtype]
        end = offset + t
        assert rel_err(inp.k_cache[:, :, offset:end], kc_ref[:, :, offset:end]) < REL_TOL[cache_dtype]
        v_got, v_ref = inp.v_cache[:, :, offset:end], vc_ref[:, :, offset:end]
        if cache_dtype == torch.bfloat16 and dtype != torch.bfloat16:
            # The interpreter truncates float -> bfloat16 where compiled Triton and torch round to nearest even
            # (tests/gpu checks this cast exactly): allow one bfloat16 ulp.
            torch.testing.assert_close(v_got, v_ref, rtol=2**-7, atol=0)
        else:
            assert torch.equal(v_got, v_ref)  # v: a cast only, so exact
        for got, before in ((inp.k_cache, kc_before), (inp.v_cache, vc_before)):  # the rest of the cache: untouched
            assert torch.equal(got[:, :, :offset], before[:, :, :offset])
            assert torch.equal(got[:, :, end:], before[:, :, end:])

    def test_offset_tensor_changes_between_calls(self) -> None:
        """One offset tensor, updated in place between calls (as between CUDA-graph replays)."""
        inp = make_qkv_prep_inputs(1, 4, 2, 64, 16, torch.float32, generator=torch.Generator().manual_seed(5))
        kc_ref, vc_ref = inp.clone_caches()
        args = (inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin)
        slot = torch.tensor(0)
        for value in (0, 12, 5):
            slot.fill_(value)
            qkv_prep_triton(*args, inp.k_cache, inp.v_cache, slot, EPS)
            qkv_prep_ref(*args, kc_ref, vc_ref, value, EPS)
        assert rel_err(inp.k_cache, kc_ref) < 1e-6
        assert torch.equal(inp.v_cache, vc_ref)

    def test_token_major_q_out(self) -> None:
        """q written into the transposed view of a (B, T, Hh, Dh) buffer (what the model passes)."""
        inp = make_qkv_prep_inputs(2, 5, 3, 48, 12, torch.float32, generator=torch.Generator().manual_seed(8))
        kc_ref, vc_ref = inp.clone_caches()
        args = (inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin)
        out = torch.full((2, 5, 3, 48), float("nan")).transpose(1, 2)  # (B, Hh, T, Dh), token-major memory
        q = qkv_prep_triton(*args, inp.k_cache, inp.v_cache, 4, EPS, out=out)
        q_ref = qkv_prep_ref(*args, kc_ref, vc_ref, 4, EPS)
        assert q.data_ptr() == out.data_ptr() and rel_err(q, q_ref) < 1e-6

    def test_out_of_range_tensor_offset_drops_rows(self) -> None:
        inp = make_qkv_prep_inputs(1, 5, 2, 48, 10, torch.float32, generator=torch.Generator().manual_seed(6))
        kc_before, vc_before = inp.clone_caches()
        args = (inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin)
        qkv_prep_triton(*args, inp.k_cache, inp.v_cache, torch.tensor(8), EPS)  # slots 8, 9 exist; 10..12 do not
        assert torch.equal(inp.v_cache[:, :, :8], vc_before[:, :, :8])
        assert torch.equal(inp.v_cache[:, :, 8:], inp.qkv[:, :2, 2].transpose(1, 2))
        assert torch.equal(inp.k_cache[:, :, :8], kc_before[:, :, :8])

    def test_dispatch_uses_triton_only_when_asked(self) -> None:
        inp = make_qkv_prep_inputs(1, 3, 2, 64, 8, torch.float32, generator=torch.Generator().manual_seed(7))
        args = (inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin)
        kc_ref, vc_ref = inp.clone_caches()
        q_ref = qkv_prep(*args, kc_ref, vc_ref, 1, EPS, backend="auto")  # CPU: the reference even under the interpreter
        q = qkv_prep(*args, inp.k_cache, inp.v_cache, 1, EPS, backend="triton")
        assert rel_err(q, q_ref) < 1e-6 and torch.equal(inp.v_cache, vc_ref)

    def test_launcher_rejects_bad_blocks(self) -> None:
        inp = make_qkv_prep_inputs(1, 2, 3, 64, 4, torch.float32)
        args = (inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin, inp.k_cache, inp.v_cache, 0, EPS)
        with pytest.raises(ValueError, match="block_h=3 must be a power of two"):
            qkv_prep_triton(*args, block_h=3)

    @pytest.mark.parametrize(("block_t", "block_h"), [(1, 1), (4, 2), (16, 4)])
    def test_launcher_tilings_agree(self, block_t: int, block_h: int) -> None:
        inp = make_qkv_prep_inputs(1, 11, 3, 48, 16, torch.float32, generator=torch.Generator().manual_seed(8))
        args = (inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin)
        kc_ref, vc_ref = inp.clone_caches()
        q_ref = qkv_prep_ref(*args, kc_ref, vc_ref, 5, EPS)
        q = qkv_prep_triton(*args, inp.k_cache, inp.v_cache, 5, EPS, block_t=block_t, block_h=block_h)
        assert rel_err(q, q_ref) < 1e-6 and rel_err(inp.k_cache, kc_ref) < 1e-6 and torch.equal(inp.v_cache, vc_ref)


NORM_CASES = [
    # (B, c, T, h, w, window frames before the tail, residual, dtype)
    (1, 4, 1, 3, 5, 0, False, torch.float32),
    (1, 96, 4, 6, 7, 2, False, torch.bfloat16),
    (2, 24, 2, 5, 3, 2, True, torch.float32),
    (1, 384, 1, 4, 4, 2, True, torch.bfloat16),
    (2, 3, 3, 2, 9, 1, False, torch.float16),
]


class TestNormSiluTriton:
    """The decoder's fused norm + SiLU (+ residual) written into a window's tail, against its reference."""

    __test__ = INTERPRETED

    @pytest.mark.parametrize(("b", "c", "t", "h", "w", "past", "residual", "dtype"), NORM_CASES,
                             ids=[f"B{n[0]}-c{n[1]}-T{n[2]}-{n[3]}x{n[4]}-past{n[5]}-res{int(n[6])}-{str(n[7])[6:]}"
                                  for n in NORM_CASES])
    def test_triton_matches_reference(self, b: int, c: int, t: int, h: int, w: int, past: int, residual: bool,
                                      dtype: torch.dtype) -> None:
        assert interpreter_enabled()
        g = torch.Generator().manual_seed(c + t)
        cl = torch.channels_last_3d

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g).to(dtype).contiguous(memory_format=cl)

        x, res = rand(b, c, t, h, w), (rand(b, c, t, h, w) if residual else None)
        weight = 1.0 + 0.3 * torch.randn(c, generator=g)
        bias = torch.randn(c, generator=g).to(dtype) if residual else None  # the previous conv's, folded in
        window = torch.full((b, c, past + t, h, w), float("nan"), dtype=dtype).contiguous(memory_format=cl)
        window_ref = window.clone()
        sums = (torch.empty_like(x), torch.empty_like(x)) if residual else (None, None)
        norm_silu_triton(x, weight, 1e-6, out=window[:, :, past:], residual=res, sum_out=sums[0], bias=bias)
        norm_silu_ref(x, weight, 1e-6, out=window_ref[:, :, past:], residual=res, sum_out=sums[1], bias=bias)
        assert not window[:, :, past:].isnan().any()  # every element of the tail written
        assert window[:, :, :past].isnan().all()  # the cache part untouched
        assert rel_err(window[:, :, past:], window_ref[:, :, past:]) < REL_TOL[dtype]
        if residual:
            assert sums[0] is not None and sums[1] is not None and rel_err(sums[0], sums[1]) < REL_TOL[dtype]

    @pytest.mark.parametrize("residual", [False, True])
    def test_bias_add_in_place(self, residual: bool) -> None:
        """A conv's bias (and a residual) added in one pass, in place over the conv's output."""
        g = torch.Generator().manual_seed(3)
        cl = torch.channels_last_3d
        y = torch.randn(2, 12, 3, 4, 5, generator=g).contiguous(memory_format=cl)
        res = torch.randn(2, 12, 3, 4, 5, generator=g).contiguous(memory_format=cl) if residual else None
        bias = torch.randn(12, generator=g)
        want = bias_add_ref(y, bias, res)
        got = bias_add_triton(y, bias, res, out=y)
        assert got is y and rel_err(y, want) < 1e-6

    def test_rejects_a_non_channels_last_tensor(self) -> None:
        x = torch.randn(1, 8, 2, 3, 3)  # contiguous NCDHW: channels are not innermost
        with pytest.raises(ValueError, match="channels-last-3d"):
            norm_silu_triton(x, torch.ones(8), 1e-6)


# ------------------------------------------------------------------------------------------------------
# norm_silu's column-chunk tiling, the fused up-sampling, and the window decoder on the Triton kernels
# ------------------------------------------------------------------------------------------------------


def _cl(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last_3d)


TILING_CASES = [
    # (c, expected (block, chunks), T, h, w, block_rows or None): the decoder's widths, then odd ones
    (96, (32, 3), 1, 3, 5, 4),
    (192, (64, 3), 1, 2, 7, None),
    (384, (128, 3), 1, 3, 3, 2),
    (40, (64, 1), 1, 3, 5, 8),
    (48, (16, 3), 2, 2, 3, None),
    (3, (4, 1), 1, 5, 3, None),
]


class TestNormSiluTiling:
    """Rows taken as power-of-two column chunks (96 = 3 x 32, ...) with a two-pass norm inside one program."""

    __test__ = INTERPRETED

    @pytest.mark.parametrize(("c", "blocks", "t", "h", "w", "block_rows"), TILING_CASES,
                             ids=[f"c{n[0]}-rows{n[5]}" for n in TILING_CASES])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_chunked_rows_match_reference(self, c: int, blocks: tuple[int, int], t: int, h: int, w: int,
                                          block_rows: int | None, dtype: torch.dtype) -> None:
        """Bias, residual and the sum written over x itself (in place), into a window's tail; few rows, and a
        block of rows that does not divide them (the last program masked)."""
        assert channel_blocks(c) == blocks
        g = torch.Generator().manual_seed(c)
        x = _cl(torch.randn(2, c, t, h, w, generator=g).to(dtype))
        res = _cl(torch.randn(2, c, t, h, w, generator=g).to(dtype))
        weight, bias = 1.0 + 0.3 * torch.randn(c, generator=g), torch.randn(c, generator=g).to(dtype)
        window = _cl(torch.full((2, c, 2 + t, h, w), float("nan"), dtype=dtype))
        want_sum = x.clone()
        want = norm_silu_ref(x, weight, EPS, residual=res, sum_out=want_sum, bias=bias)
        norm_silu_triton(x, weight, EPS, out=window[:, :, 2:], residual=res, sum_out=x, bias=bias,
                         block_rows=block_rows)
        assert window[:, :, :2].isnan().all() and not window[:, :, 2:].isnan().any()
        assert rel_err(window[:, :, 2:], want) < REL_TOL[dtype]
        assert rel_err(x, want_sum) < REL_TOL[dtype]  # sum_out aliasing x

    @pytest.mark.parametrize("c", [96, 384, 40])
    def test_norm_only(self, c: int) -> None:
        g = torch.Generator().manual_seed(c + 1)
        x = _cl(torch.randn(1, c, 1, 3, 4, generator=g))
        weight = 1.0 + 0.3 * torch.randn(c, generator=g)
        assert rel_err(norm_silu_triton(x, weight, EPS), norm_silu_ref(x, weight, EPS)) < 1e-6

    @pytest.mark.parametrize("c", [768, 8, 40])
    def test_bias_add_chunked(self, c: int) -> None:
        """768 = 6 x 128 (a time conv's output), 8 (conv_out padded), 40 (one masked block)."""
        g = torch.Generator().manual_seed(c)
        y = _cl(torch.randn(1, c, 2, 2, 3, generator=g))
        res, bias = _cl(torch.randn(1, c, 2, 2, 3, generator=g)), torch.randn(c, generator=g)
        want = bias_add_ref(y, bias, res)
        assert bias_add_triton(y, bias, res, out=y, block_rows=4) is y and torch.equal(y, want)

    def test_channel_blocks(self) -> None:
        assert [channel_blocks(c) for c in (1, 4, 8, 16, 128, 256, 768, 1024)] == [
            (1, 1), (4, 1), (8, 1), (16, 1), (128, 1), (128, 2), (128, 6), (128, 8)]
        assert channel_blocks(2048) == (2048, 1)  # more than 8 chunks: one block, as before
        assert [block_rows_for(c) for c in (96, 192, 384, 8)] == [32, 16, 8, 256]
        with pytest.raises(ValueError, match="block_rows=3 must be a power of two"):
            norm_silu_triton(_cl(torch.randn(1, 8, 1, 2, 2)), torch.ones(8), EPS, block_rows=3)


UPSAMPLE_CASES = [
    # (B, c out, fold time, T, h, w, bias, residual, dtype, window frames before the output)
    (1, 192, False, 1, 3, 4, True, True, torch.float32, 0),
    (1, 96, True, 2, 2, 3, True, False, torch.float32, 2),
    (2, 384, True, 1, 2, 2, True, False, torch.bfloat16, 0),
    (1, 40, False, 2, 3, 5, True, True, torch.float16, 1),
    (2, 3, True, 1, 3, 2, False, False, torch.bfloat16, 0),
    (1, 24, False, 1, 1, 1, False, True, torch.float32, 0),
]


class TestUpsampleTriton:
    """The 2x nearest up-sampling with its pending add (and the time fold), against its reference."""

    __test__ = INTERPRETED

    @pytest.mark.parametrize(("b", "c", "fold", "t", "h", "w", "bias", "residual", "dtype", "past"), UPSAMPLE_CASES,
                             ids=[f"B{n[0]}-c{n[1]}-fold{int(n[2])}-T{n[3]}-{n[4]}x{n[5]}-bias{int(n[6])}-"
                                  f"res{int(n[7])}-{str(n[8])[6:]}-past{n[9]}" for n in UPSAMPLE_CASES])
    def test_triton_matches_reference(self, b: int, c: int, fold: bool, t: int, h: int, w: int, bias: bool,
                                      residual: bool, dtype: torch.dtype, past: int) -> None:
        g = torch.Generator().manual_seed(c + t)
        cx, tout = (2 * c, 2 * t) if fold else (c, t)
        x = _cl(torch.randn(b, cx, t, h, w, generator=g).to(dtype))
        res = _cl(torch.randn(b, cx, t, h, w, generator=g).to(dtype)) if residual else None
        vec = torch.randn(cx, generator=g).to(dtype) if bias else None
        buf = _cl(torch.full((b, c, past + tout, 2 * h, 2 * w), float("nan"), dtype=dtype))
        want = upsample_nearest_ref(x, vec, res, fold_time=fold)
        got = upsample_nearest_triton(x, vec, res, fold_time=fold, out=buf[:, :, past:], block_rows=4)
        assert got.data_ptr() == buf[:, :, past:].data_ptr() and not got.isnan().any()
        assert buf[:, :, :past].isnan().all()  # frames before the output untouched
        if dtype == torch.bfloat16 and (bias or residual):
            # The interpreter truncates float -> bfloat16 where compiled Triton and torch round to nearest even
            # (tests/gpu checks it bit for bit): allow one bfloat16 ulp.
            torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
        else:
            assert torch.equal(got, want)
        fresh = upsample_nearest_triton(x, vec, res, fold_time=fold)  # allocated: channels-last, the same values
        assert fresh.is_contiguous(memory_format=torch.channels_last_3d) and torch.equal(fresh, got)

    def test_reference_is_the_unfused_path(self) -> None:
        """bias_add, then the time fold (view, permute, reshape) and 2-D nearest up-sampling frame by frame."""
        g = torch.Generator().manual_seed(9)
        y = _cl(torch.randn(1, 8, 2, 3, 4, generator=g))
        bias = torch.randn(8, generator=g)
        s = bias_add_ref(y, bias)
        frames = s.view(1, 2, 4, 2, 3, 4).permute(0, 2, 3, 1, 4, 5).reshape(1, 4, 4, 3, 4)  # (B, c, 2T, h, w)
        want = torch.nn.functional.interpolate(frames.transpose(1, 2).reshape(4, 4, 3, 4), scale_factor=2.0)
        got = upsample_nearest_ref(y, bias, fold_time=True)
        assert torch.equal(got, want.view(1, 4, 4, 6, 8).transpose(1, 2))
        assert got.is_contiguous(memory_format=torch.channels_last_3d)
        assert torch.equal(got[:, :, 1, 3, 5], s[:, 4:, 0, 1, 2])  # frame 2*0 + 1 is the second half

    def test_rejects_bad_shapes_and_layouts(self) -> None:
        x = _cl(torch.randn(1, 6, 1, 2, 2))
        with pytest.raises(ValueError, match="out has shape"):
            upsample_nearest_triton(x, out=_cl(torch.empty(1, 6, 1, 2, 4)))
        with pytest.raises(ValueError, match="even channel count"):
            upsample_nearest_triton(_cl(torch.randn(1, 5, 1, 2, 2)), fold_time=True)
        with pytest.raises(ValueError, match="channels-last-3d"):
            upsample_nearest_triton(torch.randn(1, 6, 1, 2, 2))


class TestWindowDecoderTriton:
    """The serving decoder (`forward_window`) with every fused kernel forced to its Triton form, where the CPU
    dispatch would pick the references, decodes a stream as the concatenating path does."""

    __test__ = INTERPRETED

    def test_window_decoder_on_triton_kernels(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import characters.vae as vae
        from characters.config import VAEConfig

        calls: Counter[str] = Counter()

        def counted(name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
            def run(*args: Any, **kwargs: Any) -> torch.Tensor:
                calls[name] += 1
                return fn(*args, **kwargs)

            return run

        monkeypatch.setattr(vae, "norm_silu", counted("norm_silu", norm_silu_triton))
        monkeypatch.setattr(vae, "bias_add", counted("bias_add", bias_add_triton))
        monkeypatch.setattr(vae, "upsample_nearest", counted("upsample", upsample_nearest_triton))
        # Widths 48 (3 x 16 chunks, and the time fold of 96), 16, and 40 (one masked block) at full resolution.
        cfg = VAEConfig(latent_channels=4, base_channels=8, channel_mult=(5, 2, 6, 6), num_res_blocks=1,
                        encoder_base_channels=8)
        torch.manual_seed(0)
        decoder = vae.CausalDecoder(cfg).eval().to(memory_format=torch.channels_last_3d)  # type: ignore[call-overload]
        z = torch.randn(1, 4, 2, 2, 3, generator=torch.Generator().manual_seed(1))  # (B, C, T, h, w)
        with torch.inference_mode():
            plain = decoder.init_state(1, 2, 3, "cpu", torch.float32)
            windowed = decoder.init_state(1, 2, 3, "cpu", torch.float32, chunk_frames=1)
            for i in range(2):  # two chunks: the second reads the caches the first left
                want = decoder.decode_chunk(z[:, :, i : i + 1], plain)
                got = decoder.decode_chunk(z[:, :, i : i + 1], windowed)
                assert got.shape == (1, 3, 4, 16, 24)
                torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
                for a, b in zip(windowed.caches, plain.caches, strict=True):
                    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        # per chunk: 2 norms in each of the 10 residual blocks (2 mid, 2 per stage) + norm_out; 3 up-samplings
        assert calls["norm_silu"] == 2 * (2 * 10 + 1) and calls["upsample"] == 2 * 3 and calls["bias_add"] > 0
