"""LiveAvatar's layers shared by its transformer and its audio injector: Wan's norms, attention projections
and the float32 linear of its autocast regions.

Projections are the engine's `characters.tp.ParallelLinear` (column for q/k/v and the MLP's first layer, row for
o and its second), so `shard_liveavatar` splits heads and MLP columns with the shared transform and FP8 is the
shared `to_fp8_`. Wan normalises q and k over all heads at once (not per head): under tensor parallelism the
RMS statistic is summed over the ranks (one small all-reduce per norm).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from characters.tp import ParallelLinear, apply_tensor_parallel


def sinusoidal(dim: int, t: torch.Tensor) -> torch.Tensor:
    """(n, dim) float32 [cos | sin] timestep embedding computed in float64 (Wan's sinusoidal_embedding_1d)."""
    half = dim // 2
    pos = t.to(torch.float64).flatten()
    freqs = torch.pow(10000, -torch.arange(half, dtype=torch.float64, device=t.device) / half)
    ang = torch.outer(pos, freqs)
    return torch.cat([torch.cos(ang), torch.sin(ang)], dim=1).float()


class RMSNorm(nn.Module):
    """Wan's RMSNorm: float32 statistics, cast back, then the weight. Sharded (`shard_`), each rank holds its
    channels and the mean square is summed over the ranks."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.full_dim = dim
        self.group: dist.ProcessGroup | None = None
        self.communicate = False

    @torch.no_grad()
    def shard_(self, rank: int, size: int, group: dist.ProcessGroup | None, communicate: bool) -> None:
        cols = self.full_dim // size
        self.weight = nn.Parameter(self.weight[rank * cols:(rank + 1) * cols].clone())
        self.group, self.communicate = group, communicate and size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        ss = xf.pow(2).sum(dim=-1, keepdim=True)  # (..., 1)
        if self.communicate:
            dist.all_reduce(ss, group=self.group)
        return (xf * torch.rsqrt(ss / self.full_dim + self.eps)).type_as(x) * self.weight


def layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Wan's affine-free LayerNorm, result in the input's dtype."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps).type_as(x)


def f32_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A linear layer computed in float32 whatever its weights' dtype (their float32 autocast regions)."""
    return F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full (unmasked) attention on (B, L, Hh, Dh) tensors; (B, Lq, Hh * Dh) out."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).flatten(2)


class _Attention(nn.Module):
    """q/k/v/o projections with RMS-normed q and k (Wan's: over all heads)."""

    def __init__(self, dim: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q, self.k, self.v = (ParallelLinear(dim, dim, "column") for _ in range(3))
        self.o = ParallelLinear(dim, dim, "row")
        self.norm_q = RMSNorm(dim, eps)
        self.norm_k = RMSNorm(dim, eps)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, Hh*Dh) -> (B, L, Hh, Dh)."""
        return x.unflatten(-1, (self.num_heads, -1))


class CrossAttention(_Attention):
    """Queries from the tokens, keys and values from a context (text, or audio tokens per frame)."""

    def context_kv(self, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.heads(self.norm_k(self.k(ctx))), self.heads(self.v(ctx))

    def forward(self, x: torch.Tensor, ctx: torch.Tensor | None = None,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        q = self.heads(self.norm_q(self.q(x)))
        k, v = kv if kv is not None else self.context_kv(ctx)  # type: ignore[arg-type]
        return self.o(attend(q, k.to(q.dtype), v.to(q.dtype)))


class SelfAttention(_Attention):
    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.heads(self.norm_q(self.q(x))), self.heads(self.norm_k(self.k(x))), self.heads(self.v(x))


def mlp(dim: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(ParallelLinear(dim, hidden, "column"), nn.GELU(approximate="tanh"),
                         ParallelLinear(hidden, dim, "row"))


def shard_liveavatar(model: nn.Module, group: dist.ProcessGroup | None = None, *, rank: int | None = None,
                     size: int | None = None, communicate: bool = True) -> nn.Module:
    """Tensor parallelism for rank `rank` of `size`: the shared transform splits every ParallelLinear and the
    heads; the q/k norms keep the rank's channels and sum their statistic over the group. `communicate=False`
    builds one rank's share with no collectives (a rank's compute alone, for benchmarks)."""
    size = size if size is not None else (dist.get_world_size(group) if dist.is_initialized() else 1)
    rank = rank if rank is not None else (dist.get_rank(group) if dist.is_initialized() else 0)
    if size == 1:
        return model
    apply_tensor_parallel(model, group, rank=rank, size=size, communicate=communicate)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.shard_(rank, size, group, communicate)
    return model


def to_fp8_(model: nn.Module) -> int:
    """Every projection and MLP layer of the blocks and audio injectors in e4m3 through the shared
    `ParallelLinear.to_fp8_` (the embeddings, the time MLP, the head and the audio encoder stay, as the authors'
    FP8 leaves them); returns how many layers."""
    layers = [m for m in model.modules() if isinstance(m, ParallelLinear)]
    for layer in layers:
        layer.to_fp8_()
    return len(layers)
