"""Kernel references and dispatch on CPU: rms_norm_ref, rope_ref, qkv_prep_ref, attention backends.

The Triton kernel itself (under TRITON_INTERPRET=1) is tested in test_kernels_triton.py.
"""

from __future__ import annotations

import ast
import importlib
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import kernels
from kernels import (
    attention,
    attention_ref,
    available_backends,
    pick_backend,
    qkv_prep,
    qkv_prep_ref,
    qkv_prep_triton,
    rms_norm_ref,
    rope_ref,
)
from kernels.testing import QKVPrepInputs, make_qkv_prep_inputs, rel_err

# The package exports the function `attention`, which shadows the submodule of the same name as an attribute.
attention_mod = importlib.import_module("kernels.attention")
EPS = 1e-6
# ||out - ref|| / ||ref|| bounds by dtype of the rounded result.
REL_TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------------------------
# rms_norm_ref / rope_ref
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dh", [48, 64, 128])
def test_rms_norm_ref_matches_manual(dtype: torch.dtype, dh: int) -> None:
    g = _gen(dh)
    x = (3.0 * torch.randn(2, 5, 3, dh, generator=g)).to(dtype)  # (B, T, Hh, Dh)
    w = torch.randn(dh, generator=g)  # (Dh,)
    x64 = x.double()
    manual = x64 / torch.sqrt((x64 * x64).sum(-1, keepdim=True) / dh + EPS) * w.double()  # (B, T, Hh, Dh)
    out = rms_norm_ref(x, w, EPS)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, manual) < REL_TOL[dtype]
    out32 = rms_norm_ref(x, w, EPS, torch.float32)
    assert out32.dtype == torch.float32
    assert rel_err(out32, manual) < 1e-6


def test_rms_norm_ref_rejects_wrong_weight() -> None:
    with pytest.raises(ValueError, match=r"weight has shape \(48,\); expected \(64,\)"):
        rms_norm_ref(torch.randn(3, 64), torch.randn(48), EPS)


def _rope_complex(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """RoPE as complex multiplication: pair (2i, 2i+1) is the number x[2i] + j x[2i+1], turned by angle[t, i]."""
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())  # (..., T, Hh, Dh/2)
    turn = torch.polar(torch.ones_like(angle.double()), angle.double()).unsqueeze(-2)  # (..., T, 1, Dh/2)
    return torch.view_as_real(xc * turn).flatten(-2)  # (..., T, Hh, Dh)


@pytest.mark.parametrize("shape", [(1, 3, 48), (2, 7, 3, 64), (2, 2, 5, 4, 128)])
def test_rope_ref_matches_complex_rotation(shape: tuple[int, ...]) -> None:
    g = _gen(len(shape))
    x = torch.randn(*shape, generator=g)  # (..., T, Hh, Dh)
    t, dh = shape[-3], shape[-1]
    angle = torch.rand(t, dh // 2, generator=g) * 2 * math.pi  # (T, Dh/2)
    out = rope_ref(x, angle.cos(), angle.sin())
    assert out.dtype == x.dtype and out.shape == x.shape
    assert rel_err(out, _rope_complex(x, angle)) < 1e-6


def test_rope_ref_per_batch_tables_broadcast() -> None:
    g = _gen(1)
    x = torch.randn(2, 6, 3, 64, generator=g)  # (B, T, Hh, Dh)
    angle = torch.rand(2, 6, 32, generator=g) * 2 * math.pi  # (B, T, Dh/2): a different table per batch row
    out = rope_ref(x, angle.cos(), angle.sin())
    assert rel_err(out, _rope_complex(x, angle)) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_ref_preserves_norms(dtype: torch.dtype) -> None:
    g = _gen(2)
    x = torch.randn(2, 9, 3, 64, generator=g).to(dtype)  # (B, T, Hh, Dh)
    angle = torch.rand(9, 32, generator=g) * 2 * math.pi
    out = rope_ref(x, angle.cos(), angle.sin(), torch.float32)  # (B, T, Hh, Dh) float32
    pair_in = x.float().reshape(2, 9, 3, 32, 2).norm(dim=-1)  # (B, T, Hh, Dh/2)
    pair_out = out.reshape(2, 9, 3, 32, 2).norm(dim=-1)
    torch.testing.assert_close(pair_out, pair_in, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.norm(dim=-1), x.float().norm(dim=-1), rtol=1e-5, atol=1e-6)


def test_rope_ref_scores_depend_on_relative_position_only() -> None:
    g = _gen(3)
    dh, n = 64, 12
    freq = 10000.0 ** (-torch.arange(dh // 2, dtype=torch.float64) / (dh // 2))  # (Dh/2,)
    angle = torch.arange(n, dtype=torch.float64)[:, None] * freq  # (T, Dh/2)
    q = torch.randn(1, 1, dh, generator=g, dtype=torch.float64).expand(n, 1, dh)  # the same q at every position
    k = torch.randn(1, 1, dh, generator=g, dtype=torch.float64).expand(n, 1, dh)
    qr = rope_ref(q, angle.cos(), angle.sin())[:, 0]  # (T, Dh)
    kr = rope_ref(k, angle.cos(), angle.sin())[:, 0]
    scores = qr @ kr.T  # (T, T)
    for lag in range(-3, 4):
        diag = torch.diagonal(scores, offset=lag)
        torch.testing.assert_close(diag, diag[:1].expand_as(diag), rtol=1e-10, atol=1e-10)


def test_rope_ref_rejects_bad_tables() -> None:
    x = torch.randn(5, 2, 64)
    with pytest.raises(ValueError, match=r"cos has shape \(5, 64\); expected \(\.\.\., 5, 32\)"):
        rope_ref(x, torch.ones(5, 64), torch.zeros(5, 32))
    with pytest.raises(ValueError, match="Dh even"):
        rope_ref(torch.randn(5, 2, 63), torch.ones(5, 31), torch.zeros(5, 31))


# --------------------------------------------------------------------------------------------------------
# qkv_prep_ref
# --------------------------------------------------------------------------------------------------------


def _expected(inp: QKVPrepInputs, offset: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k_cache, v_cache) expected from the building blocks, computed independently of qkv_prep_ref."""
    t = inp.qkv.shape[1]
    q_raw, k_raw, v_raw = inp.qkv[:, :, 0], inp.qkv[:, :, 1], inp.qkv[:, :, 2]  # (B, T, Hh, Dh) each
    q = rope_ref(rms_norm_ref(q_raw, inp.q_weight, EPS, torch.float32), inp.cos, inp.sin)  # (B, T, Hh, Dh)
    k = rope_ref(rms_norm_ref(k_raw, inp.k_weight, EPS, torch.float32), inp.cos, inp.sin)
    kc, vc = inp.clone_caches()  # (B, Hh, S, Dh) each
    kc[:, :, offset : offset + t] = k.permute(0, 2, 1, 3).to(kc.dtype)
    vc[:, :, offset : offset + t] = v_raw.permute(0, 2, 1, 3).to(vc.dtype)
    return q.permute(0, 2, 1, 3).to(inp.qkv.dtype), kc, vc


@pytest.mark.parametrize(
    ("b", "t", "hh", "dh", "s", "offset", "dtype", "cache_dtype", "as_tensor"),
    [
        (1, 1, 1, 64, 8, 0, torch.float32, torch.float32, False),
        (2, 5, 3, 48, 20, 15, torch.float16, torch.float16, True),
        (1, 7, 4, 128, 30, 11, torch.float32, torch.bfloat16, True),
        (1, 9, 3, 64, 9, 0, torch.bfloat16, torch.float32, False),
    ],
)
def test_qkv_prep_ref_writes_only_its_slots(
    b: int, t: int, hh: int, dh: int, s: int, offset: int, dtype: torch.dtype, cache_dtype: torch.dtype, as_tensor: bool
) -> None:
    inp = make_qkv_prep_inputs(b, t, hh, dh, s, dtype, cache_dtype, pad=5, generator=_gen(t * dh))
    q_exp, kc_exp, vc_exp = _expected(inp, offset)
    off: int | torch.Tensor = torch.tensor(offset) if as_tensor else offset
    q = qkv_prep_ref(inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin, inp.k_cache, inp.v_cache, off, EPS)
    assert q.shape == (b, hh, t, dh) and q.dtype == dtype and q.is_contiguous()
    assert torch.equal(q, q_exp)
    assert torch.equal(inp.k_cache, kc_exp)  # target slots as expected, every other slot bit-identical
    assert torch.equal(inp.v_cache, vc_exp)


def test_qkv_prep_ref_fills_out_buffer() -> None:
    inp = make_qkv_prep_inputs(1, 4, 2, 64, 8, torch.float32, generator=_gen(4))
    out = torch.full((1, 2, 4, 64), float("nan"))
    q = qkv_prep_ref(inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin, inp.k_cache, inp.v_cache, 2, EPS, out=out)
    assert q is out
    assert torch.equal(out, _expected(inp, 2)[0])


def test_qkv_prep_auto_on_cpu_is_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    inp = make_qkv_prep_inputs(1, 6, 3, 48, 12, torch.float32, generator=_gen(6))
    q_exp, kc_exp, vc_exp = _expected(inp, 3)
    q = qkv_prep(inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin, inp.k_cache, inp.v_cache, 3, EPS)
    assert torch.equal(q, q_exp) and torch.equal(inp.k_cache, kc_exp) and torch.equal(inp.v_cache, vc_exp)


def test_qkv_prep_triton_on_cpu_without_interpreter_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    inp = make_qkv_prep_inputs(1, 2, 1, 64, 4, torch.float32, generator=_gen(0))
    args = (inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin, inp.k_cache, inp.v_cache, 0, EPS)
    with pytest.raises(ValueError, match=r"tensors are on cpu; .*TRITON_INTERPRET=1"):
        qkv_prep(*args, backend="triton")
    with pytest.raises(ValueError, match=r"backend='cuda' is not one of"):
        qkv_prep(*args, backend="cuda")  # type: ignore[arg-type]


def test_interpreter_switched_on_after_import_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRITON_INTERPRET=1 set after triton's import cannot work (Triton fixed its library's mode then)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(tl.sum, InterpretedFunction):
        pytest.skip("this process started with TRITON_INTERPRET=1: no mismatch to provoke")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    inp = make_qkv_prep_inputs(1, 2, 1, 64, 4, torch.float32, generator=_gen(0))
    args = (inp.qkv, inp.q_weight, inp.k_weight, inp.cos, inp.sin, inp.k_cache, inp.v_cache, 0, EPS)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1 was set after triton was first imported"):
        qkv_prep_triton(*args)


# Bad arguments: (id, change applied to the good kwargs, message pattern). Shared with the Triton launcher tests.
Mutation = Callable[[dict[str, Any]], None]


def _set(key: str, fn: Callable[[dict[str, Any]], Any]) -> Mutation:
    def mutate(kw: dict[str, Any]) -> None:
        kw[key] = fn(kw)

    return mutate


BAD_ARGS: list[tuple[str, Mutation, str]] = [
    ("qkv_4d", _set("qkv", lambda kw: kw["qkv"][:, :, 0]), r"qkv has shape \(1, 6, 3, 64\); expected \(B, T, 3, Hh"),
    ("qkv_int", _set("qkv", lambda kw: kw["qkv"].to(torch.int32)), "qkv has dtype torch.int32"),
    ("qkv_float64", _set("qkv", lambda kw: kw["qkv"].double()), "qkv has dtype torch.float64"),
    (
        "qkv_strided_dh",
        _set("qkv", lambda kw: torch.randn(1, 6, 3, 3, 128)[..., ::2]),
        r"the last dim \(Dh\) must be contiguous",
    ),
    ("odd_dh", _set("qkv", lambda kw: torch.randn(1, 6, 3, 3, 63)), "head dim Dh=63 must be even"),
    ("q_weight_shape", _set("q_weight", lambda kw: torch.ones(32)), r"q_weight has shape \(32,\).*\(64,\) = \(Dh,\)"),
    ("k_weight_int", _set("k_weight", lambda kw: torch.ones(64, dtype=torch.int64)), "k_weight has .*torch.int64"),
    ("cos_shape", _set("cos", lambda kw: torch.ones(5, 32)), r"cos has shape \(5, 32\).*\(6, 32\) = \(T, Dh/2\)"),
    ("sin_dtype", _set("sin", lambda kw: kw["sin"].half()), "sin has .*dtype torch.float16.*expected float32"),
    (
        "k_cache_heads",
        _set("k_cache", lambda kw: torch.randn(1, 2, 16, 64)),
        r"k_cache has shape \(1, 2, 16, 64\); expected \(1, 3, S, 64\)",
    ),
    ("v_cache_slots", _set("v_cache", lambda kw: torch.randn(1, 3, 17, 64)), r"v_cache has shape \(1, 3, 17, 64\)"),
    ("cache_int", _set("k_cache", lambda kw: kw["k_cache"].to(torch.int16)), "k_cache has dtype torch.int16"),
    (
        "cache_strided",
        _set("v_cache", lambda kw: torch.randn(1, 3, 16, 128)[..., ::2]),
        r"v_cache has strides .*must be contiguous",
    ),
    ("offset_past_end", _set("offset", lambda kw: 11), r"offset=11 with T=6 writes slots \[11, 17\); .*S=16"),
    ("offset_negative", _set("offset", lambda kw: -1), r"offset=-1 with T=6"),
    ("offset_float", _set("offset", lambda kw: 2.0), r"offset=2.0 \(float\); expected a Python int"),
    (
        "offset_int32",
        _set("offset", lambda kw: torch.tensor(2, dtype=torch.int32)),
        "offset tensor has dtype torch.int32",
    ),
    ("offset_shape", _set("offset", lambda kw: torch.tensor([2, 3])), r"offset tensor .*shape \(2,\)"),
    ("eps_zero", _set("eps", lambda kw: 0.0), "eps=0.0 must be > 0"),
    ("out_shape", _set("out", lambda kw: torch.empty(1, 3, 6, 48)), r"out has shape \(1, 3, 6, 48\)"),
    ("out_dtype", _set("out", lambda kw: torch.empty(1, 3, 6, 64, dtype=torch.float16)), "out has .*torch.float16"),
]


def good_kwargs() -> dict[str, Any]:
    inp = make_qkv_prep_inputs(1, 6, 3, 64, 16, torch.float32, generator=_gen(1))
    kw: dict[str, Any] = dict(vars(inp))
    kw.update(offset=2, eps=EPS, out=None)
    return kw


@pytest.mark.parametrize("fn", [qkv_prep_ref, qkv_prep_triton], ids=["ref", "launcher"])
@pytest.mark.parametrize(("mutate", "pattern"), [pytest.param(m, p, id=i) for i, m, p in BAD_ARGS])
def test_qkv_prep_rejects_bad_args(
    fn: Callable[..., torch.Tensor], mutate: Mutation, pattern: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher checks its arguments before it looks for a device (no interpreter needed here)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kw = good_kwargs()
    mutate(kw)
    with pytest.raises(ValueError, match=pattern):
        fn(**kw)


# --------------------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------------------


def _attention_inputs(
    b: int, hh: int, tq: int, s: int, s_max: int, dh: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    q = torch.randn(b, hh, tq, dh, generator=g).to(dtype)  # (B, Hh, Tq, Dh)
    k_cache = torch.randn(b, hh, s_max, dh, generator=g).to(dtype)  # (B, Hh, S_max, Dh)
    v_cache = torch.randn(b, hh, s_max, dh, generator=g).to(dtype)
    return q, k_cache[:, :, :s], v_cache[:, :, :s]  # k, v: (B, Hh, S, Dh) prefix views


def _attention_f64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    p = torch.softmax(q.double() @ k.double().transpose(-1, -2) * scale, dim=-1)  # (B, Hh, Tq, S)
    return p @ v.double()  # (B, Hh, Tq, Dh)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", available_backends("cpu", torch.float32))
@pytest.mark.parametrize(("b", "hh", "tq", "s", "s_max", "dh"), [(1, 3, 1, 37, 64, 48), (2, 4, 29, 100, 131, 64)])
def test_attention_cpu_backends_match_reference(
    backend: kernels.AttentionBackend, dtype: torch.dtype, b: int, hh: int, tq: int, s: int, s_max: int, dh: int
) -> None:
    q, k, v = _attention_inputs(b, hh, tq, s, s_max, dh, dtype, seed=tq + s)
    assert not k.is_contiguous()
    out = attention(q, k, v, backend)
    truth = _attention_f64(q, k, v, 1.0 / math.sqrt(dh))
    assert out.shape == (b, hh, tq, dh) and out.dtype == dtype
    assert rel_err(out, truth) < {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    assert rel_err(attention_ref(q, k, v), truth) < {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]


def test_attention_ref_scale() -> None:
    q, k, v = _attention_inputs(1, 2, 5, 9, 12, 64, torch.float32, seed=9)
    assert rel_err(attention_ref(q, k, v, scale=0.3), _attention_f64(q, k, v, 0.3)) < 1e-6
    assert rel_err(attention(q, k, v, "sdpa_math", scale=0.3), _attention_f64(q, k, v, 0.3)) < 1e-5


def test_available_backends_cpu() -> None:
    assert available_backends("cpu", torch.float32) == ["sdpa", "sdpa_math", "sdpa_flash"]
    assert available_backends(torch.device("cpu"), torch.float64) == ["sdpa", "sdpa_math"]


def test_pick_backend_cpu_is_sdpa_untimed(caplog: pytest.LogCaptureFixture) -> None:
    q, k, v = _attention_inputs(1, 2, 3, 5, 8, 64, torch.float32, seed=1)
    with caplog.at_level(logging.INFO, logger="kernels.attention"):
        assert pick_backend(q, k, v) == "sdpa"
    assert "'sdpa' (CPU, not timed)" in caplog.text


def test_attention_rejects_unknown_or_missing_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _attention_inputs(1, 2, 3, 5, 8, 64, torch.float32, seed=2)
    with pytest.raises(ValueError, match=r"backend='xformers' is unknown; expected one of \['sdpa'"):
        attention(q, k, v, "xformers")  # type: ignore[arg-type]
    monkeypatch.setattr(attention_mod, "_flash_fn", lambda backend: None)
    with pytest.raises(ValueError, match=r"backend='flash_attn3' needs the package 'flash_attn_interface'"):
        attention(q, k, v, "flash_attn3")


def test_attention_rejects_bad_inputs() -> None:
    q, k, v = _attention_inputs(1, 2, 3, 5, 8, 64, torch.float32, seed=3)
    with pytest.raises(ValueError, match=r"q \(1, 2, 3, 64\), k \(1, 2, 5, 48\)"):
        attention(q, k[..., :48], v[..., :48])
    with pytest.raises(ValueError, match="expected one dtype on one device"):
        attention(q, k.half(), v.half())
    with pytest.raises(ValueError, match=r"v has strides .*last dim \(Dh\) must be contiguous"):
        attention(q, k, torch.randn(1, 2, 5, 128)[..., ::2])


# --------------------------------------------------------------------------------------------------------
# layering
# --------------------------------------------------------------------------------------------------------


def test_kernels_never_import_ray_or_characters() -> None:
    root = Path(kernels.__file__).parent
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top not in ("ray", "characters", "deployments", "placement"), f"{path.name} imports {name}"
