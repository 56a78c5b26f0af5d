"""LiveAvatar's block-causal streaming loop, as the authors' single-GPU `WanS2V.generate` runs it.

Per session: the condition tokens (reference + frame-packed motion) are run once through every block at
t = 0 (`start`); their keys (un-rotated) and values stay in a condition cache that every step shares. Then
each block of `f` latent frames is denoised in `steps` Euler steps; step i reads and writes its own rolling
self-attention cache (a KV cache per step: the keys of step i are those of step i's noise level), holding one
clip of frames (`blocks_per_clip` blocks) and overwritten in ring order once full. Keys enter that cache
rotated (RoPE at write time); attention reads the cache and the condition keys where they lie and merges the
two by log-sum-exp, so no step copies the cache. The reference's RoPE position moves with a random distance in
[4, 30] on every forward once generation passes frame 30 - distance, as theirs (`random.randint` in
`_forward_inference`): `rng` draws it, so a parity run seeds it as theirs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from characters.families.liveavatar.audio import block_audio
from characters.families.liveavatar.config import LiveAvatarLoopConfig
from characters.families.liveavatar.dit import LiveAvatarDiT, inject_audio, rope_attention
from characters.families.liveavatar.layers import SelfAttention, attend
from characters.families.liveavatar.rope import (
    Group,
    RopeTable,
    apply_rope,
    motion_groups,
    noisy_group,
    reference_group,
    shift_time,
)
from kernels.attention import PARTS, merge_parts, parts_ref


def attend_parts(q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Attention of (1, T, Hh, Dh) queries over the union of key sets [(k, v) (1, L, Hh, Dh)], each attended
    where it lies (no concatenated copy of the cache) and merged by log-sum-exp: (1, T, Hh * Dh)."""
    qh = q.transpose(1, 2)
    scale = q.shape[-1] ** -0.5
    fn = PARTS["flash"] if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) else parts_ref
    outs, lses = zip(*(fn(qh, k.transpose(1, 2), v.transpose(1, 2), scale) for k, v in parts), strict=True)
    return merge_parts(torch.stack(outs, 1), torch.stack(lses, 1)).transpose(1, 2).flatten(2)


def euler_schedule(steps: int, shift: float, train_timesteps: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps (steps,), sigmas (steps + 1,)) float32 of diffusers' FlowMatchEulerDiscreteScheduler(shift)
    after set_timesteps(steps): the shift is applied at construction and again on the sampled sigmas."""
    base = np.linspace(1, train_timesteps, train_timesteps, dtype=np.float32)[::-1].copy()
    s = torch.from_numpy(base) / train_timesteps
    s = shift * s / (1 + (shift - 1) * s)
    sigma_max, sigma_min = s[0].item(), s[-1].item()
    t = np.linspace(sigma_max * train_timesteps, sigma_min * train_timesteps, steps)
    sig = t / train_timesteps
    sig = shift * sig / (1 + (shift - 1) * sig)
    sigmas = torch.from_numpy(sig).to(torch.float32)
    return sigmas * train_timesteps, torch.cat([sigmas, torch.zeros(1)])


def euler_step(out: torch.Tensor, sample: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    """x_{i+1} = x_i + (sigma_{i+1} - sigma_i) * v, in float32, cast to the model output's dtype (diffusers)."""
    return (sample.float() + (sigma_next - sigma) * out).to(out.dtype)


@dataclass
class LayerCaches:
    """One layer's caches: the condition keys/values (shared by every step) and one rolling cache per step."""

    cond_k: torch.Tensor  # (1, Lc, Hh, Dh) un-rotated
    cond_v: torch.Tensor  # (1, Lc, Hh, Dh)
    cond_kr: torch.Tensor  # (1, Lc, Hh, Dh) rotated: the motion part once, the reference part every forward
    k: list[torch.Tensor] = field(default_factory=list)  # per step (1, S, Hh, Dh), rotated
    v: list[torch.Tensor] = field(default_factory=list)


class LiveAvatarStream:
    """One session's generation state on one device: `start` once, then `block` per block of latent frames."""

    def __init__(self, model: LiveAvatarDiT, loop: LiveAvatarLoopConfig, rng: random.Random | None = None) -> None:
        self.model = model
        self.loop = loop
        self.rng = rng or random.Random()
        cfg = model.cfg
        self.table = RopeTable(cfg.head_dim, cfg.rope_positions, cfg.rope_split)
        self.h, self.w = loop.latent_hw
        self.hp, self.wp = self.h // 2, self.w // 2
        self.n_tokens = self.hp * self.wp
        self.timesteps, self.sigmas = euler_schedule(loop.steps, loop.shift, loop.train_timesteps)
        self.blocks_done = 0
        self.layers: list[LayerCaches] = []

    # ----------------------------------------------------------------------------------------- positions

    def _cond_groups(self, rollout: int) -> list[Group]:
        ref = shift_time(reference_group(self.hp, self.wp, self.loop.cond_rollout_base), rollout)
        return [ref, *motion_groups(self.hp, self.wp, self.model.cfg.motion_buckets)]

    def _ref_rope(self) -> torch.Tensor:
        """(N, Dh/2, 2) for this forward: the reference rolled by a fresh random distance once past it (the
        motion groups never roll)."""
        distance = self.rng.randint(4, 30)
        frame = self.blocks_done * self.loop.frames_per_block
        rollout = max(0, frame - (self.loop.cond_rollout_base - distance))
        return self.table.group(self._cond_groups(rollout)[0])

    # ----------------------------------------------------------------------------------------- session

    @torch.no_grad()
    def start(self, ref_latent: torch.Tensor, motion: torch.Tensor, text: torch.Tensor,
              pose: torch.Tensor | None = None) -> None:
        """Prefill: (C, 1, h, w) reference, (C, Tm, h, w) motion latents, (Lt, text_dim) umT5 states."""
        m = self.model
        p = next(m.parameters())
        dev, dt = p.device, p.dtype
        self.text_kv = m.text_kv(m.text_context(text.to(dev, dt)))
        self.pose = (pose if pose is not None else torch.zeros(m.cfg.cond_dim, self.loop.frames_per_block,
                                                               self.h, self.w)).to(dev, dt)
        x = m.cond_tokens(ref_latent.to(dev, dt), motion.to(dev, dt))  # (1, Lc, D)
        if x.shape[1] > self.loop.cond_capacity:
            raise ValueError(f"liveavatar: {x.shape[1]} condition tokens exceed loop.cond_capacity="
                             f"{self.loop.cond_capacity}; lower the resolution")
        cs = self.table.groups(self._cond_groups(0)).to(dev)
        e0, _ = m.time_mods(torch.zeros(1, device=dev))
        e = e0.expand(x.shape[1], -1, -1)  # every condition token at t = 0
        slots, dh = self.loop.cache_slots, m.cfg.head_dim
        hh = m.local_heads
        self.layers = []
        for i, blk in enumerate(m.blocks):
            caches = LayerCaches(cond_k=x.new_zeros(0), cond_v=x.new_zeros(0), cond_kr=x.new_zeros(0))

            def prefill(attn: SelfAttention, h: torch.Tensor, caches: LayerCaches = caches) -> torch.Tensor:
                q, k, v = attn.qkv(h)
                caches.cond_k, caches.cond_v, caches.cond_kr = k, v, apply_rope(k, cs).type_as(v)
                return attn.o(attend(apply_rope(q, cs).type_as(v), caches.cond_kr, v))

            x = blk(x, e, prefill, self.text_kv[i])
            caches.k = [x.new_zeros(1, slots, hh, dh) for _ in range(self.loop.steps)]
            caches.v = [x.new_zeros(1, slots, hh, dh) for _ in range(self.loop.steps)]
            self.layers.append(caches)
        self.blocks_done = 0

    @torch.no_grad()
    def forward(self, latents: torch.Tensor, t: torch.Tensor, audio: tuple[torch.Tensor, torch.Tensor],
                step: int) -> torch.Tensor:
        """One denoising forward: (C, f, h, w) latents at timestep t -> (C, f, h, w) velocity; writes step's cache."""
        m, loop = self.model, self.loop
        f = loop.frames_per_block
        frame = self.blocks_done * f
        start = self.blocks_done * loop.block_tokens
        at = start % loop.cache_slots
        active = loop.cache_slots if start >= loop.cache_slots else start + loop.block_tokens
        x = m.noisy_tokens(latents, self.pose)  # (1, T, D)
        dev = x.device
        cs = self.table.group(noisy_group(f, self.hp, self.wp, frame)).to(dev)
        ref_cs = self._ref_rope().to(dev)
        n_ref = ref_cs.shape[0]
        e0, e = m.time_mods(t.expand(f).to(dev))
        e_tok = e0.repeat_interleave(self.n_tokens, dim=0)  # (T, 6, D)
        for i, blk in enumerate(m.blocks):
            caches = self.layers[i]

            def attn(sa: SelfAttention, h: torch.Tensor, caches: LayerCaches = caches) -> torch.Tensor:
                q, k, v = rope_attention(sa, h, cs)
                caches.k[step][:, at:at + loop.block_tokens] = k
                caches.v[step][:, at:at + loop.block_tokens] = v
                caches.cond_kr[:, :n_ref] = apply_rope(caches.cond_k[:, :n_ref], ref_cs).type_as(v)
                return sa.o(attend_parts(q, [(caches.k[step][:, :active], caches.v[step][:, :active]),
                                             (caches.cond_kr, caches.cond_v)]))

            x = blk(x, e_tok, attn, self.text_kv[i])
            x = inject_audio(m, i, x, audio, f)
        return m.unpatchify(m.head(x, e, f), f, self.h, self.w)

    @torch.no_grad()
    def block(self, noise: torch.Tensor, audio_feats: torch.Tensor) -> torch.Tensor:
        """Denoise one block: (C, f, h, w) noise, (1, La, Da, 4f) audio features -> (C, f, h, w) latents."""
        m, loop = self.model, self.loop
        dt = next(m.parameters()).dtype
        enc = m.casual_audio_encoder
        audio = block_audio(enc, audio_feats.to(next(enc.parameters()).device), loop.motion_frames,
                            loop.motion_latent_frames, dt)
        x = noise.to(dt)
        sig = self.sigmas.to(x.device)
        for i, t in enumerate(self.timesteps):
            out = self.forward(x, t.reshape(1), audio, step=i)
            x = euler_step(out, x, sig[i], sig[i + 1])
        self.blocks_done += 1
        return x
