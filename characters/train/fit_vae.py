"""Training the tiny VAE: encoder + causal decoder as a deterministic autoencoder on rendered clips.

Each step takes `batch` random spans of `latents` latent frames (4 video frames each) and a random crop of
`crop` latent pixels (most crops hold the mouth: it is what lip-sync is read from), encodes, adds a little
Gaussian noise to the latents (so the decoder tolerates the DiT's imperfect ones) and decodes the span from
a zero state, as a stream starts. Loss: L1 on pixels, weighted up inside the mouth box, plus a small
penalty that keeps every latent channel near zero mean and unit variance, so the DiT sees well-scaled
latents without a separate scale in the engine. Both networks are convolutional, so crops train them for
the whole frame; the decoder's per-frame attention sees a smaller grid in training than at 176x272.

`train_decoder` fits a new decoder to a frozen, trained encoder (the same loss without the latent penalty):
the latent space stays exactly the one the DiT was trained on, so a lighter decoder can replace the shipped
one without retraining the DiT (or touching its lip sync).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from characters.config import ModelConfig
from characters.train.data import Clip, render_clip
from characters.train.face import mouth_box
from characters.vae import CausalDecoder, VAEEncoder
from characters.weights import seeded_build


@dataclass(frozen=True)
class VAETrainConfig:
    steps: int = 1000
    batch: int = 2
    latents: int = 2  # latent frames per span
    crop: tuple[int, int] = (12, 18)  # latent pixels (x8 in the image)
    lr: float = 2e-3
    mouth_weight: float = 4.0
    stats_weight: float = 0.1
    latent_noise: float = 0.05
    seed: int = 0
    device: str = "cpu"


def _to_video(frames: np.ndarray) -> torch.Tensor:
    """(F, H, W, 3) uint8 -> (3, F, H, W) float in [-1, 1]."""
    return torch.from_numpy(frames).permute(3, 0, 1, 2).float() / 127.5 - 1


def _sample(clips: list[Clip], cfg: ModelConfig, tc: VAETrainConfig, rng: np.random.Generator
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of cropped spans (B, 3, F, H', W') and their per-pixel loss weights (B, 1, 1, H', W')."""
    f = cfg.vae.spatial_factor
    ch, cw = tc.crop[0] * f, tc.crop[1] * f
    lh, lw = cfg.latent_hw
    vids, weights = [], []
    for _ in range(tc.batch):
        clip = clips[int(rng.integers(len(clips)))]
        chunks = clip.frames // 4
        s = int(rng.integers(0, chunks - tc.latents + 1)) * 4
        top, bot, left, right = mouth_box(clip.identity)
        if rng.uniform() < 0.7:  # a crop that holds the mouth
            y = int(np.clip((top + bot) // 2 // f - tc.crop[0] // 2 + rng.integers(-3, 4), 0, lh - tc.crop[0]))
            x = int(np.clip((left + right) // 2 // f - tc.crop[1] // 2 + rng.integers(-4, 5), 0, lw - tc.crop[1]))
        else:
            y, x = int(rng.integers(0, lh - tc.crop[0] + 1)), int(rng.integers(0, lw - tc.crop[1] + 1))
        y, x = y * f, x * f
        frames = render_clip(clip, s, s + 4 * tc.latents)[:, y:y + ch, x:x + cw]
        vids.append(_to_video(frames))
        w = torch.ones(1, 1, ch, cw)
        w[..., max(0, top - y):max(0, bot - y), max(0, left - x):max(0, right - x)] += tc.mouth_weight
        weights.append(w)
    return torch.stack(vids), torch.stack(weights)


def build_vae(cfg: ModelConfig, seed: int) -> tuple[VAEEncoder, CausalDecoder]:
    return seeded_build(lambda: VAEEncoder(cfg.vae), seed + 2), seeded_build(lambda: CausalDecoder(cfg.vae), seed + 3)


def optimizer(params: list[torch.nn.Parameter], lr: float, steps: int
              ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with a linear warm-up over the first 5% of steps, then a cosine down to 5% of the rate."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.99))
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warm) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * i / steps))))
    return opt, sched


def _reconstruction_l1(decoder: CausalDecoder, z: torch.Tensor, video: torch.Tensor, weight: torch.Tensor,
                       tc: VAETrainConfig) -> torch.Tensor:
    """L1 of the decoder's frames from noised latents `z` against `video`, weighted (the mouth box up)."""
    noisy = z + tc.latent_noise * torch.randn_like(z)
    recon = decoder.decode(noisy.contiguous(memory_format=torch.channels_last_3d))  # (B, 3, F, H', W')
    return ((recon - video).abs() * weight).mean() / weight.mean()


def optimizer_step(loss: torch.Tensor, params: list[torch.nn.Parameter], opt: torch.optim.Optimizer,
                   sched: torch.optim.lr_scheduler.LambdaLR) -> None:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()


def train_vae(cfg: ModelConfig, clips: list[Clip], tc: VAETrainConfig,
              log: Callable[[str], None] = print) -> tuple[VAEEncoder, CausalDecoder, list[dict[str, float]]]:
    torch.manual_seed(tc.seed)
    rng = np.random.default_rng(tc.seed)
    encoder, decoder = build_vae(cfg, tc.seed)
    encoder = encoder.to(tc.device)
    decoder = decoder.to(tc.device).to(memory_format=torch.channels_last_3d)  # type: ignore[call-overload]
    params = [*encoder.parameters(), *decoder.parameters()]
    opt, sched = optimizer(params, tc.lr, tc.steps)
    history: list[dict[str, float]] = []
    t0 = time.perf_counter()
    for step in range(tc.steps):
        video, weight = (t.to(tc.device) for t in _sample(clips, cfg, tc, rng))  # (B, 3, F, H', W'), (B, 1, 1, H', W')
        z = encoder(video)  # (B, C, L, h', w')
        l1 = _reconstruction_l1(decoder, z, video, weight, tc)
        zc = z.transpose(0, 1).reshape(z.shape[1], -1)  # (C, B*L*h'*w')
        stats = (zc.mean(1) ** 2).mean() + ((zc.std(1) - 1) ** 2).mean()
        loss = l1 + tc.stats_weight * stats
        optimizer_step(loss, params, opt, sched)
        if step % 25 == 0 or step == tc.steps - 1:
            row = {"step": step, "l1": float(l1.detach()), "stats": float(stats.detach()),
                   "z_std": float(zc.detach().std(1).mean()),
                   "s": time.perf_counter() - t0}
            history.append(row)
            log(f"vae step {step:5d}  l1 {row['l1']:.4f}  latent std {row['z_std']:.2f}  "
                f"stats {row['stats']:.3f}  {row['s']:.0f}s")
    decoder = decoder.cpu().to(memory_format=torch.contiguous_format)
    return encoder.cpu().eval(), decoder.eval(), history


@torch.no_grad()
def encode_clip(encoder: VAEEncoder, clip: Clip, chunk_batch: int = 8) -> torch.Tensor:
    """All of a clip's latents, (C, F/4, h, w) float32, encoded `chunk_batch` latent frames at a time."""
    out = []
    for s in range(0, clip.frames, 4 * chunk_batch):
        frames = render_clip(clip, s, min(clip.frames, s + 4 * chunk_batch))
        out.append(encoder(_to_video(frames)[None])[0])
    return torch.cat(out, dim=1)


@torch.no_grad()
def fold_latent_scale(encoder: VAEEncoder, decoder: CausalDecoder, std: torch.Tensor) -> None:
    """Make the encoder emit latents / std (per channel) and the decoder take them: exact on both sides
    (a pure per-channel scale commutes with zero padding and the decoder's zero initial state)."""
    c = std.numel()
    conv = encoder.to_moments  # (2C, 4c, 1, 1, 1): the first C outputs are the mean
    conv.weight[:c] /= std.view(c, 1, 1, 1, 1)
    if conv.bias is not None:
        conv.bias[:c] /= std
    decoder.conv_in.weight.mul_(std.view(1, c, 1, 1, 1))


def train_decoder(cfg: ModelConfig, clips: list[Clip], tc: VAETrainConfig, encoder: VAEEncoder,
                  log: Callable[[str], None] = print, init: CausalDecoder | None = None
                  ) -> tuple[CausalDecoder, list[dict[str, float]]]:
    """A decoder for `cfg.vae`, fitted to the latents of the frozen `encoder` (its latent scale folded in
    already): the DiT's latent space does not move. Loss: L1 on pixels, weighted up inside the mouth box.
    `init`: a decoder of the same config to start from (training on), else a new one. `encoder` is left
    where it was."""
    torch.manual_seed(tc.seed)
    rng = np.random.default_rng(tc.seed)
    home = next(encoder.parameters()).device
    encoder = encoder.to(tc.device).eval().requires_grad_(False)
    decoder = seeded_build(lambda: CausalDecoder(cfg.vae), tc.seed + 3)
    if init is not None:
        decoder.load_state_dict(init.state_dict())
    decoder = decoder.to(tc.device)
    decoder = decoder.to(memory_format=torch.channels_last_3d)  # type: ignore[call-overload]
    params = list(decoder.parameters())
    opt, sched = optimizer(params, tc.lr, tc.steps)
    history: list[dict[str, float]] = []
    t0 = time.perf_counter()
    for step in range(tc.steps):
        video, weight = (t.to(tc.device) for t in _sample(clips, cfg, tc, rng))  # (B, 3, F, H', W'), (B, 1, 1, H', W')
        with torch.no_grad():
            z = encoder(video)  # (B, C, L, h', w')
        l1 = _reconstruction_l1(decoder, z, video, weight, tc)
        optimizer_step(l1, params, opt, sched)
        if step % 25 == 0 or step == tc.steps - 1:
            row = {"step": step, "l1": float(l1.detach()), "s": time.perf_counter() - t0}
            history.append(row)
            log(f"decoder step {step:5d}  l1 {row['l1']:.4f}  {row['s']:.0f}s")
    encoder.to(home)
    return decoder.cpu().to(memory_format=torch.contiguous_format).eval(), history


@torch.no_grad()
def reconstruction_error(encoder: VAEEncoder, decoder: CausalDecoder, clips: list[Clip], frames: int = 48
                         ) -> dict[str, float]:
    """How well `decoder` renders `encoder`'s latents of held-out clips (the first `frames` frames of each, from
    a zero state, as a stream starts): mean absolute error (0..255) over the frame and inside the mouth box,
    and PSNR (dB) over the frame."""
    mae, mouth_mae, mse = [], [], []
    for clip in clips:
        video = _to_video(render_clip(clip, 0, min(frames, clip.frames)))[None]  # (1, 3, F, H, W)
        recon = decoder.decode(encoder(video))
        err = (recon - video).abs() * 127.5  # 0..255
        top, bot, left, right = mouth_box(clip.identity)
        mae.append(float(err.mean()))
        mouth_mae.append(float(err[..., top:bot, left:right].mean()))
        mse.append(float((err**2).mean()))
    return {"mae": float(np.mean(mae)), "mouth_mae": float(np.mean(mouth_mae)),
            "psnr_db": float(10 * np.log10(255.0**2 / np.mean(mse))), "clips": len(clips)}
