"""LiveAvatar's layers shared by its transformer and its audio injector: Wan's norms, attention projections
and the float32 linear of its autocast regions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def sinusoidal(dim: int, t: torch.Tensor) -> torch.Tensor:
    """(n, dim) float32 [cos | sin] timestep embedding computed in float64 (Wan's sinusoidal_embedding_1d)."""
    half = dim // 2
    pos = t.to(torch.float64).flatten()
    freqs = torch.pow(10000, -torch.arange(half, dtype=torch.float64, device=t.device) / half)
    ang = torch.outer(pos, freqs)
    return torch.cat([torch.cos(ang), torch.sin(ang)], dim=1).float()


class RMSNorm(nn.Module):
    """Wan's RMSNorm: float32 statistics, cast back, then the weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)).type_as(x) * self.weight


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
    """q/k/v/o projections with RMS-normed q and k; `shard` > 1 keeps 1/shard of the heads (a rank's share)."""

    def __init__(self, dim: int, num_heads: int, eps: float, shard: int = 1) -> None:
        super().__init__()
        inner = dim // shard
        self.num_heads = num_heads // shard
        self.q, self.k, self.v = (nn.Linear(dim, inner) for _ in range(3))
        self.o = nn.Linear(inner, dim)
        self.norm_q = RMSNorm(inner, eps)
        self.norm_k = RMSNorm(inner, eps)

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


class Fp8Linear(nn.Module):
    """A linear layer in e4m3: weights quantised once per output channel, activations per token on the fly,
    the GEMM through `kernels.fp8.fp8_linear` (cuBLASLt scaled GEMM on CUDA, its reference elsewhere)."""

    def __init__(self, layer: nn.Linear) -> None:
        from kernels.fp8 import quantize_weight

        super().__init__()
        w8, sw = quantize_weight(layer.weight.detach())
        self.w8: torch.Tensor
        self.sw: torch.Tensor
        self.register_buffer("w8", w8)
        self.register_buffer("sw", sw)
        self.bias = layer.bias
        self.out_features = layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from kernels.fp8 import fp8_linear, quantize_rows

        act = quantize_rows(x.reshape(-1, x.shape[-1]))
        out = fp8_linear(act.data, act.scale, self.w8, self.sw, self.bias, out_dtype=x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)


def to_fp8_(model: nn.Module, skip: tuple[str, ...]) -> int:
    """Replace every nn.Linear whose name does not start with one of `skip` by an Fp8Linear; returns how many."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.startswith(skip)]
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, Fp8Linear(getattr(owner, leaf)))
    return len(names)
