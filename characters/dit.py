"""The causal, audio-conditioned video diffusion transformer (reference architecture).

Reads top to bottom on one device; `characters.tp.apply_tensor_parallel` splits it afterwards.
A chunk's tokens self-attend to the KV cache ([reference sink | recent frames | this chunk]), then
cross-attend, frame by frame, to that frame's audio tokens, then pass an MLP. adaLN modulation
from the flow-matching timestep scales and shifts both residual branches (Wan2.1's block layout).

One module on purpose: the block, its elementwise steps in their bf16 / FP8 / Triton-row forms and the step's
parts (CUDA graphs, preemption) change together; apart, one piece of math would live in several files.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from typing import Any, overload

import torch
import torch.nn.functional as F
from torch import nn

from characters.config import ModelConfig
from characters.kv_cache import KVCache
from characters.tp import ParallelLinear, TokenShards
from kernels._triton import HAS_TRITON
from kernels.cross_attention_fp8 import cross_attention_fp8
from kernels.fp8 import Fp8Act, quantize_rows_ref
from kernels.qkv_prep import rms_norm_ref, rope_ref
from kernels.row_quant import row_quant

# attend(layer, qkv (B, T, 3, Hh, Dh), q_norm_weight, k_norm_weight) -> (B, Hh, T, Dh), or, for an FP8
# model whose cache quantises the output, the output projection's input (B, T, Hh*Dh) as an Fp8Act
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | Fp8Act]


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of flow-matching time t in [0, 1] (scaled to [0, 1000]). (B,) -> (B, dim)"""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    ang = (t.float() * 1000.0)[:, None] * freqs  # (B, dim/2)
    return torch.cat([ang.cos(), ang.sin()], dim=1)


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """adaLN: LayerNorm without affine, then the timestep's scale and shift. (B, T, D)"""
    return F.layer_norm(x, x.shape[-1:], eps=eps) * (1 + scale) + shift


def _gated_add(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return x + gate * y


def _gated_add_norm(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual with gate, then an affine LayerNorm of the sum: (new x, normed)."""
    x = x + gate * y
    return x, F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def _add_modulate(x: torch.Tensor, y: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual, then adaLN of the sum: (new x, modulated)."""
    x = x + y
    return x, _modulate(x, shift, scale, eps)


def _gated_add_modulate(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, shift: torch.Tensor,
                        scale: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's closing gated residual, then the next block's adaLN of the sum: (new x, modulated)."""
    x = x + gate * y
    return x, _modulate(x, shift, scale, eps)


def _head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm in float32, returned in x's dtype. (..., Dh)"""
    return rms_norm_ref(x, weight, eps)


def _gelu(y: torch.Tensor) -> torch.Tensor:
    return F.gelu(y, approximate="tanh")


# FP8 variants: the same steps with the per-token quantisation of their output (the next linear layer's input)
# as their epilogue; compiled, each is one kernel that writes e4m3 values and a scale per token.
def _q(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    act = quantize_rows_ref(h)
    return act.data, act.scale


def _modulate_fp8(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    return _q(_modulate(x, shift, scale, eps))


def _gated_add_norm_fp8(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, h = _gated_add_norm(x, y, gate, weight, bias, eps)
    return (x, *_q(h))


def _add_modulate_fp8(x: torch.Tensor, y: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, h = _add_modulate(x, y, shift, scale, eps)
    return (x, *_q(h))


def _gated_add_modulate_fp8(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, shift: torch.Tensor,
                            scale: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, h = _gated_add_modulate(x, y, gate, shift, scale, eps)
    return (x, *_q(h))


def _gelu_fp8(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _q(_gelu(y))


# the same FP8 steps as single-pass Triton row kernels (kernels.row_quant), returning what the compiled ones do
def _rows_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    _, q, s = row_quant("modulate", x, shift=shift, scale=scale, eps=eps)
    return q, s


def _rows_gated_add_norm(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    new, q, s = row_quant("gated_add_norm", x, y=y, gate=gate, weight=weight, bias=bias, eps=eps)
    assert new is not None
    return new, q, s


def _rows_add_modulate(x: torch.Tensor, y: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    new, q, s = row_quant("add_modulate", x, y=y, shift=shift, scale=scale, eps=eps)
    assert new is not None
    return new, q, s


def _rows_gated_add_modulate(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, shift: torch.Tensor,
                             scale: torch.Tensor, eps: float
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    new, q, s = row_quant("gated_add_modulate", x, y=y, gate=gate, shift=shift, scale=scale, eps=eps)
    assert new is not None
    return new, q, s


def _rows_gelu(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _, q, s = row_quant("gelu", y)
    return q, s


class ElementwiseOps:
    """The block's elementwise steps: plain PyTorch, or each compiled into one fused kernel (CUDA).

    With `fp8`, the steps whose output feeds a linear layer also quantise it per token (returning an
    `Fp8Act`), and so does the MLP's GELU: in compiled form the quantisation is the epilogue of the kernel
    that produces the activation, not a pass of its own. The audio cross-attention's output (from SDPA) gets a
    compiled quantisation pass of its own (`quant`): written as one compiled function with its norms and
    softmax over the A audio keys it took 14 ms per 57b TP3 chunk against ~1 ms for the pass (docs/fp8.md).

    `row_kernels` (fused FP8 only; default: when Triton is installed): the steps whose reductions span a whole
    row (the LayerNorms with their quantisation, and the GELU's) run as `kernels.row_quant`'s Triton kernels
    instead of Inductor's looped reductions, which read each row more than once, and the audio cross-attention
    from its projections to the o projection's e4m3 input as `kernels.cross_attention_fp8`'s kernels."""

    def __init__(self, fused: bool = False, fp8: bool = False, row_kernels: bool | None = None) -> None:
        self.fused, self.fp8 = fused, fp8
        self.row_kernels = fused and fp8 and (HAS_TRITON if row_kernels is None else row_kernels)
        wrap: Callable[[Any], Any] = (lambda f: torch.compile(f, fullgraph=True, dynamic=False)) if fused \
            else (lambda f: f)
        self.gated_add: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = wrap(_gated_add)
        self.head_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = wrap(_head_norm)
        if not fp8:
            self._modulate = wrap(_modulate)
            self._gated_add_norm = wrap(_gated_add_norm)
            self._add_modulate = wrap(_add_modulate)
            self._gated_add_modulate = wrap(_gated_add_modulate)
            self._gelu: Callable[[torch.Tensor], Any] = _gelu  # one eager kernel already
        else:
            self._modulate = wrap(_modulate_fp8)
            self._gated_add_norm = wrap(_gated_add_norm_fp8)
            self._add_modulate = wrap(_add_modulate_fp8)
            self._gated_add_modulate = wrap(_gated_add_modulate_fp8)
            self._gelu = wrap(_gelu_fp8)
            self._quant = wrap(_q)
        if self.row_kernels:
            self._modulate, self._gated_add_norm = _rows_modulate, _rows_gated_add_norm
            self._add_modulate, self._gelu = _rows_add_modulate, _rows_gelu
            self._gated_add_modulate = _rows_gated_add_modulate

    def modulate(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor | Fp8Act:
        out = self._modulate(x, shift, scale, eps)
        return Fp8Act(*out) if self.fp8 else out

    def gated_add_norm(self, x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor | Fp8Act]:
        out = self._gated_add_norm(x, y, gate, weight, bias, eps)
        return (out[0], Fp8Act(out[1], out[2])) if self.fp8 else out

    def add_modulate(self, x: torch.Tensor, y: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor | Fp8Act]:
        out = self._add_modulate(x, y, shift, scale, eps)
        return (out[0], Fp8Act(out[1], out[2])) if self.fp8 else out

    def gated_add_modulate(self, x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, shift: torch.Tensor,
                           scale: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor | Fp8Act]:
        out = self._gated_add_modulate(x, y, gate, shift, scale, eps)
        return (out[0], Fp8Act(out[1], out[2])) if self.fp8 else out

    def gelu(self, y: torch.Tensor) -> torch.Tensor | Fp8Act:
        out = self._gelu(y)
        return Fp8Act(*out) if self.fp8 else out

    def quant(self, y: torch.Tensor) -> Fp8Act:
        """A per-token quantisation pass of its own (compiled: one kernel), for an input whose producer cannot
        take it as an epilogue (an attention kernel's output)."""
        return Fp8Act(*self._quant(y))


_PLAIN = ElementwiseOps(False)


class SelfAttention(nn.Module):
    """Every token attends to the KV cache. Under `topology.local_attention` every rank keeps it whole (all heads)
    and runs it on its own rows; the cache gathers the chunk's other K/V rows (`KVCache.attend_rows`)."""

    gathers_keys = True  # reads every token's K/V: kept whole only with `local_attention`

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.local_shards: TokenShards | None = None  # kept whole (`local_attention`): this rank's rows
        self.qkv = ParallelLinear(dim, 3 * dim, "column", groups=3, sequence=True)
        self.q_norm = nn.Parameter(torch.ones(self.head_dim))
        self.k_norm = nn.Parameter(torch.ones(self.head_dim))
        self.o = ParallelLinear(dim, dim, "row")

    def forward(self, x: torch.Tensor, layer: int, attend: AttendFn) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, T, 3*Hh*Dh): every token, also when x holds only this rank's (sequence parallel)
        b, t = qkv.shape[:2]
        qkv = qkv.view(b, t, 3, self.num_heads, self.head_dim)  # (B, T, 3, Hh, Dh)
        out = attend(layer, qkv, self.q_norm, self.k_norm)  # (B, Hh, T, Dh), or already (B, T, Hh*Dh) in FP8
        return self.o(out if isinstance(out, Fp8Act) else out.transpose(1, 2).reshape(b, t, -1))  # (B, T, D)


class AudioCrossAttention(nn.Module):
    """Each latent frame's tokens attend to that frame's audio tokens only: token by token (`token_local`), so
    under `topology.local_layers` every rank runs it whole (all heads) on its own rows, with no collective."""

    token_local = True

    def __init__(self, dim: int, cross_dim: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.eps = num_heads, dim // num_heads, eps
        self.ops = _PLAIN
        self.q = ParallelLinear(dim, dim, "column", sequence=True, token_local=True)
        self.kv = ParallelLinear(cross_dim, 2 * dim, "column", groups=2, token_local=True)
        self.q_norm = nn.Parameter(torch.ones(self.head_dim))
        self.k_norm = nn.Parameter(torch.ones(self.head_dim))
        self.o = ParallelLinear(dim, dim, "row", token_local=True)
        self.local_shards: TokenShards | None = None  # kept whole: the token split (this rank's rows, their frames)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        q = self.q(x)  # (B, T, Hh*Dh): every token (x may hold only this rank's); kept whole: (B, m, H*Dh)
        kv = self.kv(ctx)  # (B, nF, A, 2*Hh*Dh)
        if self.local_shards is None:
            return self.o(self._attend(q, kv))  # (B, T, D)
        # kept whole: the rank's m rows, frame by frame (one run per frame its rows touch; one at 57b's one frame)
        runs = self.local_shards.frame_segments(kv.shape[1])
        parts = [self._attend(q[:, lo:hi], kv[:, f:f + 1]) for lo, hi, f in runs]
        if len(parts) == 1:
            return self.o(parts[0])  # (B, m, D)
        if isinstance(parts[0], Fp8Act):
            acts = [p for p in parts if isinstance(p, Fp8Act)]
            return self.o(Fp8Act(torch.cat([p.data for p in acts], 1), torch.cat([p.scale for p in acts], 1)))
        return self.o(torch.cat([p for p in parts if isinstance(p, torch.Tensor)], 1))

    def _attend(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor | Fp8Act:
        """q (B, T, Hh*Dh) frame-major over kv's nF frames (B, nF, A, 2*Hh*Dh) -> the output layer's input."""
        b, t = q.shape[:2]
        nf, a = kv.shape[1], kv.shape[2]
        hh, dh = self.num_heads, self.head_dim
        if self.ops.row_kernels:  # FP8 with our Triton kernels: norms, attention and quantisation in one
            return Fp8Act(*cross_attention_fp8(q, kv, self.q_norm, self.k_norm, self.eps, heads=hh))
        kv = kv.reshape(b * nf, a, 2, hh, dh)  # (B*nF, A, 2, Hh, Dh)
        q = self.ops.head_norm(q.reshape(b * nf, t // nf, hh, dh), self.q_norm, self.eps)  # (B*nF, N, Hh, Dh)
        k = self.ops.head_norm(kv[:, :, 0], self.k_norm, self.eps)  # (B*nF, A, Hh, Dh)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             kv[:, :, 1].transpose(1, 2))  # (B*nF, Hh, N, Dh)
        out = out.transpose(1, 2).reshape(b, t, -1)  # (B, T, Hh*Dh)
        return self.ops.quant(out) if self.ops.fp8 else out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.dit
        self.eps, self.ops = d.eps, _PLAIN
        self.self_attn = SelfAttention(d.dim, d.num_heads)
        self.norm3 = nn.LayerNorm(d.dim, eps=d.eps)
        self.cross_attn = AudioCrossAttention(d.dim, d.cross_dim, d.num_heads, d.eps)
        self.fc1 = ParallelLinear(d.dim, d.ffn_dim, "column", sequence=True, token_local=True)
        self.fc2 = ParallelLinear(d.ffn_dim, d.dim, "row", token_local=True)
        self.modulation = nn.Parameter(torch.zeros(1, 1, 6, d.dim))

    def forward(self, x: torch.Tensor, e: torch.Tensor, ctx: torch.Tensor, layer: int, attend: AttendFn,
                pending: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x (B, T, D) (sequence parallel: this rank's (B, m, D)); e (B, 1 or T, 6, D); ctx (B, nF, A, Dc).
        `pending`: the previous block's closing residual (its MLP output, its gate), added here in one pass with
        this block's first step. Returns x and this block's own pending residual (y, gate): x + gate * y is the
        block's output (the caller adds it, or hands it to the next block)."""
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = (self.modulation + e).unbind(2)  # each (B, L, D)
        ops, eps = self.ops, self.eps
        if pending is None:
            h = ops.modulate(x, shift_a, scale_a, eps)
        else:
            x, h = ops.gated_add_modulate(x, *pending, shift_a, scale_a, eps)
        x, h = ops.gated_add_norm(x, self.self_attn(h, layer, attend), gate_a, self.norm3.weight, self.norm3.bias, eps)
        x, h = ops.add_modulate(x, self.cross_attn(h, ctx), shift_m, scale_m, eps)
        return x, (self.fc2(ops.gelu(self.fc1(h))), gate_m)

    def linears(self) -> tuple[ParallelLinear, ...]:
        """The linear layers FP8 (`to_fp8_`) and bf16 CPU GEMMs (`CausalDiT.to_cpu_bf16`) convert. The audio K/V
        projection stays in the compute dtype: it sees the frame's A audio tokens only (a GEMM too small for FP8 to
        matter)."""
        return (self.self_attn.qkv, self.self_attn.o, self.cross_attn.q, self.cross_attn.o, self.fc1, self.fc2)

    @torch.no_grad()
    def to_fp8_(self) -> None:
        """Quantise this block's linear layers to e4m3 (`ParallelLinear.to_fp8_`); `CausalDiT.to_fp8` does every
        block and switches the elementwise steps, `characters.weights.materialize_dit` one block at a time."""
        for layer in self.linears():
            layer.to_fp8_()


def block_causal_mask(n_sink: int, chunk_tokens: int, chunks: int, ring: int,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """The (T, T) attention mask under which `forward_sequence` over [sink | chunk 0 | ... | chunk K-1]
    equals the cached inference: the sink sees itself; chunk k sees the sink and chunks k-ring+1 .. k
    (the ring of the cache: the window plus itself). True where a query may attend."""
    group = torch.cat([torch.full((n_sink,), -1, device=device),
                       torch.arange(chunks, device=device).repeat_interleave(chunk_tokens)])  # (T,)
    q, k = group[:, None], group[None, :]
    in_window = (k >= 0) & (k <= q) & (k > q - ring)
    return (k == -1) | in_window & (q >= 0) | (q == -1) & (k == -1)


Parts = Generator[None, None, torch.Tensor]  # a forward that pauses between groups of blocks


def block_groups(blocks: int, groups: int) -> list[int]:
    """Where `groups` runs of consecutive blocks end, as even as they split (the last ends at `blocks`); more groups
    than blocks: one block each."""
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    n = min(groups, blocks)
    return [blocks * (i + 1) // n for i in range(n)]


@overload
def run_parts(parts: Parts, stop: None = None) -> torch.Tensor: ...


@overload
def run_parts(parts: Parts, stop: Callable[[], bool]) -> torch.Tensor | None: ...


def run_parts(parts: Parts, stop: Callable[[], bool] | None = None) -> torch.Tensor | None:
    """Run a paused forward (`CausalDiT.forward_parts`) through; its output. `stop`: asked between two parts, True
    ends the run there (None)."""
    while True:
        try:
            next(parts)
        except StopIteration as done:
            return done.value
        if stop is not None and stop():
            parts.close()
            return None


class CausalDiT(nn.Module):
    audio_index: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.dit
        ph, pw = d.patch_size
        self.patch_embed = nn.Linear(d.latent_channels * ph * pw, d.dim)
        self.time_embed = nn.Sequential(nn.Linear(d.freq_dim, d.dim), nn.SiLU(), nn.Linear(d.dim, d.dim))
        self.time_proj = nn.Sequential(nn.SiLU(), nn.Linear(d.dim, 6 * d.dim))
        self.audio_embed = nn.Sequential(nn.Linear(d.audio_dim, d.cross_dim), nn.GELU(approximate="tanh"),
                                         nn.Linear(d.cross_dim, d.cross_dim))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(d.num_layers))
        self.head_norm = nn.LayerNorm(d.dim, eps=d.eps, elementwise_affine=False)
        self.head_modulation = nn.Parameter(torch.zeros(1, 2, d.dim))
        self.head = nn.Linear(d.dim, d.latent_channels * ph * pw)
        self.register_buffer("audio_index", self._audio_index(), persistent=False)  # (Cf, A)
        self.shards: TokenShards | None = None  # sequence parallelism's token split (set by apply_tensor_parallel)
        self.kv_shards: TokenShards | None = None  # `local_attention`: the split whose K/V rows the cache gathers

    def _audio_index(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Audio frame index of each latent frame's A tokens within the encoder's Fa frames."""
        tf, ctx = self.cfg.vae.temporal_factor, self.cfg.audio.context_frames
        cf = self.cfg.generation.latent_frames_per_chunk
        return torch.arange(cf, device=device)[:, None] * tf + torch.arange(tf + ctx, device=device)

    def rebuild_buffers(self) -> None:
        self.audio_index = self._audio_index(self.audio_index.device)

    @property
    def fp8(self) -> bool:
        """Whether the blocks' linear layers run in FP8 (`to_fp8`)."""
        block = self.blocks[0]
        return isinstance(block, Block) and block.fc1.fp8

    def fuse_elementwise(self, fused: bool = True, row_kernels: bool | None = None) -> None:
        """Use compiled, fused elementwise steps (CUDA) or plain PyTorch ones (in FP8 form once `to_fp8` ran);
        `row_kernels`: see `ElementwiseOps`."""
        ops = ElementwiseOps(fused, self.fp8, row_kernels)
        for module in self.modules():
            if isinstance(module, Block | AudioCrossAttention):
                module.ops = ops

    @torch.no_grad()
    def to_cpu_bf16(self) -> None:
        """Run the blocks' linear layers (the layers `to_fp8` converts) as bf16 GEMMs on a CPU with bf16 dot products
        (`ParallelLinear.to_cpu_bf16_`); everything else stays in the compute dtype."""
        for block in self.blocks:
            assert isinstance(block, Block)
            for layer in block.linears():
                layer.to_cpu_bf16_()

    @torch.no_grad()
    def to_fp8(self) -> None:
        """Quantise the blocks' linear layers to e4m3 (per output channel; call after the weights are loaded,
        or before loading an FP8 checkpoint into the converted model; `Block.linears` says which) and switch the
        elementwise steps to their quantising form. The embeddings, the head and the timestep MLPs stay in the
        compute dtype. Blocks already converted are kept as they are."""
        for block in self.blocks:
            assert isinstance(block, Block)
            block.to_fp8_()
        fused = isinstance(self.blocks[0], Block) and self.blocks[0].ops.fused
        self.fuse_elementwise(fused)

    # ------------------------------------------------------------------ pieces
    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, nF, h, w) latents -> (B, T, C*ph*pw) patches (embedded in `_run`)."""
        b, c, nf, h, w = x.shape
        ph, pw = self.cfg.dit.patch_size
        x = x.view(b, c, nf, h // ph, ph, w // pw, pw).permute(0, 2, 3, 5, 1, 4, 6)  # (B, nF, gh, gw, C, ph, pw)
        return x.reshape(b, nf * (h // ph) * (w // pw), c * ph * pw)  # (B, T, C*ph*pw)

    def unpatchify(self, y: torch.Tensor, nf: int) -> torch.Tensor:
        b = y.shape[0]
        gh, gw = self.cfg.token_grid
        ph, pw = self.cfg.dit.patch_size
        c = self.cfg.dit.latent_channels
        y = y.view(b, nf, gh, gw, c, ph, pw).permute(0, 4, 1, 2, 5, 3, 6)  # (B, C, nF, gh, ph, gw, pw)
        return y.reshape(b, c, nf, gh * ph, gw * pw)  # (B, C, nF, h, w)

    def audio_context(self, feats: torch.Tensor) -> torch.Tensor:
        """(B, Fa, audio_dim) encoder features of a chunk -> (B, Cf, A, Dc) per-latent-frame context."""
        return self.audio_embed(feats[:, self.audio_index])

    def modulation(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """t (B, L) -> e0 (B, L, D) and block modulation e (B, L, 6, D)."""
        b, ln = t.shape
        emb = timestep_embedding(t.reshape(-1), self.cfg.dit.freq_dim).to(self.head.weight.dtype)  # (B*L, F)
        e0 = self.time_embed(emb).view(b, ln, -1)
        return e0, self.time_proj(e0).view(b, ln, 6, -1)

    def _run(self, patches: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor, nf: int, attend: AttendFn,
             modulation: tuple[torch.Tensor, torch.Tensor] | None = None, groups: int = 1) -> Parts:
        # patches (B, T, C*ph*pw); t (B, 1 or T); `modulation`: `self.modulation(t)` made earlier. Under sequence
        # parallelism the residual stream holds this rank's m rows of tokens from the embedding to the head; the
        # head's output is gathered. A generator: it pauses between `groups` runs of blocks (`block_groups`) and
        # returns the output (`run_parts` runs it through).
        ends = set(block_groups(len(self.blocks), groups)[:-1])
        dtype, shards = patches.dtype, self.shards
        e0, e = self.modulation(t) if modulation is None else modulation
        e0, e = e0.to(dtype), e.to(dtype)  # (B, L, D), (B, L, 6, D)
        if shards is not None:
            shards.begin(patches.shape[1])
            patches = shards.split(patches)  # (B, m, C*ph*pw)
            if e.shape[1] > 1:  # a timestep per token (forward_sequence)
                e0, e = shards.split(e0), shards.split(e)
        tokens = self.patch_embed(patches)  # (B, T or m, D)
        pending = None
        for i, block in enumerate(self.blocks):
            tokens, pending = block(tokens, e, ctx.to(dtype), i, attend, pending)
            if i + 1 in ends:
                yield
        if pending is not None:  # the last block's closing residual
            last = self.blocks[-1]
            assert isinstance(last, Block)
            tokens = last.ops.gated_add(tokens, *pending)
        shift, scale = (self.head_modulation + e0[:, :, None, :]).unbind(2)  # (B, L, D) each
        out = self.head(self.head_norm(tokens) * (1 + scale) + shift)  # (B, T or m, C*ph*pw)
        return self.unpatchify(out if shards is None else shards.gather(out), nf)

    # ------------------------------------------------------------------ entry points
    def forward(self, x: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cache: KVCache, offset: int, valid: int,
                modulation: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One forward over a chunk (or the reference frame) with the KV cache: `forward_parts` run through."""
        return run_parts(self.forward_parts(x, t, ctx, rope, cache, offset, valid, modulation))

    def forward_parts(self, x: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor,
                      rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache, offset: int | torch.Tensor,
                      valid: int, modulation: tuple[torch.Tensor, torch.Tensor] | None = None,
                      groups: int = 1) -> Parts:
        """One forward over a chunk (or the reference frame) with the KV cache, as a generator that pauses after
        each of `groups` runs of blocks but the last (`block_groups`; the caller may stop there: a chunk the
        DiT gives up, `DiTRunner.step`) and returns the output.

        x (B, C, nF, h, w) latents at time t (B,); ctx (B, nF, A, Dc) from `audio_context`;
        rope: (cos, sin) (T, Dh/2). Writes this chunk's K/V at `offset` and attends over
        cache keys [0, valid). Returns the flow-matching velocity (B, C, nF, h, w).
        `modulation`: `self.modulation(t[:, None])` if the caller keeps it (a function of t and the weights
        alone: the timestep MLPs read ~1 GB of weights per forward at 57b).
        """
        cos, sin = rope
        fp8, kv_shards = self.fp8, self.kv_shards

        def attend(layer: int, qkv: torch.Tensor, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor | Fp8Act:
            if kv_shards is not None:  # self-attention whole on this rank's rows: its RoPE rows, the K/V gathered
                return cache.attend_rows(layer, qkv, qw, kw, rows_cos, rows_sin, offset, valid, kv_shards,
                                         fp8_out=fp8)
            return cache.attend(layer, qkv, qw, kw, cos, sin, offset, valid, fp8_out=fp8)

        if kv_shards is not None:
            kv_shards.begin(cos.shape[0])  # this forward's T tokens (`_run` begins it again, the same)
            rows_cos, rows_sin = kv_shards.split(cos[None])[0], kv_shards.split(sin[None])[0]  # (m, Dh/2)

        return (yield from self._run(self.patchify(x), t[:, None], ctx, x.shape[2], attend, modulation, groups))

    def forward_sequence(self, x: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Full recomputation without a cache (the equivalence reference; not a serving path).

        x (B, C, nF, h, w) every frame of the history; t (B, T) a timestep per token;
        ctx (B, nF, A, Dc); cos/sin (T, Dh/2); mask (T, T) bool, True where a query may attend.
        """
        eps = self.cfg.dit.eps
        if self.kv_shards is not None:
            raise ValueError("forward_sequence (the reference without a cache) runs with self-attention split or on "
                             "one rank; topology.local_attention serves through the cache (forward)")

        def attend(layer: int, qkv: torch.Tensor, qw: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
            q = rope_ref(rms_norm_ref(qkv[:, :, 0].float(), qw, eps), cos, sin).to(qkv.dtype)  # (B, T, Hh, Dh)
            k = rope_ref(rms_norm_ref(qkv[:, :, 1].float(), kw, eps), cos, sin).to(qkv.dtype)
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), qkv[:, :, 2].transpose(1, 2),
                                                  attn_mask=mask)

        return run_parts(self._run(self.patchify(x), t, ctx, x.shape[2], attend))
