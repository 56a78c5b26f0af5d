"""Split-KV attention: the fold (a view where it can be), the log-sum-exp merge, the backends' dispatch.

CPU tests run the split through the float32 reference parts (`parts_ref`), so they check the fold and the
merge exactly; mutant merges (a part dropped, the log base mixed up) are run too and must fail the same
tolerance. The `gpu` class checks the cuDNN and flash parts on the 57b shapes; it is skipped without CUDA and
deselected by `-m "not gpu"` in CI.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import pytest
import torch

from kernels.attention import (
    ATTENTION_BACKENDS,
    PARTS,
    AttentionBackend,
    attention,
    attention_ref,
    available_backends,
    merge_parts,
    parts_ref,
    pick_backend,
    split_attention,
)
from kernels.testing import rel_err

# The package exports the function `attention`, which shadows the submodule of the same name as an attribute.
attention_mod = importlib.import_module("kernels.attention")
LN2 = math.log(2.0)
# ||out - truth|| / ||truth|| bounds, truth in float64: bf16 rounds each part and the merged result.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
SPLIT_BACKENDS: list[AttentionBackend] = [b for b in ATTENTION_BACKENDS if "_split" in b]


def _inputs(
    b: int, hh: int, tq: int, s: int, s_max: int, dh: int, dtype: torch.dtype, seed: int, token_major: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, Hh, Tq, Dh), token-major (a view of (B, Tq, Hh, Dh)) or contiguous; k, v (B, Hh, S, Dh) prefix
    views of (B, Hh, S_max, Dh) caches. Key norms ramp 0.3 -> 3 along S, so the parts' log-sum-exps differ
    by several units: a merge that weighs parts wrongly (e.g. base 2 for e) is far off, not within rounding."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, tq, hh, dh, generator=g).transpose(1, 2)  # (B, Hh, Tq, Dh) view of (B, Tq, Hh, Dh)
    q = q if token_major else q.contiguous()
    ramp = torch.linspace(0.3, 3.0, s_max).view(1, 1, s_max, 1)  # (1, 1, S_max, 1)
    k_cache = torch.randn(b, hh, s_max, dh, generator=g) * ramp  # (B, Hh, S_max, Dh)
    v_cache = torch.randn(b, hh, s_max, dh, generator=g)
    return q.to(dtype), k_cache.to(dtype)[:, :, :s], v_cache.to(dtype)[:, :, :s]


def _truth(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    p = torch.softmax(q.double() @ k.double().transpose(-1, -2) * scale, dim=-1)  # (B, Hh, Tq, S)
    return p @ v.double()  # (B, Hh, Tq, Dh)


# --------------------------------------------------------------------------------------------------------
# split + merge == reference
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("token_major", [True, False])
@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_split_matches_reference(n: int, b: int, token_major: bool, dtype: torch.dtype) -> None:
    q, k, v = _inputs(b, 3, 7, 60, 83, 32, dtype, seed=10 * n + b, token_major=token_major)
    assert not k.is_contiguous() and not v.is_contiguous()
    out = split_attention(q, k, v, n)
    truth = _truth(q, k, v, 1.0 / math.sqrt(32))
    assert out.shape == (b, 3, 7, 32) and out.dtype == dtype
    assert rel_err(out, truth) < REL_TOL[dtype]
    assert rel_err(attention_ref(q, k, v), truth) < REL_TOL[dtype]
    # the output comes back in q's memory order (token-major feeds the output projection without a copy)
    assert (out.stride(1) < out.stride(2)) == token_major


@pytest.mark.parametrize("q_fold", ["expand", "repeat"])
def test_split_scale_and_q_fold(q_fold: Any) -> None:
    q, k, v = _inputs(1, 2, 5, 48, 50, 16, torch.float32, seed=3)
    out = split_attention(q, k, v, 4, parts_ref, scale=0.7, q_fold=q_fold)
    assert rel_err(out, _truth(q, k, v, 0.7)) < REL_TOL[torch.float32]


def test_parts_ref_lse_is_natural_log() -> None:
    q, k, v = _inputs(1, 2, 5, 16, 16, 8, torch.float32, seed=4)
    out, lse = parts_ref(q, k, v, 0.5)
    scores = q.double() @ k.double().transpose(-1, -2) * 0.5  # (B, Hh, Tq, S)
    assert lse.shape == (1, 2, 5) and lse.dtype == torch.float32
    assert torch.allclose(lse.double(), scores.exp().sum(-1).log(), atol=1e-5)
    assert rel_err(out, _truth(q, k, v, 0.5)) < 1e-6


# --------------------------------------------------------------------------------------------------------
# a wrong merge fails the same checks
# --------------------------------------------------------------------------------------------------------


def _drop_last_part(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    return merge_parts(out[:, :-1], lse[:, :-1])


def _lse_read_as_base2(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    return merge_parts(out, lse * LN2)  # weights 2^(lse_i) / sum_j 2^(lse_j): natural lse taken for log2


def _lse_read_as_natural_from_base2(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    return merge_parts(out, lse / LN2)  # the other mix-up: a kernel's log2 stats taken for natural log


def _plain_mean(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    return out.float().mean(dim=1).to(out.dtype)  # ignores the log-sum-exp altogether


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wrong", [_drop_last_part, _lse_read_as_base2, _lse_read_as_natural_from_base2, _plain_mean])
def test_wrong_merges_fail_the_tolerance(wrong: Any, dtype: torch.dtype) -> None:
    q, k, v = _inputs(1, 3, 7, 60, 83, 32, dtype, seed=5)
    truth = _truth(q, k, v, 1.0 / math.sqrt(32))
    assert rel_err(split_attention(q, k, v, 4, merge=merge_parts), truth) < REL_TOL[dtype]
    assert rel_err(split_attention(q, k, v, 4, merge=wrong), truth) > 10 * REL_TOL[torch.bfloat16]


def test_merge_is_one_graph() -> None:
    """No graph breaks (no .item(), no host sync, no data-dependent shapes): capturable / compilable."""
    out = torch.randn(1, 3, 2, 5, 8, dtype=torch.bfloat16)  # (B, n, Hh, Tq, Dh)
    lse = torch.randn(1, 3, 2, 5)  # (B, n, Hh, Tq)
    traced = torch.compile(merge_parts, fullgraph=True, dynamic=False, backend="eager")
    assert torch.equal(traced(out, lse), merge_parts(out, lse))


# --------------------------------------------------------------------------------------------------------
# the fold: a view for B == 1
# --------------------------------------------------------------------------------------------------------


class _Spy:
    """A `PartsFn` that records what the kernel would be handed, then runs the reference."""

    def __init__(self) -> None:
        self.args: tuple[torch.Tensor, ...] = ()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> Any:
        self.args = (q, k, v)
        return parts_ref(q, k, v, scale)


@pytest.mark.parametrize("q_fold", ["expand", "repeat"])
def test_fold_is_a_view_of_the_cache_for_batch_one(q_fold: Any) -> None:
    hh, tq, s, s_max, dh, n = 3, 7, 60, 83, 32, 4
    q, k, v = _inputs(1, hh, tq, s, s_max, dh, torch.bfloat16, seed=6)
    spy = _Spy()
    split_attention(q, k, v, n, spy, q_fold=q_fold)
    qf, kf, vf = spy.args
    part = s // n
    for folded, x in ((kf, k), (vf, v)):
        assert folded.shape == (n, hh, part, dh)
        assert folded.data_ptr() == x.data_ptr()  # no copy: the kernel reads the cache itself
        assert folded.stride() == (part * dh, s_max * dh, dh, 1)
        assert torch.equal(folded[2], x[0, :, 2 * part : 3 * part])  # batch index = part index
    assert qf.shape == (n, hh, tq, dh)
    if q_fold == "expand":
        assert qf.stride() == (0, *q.stride()[1:]) and qf.data_ptr() == q.data_ptr()
    else:
        assert qf.stride() == (tq * hh * dh, *q.stride()[1:]) and qf.data_ptr() != q.data_ptr()
    assert all(torch.equal(qf[i], q[0]) for i in range(n))


def test_fold_copies_for_batch_two_in_batch_major_order() -> None:
    q, k, v = _inputs(2, 3, 7, 60, 83, 32, torch.float32, seed=7)
    spy = _Spy()
    split_attention(q, k, v, 3, spy)
    qf, kf, _ = spy.args
    assert kf.shape == (6, 3, 20, 32) and kf.is_contiguous()
    for b in range(2):
        for i in range(3):
            assert torch.equal(kf[b * 3 + i], k[b, :, 20 * i : 20 * (i + 1)])
            assert torch.equal(qf[b * 3 + i], q[b])


# --------------------------------------------------------------------------------------------------------
# S not divisible by n; dispatch through `attention`
# --------------------------------------------------------------------------------------------------------


def test_split_rejects_s_not_divisible_by_n() -> None:
    q, k, v = _inputs(1, 2, 3, 30, 40, 16, torch.float32, seed=8)
    with pytest.raises(ValueError, match=r"S=30 keys do not split into n=4 equal parts"):
        split_attention(q, k, v, 4)
    with pytest.raises(ValueError, match=r"n=0"):
        split_attention(q, k, v, 0)
    with pytest.raises(ValueError, match=r"q_fold='tile'"):
        split_attention(q, k, v, 2, q_fold="tile")  # type: ignore[arg-type]


@pytest.mark.parametrize(("s", "backend", "parts"), [
    (60, "sdpa_cudnn_split4", 4),
    (30, "sdpa_flash_split4", 3),  # 4 does not divide 30: the largest count <= 4 that does
    (37, "sdpa_cudnn_split8", 1),  # prime: one part
    (5 * 2992, "sdpa_flash_split8", 8),
])  # fmt: skip
def test_backend_uses_the_largest_part_count_that_divides_s(
    s: int, backend: AttentionBackend, parts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []
    real = attention_mod.split_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, *args: Any) -> torch.Tensor:
        seen.append(n)
        return real(q, k, v, n, *args)

    monkeypatch.setattr(attention_mod, "split_attention", spy)
    q, k, v = _inputs(1, 1, 2, s, s + 5, 16, torch.float32, seed=s)
    out = attention(q, k, v, backend)
    assert seen == [parts]
    assert rel_err(out, _truth(q, k, v, 0.25)) < REL_TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", SPLIT_BACKENDS)
def test_split_backends_on_cpu_match_reference(backend: AttentionBackend, dtype: torch.dtype) -> None:
    """On CPU tensors a split backend runs the reference parts through the same fold and merge."""
    q, k, v = _inputs(2, 3, 9, 64, 70, 32, dtype, seed=9)
    out = attention(q, k, v, backend, scale=0.2)
    assert out.shape == (2, 3, 9, 32) and out.dtype == dtype
    assert rel_err(out, _truth(q, k, v, 0.2)) < REL_TOL[dtype]


def test_split_backends_are_named_and_offered_only_where_kernels_run() -> None:
    assert [f"sdpa_{kernel}_split{n}" for kernel in ("cudnn", "flash") for n in (2, 4, 8)] == SPLIT_BACKENDS
    assert not set(SPLIT_BACKENDS) & set(available_backends("cpu", torch.bfloat16))
    assert set(PARTS) == {"cudnn", "flash"}


# --------------------------------------------------------------------------------------------------------
# on a CUDA GPU: the cuDNN and flash parts
# --------------------------------------------------------------------------------------------------------

GPU_SHAPES = [
    # (B, Hh, Tq, S, S_max, Dh): the 57b rank-local chunk (TP=4) over the full ring, then B = 2 over a prefix
    (1, 18, 2992, 5 * 2992, 5 * 2992, 128),
    (2, 4, 187, 400, 512, 64),
]


def _cuda_inputs(
    b: int, hh: int, tq: int, s: int, s_max: int, dh: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(tq + s)
    q = torch.randn(b, tq, hh, dh, generator=gen, device="cuda").to(dtype).transpose(1, 2)  # token-major
    k = torch.randn(b, hh, s_max, dh, generator=gen, device="cuda").to(dtype)[:, :, :s]  # (B, Hh, S, Dh)
    v = torch.randn(b, hh, s_max, dh, generator=gen, device="cuda").to(dtype)[:, :, :s]
    return q, k, v


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
class TestSplitCuda:
    @pytest.mark.parametrize("kernel", ["cudnn", "flash"])
    def test_kernel_lse_is_natural_log(self, kernel: str) -> None:
        q, k, v = _cuda_inputs(1, 4, 64, 256, 256, 128, torch.bfloat16)
        out, lse = PARTS[kernel](q, k, v, 0.1)
        ref_out, ref_lse = parts_ref(q, k, v, 0.1)
        assert lse.shape == (1, 4, 64) and lse.dtype == torch.float32
        err = (lse - ref_lse).abs().max().item()
        assert err < 1e-2, f"{kernel} lse differs from the natural-log reference by {err}"
        assert (lse * LN2 - ref_lse).abs().max().item() > 0.5  # and is not log2 (which the test could not tell)
        assert rel_err(out, ref_out) < 1e-2

    @pytest.mark.parametrize("q_fold", ["expand", "repeat"])
    @pytest.mark.parametrize("kernel", ["cudnn", "flash"])
    @pytest.mark.parametrize(("b", "hh", "tq", "s", "s_max", "dh"), GPU_SHAPES)
    def test_split_kernels_match_reference(
        self, kernel: str, q_fold: Any, b: int, hh: int, tq: int, s: int, s_max: int, dh: int
    ) -> None:
        q, k, v = _cuda_inputs(b, hh, tq, s, s_max, dh, torch.bfloat16)
        ref = attention_ref(q, k, v)
        errs = {n: rel_err(split_attention(q, k, v, n, PARTS[kernel], q_fold=q_fold), ref) for n in (2, 4, 8)}
        assert all(e < 1e-2 for e in errs.values()), errs

    @pytest.mark.parametrize(("b", "hh", "tq", "s", "s_max", "dh"), GPU_SHAPES)
    def test_split_backends_match_reference(self, b: int, hh: int, tq: int, s: int, s_max: int, dh: int) -> None:
        q, k, v = _cuda_inputs(b, hh, tq, s, s_max, dh, torch.bfloat16)
        assert set(SPLIT_BACKENDS) <= set(available_backends("cuda", torch.bfloat16))
        assert not set(SPLIT_BACKENDS) & set(available_backends("cuda", torch.float32))
        ref = attention_ref(q, k, v)
        errs = {name: rel_err(attention(q, k, v, name), ref) for name in SPLIT_BACKENDS}
        assert all(e < 1e-2 for e in errs.values()), errs

    def test_split_backend_replays_in_a_cuda_graph(self) -> None:
        q, k, v = _cuda_inputs(1, 18, 2992, 5 * 2992, 5 * 2992, 128, torch.bfloat16)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (cuDNN plan, merge compile) outside the capture
            attention(q, k, v, "sdpa_cudnn_split4")
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = attention(q, k, v, "sdpa_cudnn_split4")
        q.copy_(torch.randn_like(q))  # new inputs in the same buffers
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, attention_ref(q, k, v)) < 1e-2

    def test_pick_backend_times_the_split_backends(self) -> None:
        q, k, v = _cuda_inputs(1, 18, 2992, 5 * 2992, 5 * 2992, 128, torch.bfloat16)
        best = pick_backend(q, k, v, candidates=["sdpa_cudnn", *SPLIT_BACKENDS])
        assert rel_err(attention(q, k, v, best), attention_ref(q, k, v)) < 1e-2
