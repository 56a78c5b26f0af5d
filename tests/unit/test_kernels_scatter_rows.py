"""`kernels.scatter_rows`: every rank's gathered K/V rows into the cache in token order (`topology.local_attention`).
The reference against a plain token-order copy, its checks, and the Triton kernel against the reference on the CPU
under Triton's interpreter (in a child process, as tests/unit/test_kernels_row_quant_triton.py). On the GPU:
tests/gpu/test_fp8_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch
from interpreted import run_interpreted

from kernels.fp8 import FP8
from kernels.scatter_rows import scatter_axis, scatter_rows_ref, scatter_rows_triton

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# (n ranks, m rows each, T tokens, Dh, dtype): padding rows on the last rank; 48-wide rows (12 words: a masked
# power-of-two block); e4m3 rows of 128 bytes (32 words, the 57b cache's); a rank of padding only (n*m - T > m)
CASES = [(3, 5, 13, 8, torch.float32), (2, 4, 8, 48, torch.bfloat16), (3, 70, 205, 128, FP8),
         (4, 3, 8, 16, torch.float32)]
OFFSETS = [0, 6]


def _inputs(n: int, m: int, dh: int, dtype: torch.dtype, seed: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randn(n, 2, 1, 3, m, dh, generator=g)  # (n, K|V, B, Hh, m, Dh)
    cache = torch.randn(2, 1, 3, n * m + 12, dh, generator=g)  # (K|V, B, Hh, S, Dh): room past the rows
    if dtype == FP8:
        return (blocks * 8).to(FP8), (cache * 8)[0].to(FP8), (cache * 8)[1].to(FP8)
    return blocks.to(dtype), cache[0].to(dtype), cache[1].to(dtype)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == FP8 else x


@pytest.mark.parametrize("offset", OFFSETS)
def test_reference_puts_the_rows_in_token_order_and_nothing_else(offset: int) -> None:
    n, m, t, dh, dtype = CASES[0]
    blocks, k, v = _inputs(n, m, dh, dtype)
    k0, v0 = k.clone(), v.clone()
    scatter_rows_ref(blocks, k, v, offset, t)
    for got, before, which in ((k, k0, 0), (v, v0, 1)):
        rows = torch.cat(list(blocks[:, which]), 2)[:, :, :t]  # (B, Hh, T, Dh): the ranks' rows in order
        assert torch.equal(got[:, :, offset:offset + t], rows)
        assert torch.equal(got[:, :, :offset], before[:, :, :offset])
        assert torch.equal(got[:, :, offset + t:], before[:, :, offset + t:])


def test_a_device_offset_writes_what_the_int_does() -> None:
    n, m, t, dh, dtype = CASES[2]
    blocks, k, v = _inputs(n, m, dh, dtype)
    a, b = (k.clone(), v.clone()), (k.clone(), v.clone())
    scatter_rows_ref(blocks, *a, 6, t)
    scatter_rows_ref(blocks, *b, torch.tensor(6), t)
    assert all(torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("as_tensor", [False, True])
def test_one_buffer_along_its_last_axis(as_tensor: bool) -> None:
    """`scatter_axis` along the keys where they are the last axis (the Triton FP8 cache's transposed V, e4m3) and of
    a 3-D buffer (its V scales): rank c's entry i at offset + c*m + i, padding out, the rest untouched."""
    n, m, t, offset = 3, 4, 10, 5
    g = torch.Generator().manual_seed(1)
    vt_blocks = (torch.randn(n, 1, 2, 8, m, generator=g) * 8).to(FP8)  # (n, B, Hh, Dh, m)
    vt = (torch.randn(1, 2, 8, 20, generator=g) * 8).to(FP8)  # (B, Hh, Dh, S)
    vs_blocks, vs = torch.rand(n, 1, 2, m, generator=g), torch.rand(1, 2, 20, generator=g)  # (n, B, Hh, m), (B, Hh, S)
    off: int | torch.Tensor = torch.tensor(offset) if as_tensor else offset
    for dst, blocks, axis in ((vt, vt_blocks, 3), (vs, vs_blocks, 2)):
        before = _bits(dst).clone()
        scatter_axis(dst, blocks, off, t, axis)
        rows = torch.cat([_bits(b) for b in blocks], axis).narrow(axis, 0, t)  # the ranks' entries in order
        assert torch.equal(_bits(dst).narrow(axis, offset, t), rows)
        assert torch.equal(_bits(dst).narrow(axis, 0, offset), before.narrow(axis, 0, offset))
        rest = dst.shape[axis] - offset - t
        assert torch.equal(_bits(dst).narrow(axis, offset + t, rest), before.narrow(axis, offset + t, rest))


def test_bad_shapes_are_refused() -> None:
    blocks, k, v = _inputs(3, 5, 8, torch.float32)
    with pytest.raises(ValueError, match=r"expected \(n, 2, B, Hh, m, Dh\)"):
        scatter_rows_ref(blocks[:, :1], k, v, 0, 13)
    with pytest.raises(ValueError, match=r"v is torch.float32 \(1, 2, 27, 8\)"):
        scatter_rows_ref(blocks, k, v[:, :2], 0, 13)
    with pytest.raises(ValueError, match=r"tokens=16 must be in \[1, 15\]"):
        scatter_rows_ref(blocks, k, v, 0, 16)


def test_interpreted_suite_in_child_process() -> None:
    run_interpreted(__file__, passed=2 * len(CASES) * len(OFFSETS), k="interpreted_kernel")


setattr(test_interpreted_suite_in_child_process, "__test__", not INTERPRETED)  # noqa: B010 (pytest's opt-out)


class TestScatterRowsInterpreted:
    __test__ = INTERPRETED  # collected in the child process of test_interpreted_suite_in_child_process

    @pytest.mark.parametrize("case", CASES)
    @pytest.mark.parametrize("offset", OFFSETS)
    @pytest.mark.parametrize("as_tensor", [False, True])
    def test_interpreted_kernel_equals_the_reference(self, case: tuple, offset: int, as_tensor: bool) -> None:
        n, m, t, dh, dtype = case
        blocks, k, v = _inputs(n, m, dh, dtype, seed=offset)
        want, got = (k.clone(), v.clone()), (k.clone(), v.clone())
        scatter_rows_ref(blocks, *want, offset, t)
        scatter_rows_triton(blocks, *got, torch.tensor(offset) if as_tensor else offset, t, block_m=4)
        assert all(torch.equal(_bits(x), _bits(y)) for x, y in zip(want, got, strict=True))
