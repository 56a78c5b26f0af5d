"""LiveAvatar's transformer (Wan2.2-S2V-14B, causal): read top to bottom on one device.

Parameter names are the authors' (`CausalWanModel_S2V`'s state dict), so a hub checkpoint loads as published.
Two forwards, as theirs: `prefill` runs the condition tokens (reference + frame-packed motion) through every
block at t = 0 and leaves their keys and values in the condition cache; `forward` denoises one block of latent
frames against the rolling self-attention cache plus that condition cache, writing its own keys (RoPE applied
once, at write time) into the step's cache. Their numerics are kept where they differ from plain bf16: the
cross-attention's input norm sees a bf16-rounded residual; modulation, gates and the head run in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from characters.families.liveavatar.audio import AudioInjector, CausalAudioEncoder
from characters.families.liveavatar.config import LiveAvatarDiTConfig
from characters.families.liveavatar.layers import (
    CrossAttention,
    SelfAttention,
    f32_linear,
    layer_norm,
    mlp,
    sinusoidal,
)
from characters.families.liveavatar.rope import apply_rope

SelfAttnFn = Callable[["SelfAttention", torch.Tensor], torch.Tensor]


class Block(nn.Module):
    """One Wan2.2-S2V block: modulated self-attention, text cross-attention, modulated MLP."""

    def __init__(self, cfg: LiveAvatarDiTConfig) -> None:
        super().__init__()
        d = cfg.dim
        self.eps = cfg.eps
        self.self_attn = SelfAttention(d, cfg.num_heads, cfg.eps)
        self.norm3 = nn.LayerNorm(d, eps=cfg.eps, elementwise_affine=True)
        self.cross_attn = CrossAttention(d, cfg.num_heads, cfg.eps)
        self.ffn = mlp(d, cfg.ffn_dim)
        self.modulation = nn.Parameter(torch.randn(1, 6, d) / d**0.5)

    def mods(self, e: torch.Tensor) -> list[torch.Tensor]:
        """(L, 6, D) float32 per-token modulation -> six (1, L, D): shift/scale/gate of attention, then MLP."""
        m = self.modulation.float()[0] + e  # (L, 6, D)
        return [m[None, :, i] for i in range(6)]

    def forward(self, x: torch.Tensor, e: torch.Tensor, attn: SelfAttnFn,
                text_kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x (1, L, D) in the compute dtype, e (L, 6, D) float32; `attn(self_attn, h)` attends over the caches.

        Inside the block the residual is float32 (their gated adds run under float32 autocast); it returns to the
        compute dtype at the block's end. The cross-attention's norm sees the residual rounded to bf16, as theirs."""
        dt = x.dtype
        m = self.mods(e)
        h = (layer_norm(x, self.eps).float() * (1 + m[1]) + m[0]).to(dt)
        r = x.float() + attn(self.self_attn, h).float() * m[2]
        h = self.norm3(r.to(torch.bfloat16)).to(dt)
        r = r + self.cross_attn(h, kv=text_kv).float()
        h = (layer_norm(r, self.eps) * (1 + m[4]) + m[3]).to(dt)
        r = r + self.ffn(h).float() * m[5]
        return r.to(dt)




class Head(nn.Module):
    def __init__(self, cfg: LiveAvatarDiTConfig) -> None:
        super().__init__()
        self.eps = cfg.eps
        self.head = nn.Linear(cfg.dim, cfg.latent_channels * 4)
        self.modulation = nn.Parameter(torch.randn(1, 2, cfg.dim) / cfg.dim**0.5)

    def forward(self, x: torch.Tensor, e: torch.Tensor, frames: int) -> torch.Tensor:
        """x (1, f*N, D), e (f, D) float32 -> (1, f*N, C*4) in x's dtype."""
        m = self.modulation.float() + e[:, None]  # (f, 2, D)
        shift, scale = m[:, 0], m[:, 1]
        h = layer_norm(x, self.eps).float().unflatten(1, (frames, -1))  # (1, f, N, D)
        h = h * (1 + scale[None, :, None]) + shift[None, :, None]
        return f32_linear(self.head, h.flatten(1, 2)).to(x.dtype)


class FramePacker(nn.Module):
    """Motion latents -> tokens: the nearest frame at the full grid, 2 frames at 2x, 16 at 4x (FramePack)."""

    def __init__(self, cfg: LiveAvatarDiTConfig) -> None:
        super().__init__()
        c, d = cfg.latent_channels, cfg.dim
        self.buckets = cfg.motion_buckets
        self.proj = nn.Conv3d(c, d, kernel_size=(1, 2, 2), stride=(1, 2, 2))
        self.proj_2x = nn.Conv3d(c, d, kernel_size=(2, 4, 4), stride=(2, 4, 4))
        self.proj_4x = nn.Conv3d(c, d, kernel_size=(4, 8, 8), stride=(4, 8, 8))

    def forward(self, motion: torch.Tensor) -> torch.Tensor:
        """(C, Tm, h, w) latents -> (1, 1.5 N, D) tokens: nearest, 2x, 4x."""
        c, tm, h, w = motion.shape
        total = sum(self.buckets)
        padded = motion.new_zeros(c, total, h, w)
        keep = min(total, tm)
        padded[:, total - keep:] = motion[:, tm - keep:]
        far, mid, near = padded[None].split(list(self.buckets)[::-1], dim=2)
        parts = [self.proj(near), self.proj_2x(mid), self.proj_4x(far)]
        return torch.cat([p.flatten(2).transpose(1, 2) for p in parts], dim=1)


class LiveAvatarDiT(nn.Module):
    """The whole transformer; the streaming loop (`loop.py`) owns caches and the order of calls. Tensor
    parallelism is applied afterwards (`layers.shard_liveavatar`)."""

    def __init__(self, cfg: LiveAvatarDiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, c = cfg.dim, cfg.latent_channels
        self.patch_embedding = nn.Conv3d(c, d, kernel_size=(1, 2, 2), stride=(1, 2, 2))
        self.text_embedding = nn.Sequential(nn.Linear(cfg.text_dim, d), nn.GELU(approximate="tanh"), nn.Linear(d, d))
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(d, d * 6))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.head = Head(cfg)
        if cfg.cond_dim:
            self.cond_encoder = nn.Conv3d(cfg.cond_dim, d, kernel_size=(1, 2, 2), stride=(1, 2, 2))
        self.casual_audio_encoder = CausalAudioEncoder(cfg)  # (sic): the authors' attribute name
        self.audio_injector = AudioInjector(cfg)
        self.trainable_cond_mask = nn.Embedding(3, d)
        self.frame_packer = FramePacker(cfg)

    @property
    def local_heads(self) -> int:
        """Attention heads on this rank (all of them until `shard_liveavatar` splits them)."""
        return cast(Block, self.blocks[0]).self_attn.num_heads

    # ------------------------------------------------------------------ conditioning, once per avatar/session

    def text_context(self, text: torch.Tensor) -> torch.Tensor:
        """(Lt, text_dim) umT5 states -> (1, text_len, D): zero-padded to text_len, all positions attended."""
        if text.shape[0] > self.cfg.text_len:
            raise ValueError(f"liveavatar: the prompt has {text.shape[0]} tokens, more than text_len="
                             f"{self.cfg.text_len} (the umT5 encoder truncates to it)")
        pad = text.new_zeros(self.cfg.text_len - text.shape[0], text.shape[1])
        return self.text_embedding(torch.cat([text, pad])[None])

    def text_kv(self, context: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each block's cross-attention keys and values of the text context: computed once, reused every step."""
        return [cast(Block, blk).cross_attn.context_kv(context) for blk in self.blocks]

    def time_mods(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(f,) timesteps -> ((f, 6, D) block modulation, (f, D) head input), float32."""
        emb0, emb2 = cast(nn.Linear, self.time_embedding[0]), cast(nn.Linear, self.time_embedding[2])
        e = f32_linear(emb2, F.silu(f32_linear(emb0, sinusoidal(self.cfg.freq_dim, t))))
        e0 = f32_linear(cast(nn.Linear, self.time_projection[1]), F.silu(e)).unflatten(1, (6, self.cfg.dim))
        return e0, e

    def cond_tokens(self, ref_latent: torch.Tensor, motion: torch.Tensor) -> torch.Tensor:
        """(C, 1, h, w) reference + (C, Tm, h, w) motion latents -> (1, Lc, D) condition tokens, marked."""
        ref = self.patch_embedding(ref_latent[None]).flatten(2).transpose(1, 2)  # (1, N, D)
        mot = self.frame_packer(motion)  # (1, 1.5N, D)
        marks = torch.cat([ref.new_ones(ref.shape[1], dtype=torch.long),
                           torch.full((mot.shape[1],), 2, dtype=torch.long, device=ref.device)])
        return torch.cat([ref, mot], dim=1) + self.trainable_cond_mask(marks)[None].to(ref.dtype)

    def noisy_tokens(self, latents: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """(C, f, h, w) latents + (Cc, f, h, w) pose condition -> (1, f*N, D) tokens, marked 0."""
        x = self.patch_embedding(latents[None])
        if hasattr(self, "cond_encoder"):
            x = x + self.cond_encoder(cond[None].to(x.dtype))
        x = x.flatten(2).transpose(1, 2)
        mark = torch.zeros(1, dtype=torch.long, device=x.device)
        return x + self.trainable_cond_mask(mark).to(x.dtype)

    def unpatchify(self, x: torch.Tensor, frames: int, h: int, w: int) -> torch.Tensor:
        """(1, f*N, C*4) -> (C, f, h, w)."""
        c = self.cfg.latent_channels
        u = x[0].view(frames, h // 2, w // 2, 1, 2, 2, c)
        return torch.einsum("fhwpqrc->cfphqwr", u).reshape(c, frames, h, w)


def inject_audio(model: LiveAvatarDiT, layer: int, x: torch.Tensor, audio: tuple[torch.Tensor, torch.Tensor],
                 frames: int) -> torch.Tensor:
    """After block `layer`, add its audio cross-attention: each latent frame's tokens attend to that frame's
    audio tokens, through an AdaLN conditioned on the frame's global audio vector."""
    slot = model.audio_injector.slot.get(layer)
    if slot is None:
        return x
    glob, local = audio  # (f, D), (f, A+1, D)
    tokens = x.shape[1]
    h = x.reshape(frames, tokens // frames, x.shape[-1])  # (f, N, D)
    h = model.audio_injector.injector_adain_layers[slot](h, glob)
    out = model.audio_injector.injector[slot](h, ctx=local)  # (f, N, D)
    return x + out.reshape(1, tokens, -1).to(x.dtype)


def rope_attention(attn: SelfAttention, h: torch.Tensor, cs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v of `h` with q and k rotated by `cs`, in h's dtype (their .type_as(v))."""
    q, k, v = attn.qkv(h)
    return apply_rope(q, cs).type_as(v), apply_rope(k, cs).type_as(v), v
