"""The decoder kernels' CPU paths (`norm_silu_cpu`, `bias_add_cpu`, `upsample_nearest_cpu`) against their
readable references, on fresh random inputs, odd shapes, window slices and aliasing; and the dispatch."""

from __future__ import annotations

import pytest
import torch

from kernels import norm_silu as ns
from kernels import upsample as up
from kernels.norm_silu import bias_add_cpu, bias_add_ref, norm_silu_cpu, norm_silu_ref
from kernels.upsample import upsample_nearest_cpu, upsample_nearest_ref

CL3D = torch.channels_last_3d
SHAPES = [(1, 4, 4, 9, 7), (2, 6, 3, 5, 4), (1, 3, 1, 2, 3), (1, 32, 1, 22, 34), (3, 8, 2, 1, 5)]


def rand(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 2).contiguous(memory_format=CL3D)


def extras(c: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(c, generator=g) + 0.5, torch.randn(c, generator=g)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("with_bias", "with_residual"), [(False, False), (True, False), (False, True), (True, True)])
def test_norm_silu_cpu_matches_the_reference(shape: tuple[int, ...], with_bias: bool, with_residual: bool) -> None:
    x, r = rand(shape, 1), rand(shape, 2)
    w, b = extras(shape[1], 3)
    kw = {"bias": b if with_bias else None, "residual": r if with_residual else None}
    want_sum, got_sum = torch.empty_like(x), torch.empty_like(x)
    want = norm_silu_ref(x, w, 1e-6, sum_out=want_sum, **kw)
    got = norm_silu_cpu(x, w, 1e-6, sum_out=got_sum, **kw)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert torch.equal(got_sum, want_sum)  # the same float32 adds in the same order
    assert got.is_contiguous(memory_format=CL3D)


def test_norm_silu_cpu_writes_a_window_tail_and_may_sum_into_x() -> None:
    b, c, t, h, w = 1, 8, 4, 6, 10
    x, r = rand((b, c, t, h, w), 4), rand((b, c, t, h, w), 5)
    weight, bias = extras(c, 6)
    window = torch.full((b, c, 2 + t, h, w), 7.0).contiguous(memory_format=CL3D)
    want = norm_silu_ref(x, weight, 1e-6, residual=r, bias=bias)
    want_sum = x + bias.view(1, -1, 1, 1, 1) + r
    norm_silu_cpu(x, weight, 1e-6, out=window[:, :, 2:], residual=r, bias=bias, sum_out=x)  # sum into x itself
    torch.testing.assert_close(window[:, :, 2:], want, atol=2e-6, rtol=1e-5)
    assert torch.equal(window[:, :, :2], torch.full_like(window[:, :, :2], 7.0))  # the cache frames untouched
    assert torch.equal(x, want_sum)


@pytest.mark.parametrize("shape", SHAPES)
def test_bias_add_cpu_matches_the_reference_in_place_too(shape: tuple[int, ...]) -> None:
    x, r = rand(shape, 7), rand(shape, 8)
    _, bias = extras(shape[1], 9)
    assert torch.equal(bias_add_cpu(x, bias), bias_add_ref(x, bias))
    want = bias_add_ref(x, bias, r)
    assert torch.equal(bias_add_cpu(x, bias, r, out=x), want)  # out aliasing x
    assert torch.equal(x, want)


@pytest.mark.parametrize(("shape", "fold_time"),  # folding time needs an even channel count (refusal: below)
                         [(s, f) for s in SHAPES for f in (False, True) if not (f and s[1] % 2)])
@pytest.mark.parametrize(("with_bias", "with_residual"), [(False, False), (True, False), (False, True), (True, True)])
def test_upsample_nearest_cpu_matches_the_reference(shape: tuple[int, ...], fold_time: bool, with_bias: bool,
                                                    with_residual: bool) -> None:
    x, r = rand(shape, 10), rand(shape, 11)
    _, b = extras(shape[1], 12)
    kw = {"bias": b if with_bias else None, "residual": r if with_residual else None, "fold_time": fold_time}
    want, got = upsample_nearest_ref(x, **kw), upsample_nearest_cpu(x, **kw)
    assert got.shape == want.shape and torch.equal(got, want)
    assert got.is_contiguous(memory_format=CL3D)


def test_upsample_nearest_cpu_into_a_window_tail() -> None:
    x = rand((1, 6, 2, 3, 5), 13)
    window = torch.zeros(1, 3, 2 + 4, 6, 10).contiguous(memory_format=CL3D)
    upsample_nearest_cpu(x, fold_time=True, out=window[:, :, 2:])
    assert torch.equal(window[:, :, 2:], upsample_nearest_ref(x, fold_time=True))
    assert not window[:, :, :2].any()


def test_cpu_paths_fall_back_to_the_reference_for_other_dtypes_and_layouts() -> None:
    x = rand((1, 4, 2, 3, 5), 14).bfloat16()
    w, b = extras(4, 15)
    assert torch.equal(norm_silu_cpu(x, w, 1e-6, bias=b), norm_silu_ref(x, w, 1e-6, bias=b))
    assert torch.equal(bias_add_cpu(x, b), bias_add_ref(x, b))
    assert torch.equal(upsample_nearest_cpu(x, b), upsample_nearest_ref(x, b))
    plain = rand((1, 4, 2, 3, 5), 16).contiguous()  # an `out` that is not channels-last: the reference path
    out = torch.empty(1, 4, 2, 6, 10)
    upsample_nearest_cpu(plain, out=out)
    assert torch.equal(out, upsample_nearest_ref(plain))


def test_cpu_paths_keep_the_contract_checks() -> None:
    x = rand((1, 4, 2, 3, 5), 17)
    with pytest.raises(ValueError, match=r"weight has shape \(3,\); expected \(4,\)"):
        norm_silu_cpu(x, torch.ones(3), 1e-6)
    with pytest.raises(ValueError, match="fold_time needs an even channel count"):
        upsample_nearest_cpu(rand((1, 3, 2, 3, 5), 18), fold_time=True)


def test_dispatch_takes_the_cpu_paths_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(ns, "norm_silu_cpu", lambda *a, **k: calls.append("norm_silu_cpu"))
    monkeypatch.setattr(ns, "bias_add_cpu", lambda *a, **k: calls.append("bias_add_cpu"))
    monkeypatch.setattr(up, "upsample_nearest_cpu", lambda *a, **k: calls.append("upsample_nearest_cpu"))
    x = rand((1, 4, 1, 2, 2), 19)
    ns.norm_silu(x, torch.ones(4), 1e-6)
    ns.bias_add(x, torch.ones(4))
    up.upsample_nearest(x)
    assert calls == ["norm_silu_cpu", "bias_add_cpu", "upsample_nearest_cpu"]
