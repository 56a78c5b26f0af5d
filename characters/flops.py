"""Parameter counts and FLOPs per chunk, from the model itself (built on ``meta``) and its config.

FLOPs count a multiply-add as 2. Per forward over T chunk tokens with S cache keys:
    linear layers    2 * T * (their weights)         (audio K/V: 2 * nF*A * weights)
    self-attention   4 * T * S * D per layer         (QK^T and PV)
    cross-attention  4 * T * A * D per layer
Split layers (ParallelLinear and attention) divide by the tensor-parallel ranks; the rest is
replicated on every rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from characters.config import ModelConfig, SessionConfig
from characters.dit import Block, CausalDiT
from characters.tp import ParallelLinear

# Matmul rates measured on the lent H200 (FLOP/s): the median over the 15 step runs of benchmarks/h200/step_*_fp8.json
# of each run's best-of-five 8192^3 medians (bf16 torch.mm; FP8 torch._scaled_mm with row-wise scales, fast
# accumulation). The FP8 estimates of `characters presets` and scripts/simulate_fleet.py are floors at these rates.
H200_BF16_RATE = 755e12
H200_FP8_RATE = 1380e12


@dataclass(frozen=True)
class ChunkCost:
    params: int
    params_per_rank: int
    tokens_per_chunk: int
    cache_tokens: int
    forwards_per_chunk: int
    flops_per_forward: float
    flops_per_chunk: float
    flops_per_chunk_per_rank: float
    # the rank's share split by the unit that runs it (they sum to flops_per_chunk_per_rank)
    linear_flops_per_chunk_per_rank: float = 0.0  # the blocks' split linear layers (FP8 under precision='fp8')
    attention_flops_per_chunk_per_rank: float = 0.0  # self- and cross-attention
    other_flops_per_chunk_per_rank: float = 0.0  # audio K/V, embeddings, head, timestep MLPs

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def floor_ms(self, bf16_rate: float, fp8_rate: float | None = None, fp8_attention: bool = False) -> float:
        """The rank's FLOP floor per chunk in ms: linear layers at `fp8_rate` when given (FP8 GEMMs), else at
        `bf16_rate`; self-attention at `fp8_rate` when `fp8_attention`; the rest at `bf16_rate` (FLOP/s)."""
        lin_rate = fp8_rate or bf16_rate
        att_rate = fp8_rate if fp8_attention and fp8_rate else bf16_rate
        return 1e3 * (self.linear_flops_per_chunk_per_rank / lin_rate
                      + self.attention_flops_per_chunk_per_rank / att_rate
                      + self.other_flops_per_chunk_per_rank / bf16_rate)


def build_meta_dit(cfg: ModelConfig) -> CausalDiT:
    with torch.device("meta"):
        return CausalDiT(cfg)


def chunk_cost(session: SessionConfig) -> ChunkCost:
    cfg, ranks = session.model, session.topology.dit_ranks
    model = build_meta_dit(cfg)
    d, g = cfg.dit, cfg.generation
    t, s = cfg.tokens_per_chunk, cfg.cache_tokens
    audio_tokens = g.latent_frames_per_chunk * cfg.audio_tokens_per_latent
    split = sum(p.numel() for m in model.modules() if isinstance(m, ParallelLinear)
                for n, p in m.named_parameters(recurse=False) if n == "weight")
    total = sum(p.numel() for p in model.parameters())
    kv_weights = sum(b.cross_attn.kv.weight.numel() for b in model.blocks if isinstance(b, Block))
    # the patch embedding and head: per token; each rank runs its own tokens under sequence parallelism
    per_token = sum(p.numel() for p in (model.patch_embed.weight, model.head.weight))
    per_vector = sum(p.numel() for p in [*model.time_embed.parameters(), *model.time_proj.parameters()])
    audio_embed = sum(p.numel() for p in model.audio_embed.parameters())
    attn = d.num_layers * (4 * t * s * d.dim + 4 * t * cfg.audio_tokens_per_latent * d.dim)
    split_flops = 2 * t * (split - kv_weights) + 2 * audio_tokens * kv_weights + attn
    token_flops = 2 * t * per_token
    rep_flops = 2 * per_vector + 2 * audio_tokens * audio_embed
    per_forward = float(split_flops + token_flops + rep_flops)
    token_share = ranks if session.topology.sequence_parallel else 1
    per_forward_rank = split_flops / ranks + token_flops / token_share + rep_flops
    n = g.forwards_per_chunk
    linear = 2 * t * (split - kv_weights) / ranks
    attention = attn / ranks
    return ChunkCost(params=total, params_per_rank=(split // ranks) + (total - split), tokens_per_chunk=t,
                     cache_tokens=s, forwards_per_chunk=n, flops_per_forward=per_forward,
                     flops_per_chunk=n * per_forward, flops_per_chunk_per_rank=n * per_forward_rank,
                     linear_flops_per_chunk_per_rank=n * linear, attention_flops_per_chunk_per_rank=n * attention,
                     other_flops_per_chunk_per_rank=n * (per_forward_rank - linear - attention))
