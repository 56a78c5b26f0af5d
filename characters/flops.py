"""Parameter counts and FLOPs per chunk, from the model itself (built on ``meta``) and its config.

FLOPs count a multiply-add as 2. Per forward over T chunk tokens with S cache keys:
    linear layers    2 * T * (their weights)         (audio K/V: 2 * nF*A * weights)
    self-attention   4 * T * S * D per layer         (QK^T and PV)
    cross-attention  4 * T * A * D per layer
Split layers (ParallelLinear and attention) divide by the tensor-parallel ranks; the rest is
replicated on every rank. Token-local layers kept whole (`topology.local_layers`) run on the rank's
1/n of the tokens: the same share of their FLOPs (the audio K/V projection, over the audio tokens,
then runs whole on every rank) for their whole weights in each rank's memory; so does self-attention under
`topology.local_attention` (its K/V rows gathered, `chunk_collectives`).

`chunk_collectives` lists the collectives one rank of a split session calls per chunk, with their
sizes: what an estimate of their time starts from (`scripts/benchmarks/latency_budget.py`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch

from characters.config import ModelConfig, SessionConfig
from characters.dit import Block, CausalDiT
from characters.kv_cache import KVCache
from characters.tp import ParallelLinear, apply_tensor_parallel

# Matmul rates measured on the lent H200 (FLOP/s): the median over the 15 step runs of benchmarks/h200/step_*_fp8.json
# of each run's best-of-five 8192^3 medians (bf16 torch.mm; FP8 torch._scaled_mm with row-wise scales, fast
# accumulation). The FP8 estimates of `characters presets` and scripts/tools/simulate_fleet.py are
# floors at these rates.
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
    topo = session.topology
    attention_whole = {id(lin) for b in model.blocks if isinstance(b, Block) and topo.local_attention
                       for lin in (b.self_attn.qkv, b.self_attn.o)}
    whole = sum(m.weight.numel() for m in model.modules() if isinstance(m, ParallelLinear)
                and (m.token_local or id(m) in attention_whole)
                ) if topo.local_layers and ranks > 1 else 0  # kept whole on every rank
    total = sum(p.numel() for p in model.parameters())
    kv_weights = sum(b.cross_attn.kv.weight.numel() for b in model.blocks if isinstance(b, Block))
    # the patch embedding and head: per token; each rank runs its own tokens under sequence parallelism
    per_token = sum(p.numel() for p in (model.patch_embed.weight, model.head.weight))
    per_vector = sum(p.numel() for p in [*model.time_embed.parameters(), *model.time_proj.parameters()])
    audio_embed = sum(p.numel() for p in model.audio_embed.parameters())
    attn = d.num_layers * (4 * t * s * d.dim + 4 * t * cfg.audio_tokens_per_latent * d.dim)
    kv_flops = 2 * audio_tokens * kv_weights
    split_flops = 2 * t * (split - kv_weights) + attn
    token_flops = 2 * t * per_token
    rep_flops = 2 * per_vector + 2 * audio_tokens * audio_embed
    per_forward = float(split_flops + kv_flops + token_flops + rep_flops)
    token_share = ranks if session.topology.sequence_parallel else 1
    per_forward_rank = split_flops / ranks + kv_flops / (1 if whole else ranks) + token_flops / token_share + rep_flops
    n = g.forwards_per_chunk
    linear = 2 * t * (split - kv_weights) / ranks
    attention = attn / ranks
    return ChunkCost(params=total, params_per_rank=(split - whole) // ranks + whole + (total - split),
                     tokens_per_chunk=t,
                     cache_tokens=s, forwards_per_chunk=n, flops_per_forward=per_forward,
                     flops_per_chunk=n * per_forward, flops_per_chunk_per_rank=n * per_forward_rank,
                     linear_flops_per_chunk_per_rank=n * linear, attention_flops_per_chunk_per_rank=n * attention,
                     other_flops_per_chunk_per_rank=n * (per_forward_rank - linear - attention))


@dataclass(frozen=True)
class RankMemory:
    weights_bytes: int  # the rank's DiT weights as it holds them (FP8 blocks under precision='fp8', scales included)
    cache_bytes: int  # its KV cache (every head it attends: all of them under topology.local_attention)


def rank_memory(session: SessionConfig) -> RankMemory:
    """What one DiT rank of `session` holds on its GPU before any step runs: its share of the weights (split, or kept
    whole by `topology.local_layers` / `local_attention`) in the session's precision and its KV cache (FP8 in the
    form of `model.attention_fp8_kernel`; 'auto' counts as cuDNN's). Worked out on the meta device: nothing is
    allocated. Activations, workspaces and CUDA graphs come on top."""
    cfg, topo, ranks = session.model, session.topology, session.topology.dit_ranks
    if cfg.attention_precision == "fp8" and cfg.attention_fp8_kernel == "auto":
        cfg = cfg.model_copy(update={"attention_fp8_kernel": "cudnn"})
    dtype = getattr(torch, session.dtype)  # the compute dtype (`presets`: bfloat16, a GPU session's)
    model = build_meta_dit(cfg)
    apply_tensor_parallel(model, rank=0, size=ranks, communicate=False, sequence_parallel=topo.sequence_parallel,
                          local_layers=topo.local_layers, local_attention=topo.local_attention)
    model.to(dtype)
    if cfg.precision == "fp8":
        model.to_fp8()
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    heads = cfg.dit.num_heads if topo.local_attention else cfg.dit.num_heads // ranks  # as `DiTRunner` has them
    cache = KVCache(cfg, local_heads=heads, device="meta", dtype=dtype, attention_backend="sdpa")
    return RankMemory(weights_bytes=weights, cache_bytes=cache.nbytes())


@dataclass(frozen=True)
class Collective:
    """One kind of collective call a rank of a split session makes, and how often per chunk."""

    op: Literal["all_gather", "reduce_scatter", "all_reduce"]
    bytes: int  # the whole tensor of one call: the gathered output, the reduce-scatter's input, the all-reduce's
    calls: int  # per chunk
    what: str


def chunk_collectives(session: SessionConfig) -> list[Collective]:
    """The collectives one DiT rank calls per chunk (none on one rank), grouped by kind and size: sequence
    parallelism's all-gathers before the split column layers (FP8: the e4m3 bytes and their per-token float32
    scales, two calls) and reduce-scatters after the split row layers, or all-reduces after the row layers with
    every token on every rank; the head's gather. Layers kept whole (`local_layers`) call none; self-attention kept
    whole (`local_attention`) gathers every rank's K/V rows, one call a block (the Triton FP8 cache's form: three)."""
    cfg, topo = session.model, session.topology
    ranks = topo.dit_ranks
    if ranks == 1:
        return []
    model = build_meta_dit(cfg)
    apply_tensor_parallel(model, rank=0, size=ranks, communicate=False, sequence_parallel=topo.sequence_parallel,
                          local_layers=topo.local_layers, local_attention=topo.local_attention)
    t, n = cfg.tokens_per_chunk, cfg.generation.forwards_per_chunk
    act = torch.finfo(getattr(torch, session.dtype)).bits // 8  # the compute dtype's bytes
    fp8 = cfg.precision == "fp8"
    calls: dict[tuple[str, int, str], int] = {}

    def add(op: str, nbytes: int, what: str) -> None:
        calls[(op, nbytes, what)] = calls.get((op, nbytes, what), 0) + n

    for name, m in model.named_modules():
        if not isinstance(m, ParallelLinear) or m.tp_size == 1:
            continue
        where = name.split(".", 2)[-1] if name.startswith("blocks.") else name  # per block: "blocks.7.fc1" -> "fc1"
        if m.shards is not None and m.mode == "column":
            add("all_gather", t * m.full_in * (1 if fp8 else act), f"{where} input")
            if fp8:
                add("all_gather", t * 4, f"{where} input scales")
        elif m.shards is not None:
            add("reduce_scatter", t * m.full_out * act, f"{where} output")
        elif m.mode == "row":
            add("all_reduce", t * m.full_out * act, f"{where} output")
    if topo.local_attention:  # per block: every rank's K/V rows (padding rows too) in the cache's written form
        rows, d, h = ranks * -(-t // ranks), cfg.dit.dim, cfg.dit.num_heads
        for _ in model.blocks:
            if cfg.attention_precision != "fp8":
                add("all_gather", 2 * rows * d * act, "self-attention K/V rows")
            elif cfg.attention_fp8_kernel == "triton":  # K, V transposed, V's scale per (head, key): three calls
                add("all_gather", rows * d, "self-attention K rows (e4m3)")
                add("all_gather", rows * d, "self-attention V rows (e4m3)")
                add("all_gather", rows * h * 4, "self-attention V row scales")
            else:  # cuDNN's form (what "auto" picks on Hopper): K and V in e4m3 in one buffer
                add("all_gather", 2 * rows * d, "self-attention K/V rows (e4m3)")
    if topo.sequence_parallel:
        add("all_gather", t * model.head.out_features * act, "head output")
    return [Collective(op, nbytes, count, what) for (op, nbytes, what), count in calls.items()]  # type: ignore[arg-type]
