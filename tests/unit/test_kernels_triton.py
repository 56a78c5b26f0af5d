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
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import qkv_prep, qkv_prep_ref, qkv_prep_triton
from kernels._triton import interpreter_enabled
from kernels.norm_silu import bias_add_ref, bias_add_triton, norm_silu_ref, norm_silu_triton
from kernels.testing import make_qkv_prep_inputs, rel_err

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # as the process started
EPS = 1e-6
REL_TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}  # ||out - ref|| / ||ref|| by dtype


def test_interpreted_suite_in_child_process() -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-p", "no:cacheprovider"]
    res = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, tail
    summary = re.search(r"(\d+) passed", res.stdout)
    assert summary and int(summary.group(1)) >= len(CASES) + len(NORM_CASES), tail
    assert not re.search(r"\d+ (failed|skipped|error)", res.stdout), tail


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
