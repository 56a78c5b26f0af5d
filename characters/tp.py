"""Tensor parallelism as a transform over a model that reads top to bottom on one device.

Every linear layer that tensor parallelism splits is a `ParallelLinear` that knows how it splits:

- ``column``: output features are split across ranks (Q/K/V projections, the MLP's first layer).
  ``groups`` > 1 splits each of several fused outputs separately (fused QKV: each of Q, K and V
  is split by heads, so rank r holds heads [r*Hl, (r+1)*Hl) of all three).
- ``row``: input features are split; partial outputs are summed with an all-reduce; rank 0 alone
  adds the bias (in its GEMM), so the sum carries it once (output projections, the MLP's second layer).

On one device (``size == 1``) both are a plain linear layer. `apply_tensor_parallel(model, group)`
slices the weights each rank keeps and divides every attention module's head count; the
parameter's logical (unsplit) shape stays known through `full_shape`, which is what seeded
initialisation and sharded checkpoints use.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

Mode = Literal["column", "row"]


class ParallelLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, mode: Mode, *, groups: int = 1, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.mode: Mode = mode
        self.groups = groups
        self.full_in, self.full_out = in_features, out_features
        self.tp_rank, self.tp_size = 0, 1
        self.group: dist.ProcessGroup | None = None
        self.communicate = True

    def shard_tensor(self, name: Literal["weight", "bias"], full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the logical (unsplit) `weight` or `bias` tensor."""
        r, n = self.tp_rank, self.tp_size
        if n == 1:
            return full
        if self.mode == "row":
            if name == "bias":
                return full  # added once, after the all-reduce
            cols = full.shape[1] // n
            return full[:, r * cols:(r + 1) * cols]
        grouped = full.reshape(self.groups, full.shape[0] // self.groups, *full.shape[1:])  # (G, out/G, ...)
        rows = grouped.shape[1] // n
        return grouped[:, r * rows:(r + 1) * rows].reshape(-1, *full.shape[1:])

    def full_shape(self, name: Literal["weight", "bias"]) -> tuple[int, ...]:
        return (self.full_out, self.full_in) if name == "weight" else (self.full_out,)

    def shard_(self, rank: int, size: int, group: dist.ProcessGroup | None, communicate: bool = True) -> None:
        """Keep this rank's slice of the current (full) weights. `communicate=False` skips the
        all-reduce (one rank's compute alone, for benchmarks: the output is then not the model's)."""
        if size == 1:
            return
        if self.tp_size != 1:
            raise RuntimeError("ParallelLinear is already sharded; shard a freshly built model")
        self.tp_rank, self.tp_size, self.group, self.communicate = rank, size, group, communicate
        with torch.no_grad():
            self.weight = nn.Parameter(self.shard_tensor("weight", self.weight).clone())
            if self.bias is not None:
                self.bias = nn.Parameter(self.shard_tensor("bias", self.bias).clone())
        if self.mode == "row":
            self.in_features //= size
        else:
            self.out_features //= size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "column" or self.tp_size == 1:
            return super().forward(x)
        # rank 0 adds the bias in the GEMM's epilogue; the all-reduce then counts it exactly once
        y = torch.nn.functional.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        if self.communicate:
            dist.all_reduce(y, group=self.group)
        return y


def apply_tensor_parallel(model: nn.Module, group: dist.ProcessGroup | None = None, *,
                          rank: int | None = None, size: int | None = None, communicate: bool = True) -> nn.Module:
    """Split `model` in place for tensor-parallel rank `rank` of `size` (default: from `group`).

    Modules with a `num_heads` attribute have it divided by `size`. `communicate=False` builds one
    rank's share with no collectives (benchmarks of a rank's compute alone). Building the model on the
    ``meta`` device first and sharding before materialising keeps memory to one rank's share.
    """
    if size is None:
        size = dist.get_world_size(group) if dist.is_initialized() else 1
    if rank is None:
        rank = dist.get_rank(group) if dist.is_initialized() else 0
    if size == 1:
        return model
    for module in model.modules():
        if isinstance(module, ParallelLinear):
            module.shard_(rank, size, group, communicate)
        heads = getattr(module, "num_heads", None)
        if isinstance(heads, int) and not isinstance(module, nn.MultiheadAttention):
            if heads % size:
                raise ValueError(f"{type(module).__name__}.num_heads={heads} is not divisible by {size} ranks")
            setattr(module, "num_heads", heads // size)  # noqa: B010 (any attention-like module)
    return model
