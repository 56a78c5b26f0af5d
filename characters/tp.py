"""Tensor parallelism as a transform over a model that reads top to bottom on one device.

Details: docs/dit.md (`characters.tp`)."""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kernels.fp8 import FP8, Fp8Act, fp8_linear, quantize_rows_ref, quantize_weight

Mode = Literal["column", "row"]
Overlap = Literal["none", "ring", "symm_mem"]
OVERLAPS: tuple[Overlap, ...] = ("none", "ring", "symm_mem")


class TokenShards:
    """How the T tokens of the current forward are split over the ranks, and the collectives that
    move between the split and the whole.

    Rank r owns rows [r*m, (r+1)*m) with m = ceil(T/n); rows past T (only when n does not divide T)
    are zero padding that the token-wise ops carry along and every gather drops. `begin(T)` is called
    once per forward, before any layer runs (T is a host int: static per captured graph).
    `communicate=False` leaves the collectives out (one rank's compute alone, for benchmarks): a
    gather then fills only this rank's rows, so shapes and FLOPs are the rank's own.
    """

    def __init__(self, rank: int, size: int, group: dist.ProcessGroup | None, *, overlap: Overlap = "none",
                 communicate: bool = True) -> None:
        if overlap not in OVERLAPS:
            raise ValueError(f"tp overlap={overlap!r} is unknown; expected one of {list(OVERLAPS)}")
        self.rank, self.size, self.group = rank, size, group
        self.overlap: Overlap = overlap
        self.communicate = communicate
        self.tokens, self.rows = 0, 0
        self._standins: dict[tuple[object, ...], torch.Tensor] = {}
        self._symm_enabled: set[str] = set()

    def begin(self, tokens: int) -> None:
        self.tokens, self.rows = tokens, -(-tokens // self.size)

    # ------------------------------------------------------------------ layout helpers
    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (B, n*m, ...), zero rows appended when n does not divide T."""
        pad = self.size * self.rows - x.shape[1]
        if pad == 0:
            return x
        return F.pad(x, (0, 0) * (x.ndim - 2) + (0, pad))

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a tensor every rank holds whole. (B, T, ...) -> (B, m, ...)"""
        m = self.rows
        return self._padded(x)[:, self.rank * m:(self.rank + 1) * m]

    def row_buffer(self, like: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A row layer's output, (1, n*m, width) with its padding rows zero, for its GEMM to write its T rows
        into in place (`out[:, :T]`), when the ranks do not divide T: the reduce-scatter then takes it as it is,
        instead of a padded copy of the whole output (at 3 ranks of `57b`, that copy and its fill were 9 ms of
        a 159 ms step). None when nothing pads, or for B > 1 (its first T rows would not be contiguous)."""
        if self.size * self.rows == self.tokens or like.shape[0] != 1:
            return None
        buf = torch.empty(1, self.size * self.rows, width, device=like.device, dtype=dtype)
        buf[:, self.tokens:].zero_()
        return buf

    def _blocks(self, b: int, width: int, like: torch.Tensor) -> torch.Tensor:
        """A gather buffer (n, B, m, width): block c holds rank c's rows, contiguous for send/recv."""
        return torch.empty(self.size, b, self.rows, width, device=like.device, dtype=like.dtype)

    def _whole(self, blocks: torch.Tensor) -> torch.Tensor:
        """(n, B, m, W) -> (B, T, W); a view for B == 1."""
        n, b, m, w = blocks.shape
        return blocks.transpose(0, 1).reshape(b, n * m, w)[:, :self.tokens]

    def _row_range(self, c: int) -> tuple[int, int]:
        return c * self.rows, min((c + 1) * self.rows, self.tokens)

    def frame_segments(self, frames: int) -> list[tuple[int, int, int]]:
        """This rank's m rows as runs of one frame each: (start, end, frame) in local row offsets, covering [0, m)
        in order. The T tokens are frame-major, T / `frames` per frame; padding rows (past T) join the last frame's
        run (their values are dropped at the gather). Host ints: static per shape (graph capture)."""
        if frames < 1 or self.tokens % frames:
            raise ValueError(f"T={self.tokens} tokens do not split into {frames} frames")
        per, lo0 = self.tokens // frames, self.rank * self.rows
        segments, start = [], 0
        while start < self.rows:
            frame = min((lo0 + start) // per, frames - 1)
            end = self.rows if frame == frames - 1 else min(self.rows, (frame + 1) * per - lo0)
            segments.append((start, end, frame))
            start = end
        return segments

    # ------------------------------------------------------------------ collectives
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """All ranks' rows, whole: (B, m, W) -> (B, T, W)."""
        if not self.communicate:
            blocks = self._standin(x)
            blocks[self.rank].copy_(x)
            return self._whole(blocks)
        blocks = self._blocks(x.shape[0], x.shape[-1], x)  # (n, B, m, W)
        dist.all_gather_into_tensor(blocks.flatten(0, 1), x.contiguous(), group=self.group)  # (n*B, m, W)
        return self._whole(blocks)

    def _standin(self, x: torch.Tensor) -> torch.Tensor:
        """Without communication: a gather buffer kept per shape (made on first use, outside any graph
        capture) whose other ranks' rows hold copies of this rank's first rows: activations of the real
        magnitude, not stale memory (denormals and NaNs slow CPU math) nor zeros (a GEMM over zeros draws
        less power and runs at higher clocks than one over real data). No fill lands in the timed step."""
        key = (x.shape[0], self.rows, x.shape[-1], x.dtype, x.device)
        buf = self._standins.get(key)
        if buf is None:
            buf = self._standins[key] = self._blocks(x.shape[0], x.shape[-1], x)
            buf.copy_(x.expand_as(buf))  # (n, B, m, W) <- (B, m, W) in every block
        return buf

    def gather_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """All ranks' blocks of `blocks` (n, ...), in place: block `rank` holds this rank's data (written there
        first), the others are filled from their ranks (`topology.local_attention`'s K/V rows). Without
        communication the other blocks keep copies of this rank's first block, made on first use (outside any
        graph capture: the warm-up's eager steps): values of the real magnitude, no copy in the timed step."""
        if blocks.shape[0] != self.size:
            raise ValueError(f"gather_blocks: {blocks.shape[0]} blocks for {self.size} ranks")
        raw = blocks.view(torch.uint8) if blocks.dtype == FP8 else blocks  # NCCL and gloo move FP8 as bytes
        if not self.communicate:
            key = (raw.data_ptr(), tuple(raw.shape))
            if key not in self._standins:
                self._standins[key] = raw
                raw.copy_(raw[self.rank].expand_as(raw).clone())
            return blocks
        dist.all_gather_into_tensor(raw.flatten(0, 1) if raw.ndim > 1 else raw, raw[self.rank].contiguous(),
                                    group=self.group)
        return blocks

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """x <- the largest of every rank's x, in place (a per-tensor scale all ranks must share)."""
        if self.communicate:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def gather_act(self, act: Fp8Act) -> Fp8Act:
        """An FP8 activation's rows from all ranks: its e4m3 values (moved as bytes: half the bf16 traffic)
        and its per-token scales. (B, m, K) -> (B, T, K)."""
        data = self.gather(act.data.view(torch.uint8)).view(FP8)
        return Fp8Act(data, self.gather(act.scale))

    def reduce_scatter(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the sum over ranks of `partial`, each rank's (B, T, N) -> (B, m, N); `partial`
        may come padded already, (B, n*m, N) (`row_buffer`)."""
        n, r, m = self.size, self.rank, self.rows
        padded = partial if partial.shape[1] == n * m else self._padded(partial)  # (B, n*m, N)
        if not self.communicate:
            return padded[:, r * m:(r + 1) * m]
        b = padded.shape[0]
        blocks = padded.view(b, n, m, -1).transpose(0, 1).contiguous()  # (n, B, m, N); a view for B == 1
        out = torch.empty_like(blocks[0])
        dist.reduce_scatter_tensor(out, blocks.flatten(0, 1), group=self.group)  # (n*B, m, N) -> (B, m, N)
        return out

    def gather_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """linear(all-gather(x)): (B, m, K) local rows -> (B, T, N) every token, this rank's features."""
        if self.overlap == "none" or not self.communicate:
            return F.linear(self.gather(x), weight, bias)
        if self.overlap == "symm_mem":
            group = self._symm_group(x)  # first: importing symmetric memory registers the ops
            _, (y,) = torch.ops.symm_mem.fused_all_gather_matmul(
                x.reshape(-1, x.shape[-1]), [weight.t()], 0, group, return_A=False)  # (n*m, N)
            if bias is not None:
                y.add_(bias)
            return y[None, :self.tokens]  # (1, T, N)
        n, r = self.size, self.rank
        b = x.shape[0]
        blocks = self._blocks(b, x.shape[-1], x)  # (n, B, m, K): the ring fills it block by block
        out = torch.empty(n, b, self.rows, weight.shape[0], device=x.device, dtype=x.dtype)  # (n, B, m, N)
        blocks[r].copy_(x)
        for s in range(n):
            c = (r - s) % n  # the block here at step s
            pending = []
            if s < n - 1:  # pass block c on while its GEMM runs; the previous rank's block comes in
                pending = dist.batch_isend_irecv([
                    dist.P2POp(dist.isend, blocks[c], (r + 1) % n, self.group),
                    dist.P2POp(dist.irecv, blocks[(c - 1) % n], (r - 1) % n, self.group),
                ])
            _linear_into(out[c], blocks[c], weight, bias)
            for work in pending:
                work.wait()
        return self._whole(out)

    def linear_reduce_scatter(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                              ) -> torch.Tensor:
        """Sum over ranks of linear(x), plus `bias` once, this rank's rows: (B, T, K) every token -> (B, m, N).
        Every rank passes the same whole `bias`; rank 0 adds it in its GEMM (or each rank to its own rows
        after the sum), so the sum carries it exactly once."""
        n, r, m = self.size, self.rank, self.rows
        if self.overlap == "symm_mem" and self.communicate:
            group = self._symm_group(x)
            y = torch.ops.symm_mem.fused_matmul_reduce_scatter(
                self._padded(x).reshape(-1, x.shape[-1]), weight.t(), "sum", 0, group)  # (m, N)
            if bias is not None:
                y.add_(bias)
            return y[None]  # (1, m, N)
        bias = bias if r == 0 else None
        if self.overlap == "none" or not self.communicate:  # without communication: the rank's GEMM over every
            buf = self.row_buffer(x, weight.shape[0], x.dtype)  # token, as in the real path; its rows kept
            if buf is None:
                return self.reduce_scatter(F.linear(x, weight, bias))
            _linear_into(buf[:, :self.tokens], x, weight, bias)
            return self.reduce_scatter(buf)
        # ring: block c's sum starts at rank c+1 and gathers one rank's partial per step, ending at rank c
        inbox = [torch.empty(x.shape[0], m, weight.shape[0], device=x.device, dtype=x.dtype) for _ in range(2)]
        pending: list[dist.Work] = []
        acc = x.new_empty(0)
        for s in range(n):
            c = (r - s - 1) % n
            lo, hi = self._row_range(c)
            part = self._padded_rows(F.linear(x[:, lo:hi], weight, bias))  # (B, m, N): runs while the ring moves
            for work in pending:
                work.wait()
            acc = part if s == 0 else part.add_(inbox[(s - 1) % 2])
            if s < n - 1:
                pending = dist.batch_isend_irecv([
                    dist.P2POp(dist.isend, acc, (r + 1) % n, self.group),
                    dist.P2POp(dist.irecv, inbox[s % 2], (r - 1) % n, self.group),
                ])
        return acc

    def _symm_group(self, x: torch.Tensor) -> str:
        """The group's name, with symmetric memory enabled for it (once); checks what the fused ops need."""
        if not x.is_cuda or x.shape[0] != 1:
            raise ValueError(f"tp overlap='symm_mem' needs CUDA tensors with batch 1; got {x.device} tensors "
                             f"of shape {tuple(x.shape)}: use overlap='ring' or 'none'")
        group = self.group if self.group is not None else dist.group.WORLD
        name: str = group.group_name  # type: ignore[union-attr]
        if name not in self._symm_enabled:
            from torch.distributed import _symmetric_memory as symm_mem

            symm_mem.enable_symm_mem_for_group(name)  # type: ignore[arg-type]
            self._symm_enabled.add(name)
        return name

    def _padded_rows(self, y: torch.Tensor) -> torch.Tensor:
        """(B, rows <= m, N) -> (B, m, N) with zero rows appended (the last block when n does not divide T)."""
        pad = self.rows - y.shape[1]
        return y if pad == 0 else F.pad(y, (0, 0, 0, pad))


def _linear_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out = linear(x), written in place (no copy of the GEMM's result). x (..., K), out (..., N), both contiguous."""
    x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])  # (rows, K), (rows, N)
    if bias is None:
        torch.mm(x2, weight.t(), out=out2)
    else:
        torch.addmm(bias, x2, weight.t(), out=out2)


class ParallelLinear(nn.Linear):
    weight_scale: torch.Tensor  # (out,) float32, only once `to_fp8_` ran

    def __init__(self, in_features: int, out_features: int, mode: Mode, *, groups: int = 1, bias: bool = True,
                 sequence: bool = False, token_local: bool = False) -> None:
        """`sequence`: a column layer whose input is the residual stream (split by tokens under sequence
        parallelism, so gathered first). Row layers always scatter by tokens under sequence parallelism.
        `token_local`: a layer of a token-by-token stage (the MLP, the audio cross-attention), kept whole on every
        rank under `local_layers` (`apply_tensor_parallel`)."""
        super().__init__(in_features, out_features, bias=bias)
        self.mode: Mode = mode
        self.groups = groups
        self.sequence = sequence or mode == "row"
        self.token_local = token_local
        self.kept_whole = False  # `apply_tensor_parallel(local_layers=True)`: whole weights on a rank of several
        self.full_in, self.full_out = in_features, out_features
        self.tp_rank, self.tp_size = 0, 1
        self.group: dist.ProcessGroup | None = None
        self.communicate = True
        self.shards: TokenShards | None = None
        self.fp8 = False  # `to_fp8_`: e4m3 weight with per-output-channel `weight_scale`, FP8 GEMM
        self.compute_dtype = torch.float32
        self.weight_bf16: torch.Tensor | None = None  # `to_cpu_bf16_`: the GEMM in bf16 (CPUs with bf16 dot products)

    def shard_tensor(self, name: Literal["weight", "bias", "weight_scale"], full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the logical (unsplit) `weight`, `bias` or FP8 `weight_scale` tensor."""
        r, n = self.tp_rank, self.tp_size
        if n == 1:
            return full
        if self.mode == "row":
            if name != "weight":
                return full  # bias: added once, after the all-reduce; per-output-channel scales: every rank's
            cols = full.shape[1] // n
            return full[:, r * cols:(r + 1) * cols]
        grouped = full.reshape(self.groups, full.shape[0] // self.groups, *full.shape[1:])  # (G, out/G, ...)
        rows = grouped.shape[1] // n
        return grouped[:, r * rows:(r + 1) * rows].reshape(-1, *full.shape[1:])

    def full_shape(self, name: Literal["weight", "bias", "weight_scale"]) -> tuple[int, ...]:
        return (self.full_out, self.full_in) if name == "weight" else (self.full_out,)

    @torch.no_grad()
    def to_cpu_bf16_(self) -> None:
        """Run this layer's GEMM in bf16 on a CPU with bf16 dot products: a bf16 copy of the weight, the input cast
        per call, the product (accumulated in float32 by oneDNN) back in the input's dtype, the bias added in it.
        One rank only (a CPU session has one)."""
        if self.tp_size != 1 or self.fp8:
            raise ValueError(f"to_cpu_bf16_ is for one-rank, non-FP8 layers (tp_size={self.tp_size}, fp8={self.fp8})")
        self.weight_bf16 = self.weight.detach().to(torch.bfloat16)

    @torch.no_grad()
    def to_fp8_(self) -> None:
        """Quantise this rank's weight once, per output channel, to e4m3 (`weight`) with float32 scales
        (`weight_scale`, a buffer saved with the weights); forwards then run the FP8 GEMM, their output in the
        weight's former dtype. An FP8 checkpoint loads into the converted module as is."""
        if self.fp8:
            return
        self.compute_dtype = self.weight.dtype
        w8, scale = quantize_weight(self.weight)
        self.weight = nn.Parameter(w8, requires_grad=False)
        self.register_buffer("weight_scale", scale)
        self.fp8 = True

    def shard_(self, rank: int, size: int, group: dist.ProcessGroup | None, communicate: bool = True,
               shards: TokenShards | None = None) -> None:
        """Keep this rank's slice of the current (full) weights. `communicate=False` skips the
        collectives (one rank's compute alone, for benchmarks: the output is then not the model's).
        `shards`: sequence parallelism's token split (None: replicated tokens, all-reduce)."""
        if size == 1:
            return
        if self.tp_size != 1:
            raise RuntimeError("ParallelLinear is already sharded; shard a freshly built model")
        if self.fp8:
            raise RuntimeError("ParallelLinear is already FP8; shard first, then call to_fp8_ (or load FP8 shards)")
        self.tp_rank, self.tp_size, self.group, self.communicate = rank, size, group, communicate
        self.shards = shards if self.sequence else None
        with torch.no_grad():
            self.weight = nn.Parameter(self.shard_tensor("weight", self.weight).clone())
            if self.bias is not None:
                self.bias = nn.Parameter(self.shard_tensor("bias", self.bias).clone())
        if self.mode == "row":
            self.in_features //= size
        else:
            self.out_features //= size

    def forward(self, x: torch.Tensor | Fp8Act) -> torch.Tensor:
        if self.fp8:
            return self._forward_fp8(x)
        if isinstance(x, Fp8Act):
            raise ValueError(f"{type(self).__name__}: an FP8 activation reached a bf16 layer ({self.full_in} -> "
                             f"{self.full_out}); convert the model with to_fp8() or feed it a plain tensor")
        if self.weight_bf16 is not None:
            y = F.linear(x.to(torch.bfloat16), self.weight_bf16).to(x.dtype)
            return y if self.bias is None else y + self.bias
        if self.tp_size == 1:
            return super().forward(x)
        if self.mode == "column":
            return super().forward(x) if self.shards is None else self.shards.gather_linear(x, self.weight, self.bias)
        if self.shards is not None:  # the bias enters the sum once (see `linear_reduce_scatter`)
            return self.shards.linear_reduce_scatter(x, self.weight, self.bias)
        # rank 0 adds the bias in the GEMM's epilogue; the sum over ranks then counts it exactly once
        bias = self.bias if self.tp_rank == 0 else None
        y = F.linear(x, self.weight, bias)
        if self.communicate:
            dist.all_reduce(y, group=self.group)
        return y

    def _forward_fp8(self, x: torch.Tensor | Fp8Act) -> torch.Tensor:
        """The FP8 GEMM. `x` normally arrives quantised by the kernel that produced it (an `Fp8Act`); a plain
        tensor is quantised here, in a pass of its own (the reference path's inputs)."""
        act = x if isinstance(x, Fp8Act) else quantize_rows_ref(x)
        w, sw, dtype = self.weight, self.weight_scale, self.compute_dtype
        if self.tp_size == 1:
            return fp8_linear(act.data, act.scale, w, sw, self.bias, dtype)
        shards = self.shards
        if shards is not None and shards.communicate and shards.overlap != "none":
            raise ValueError(f"precision='fp8' runs the sequence-parallel collectives as tp_overlap='none'; got "
                             f"tp_overlap={shards.overlap!r}: set topology.tp_overlap='none' for FP8")
        if self.mode == "column":
            if shards is not None:
                act = shards.gather_act(act)  # (B, T, K) every token, FP8 bytes moved
            return fp8_linear(act.data, act.scale, w, sw, self.bias, dtype)
        bias = self.bias if self.tp_rank == 0 else None  # the sum over ranks carries it once
        if shards is not None:
            buf = shards.row_buffer(act.data, w.shape[0], dtype)
            y = fp8_linear(act.data, act.scale, w, sw, bias, dtype, out=None if buf is None else buf[:, :shards.tokens])
            return shards.reduce_scatter(y if buf is None else buf)
        y = fp8_linear(act.data, act.scale, w, sw, bias, dtype)
        if self.communicate:
            dist.all_reduce(y, group=self.group)
        return y


def apply_tensor_parallel(model: nn.Module, group: dist.ProcessGroup | None = None, *,
                          rank: int | None = None, size: int | None = None, communicate: bool = True,
                          sequence_parallel: bool = False, overlap: Overlap = "none",
                          local_layers: bool = False, local_attention: bool = False) -> nn.Module:
    """Split `model` in place for tensor-parallel rank `rank` of `size` (default: from `group`).

    Modules with a `num_heads` attribute have it divided by `size`. With `sequence_parallel`, one
    `TokenShards` is shared by every sequence layer and set as the `shards` attribute of each module
    that declares one (the model splits and gathers its tokens through it); `overlap` picks its
    collectives. `local_layers` (sequence parallel only): token-local layers (``token_local``) stay whole
    and run on the rank's own tokens; a token-local module with heads keeps all of them and gets the token
    split as its `local_shards` (its rows' frames). `local_attention` (with `local_layers`): modules that gather
    keys (``gathers_keys``: self-attention) stay whole too, with all their heads and the token split as their
    `local_shards`; modules with a `kv_shards` attribute (the model) get the token split there (its cache then
    gathers every rank's K/V rows). `communicate=False` builds one rank's share with no collectives
    (benchmarks of a rank's compute alone). Building the model on the ``meta`` device first and sharding
    before materialising keeps memory to one rank's share.
    """
    if size is None:
        size = dist.get_world_size(group) if dist.is_initialized() else 1
    if rank is None:
        rank = dist.get_rank(group) if dist.is_initialized() else 0
    if size == 1:
        return model
    if local_layers and not sequence_parallel:
        raise ValueError("local_layers keeps token-local layers whole on each rank's own tokens, which needs "
                         "sequence_parallel=True (with every token on every rank each rank would run them all)")
    if local_attention and not local_layers:
        raise ValueError("local_attention keeps self-attention whole beside the token-local layers, which needs "
                         "local_layers=True")
    shards = TokenShards(rank, size, group, overlap=overlap, communicate=communicate) if sequence_parallel else None
    # self-attention kept whole (`local_attention`): its linear layers are too
    whole = {id(sub) for module in model.modules() if local_attention and getattr(module, "gathers_keys", False)
             for sub in module.modules() if isinstance(sub, ParallelLinear)}
    for module in model.modules():
        if local_attention and hasattr(module, "kv_shards"):
            setattr(module, "kv_shards", shards)  # noqa: B010 (the model whose cache gathers the K/V rows)
        if id(module) in whole:
            assert isinstance(module, ParallelLinear)
            module.kept_whole = True
            continue
        if local_attention and getattr(module, "gathers_keys", False):
            setattr(module, "local_shards", shards)  # noqa: B010 (whole, all heads, this rank's rows)
            continue
        if local_layers and getattr(module, "token_local", False):
            if isinstance(module, ParallelLinear):
                module.kept_whole = True
            else:
                setattr(module, "local_shards", shards)  # noqa: B010 (a token-local module reads its rows' frames)
            continue  # whole weights, all heads
        if isinstance(module, ParallelLinear):
            module.shard_(rank, size, group, communicate, shards)
        elif hasattr(module, "shards"):  # the model that splits and gathers its tokens
            setattr(module, "shards", shards)  # noqa: B010 (any module declaring it)
        heads = getattr(module, "num_heads", None)
        if isinstance(heads, int) and not isinstance(module, nn.MultiheadAttention):
            if heads % size:
                raise ValueError(f"{type(module).__name__}.num_heads={heads} is not divisible by {size} ranks")
            setattr(module, "num_heads", heads // size)  # noqa: B010 (any attention-like module)
    return model


def set_overlap(model: nn.Module, overlap: Overlap) -> None:
    """Switch a sequence-parallel model's collectives at run time (recapture CUDA graphs afterwards)."""
    if overlap not in OVERLAPS:
        raise ValueError(f"tp overlap={overlap!r} is unknown; expected one of {list(OVERLAPS)}")
    shards = {id(m.shards): m.shards for m in model.modules() if isinstance(m, ParallelLinear) and m.shards}
    if not shards:
        raise ValueError(f"tp overlap={overlap!r} applies to sequence-parallel collectives, and this model has none "
                         "(one rank, or every token on every rank): set topology.sequence_parallel first")
    for token_shards in shards.values():
        token_shards.overlap = overlap
