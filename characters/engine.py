"""The single-session engine: one DiT rank's step, the decoder, and both together in one process.

The hot loop is `DiTRunner.step` (audio windows in, latents out) and `DecoderRunner.decode`
(latents in, frames out). Shapes are static, buffers preallocated, and nothing in either reads a
device value back to the host: the slot, valid length and RoPE position of chunk k are host
integers the runner already knows. Ray actors (deployments/) wrap these classes unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from characters.audio import AudioEncoder, AudioFrontend, chunk_sample_range
from characters.config import SessionConfig, check_tensor_parallel
from characters.dit import CausalDiT
from characters.kv_cache import KVCache
from characters.rope import RopeTables
from characters.tp import apply_tensor_parallel
from characters.vae import CausalDecoder, VAEEncoder
from characters.weights import check_model_config, init_weights, load_weights, seeded_build, shard_path

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def flow_schedule(steps: int, shift: float) -> list[float]:
    """Flow-matching times from 1 (noise) to 0 (clean), shifted toward the noisy end."""
    s = np.linspace(1.0, 0.0, steps + 1)
    return [float(shift * x / (1 + (shift - 1) * x)) for x in s]


@dataclass
class ForwardRecord:
    """Inputs of the forward whose K/V stayed in the cache (for equivalence tests)."""

    x: torch.Tensor  # (B, C, Cf, h, w)
    t: float
    ctx: torch.Tensor  # (B, Cf, A, Dc)
    v: torch.Tensor  # (B, C, Cf, h, w) that forward's output


class DiTRunner:
    """One tensor-parallel rank of one session's DiT, with its cache and audio encoder."""

    def __init__(self, cfg: SessionConfig, *, device: torch.device | str = "cpu", group: dist.ProcessGroup | None = None,
                 rank: int = 0, ranks: int = 1, attention_backend: str = "sdpa", communicate: bool = True) -> None:
        self.cfg, self.device = cfg, torch.device(device)
        m = cfg.model
        self.dtype = torch_dtype(cfg.dtype)
        check_tensor_parallel(m.dit, ranks)
        with torch.device("meta"):
            dit = CausalDiT(m)
        apply_tensor_parallel(dit, group, rank=rank, size=ranks, communicate=communicate)
        init_weights(dit, cfg.seed, device=self.device)
        self.audio_encoder = seeded_build(lambda: AudioEncoder(m.audio, m.dit.audio_dim), cfg.seed + 1, self.device)
        if cfg.weights:
            check_model_config(m, cfg.weights)
            load_weights(dit, shard_path(cfg.weights, rank, ranks))
            load_weights(self.audio_encoder, Path(cfg.weights) / "audio.safetensors")
        self.dit = dit.to(self.dtype).eval()
        self.audio_encoder.eval()
        self.cache = KVCache(m, local_heads=m.dit.num_heads // ranks, device=self.device, dtype=self.dtype,
                             attention_backend=attention_backend)
        self.rope = RopeTables(m.dit, m.generation.latent_frames_per_chunk, m.token_grid, self.device)
        self.sink_rope = self.rope.sink()
        self.sigmas = flow_schedule(m.generation.denoising_steps, m.generation.timestep_shift)
        self.frontend = AudioFrontend(m.audio, m.generation.frames_per_chunk)
        h, w = m.latent_hw
        self.x = torch.empty(1, m.dit.latent_channels, m.generation.latent_frames_per_chunk, h, w,
                             device=self.device, dtype=torch.float32)  # (B, C, Cf, h, w)
        self.times = {s: torch.full((1,), s, device=self.device) for s in [*self.sigmas, 0.0]}
        self.generator = torch.Generator(device=self.device)
        self.chunk = 0

    @torch.inference_mode()
    def audio_context(self, windows: np.ndarray | torch.Tensor) -> torch.Tensor:
        """(Fa, W) PCM windows -> (1, Cf, A, Dc) cross-attention context."""
        w = torch.as_tensor(windows).to(self.device, non_blocking=True)[None]  # (1, Fa, W)
        return self.dit.audio_context(self.audio_encoder(w).to(self.dtype))

    @torch.inference_mode()
    def start(self, ref_latent: torch.Tensor) -> None:
        """Begin a session: wipe all state, then write the reference frame into the sink.
        ref_latent (1, C, h, w)."""
        self.cache.reset()
        self.frontend.reset()
        self.chunk = 0
        self.generator.manual_seed(self.cfg.seed)
        ctx = self.audio_context(self.frontend.silence_windows())[:, :1]  # (1, 1, A, Dc)
        ref = ref_latent.to(self.device, self.dtype)[:, :, None]  # (1, C, 1, h, w)
        n = self.cache.sink_tokens
        self.dit(ref, self.times[0.0], ctx, self.sink_rope, self.cache, 0, n)

    @torch.inference_mode()
    def step(self, pcm: np.ndarray, record: list[ForwardRecord] | None = None) -> torch.Tensor:
        """Generate chunk k from its audio samples (float32 mono 16 kHz, exactly the chunk's count).
        Returns latents (1, C, Cf, h, w) in float32."""
        return self.step_windows(self.frontend.push(pcm), record)

    @torch.inference_mode()
    def step_windows(self, windows: np.ndarray | torch.Tensor, record: list[ForwardRecord] | None = None
                     ) -> torch.Tensor:
        g, k = self.cfg.model.generation, self.chunk
        ctx = self.audio_context(windows)  # (1, Cf, A, Dc)
        offset, valid = self.cache.chunk_offset(k), self.cache.chunk_valid(k)
        rope = self.rope.chunk(k * g.latent_frames_per_chunk)
        x = torch.randn(self.x.shape, generator=self.generator, device=self.device, out=self.x)
        for t, t_next in zip(self.sigmas[:-1], self.sigmas[1:], strict=True):
            x_in = x
            v = self.dit(x.to(self.dtype), self.times[t], ctx, rope, self.cache, offset, valid)
            x = x + (t_next - t) * v.float()  # Euler step of dx/dt = v
        if g.cache_update == "extra_pass":
            x_in, t = x, 0.0
            v = self.dit(x.to(self.dtype), self.times[0.0], ctx, rope, self.cache, offset, valid)
        if record is not None:
            record.append(ForwardRecord(x_in.clone(), t, ctx.clone(), v.float().clone()))
        self.chunk += 1
        return x


class ReferenceEncoder:
    """The VAE encoder: reference image -> the latent that fills the cache's sink."""

    def __init__(self, cfg: SessionConfig, *, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.encoder = seeded_build(lambda: VAEEncoder(cfg.model.vae), cfg.seed + 2, self.device)
        if cfg.weights:
            load_weights(self.encoder, Path(cfg.weights) / "vae_encoder.safetensors")
        self.encoder.eval()

    @torch.inference_mode()
    def encode(self, image: np.ndarray) -> torch.Tensor:
        """(H, W, 3) uint8 -> (1, C, h, w) float32."""
        x = torch.as_tensor(image, device=self.device).permute(2, 0, 1)[None].float() / 127.5 - 1  # (1, 3, H, W)
        return self.encoder.encode_image(x)


class DecoderRunner:
    """The causal streaming VAE decoder with its per-session temporal state."""

    def __init__(self, cfg: SessionConfig, *, device: torch.device | str = "cpu") -> None:
        self.cfg, self.device = cfg, torch.device(device)
        m = cfg.model
        self.dtype = torch_dtype(cfg.dtype)
        self.decoder = seeded_build(lambda: CausalDecoder(m.vae), cfg.seed + 3, self.device)
        if cfg.weights:
            load_weights(self.decoder, Path(cfg.weights) / "vae_decoder.safetensors")
        self.decoder = self.decoder.to(self.dtype).eval()
        h, w = m.latent_hw
        self.state = self.decoder.init_state(1, h, w, self.device, self.dtype)

    def start(self) -> None:
        self.decoder.reset_state(self.state)

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(1, C, Cf, h, w) -> (F, H, W, 3) uint8 frames, on the decoder's device."""
        video = self.decoder.decode_chunk(latents.to(self.device, self.dtype), self.state)  # (1, 3, F, H, W)
        return ((video[0].float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0)


class CharacterEngine:
    """One whole session in this process: reference encoder, DiT (one rank), decoder."""

    def __init__(self, cfg: SessionConfig, *, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.encoder = ReferenceEncoder(cfg, device=device)
        self.dit = DiTRunner(cfg, device=device)
        self.decoder = DecoderRunner(cfg, device=device)

    @property
    def chunk(self) -> int:
        return self.dit.chunk

    def chunk_samples(self, k: int) -> tuple[int, int]:
        g = self.cfg.model.generation
        return chunk_sample_range(k, g.frames_per_chunk, self.cfg.model.audio.sample_rate, g.fps)

    def start(self, image: np.ndarray) -> None:
        self.dit.start(self.encoder.encode(image))
        self.decoder.start()

    def step(self, pcm: np.ndarray) -> np.ndarray:
        """Chunk k's audio samples -> its F frames (F, H, W, 3) uint8."""
        return self.decoder.decode(self.dit.step(pcm)).cpu().numpy()
