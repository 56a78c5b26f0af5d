"""Training the tiny DiT and audio encoder by flow matching on VAE latents, the way inference runs.

Details: docs/training.md (`characters.train.fit_dit`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from characters.audio import AudioEncoder, AudioFrontend, frame_end_sample
from characters.config import AudioConfig, ModelConfig
from characters.dit import CausalDiT, block_causal_mask
from characters.engine import flow_schedule
from characters.rope import RopeTables
from characters.train.data import Clip
from characters.train.face import mouth_box
from characters.weights import init_weights, seeded_build


@dataclass(frozen=True)
class DiTTrainConfig:
    steps: int = 1200
    batch: int = 4
    chunks: int = 4  # K chunks per sequence
    lr: float = 8e-4
    mouth_weight: float = 6.0
    seed: int = 0
    bf16: bool = True
    device: str = "cpu"
    schedule_steps: int = 2  # the flow schedule noised to (cache keys at its second-last time); the shipped `tiny`
    # DiT was trained on 2 steps and runs at the preset's 1 (docs/training.md: it scores the same)


@dataclass
class ClipLatents:
    """What DiT training reads of one clip (all precomputed once)."""

    latents: torch.Tensor  # (C, L, h, w) the clip's latents
    reference: torch.Tensor  # (C, h, w) the reference image's latent
    bands: torch.Tensor  # (ctx + F, Sf, n_bands) log band power of each frame's window (ctx frames of silence first)
    weight: torch.Tensor  # (h, w) loss weight (mouth region up-weighted)


def clip_windows(pcm: np.ndarray, frames: int, audio: AudioConfig, fps: int = 24) -> np.ndarray:
    """Windows of frames -ctx .. frames-1, each the `window_samples` samples ending at that frame's end
    (zeros before the start): exactly what `AudioFrontend.push` hands the encoder. (ctx + F, W) float32"""
    w = audio.window_samples
    padded = np.concatenate([np.zeros(w, np.float32), pcm.astype(np.float32)])
    out = np.zeros((audio.context_frames + frames, w), np.float32)
    for i, f in enumerate(range(-audio.context_frames, frames)):
        end = frame_end_sample(f, audio.sample_rate, fps) + w  # index in `padded`
        if end > 0:
            seg = padded[max(0, end - w):end]
            out[i, w - seg.size:] = seg
    return out


def latent_weight(clip: Clip, cfg: ModelConfig, mouth_weight: float) -> torch.Tensor:
    h, w = cfg.latent_hw
    f = cfg.vae.spatial_factor
    top, bot, left, right = mouth_box(clip.identity, margin=6.0)
    out = torch.ones(h, w)
    out[max(0, top // f):min(h, -(-bot // f)), max(0, left // f):min(w, -(-right // f))] += mouth_weight
    return out


def build_dit(cfg: ModelConfig, seed: int) -> tuple[CausalDiT, AudioEncoder]:
    """The DiT and audio encoder as `DiTRunner` builds them from a seed, head zeroed (output 0 at start)."""
    dit = CausalDiT(cfg)
    init_weights(dit, seed)
    with torch.no_grad():
        dit.head.weight.zero_()
    return dit, seeded_build(lambda: AudioEncoder(cfg.audio, cfg.dit.audio_dim), seed + 1)


class SequenceBatcher:
    """Draws training sequences [sink | K chunks] and builds everything `forward_sequence` takes."""

    def __init__(self, cfg: ModelConfig, data: list[ClipLatents], chunks: int, seed: int,
                 device: str = "cpu", schedule_steps: int | None = None) -> None:
        self.cfg, self.data, self.k = cfg, data, chunks
        self.rng = np.random.default_rng(seed)
        g = cfg.generation
        sig = flow_schedule(schedule_steps or g.denoising_steps, g.timestep_shift)
        self.t_last, self.t_steps = sig[-2], sig[:-1]
        n = cfg.tokens_per_frame
        self.device = device
        rope = RopeTables(cfg.dit, g.latent_frames_per_chunk, cfg.token_grid, device)
        tables = [rope.sink(), *[rope.chunk(k) for k in range(chunks)]]
        self.cos, self.sin = torch.cat([c for c, _ in tables]), torch.cat([s for _, s in tables])  # (T, Dh/2)
        self.mask = block_causal_mask(n, cfg.tokens_per_chunk, chunks, g.ring_slots, device)  # (T, T)

    def draw(self, batch: int) -> dict[str, torch.Tensor]:
        k, ctx = self.k, self.cfg.audio.context_frames
        tf = self.cfg.vae.temporal_factor
        x0, ref, bands, weight, t_chunks = [], [], [], [], []
        for _ in range(batch):
            d = self.data[int(self.rng.integers(len(self.data)))]
            s = int(self.rng.integers(0, d.latents.shape[1] - k + 1))
            x0.append(d.latents[:, s:s + k])
            ref.append(d.reference)
            # chunk j hears frames tf*(s+j) - ctx .. tf*(s+j) + tf - 1, i.e. rows tf*(s+j) .. + tf + ctx
            bands.append(torch.stack([d.bands[tf * (s + j):tf * (s + j) + tf + ctx] for j in range(k)]))
            weight.append(d.weight)
            last = self.t_steps[int(self.rng.integers(len(self.t_steps)))]
            t_chunks.append(torch.tensor([self.t_last] * (k - 1) + [last]))
        out = {"x0": torch.stack(x0), "ref": torch.stack(ref), "bands": torch.stack(bands),
               "weight": torch.stack(weight), "t": torch.stack(t_chunks).float()}
        return {k: v.to(self.device) for k, v in out.items()}


def sequence_velocity(dit: CausalDiT, audio: AudioEncoder, sink_bands: torch.Tensor, batcher: SequenceBatcher,
                      ref: torch.Tensor, xt: torch.Tensor, bands: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The DiT's velocity for every chunk of a sequence, in one `forward_sequence`.

    ref (B, C, h, w) reference latent; xt (B, C, K, h, w) the chunks' noisy latents at times t (B, K);
    bands (B, K, A, Sf, n_bands) each chunk's log band power; sink_bands (1, 1, A, Sf, n_bands) silence.
    Returns (B, C, K, h, w)."""
    bsz = t.shape[0]
    x = torch.cat([ref[:, :, None], xt], dim=2)  # (B, C, 1 + K, h, w)
    n, nt = batcher.cfg.tokens_per_frame, batcher.cfg.tokens_per_chunk
    t_tok = torch.cat([torch.zeros(bsz, n, device=t.device), t.repeat_interleave(nt, dim=1)], dim=1)  # (B, T)
    feats = audio.project(torch.cat([sink_bands.expand(bsz, -1, -1, -1, -1), bands], dim=1))  # (B, 1+K, A, Da)
    ctx = dit.audio_embed(feats)  # (B, 1 + K, A, Dc)
    return dit.forward_sequence(x, t_tok, ctx, batcher.cos, batcher.sin, batcher.mask)[:, :, 1:]


def sequence_loss(dit: CausalDiT, audio: AudioEncoder, sink_bands: torch.Tensor, batcher: SequenceBatcher,
                  b: dict[str, torch.Tensor]) -> torch.Tensor:
    """Flow-matching loss of one batch of sequences (weighted MSE on the velocity of every chunk)."""
    x0, t = b["x0"], b["t"]  # (B, C, K, h, w), (B, K)
    noise = torch.randn_like(x0)
    tt = t[:, None, :, None, None]
    v = sequence_velocity(dit, audio, sink_bands, batcher, b["ref"], (1 - tt) * x0 + tt * noise, b["bands"], t)
    err = (v.float() - (noise - x0)).square().mean(1)  # (B, K, h, w)
    w = b["weight"][:, None]  # (B, 1, h, w)
    return (err * w).sum() / (w.sum() * t.shape[1])


def train_dit(cfg: ModelConfig, data: list[ClipLatents], tc: DiTTrainConfig,
              log: Callable[[str], None] = print) -> tuple[CausalDiT, AudioEncoder, list[dict[str, float]]]:
    torch.manual_seed(tc.seed)
    dit, audio = build_dit(cfg, tc.seed)
    dit, audio = dit.to(tc.device).train(), audio.to(tc.device).train()
    batcher = SequenceBatcher(cfg, data, tc.chunks, tc.seed, tc.device, tc.schedule_steps)
    ctx, tf = cfg.audio.context_frames, cfg.vae.temporal_factor
    silence = torch.zeros(1, tf + ctx, cfg.audio.window_samples, device=tc.device)
    with torch.no_grad():
        sink_bands = audio.band_features(silence)  # (1, A, Sf, n_bands)
    params = [*dit.parameters(), *audio.parameters()]
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                            lr=tc.lr, betas=(0.9, 0.98))
    warm = max(1, tc.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warm) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * i / tc.steps))))
    history: list[dict[str, float]] = []
    t0, running = time.perf_counter(), 0.0
    for step in range(tc.steps):
        batch = batcher.draw(tc.batch)
        with torch.autocast(torch.device(tc.device).type, dtype=torch.bfloat16, enabled=tc.bf16):
            loss = sequence_loss(dit, audio, sink_bands[:, None], batcher, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        running = float(loss.detach()) if step == 0 else 0.95 * running + 0.05 * float(loss.detach())
        if step % 25 == 0 or step == tc.steps - 1:
            row = {"step": step, "loss": running, "s": time.perf_counter() - t0}
            history.append(row)
            log(f"dit step {step:5d}  loss {running:.4f}  {row['s']:.0f}s")
    return dit.cpu().eval(), audio.cpu().eval(), history


@torch.no_grad()
def prepare_clip(clip: Clip, latents: torch.Tensor, reference: torch.Tensor, audio: AudioEncoder,
                 cfg: ModelConfig, mouth_weight: float) -> ClipLatents:
    windows = torch.from_numpy(clip_windows(clip.pcm, clip.frames, cfg.audio))[None]  # (1, ctx + F, W)
    bands = audio.band_features(windows)[0]  # (ctx + F, Sf, n_bands)
    return ClipLatents(latents.float(), reference.float(), bands, latent_weight(clip, cfg, mouth_weight))


def check_windows(cfg: ModelConfig, pcm: np.ndarray, frames: int) -> float:
    """Max abs difference between `clip_windows` and the streaming frontend's windows (should be 0)."""
    fe = AudioFrontend(cfg.audio, cfg.generation.frames_per_chunk)
    ours = clip_windows(pcm, frames, cfg.audio)
    fc, ctx = cfg.generation.frames_per_chunk, cfg.audio.context_frames
    worst = 0.0
    for k in range(frames // fc):
        a, b = k * fc * 16000 // 24, (k + 1) * fc * 16000 // 24
        got = fe.push(pcm[a:b])
        worst = max(worst, float(np.abs(got - ours[k * fc:k * fc + fc + ctx]).max()))
    return worst


__all__ = ["ClipLatents", "DiTTrainConfig", "SequenceBatcher", "build_dit", "check_windows", "clip_windows",
           "prepare_clip", "sequence_velocity", "train_dit"]
