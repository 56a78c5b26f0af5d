"""The per-tensor FP8 attention form (`kernels.attention_cudnn_fp8`, the cache `KVCache` keeps for cuDNN's FP8
kernel): its reference, the V scale set on a cache's first write, the padded cache and the kernel choice. cuDNN
itself runs on a Hopper GPU only: tests/gpu/test_fp8_gpu.py compares it with this reference."""

from __future__ import annotations

import pytest
import torch

from characters.config import model_preset
from characters.kv_cache import KVCache, fp8_attention_kernel
from kernels.attention import attention_ref
from kernels.attention_cudnn_fp8 import attention_fp8_tensor, attention_fp8_tensor_ref, cudnn_fp8_supported, padded_keys
from kernels.fp8 import FP8
from kernels.qkv_prep_fp8 import V_HEADROOM, set_v_tensor_scale
from kernels.testing import rel_err


def _inputs(b: int = 1, hh: int = 3, t: int = 20, s: int = 128, dh: int = 64, seed: int = 0
            ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, hh, n, dh, generator=g) for n in (t, s, s))
    qk = torch.tensor([q.abs().amax() / 448, k.abs().amax() / 448])
    vs = torch.tensor([2 * v.abs().amax() / 448])
    return (q / qk[0]).to(FP8), (k / qk[1]).to(FP8), (v / vs).to(FP8), qk, vs


def test_reference_is_attention_over_the_dequantised_cache() -> None:
    q8, k8, v8, qk, vs = _inputs()
    out = torch.empty(1, 20, 3, 64, dtype=FP8).transpose(1, 2)  # token-major, as the output projection reads it
    got = attention_fp8_tensor(q8, k8, v8, 100, qk, vs, out, "torch")
    assert got is out
    exact = attention_ref(q8.float() * qk[0], k8[:, :, :100].float() * qk[1], v8[:, :, :100].float() * vs)
    err = rel_err(out.float() * vs, exact)
    assert 1e-3 < err < 0.05, err  # the output's e4m3 rounding, nothing more
    full = torch.empty_like(out)
    attention_fp8_tensor_ref(q8, k8, v8, 128, qk, vs, full)
    assert not torch.equal(full.view(torch.uint8), out.view(torch.uint8))  # keys past `valid` are not read


def test_output_scale_never_overflows() -> None:
    """|out| <= max|v|: one key dominating every row gives V's largest row back, within e4m3's range."""
    q8, k8, v8, qk, vs = _inputs(t=4, s=64)
    v8[0, :, 7] = torch.full((64,), 448.0).to(FP8)  # the largest V the scale allows
    k8.zero_()
    k8[0, :, 7] = q8[0, :, 0]  # key 7 aligned with query 0 ...
    qk = torch.tensor([qk[0].item(), 50.0])  # ... and its score large enough to take all the weight
    out = torch.empty(1, 3, 4, 64, dtype=FP8)
    attention_fp8_tensor_ref(q8, k8, v8, 64, qk, vs, out)
    assert torch.isfinite(out.float()).all() and out.float()[0, :, 0].eq(448).all()


def test_v_scale_is_set_on_the_first_write_only() -> None:
    qkv = torch.randn(1, 10, 3, 2, 64)
    vs = torch.zeros(1)
    set_v_tensor_scale(vs, qkv)
    first = qkv[:, :, 2].abs().amax() * V_HEADROOM / 448
    torch.testing.assert_close(vs, first.reshape(1))
    set_v_tensor_scale(vs, 100 * qkv)  # a later chunk: the session's scale holds
    torch.testing.assert_close(vs, first.reshape(1))


def test_bad_arguments_are_value_errors() -> None:
    q8, k8, v8, qk, vs = _inputs()
    out = torch.empty(1, 3, 20, 64, dtype=FP8)
    with pytest.raises(ValueError, match="valid=0"):
        attention_fp8_tensor(q8, k8, v8, 0, qk, vs, out, "torch")
    with pytest.raises(ValueError, match="v_scale"):
        attention_fp8_tensor(q8, k8, v8, 10, qk, vs.reshape(1, 1), out, "torch")
    with pytest.raises(ValueError, match="out is"):
        attention_fp8_tensor(q8, k8, v8, 10, qk, vs, out.float(), "torch")
    with pytest.raises(ValueError, match="kernel='flash'"):
        attention_fp8_tensor(q8, k8, v8, 10, qk, vs, out, "flash")


def test_padded_keys_and_support() -> None:
    assert [padded_keys(n) for n in (1, 64, 65, 14960)] == [64, 64, 128, 14976]
    assert not cudnn_fp8_supported("cpu", 128)


def test_kernel_choice_and_the_cudnn_cache_form() -> None:
    m = model_preset("tiny", attention_precision="fp8")
    assert fp8_attention_kernel(m, "cpu") == "triton"  # auto: cuDNN only where it runs
    c = model_preset("tiny", attention_precision="fp8", attention_fp8_kernel="cudnn")
    assert fp8_attention_kernel(c, "cpu") == "cudnn"  # on a CPU: its reference (FP8 emulation)
    cache = KVCache(c, local_heads=4, device="cpu", dtype=torch.bfloat16)
    s = padded_keys(c.cache_tokens)
    assert cache.k.shape == cache.v.shape == (4, 1, 4, s, 48) and cache.v.dtype == FP8 and s % 64 == 0
    assert cache.v_scale.shape == (4, 1) and not cache.v_scale.any()  # unset until the first write
    cache.v_scale.fill_(2.0)
    cache.v_inv.fill_(0.5)
    cache.v_scale_set = [True] * 4
    cache.k.view(torch.uint8).fill_(1)
    cache.reset()
    assert not cache.v_scale.any() and not cache.v_inv.any() and not cache.k.view(torch.uint8).any()
    assert not any(cache.v_scale_set)


def test_v_scale_comes_from_the_sink_and_holds_for_the_session() -> None:
    """The first write after a reset (the reference frame into the sink) sets each layer's V scale; chunks leave
    it; the next session's sink sets it again."""
    from characters.config import session_config
    from characters.engine import DiTRunner

    cfg = session_config("tiny", "cpu", seed=2, weights="random",
                         model={"precision": "fp8", "attention_precision": "fp8", "attention_fp8_kernel": "cudnn",
                                "dit": {"num_layers": 2}})
    runner = DiTRunner(cfg, emulate_fp8=True)
    h, w = cfg.model.latent_hw
    runner.start(torch.randn(1, cfg.model.dit.latent_channels, h, w, generator=torch.Generator().manual_seed(0)))
    first = runner.cache.v_scale.clone()
    assert (first > 0).all() and all(runner.cache.v_scale_set)
    torch.testing.assert_close(runner.cache.v_inv, 1 / first)  # the output's scale, kept beside it
    for _ in range(2):
        runner.step(torch.zeros(runner.frontend.expected_samples).numpy())
    assert torch.equal(runner.cache.v_scale, first)
    runner.start(10 * torch.randn(1, cfg.model.dit.latent_channels, h, w, generator=torch.Generator().manual_seed(1)))
    assert not torch.equal(runner.cache.v_scale, first)
    torch.testing.assert_close(runner.cache.v_inv, 1 / runner.cache.v_scale)
