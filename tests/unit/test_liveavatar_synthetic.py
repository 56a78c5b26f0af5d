"""Synthetic LiveAvatar weights: a function of (seed, key) only, scaled by the documented rule."""

from __future__ import annotations

import math

import torch

from characters.families.liveavatar.synthetic import synthetic_state_dict, synthetic_tensor


def test_a_key_does_not_depend_on_the_order_or_company_it_is_drawn_in() -> None:
    spec = {
        "blocks.0.self_attn.q.weight": ((64, 32), torch.float32),
        "blocks.0.modulation": ((1, 6, 32), torch.float32),
        "blocks.0.norm3.weight": ((32,), torch.float32),
    }
    forward = synthetic_state_dict(spec, seed=7)
    backward = synthetic_state_dict(dict(reversed(list(spec.items()))), seed=7)
    alone = synthetic_tensor("blocks.0.norm3.weight", (32,), torch.float32, seed=7)
    assert list(forward) == list(spec)
    for name in spec:
        assert torch.equal(forward[name], backward[name])
    assert torch.equal(forward["blocks.0.norm3.weight"], alone)


def test_seed_and_name_both_change_the_values() -> None:
    a = synthetic_tensor("blocks.0.self_attn.q.weight", (16, 16), torch.float32, seed=0)
    assert not torch.equal(a, synthetic_tensor("blocks.0.self_attn.q.weight", (16, 16), torch.float32, seed=1))
    assert not torch.equal(a, synthetic_tensor("blocks.0.self_attn.k.weight", (16, 16), torch.float32, seed=0))


def test_scales_follow_the_rule() -> None:
    weight = synthetic_tensor("blocks.0.ffn.0.weight", (256, 4096), torch.float32, seed=3)
    assert abs(weight.std().item() - 1 / math.sqrt(4096)) < 0.05 / math.sqrt(4096)
    conv = synthetic_tensor("patch_embedding.weight", (512, 16, 1, 2, 2), torch.float32, seed=3)
    assert abs(conv.std().item() - 1 / math.sqrt(64)) < 0.05 / math.sqrt(64)
    modulation = synthetic_tensor("head.modulation", (1, 2, 4096), torch.float32, seed=3)
    assert abs(modulation.std().item() - 1 / math.sqrt(4096)) < 0.1 / math.sqrt(4096)
    norm = synthetic_tensor("blocks.0.self_attn.norm_q.weight", (4096,), torch.float32, seed=3)
    assert abs(norm.mean().item() - 1.0) < 0.01 and abs(norm.std().item() - 0.1) < 0.01
    bias = synthetic_tensor("blocks.0.self_attn.q.bias", (4096,), torch.float32, seed=3)
    assert abs(bias.mean().item()) < 0.002 and abs(bias.std().item() - 0.02) < 0.002


def test_dtype_is_a_cast_of_the_float32_draw() -> None:
    full = synthetic_tensor("text_embedding.0.weight", (32, 8), torch.float32, seed=5)
    half = synthetic_tensor("text_embedding.0.weight", (32, 8), torch.bfloat16, seed=5)
    assert half.dtype == torch.bfloat16
    assert torch.equal(half, full.to(torch.bfloat16))
