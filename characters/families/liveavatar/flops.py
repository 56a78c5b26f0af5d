"""LiveAvatar's arithmetic per block: matmul FLOPs, parameters and what one tensor-parallel rank holds, for the
floors beside measured times (`characters presets`, scripts/liveavatar/bench_dit.py)."""

from __future__ import annotations

from dataclasses import dataclass

from characters.families.liveavatar.config import LiveAvatarDiTConfig, LiveAvatarLoopConfig


@dataclass(frozen=True)
class BlockCost:
    ranks: int
    params: int  # the whole transformer
    flops_per_rank: float  # one block (every step), steady state (the rolling cache full)
    linear_flops_per_rank: float  # the part in linear layers (what FP8 speeds up)
    weights_gb_per_rank: float  # bf16
    cache_gb_per_rank: float  # the per-step rolling caches + the condition cache, bf16


def params(cfg: LiveAvatarDiTConfig) -> int:
    """The transformer's parameter count, from the model built on the meta device (no memory)."""
    import torch

    from characters.families.liveavatar.dit import LiveAvatarDiT

    with torch.device("meta"):
        return sum(p.numel() for p in LiveAvatarDiT(cfg).parameters())


def block_cost(cfg: LiveAvatarDiTConfig, loop: LiveAvatarLoopConfig, ranks: int = 1) -> BlockCost:
    t, d, f = loop.block_tokens, cfg.dim, cfg.ffn_dim
    cond = int(2.5 * loop.tokens_per_frame)
    keys = loop.cache_slots + cond
    inj = len(cfg.audio_inject_layers)
    linear = cfg.num_layers * 2 * t * (6 * d * d + 2 * d * f) + inj * 2 * t * 2 * d * d  # (text K/V once a session)
    attention = cfg.num_layers * 4 * t * d * (keys + cfg.text_len) + inj * 4 * t * d * (cfg.audio_tokens + 1)
    per_rank = loop.steps * (linear + attention) / ranks
    cache = (loop.steps * loop.cache_slots + cond) * 2 * d * 2 * cfg.num_layers / ranks
    return BlockCost(ranks, params(cfg), per_rank, loop.steps * linear / ranks, params(cfg) * 2 / ranks / 1e9,
                     cache / 1e9)
