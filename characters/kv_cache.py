"""The session's KV cache: preallocated, static shapes, a permanent sink plus a ring of chunk slots.

Chunk k writes slot k mod R and attends to the sink and every valid slot; attention is order-free once RoPE is
applied, so nothing moves when the window rolls. In `write_time` mode norm, RoPE, cast and layout happen once,
when K/V are written; `naive` redoes them in every call (kept for measurement and equivalence tests).

Details: docs/dit.md (`characters.kv_cache`)."""

from __future__ import annotations

import torch

from characters.config import ModelConfig
from characters.tp import TokenShards
from kernels.attention import AttentionBackend, attention, attention_fp8_out
from kernels.attention_cudnn_fp8 import attention_fp8_tensor, cudnn_fp8_supported, padded_keys
from kernels.attention_fp8 import attention_fp8
from kernels.fp8 import FP8, Fp8Act, quantize_rows
from kernels.qkv_prep import qkv_prep, rms_norm_ref, rope_ref
from kernels.qkv_prep_fp8 import qkv_prep_fp8, set_v_tensor_scale
from kernels.scatter_rows import scatter_axis, scatter_rows


def fp8_attention_kernel(cfg: ModelConfig, device: torch.device | str) -> str:
    """The FP8 attention kernel `cfg.attention_fp8_kernel` means on `device`: "triton" or "cudnn" ("auto": cuDNN
    where `kernels.attention_cudnn_fp8.cudnn_fp8_supported`). "cudnn" on a CPU runs its float32 reference (FP8
    emulation in tests); on a GPU where cuDNN's FP8 attention cannot run it is a ValueError naming the field."""
    device, kernel, dh = torch.device(device), cfg.attention_fp8_kernel, cfg.dit.head_dim
    if kernel == "auto":
        return "cudnn" if cudnn_fp8_supported(device, dh) else "triton"
    if kernel == "cudnn" and device.type == "cuda" and not cudnn_fp8_supported(device, dh):
        raise ValueError(f"model.attention_fp8_kernel='cudnn' needs a Hopper GPU (compute capability 9.0), head_dim "
                         f"64 or 128 (this model: {dh}) and the nvidia-cudnn-frontend package (pip install "
                         "'realtime-characters[cudnn]'); use 'triton' or 'auto'")
    return kernel


class KVCache:
    def __init__(self, cfg: ModelConfig, *, local_heads: int, device: torch.device | str, dtype: torch.dtype,
                 batch: int = 1, attention_backend: AttentionBackend = "sdpa") -> None:
        g, d = cfg.generation, cfg.dit
        self.mode = g.cache_mode
        self.sink_tokens, self.chunk_tokens, self.ring_slots = cfg.tokens_per_frame, cfg.tokens_per_chunk, g.ring_slots
        self.eps, self.dtype, self.backend = d.eps, dtype, attention_backend
        self._staging: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}  # `attend_rows`'s gather
        shape_s = (d.num_layers, batch, cfg.cache_tokens)
        self.fp8 = cfg.attention_precision == "fp8"
        self.fp8_kernel = fp8_attention_kernel(cfg, device) if self.fp8 else None
        if self.fp8_kernel == "cudnn":
            self.k = torch.zeros(d.num_layers, batch, local_heads, padded_keys(cfg.cache_tokens), d.head_dim,
                                 device=device, dtype=FP8)  # (L, B, Hh, S', Dh) e4m3
            self.v = torch.zeros_like(self.k)  # (L, B, Hh, S', Dh) e4m3
            self.v_scale = torch.zeros(d.num_layers, 1, device=device)  # (L, 1): 0 until the first write
            self.v_inv = torch.zeros_like(self.v_scale)  # (L, 1): 1 / v_scale, the output's scale for cuDNN
            # per layer, whether this session's first write has run (host flags: later writes, and the CUDA graphs
            # captured after the warm-up's writes, skip the V amax that only the first write needs)
            self.v_scale_set = [False] * d.num_layers
            self.qk_scale = torch.ones(d.num_layers, 2, device=device)
        elif self.fp8:
            self.k = torch.zeros(d.num_layers, batch, local_heads, cfg.cache_tokens, d.head_dim, device=device,
                                 dtype=FP8)  # (L, B, Hh, S, Dh) e4m3
            self.vt = torch.zeros(d.num_layers, batch, local_heads, d.head_dim, cfg.cache_tokens, device=device,
                                  dtype=FP8)  # (L, B, Hh, Dh, S) e4m3, V transposed
            self.v_scale = torch.ones(d.num_layers, batch, local_heads, cfg.cache_tokens,
                                      device=device)  # (L, B, Hh, S)
            self.qk_scale = torch.ones(d.num_layers, 2, device=device)  # (L, 2): q and k scales per layer
        elif self.mode == "write_time":
            self.k = torch.zeros(d.num_layers, batch, local_heads, cfg.cache_tokens, d.head_dim,
                                 device=device, dtype=dtype)  # (L, B, Hh, S, Dh)
            self.v = torch.zeros_like(self.k)
        else:
            self.k = torch.zeros(*shape_s, local_heads, d.head_dim, device=device)  # (L, B, S, Hh, Dh) raw fp32
            self.v = torch.zeros_like(self.k)
            self.cos = torch.zeros(cfg.cache_tokens, d.head_dim // 2, device=device)  # (S, Dh/2)
            self.sin = torch.zeros_like(self.cos)

    def _buffers(self) -> list[torch.Tensor]:
        if self.fp8_kernel == "cudnn":
            return [self.k, self.v, self.v_scale, self.v_inv, self.qk_scale]
        if self.fp8:
            return [self.k, self.vt, self.v_scale, self.qk_scale]
        return [self.k, self.v] + ([self.cos, self.sin] if self.mode == "naive" else [])

    def reset(self) -> None:
        """Wipe every buffer in place (a returned warm slot keeps nothing of the last session)."""
        if self.fp8_kernel == "cudnn":
            self.v_scale_set = [False] * len(self.v_scale_set)
        for buf in self._buffers():
            (buf.view(torch.uint8) if buf.dtype == FP8 else buf).zero_()

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers())

    # ------------------------------------------------------------------ slot arithmetic (host ints)
    def chunk_offset(self, chunk: int) -> int:
        return self.sink_tokens + (chunk % self.ring_slots) * self.chunk_tokens

    def chunk_valid(self, chunk: int) -> int:
        return self.sink_tokens + min(chunk + 1, self.ring_slots) * self.chunk_tokens

    # ------------------------------------------------------------------ the attention call
    def attend(self, layer: int, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, offset: int | torch.Tensor, valid: int, fp8_out: bool = False
               ) -> torch.Tensor | Fp8Act:
        """Write this call's K/V at `offset` and attend over keys [0, valid). qkv: (B, T, 3, Hh, Dh).
        Returns (B, Hh, T, Dh); with `fp8_out` (an FP8 model) the output projection's input instead, (B, T, Hh*Dh)
        quantised per token."""
        attend = attention_fp8_out if fp8_out else attention
        if self.fp8_kernel == "cudnn":
            return self._attend_fp8_tensor(layer, qkv, q_weight, k_weight, cos, sin, offset, valid, fp8_out)
        if self.fp8:
            return self._attend_fp8(layer, qkv, q_weight, k_weight, cos, sin, offset, valid, fp8_out)
        if self.mode == "write_time":
            kc, vc = self.k[layer], self.v[layer]  # (B, Hh, S, Dh)
            b, t, _, hh, dh = qkv.shape
            # q token-major, so attention's output comes back token-major and the output
            # projection's (B, T, Hh*Dh) view needs no copy
            q = torch.empty(b, t, hh, dh, device=qkv.device, dtype=qkv.dtype).transpose(1, 2)  # (B, Hh, T, Dh)
            q = qkv_prep(qkv, q_weight, k_weight, cos, sin, kc, vc, offset, self.eps, out=q)
            return attend(q, kc[:, :, :valid], vc[:, :, :valid], self.backend)
        if not isinstance(offset, int):
            raise ValueError("cache_mode='naive' needs a host int offset (it slices the cache); use 'write_time'")
        t = qkv.shape[1]
        kr, vr = self.k[layer], self.v[layer]  # (B, S, Hh, Dh) fp32
        kr[:, offset:offset + t] = qkv[:, :, 1].float()
        vr[:, offset:offset + t] = qkv[:, :, 2].float()
        self.cos[offset:offset + t], self.sin[offset:offset + t] = cos, sin
        q = rope_ref(rms_norm_ref(qkv[:, :, 0].float(), q_weight, self.eps), cos, sin)  # (B, T, Hh, Dh)
        k = rope_ref(rms_norm_ref(kr[:, :valid], k_weight, self.eps), self.cos[:valid], self.sin[:valid])
        q = q.to(self.dtype).transpose(1, 2)  # (B, Hh, T, Dh)
        k = k.to(self.dtype).transpose(1, 2)  # (B, Hh, valid, Dh)
        v = vr[:, :valid].to(self.dtype).transpose(1, 2)
        return attend(q, k, v, self.backend)

    # ------------------------------------------------------------------ self-attention whole on a rank's rows
    def attend_rows(self, layer: int, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, offset: int | torch.Tensor, valid: int, shards: TokenShards,
                    fp8_out: bool = False) -> torch.Tensor | Fp8Act:
        """`attend` for self-attention kept whole on this rank's rows (`topology.local_attention`): qkv (B, m, 3,
        Hh, Dh) holds rank r's m rows of the T tokens (all heads), cos / sin (m, Dh/2) their RoPE rows. The rows'
        K/V go, in the cache's form, into block r of a staging buffer; every rank's block is gathered (one
        all-gather; FP8: bytes); the T rows land in the cache at `offset` in token order (rank c's row i at
        offset + c*m + i; padding rows past T dropped), as one rank writes a chunk; then this rank's queries attend
        over keys [0, valid). Returns what `attend` does, for the m rows. With FP8's per-layer V scale, the first
        write's scale is the largest over the ranks (every rank quantises V alike)."""
        if self.mode != "write_time":
            raise ValueError("topology.local_attention gathers K/V rows in the cache's written form: it needs "
                             "generation.cache_mode='write_time'")
        b, m, _, hh, dh = qkv.shape
        n, r, t = shards.size, shards.rank, shards.tokens
        own = max(0, min(m, t - r * m))  # this rank's rows that are tokens (the rest pad the last ranks)
        q8 = torch.empty(b, m, hh, dh, device=qkv.device, dtype=FP8).transpose(1, 2) if self.fp8 else None
        if self.fp8_kernel == "cudnn":
            k, v, vs, qks = self.k[layer], self.v[layer], self.v_scale[layer], self.qk_scale[layer]
            if not self.v_scale_set[layer]:  # the session's first write: V's scale, the same on every rank
                if own:
                    set_v_tensor_scale(vs, qkv[:, :own])
                torch.reciprocal(shards.all_reduce_max(vs), out=self.v_inv[layer])
                self.v_scale_set[layer] = True
            st = self._stage((n, 2, b, hh, m, dh), FP8)  # (n, K|V, B, Hh, m, Dh) e4m3
            assert q8 is not None
            q = qkv_prep_fp8(qkv, q_weight, k_weight, cos, sin, st[r, 0], st[r, 1], vs, qks, 0, self.eps, out=q8,
                             v_layout="tensor")
            shards.gather_blocks(st)
            scatter_rows(st, k, v, offset, t)
            o = torch.empty(b, m, hh, dh, device=qkv.device, dtype=FP8).transpose(1, 2)  # token-major, as q
            attention_fp8_tensor(q, k, v, valid, qks, vs, o, "cudnn" if qkv.is_cuda else "torch", self.v_inv[layer])
            if not fp8_out:
                return (o.float() * vs).to(qkv.dtype)  # (B, Hh, m, Dh)
            return Fp8Act(o.transpose(1, 2).reshape(b, m, hh * dh), vs.expand(b, m, 1).contiguous())
        if self.fp8:
            k, vt, vs, qks = self.k[layer], self.vt[layer], self.v_scale[layer], self.qk_scale[layer]
            kst = self._stage((n, b, hh, m, dh), FP8)
            vtst = self._stage((n, b, hh, dh, m), FP8)  # V transposed, as the cache holds it
            vsst = self._stage((n, b, hh, m), torch.float32)  # its scale per (head, key)
            assert q8 is not None
            q = qkv_prep_fp8(qkv, q_weight, k_weight, cos, sin, kst[r], vtst[r], vsst[r], qks, 0, self.eps, out=q8)
            for buf in (kst, vtst, vsst):
                shards.gather_blocks(buf)
            scatter_axis(k, kst, offset, t, axis=2)
            scatter_axis(vt, vtst, offset, t, axis=3)
            scatter_axis(vs, vsst, offset, t, axis=2)
            out = attention_fp8(q, k[:, :, :valid], vt[..., :valid], vs[..., :valid], qks, qkv.dtype)
            return quantize_rows(out.transpose(1, 2).reshape(b, m, hh * dh)) if fp8_out else out
        st = self._stage((n, 2, b, hh, m, dh), self.dtype)  # (n, K|V, B, Hh, m, Dh)
        q = torch.empty(b, m, hh, dh, device=qkv.device, dtype=qkv.dtype).transpose(1, 2)  # token-major
        q = qkv_prep(qkv, q_weight, k_weight, cos, sin, st[r, 0], st[r, 1], 0, self.eps, out=q)
        shards.gather_blocks(st)
        kc, vc = self.k[layer], self.v[layer]
        scatter_rows(st, kc, vc, offset, t)
        return (attention_fp8_out if fp8_out else attention)(q, kc[:, :, :valid], vc[:, :, :valid], self.backend)

    def _stage(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A staging buffer of `shape` kept per shape (made zeroed on first use: the warm-up's eager steps, before
        any graph capture), for `attend_rows`."""
        key = (shape, dtype)
        buf = self._staging.get(key)
        if buf is None:
            buf = self._staging[key] = torch.zeros(shape, device=self.k.device, dtype=dtype)
        return buf

    def _attend_fp8(self, layer: int, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, offset: int | torch.Tensor, valid: int, fp8_out: bool
                    ) -> torch.Tensor | Fp8Act:
        """The FP8 cache: one kernel writes q8 and this chunk's K/V (with scales), one reads them."""
        b, t, _, hh, dh = qkv.shape
        k, vt, vs, qks = self.k[layer], self.vt[layer], self.v_scale[layer], self.qk_scale[layer]
        q = torch.empty(b, t, hh, dh, device=qkv.device, dtype=FP8).transpose(1, 2)  # (B, Hh, T, Dh) token-major
        q = qkv_prep_fp8(qkv, q_weight, k_weight, cos, sin, k, vt, vs, qks, offset, self.eps, out=q)
        out = attention_fp8(q, k[:, :, :valid], vt[..., :valid], vs[..., :valid], qks, qkv.dtype)  # (B, Hh, T, Dh)
        if not fp8_out:
            return out
        return quantize_rows(out.transpose(1, 2).reshape(b, t, hh * dh))  # the output projection's input

    def _attend_fp8_tensor(self, layer: int, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, offset: int | torch.Tensor, valid: int, fp8_out: bool
                           ) -> torch.Tensor | Fp8Act:
        """The cuDNN form: per-tensor scales; the e4m3 output (scale v_scale) is the output projection's input."""
        b, t, _, hh, dh = qkv.shape
        k, v, vs, qks = self.k[layer], self.v[layer], self.v_scale[layer], self.qk_scale[layer]
        if not self.v_scale_set[layer]:  # the session's first write (the sink) sets V's scale
            set_v_tensor_scale(vs, qkv)  # (where it is still 0: right in a graph captured before any write too)
            torch.reciprocal(vs, out=self.v_inv[layer])
            self.v_scale_set[layer] = True
        q = torch.empty(b, t, hh, dh, device=qkv.device, dtype=FP8).transpose(1, 2)  # (B, Hh, T, Dh) token-major
        q = qkv_prep_fp8(qkv, q_weight, k_weight, cos, sin, k, v, vs, qks, offset, self.eps, out=q, v_layout="tensor")
        o = torch.empty(b, t, hh, dh, device=qkv.device, dtype=FP8).transpose(1, 2)  # token-major, as q
        attention_fp8_tensor(q, k, v, valid, qks, vs, o, "cudnn" if qkv.is_cuda else "torch", self.v_inv[layer])
        if not fp8_out:
            return (o.float() * vs).to(qkv.dtype)  # (B, Hh, T, Dh)
        return Fp8Act(o.transpose(1, 2).reshape(b, t, hh * dh), vs.expand(b, t, 1).contiguous())

