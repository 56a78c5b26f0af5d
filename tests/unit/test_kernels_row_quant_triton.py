"""`kernels.row_quant`: the reference against the DiT block's own FP8 steps, the checks, and the Triton kernel
against the reference on the CPU under Triton's interpreter (in a child process: TRITON_INTERPRET must be set
before triton's first import, as in tests/unit/test_kernels_fp8_triton.py). On the GPU: tests/gpu/test_fp8_gpu.py."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from interpreted import run_interpreted

from characters.dit import ElementwiseOps
from kernels._triton import HAS_TRITON
from kernels.fp8 import Fp8Act, dequantize_rows
from kernels.row_quant import MODES, row_quant_ref, row_quant_triton
from kernels.testing import rel_err

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# (B, T, D, a modulation row per token); a row is held as two power-of-two parts (kernels.row_quant.row_blocks):
# 96 = 64 + 32, 100 = 64 + 36 (the second part masked at 100), 64 (a second part all masked), 72 = 64 + 8 of 16
CASES = [(1, 7, 96, False), (2, 5, 100, True), (1, 3, 64, True), (1, 4, 72, False)]


def _inputs(mode: str, b: int, t: int, d: int, per_token: bool, dtype: torch.dtype,
            seed: int = 0) -> tuple[torch.Tensor, dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    x, y = (torch.randn(b, t, d, generator=g).to(dtype) for _ in "xy")
    mod = torch.randn(b, t if per_token else 1, 6, d, generator=g).to(dtype)  # the block's rows are views of it
    w, bias = torch.randn(d, generator=g).to(dtype), torch.randn(d, generator=g).to(dtype)
    kw: dict[str, Any] = {"modulate": {"shift": mod[:, :, 0], "scale": mod[:, :, 1]},
                          "add_modulate": {"y": y, "shift": mod[:, :, 0], "scale": mod[:, :, 1]},
                          "gated_add_norm": {"y": y, "gate": mod[:, :, 2], "weight": w, "bias": bias},
                          "gelu": {},
                          "gated_add_modulate": {"y": y, "gate": mod[:, :, 5], "shift": mod[:, :, 0],
                                                 "scale": mod[:, :, 1]}}[mode]
    return x, kw


def test_interpreted_suite_in_child_process() -> None:
    run_interpreted(__file__, passed=2 * len(MODES) * len(CASES), k="interpreted_kernel")


setattr(test_interpreted_suite_in_child_process, "__test__", not INTERPRETED)  # noqa: B010 (pytest's opt-out)


class TestRowQuantInterpreted:
    __test__ = INTERPRETED  # collected in the child process of test_interpreted_suite_in_child_process

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("mode", MODES)
    @pytest.mark.parametrize(("b", "t", "d", "per_token"), CASES)
    def test_interpreted_kernel_matches_reference(self, mode: str, b: int, t: int, d: int, per_token: bool,
                                                  dtype: torch.dtype) -> None:
        _kernel_matches_reference(mode, b, t, d, per_token, dtype)


def _kernel_matches_reference(mode: str, b: int, t: int, d: int, per_token: bool, dtype: torch.dtype) -> None:
    """float32: the kernel equals the reference (the residual, every e4m3 code; scales to float32 rounding).
    bfloat16: the interpreter rounds float32 -> bfloat16 differently from torch (a unit in the last place on a
    part of the residual; compiled, the cast is torch's), so the residual is within one bf16 step and the
    quantised rows within the step that moves."""
    x, kw = _inputs(mode, b, t, d, per_token, dtype)
    ref, got = row_quant_ref(mode, x, **kw), row_quant_triton(mode, x, **kw)  # type: ignore[arg-type]
    assert (ref[0] is None) == (got[0] is None) == (mode in ("modulate", "gelu"))
    assert got[1].shape == (b, t, d) and got[2].shape == (b, t, 1)
    if dtype == torch.float32:
        if ref[0] is not None:
            assert torch.equal(got[0], ref[0])
        assert torch.equal(got[1].view(torch.uint8), ref[1].view(torch.uint8))
        torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=0)
    else:
        if ref[0] is not None:
            assert got[0] is not None
            torch.testing.assert_close(got[0], ref[0], rtol=2**-7, atol=0)
        torch.testing.assert_close(got[2], ref[2], rtol=1e-2, atol=0)
        assert rel_err(dequantize_rows(Fp8Act(*got[1:])), dequantize_rows(Fp8Act(*ref[1:]))) < 3e-2


@pytest.mark.parametrize("mode", MODES)
def test_reference_is_the_blocks_fp8_step(mode: str) -> None:
    """The reference computes what the DiT block's plain FP8 steps do (float32, where no rounding differs)."""
    x, kw = _inputs(mode, 1, 9, 48, False, torch.float32, seed=1)
    new, q, s = row_quant_ref(mode, x, **kw)  # type: ignore[arg-type]
    ops, eps = ElementwiseOps(False, fp8=True), 1e-6
    if mode == "modulate":
        want: Any = ops.modulate(x, kw["shift"], kw["scale"], eps)
    elif mode == "add_modulate":
        want = ops.add_modulate(x, kw["y"], kw["shift"], kw["scale"], eps)
    elif mode == "gated_add_norm":
        want = ops.gated_add_norm(x, kw["y"], kw["gate"], kw["weight"], kw["bias"], eps)
    elif mode == "gated_add_modulate":
        want = ops.gated_add_modulate(x, kw["y"], kw["gate"], kw["shift"], kw["scale"], eps)
    else:
        want = ops.gelu(x)
    if new is not None:
        torch.testing.assert_close(new, want[0])
        want = want[1]
    assert rel_err(dequantize_rows(Fp8Act(q, s)), dequantize_rows(want)) < 1e-6


def test_bad_arguments_are_named() -> None:
    x, kw = _inputs("gated_add_norm", 1, 4, 16, False, torch.float32)
    with pytest.raises(ValueError, match="mode='norm' is unknown"):
        row_quant_ref("norm", x)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gate is missing"):
        row_quant_ref("gated_add_norm", x, **{**kw, "gate": None})
    with pytest.raises(ValueError, match="shift is not one of them"):
        row_quant_ref("gelu", x, shift=kw["gate"])
    with pytest.raises(ValueError, match=r"gate must be \(B, 1 or T, D\)"):
        row_quant_ref("gated_add_norm", x, **{**kw, "gate": torch.zeros(1, 3, 16)})
    with pytest.raises(ValueError, match="x must be"):
        row_quant_ref("gelu", x[0])


def test_fused_fp8_steps_with_row_kernels_run_on_a_cpu() -> None:
    """`ElementwiseOps` with row kernels (the default for fused FP8 when Triton is installed) takes CPU tensors
    too: `row_quant` dispatches them to the reference (no Triton launch on a CPU tensor outside the interpreter)."""
    fused, plain = ElementwiseOps(True, fp8=True), ElementwiseOps(False, fp8=True)
    assert fused.row_kernels == HAS_TRITON and not plain.row_kernels
    x, kw = _inputs("gated_add_norm", 1, 6, 32, False, torch.float32, seed=2)
    (xa, ha), (xb, hb) = (ops.gated_add_norm(x, kw["y"], kw["gate"], kw["weight"], kw["bias"], 1e-6)
                          for ops in (fused, plain))
    torch.testing.assert_close(xa, xb)
    assert rel_err(dequantize_rows(ha), dequantize_rows(hb)) < 1e-6
    assert rel_err(dequantize_rows(fused.gelu(x)), dequantize_rows(plain.gelu(x))) < 1e-6
