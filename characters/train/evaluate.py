"""Generate held-out clips with the engine's pieces and score them (`characters.train.lipsync`).

`generate` drives one session exactly as `CharacterEngine` does (reference -> sink, then chunk by chunk:
that chunk's audio samples -> DiT -> decoder), from separately built pieces, so a tensor-parallel rank or
any other arrangement of the same runners can be scored the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from characters.audio import chunk_sample_range
from characters.config import SessionConfig
from characters.engine import CharacterEngine, DecoderRunner, DiTRunner, ReferenceEncoder
from characters.train.data import Clip, reference_image
from characters.train.lipsync import LipSync, lipsync_score


def chunk_pcm(pcm: np.ndarray, k: int, frames_per_chunk: int = 4) -> np.ndarray:
    """Chunk k's samples of a stream, zero-padded past its end."""
    a, b = chunk_sample_range(k, frames_per_chunk)
    out = np.zeros(b - a, np.float32)
    have = pcm[a:b]
    out[: have.size] = have
    return out


def generate(dit: DiTRunner, encoder: ReferenceEncoder | None, decoder: DecoderRunner | None, image: np.ndarray,
             pcm: np.ndarray, frames: int, seed: int | None = None, anchor: bool = True) -> np.ndarray | None:
    """Frames (F, H, W, 3) uint8 of one session over `pcm`; None where this process has no decoder (a
    tensor-parallel rank > 0, which still runs its share of every DiT step). `encoder` None: the reference
    latent is encoded by a fresh `ReferenceEncoder` of the DiT's config. `anchor`: frames anchored on the
    reference (`characters.identity`), as a session's are; False: as the decoder makes them."""
    enc = encoder or ReferenceEncoder(dit.cfg)
    dit.start(enc.encode(image), seed)
    if decoder is not None:
        decoder.start(reference=image if anchor else None)
    fc = dit.cfg.model.generation.frames_per_chunk
    out = []
    for k in range(-(-frames // fc)):
        latents = dit.step(chunk_pcm(pcm, k, fc))
        if decoder is not None:
            out.append(decoder.decode(latents).cpu().numpy())
    return np.concatenate(out)[:frames] if decoder is not None else None


def generate_latents(dit: DiTRunner, encoder: ReferenceEncoder, image: np.ndarray, pcm: np.ndarray, frames: int,
                     seed: int | None = None) -> torch.Tensor:
    """The DiT's half of `generate`: the session's latents (C, L, h, w) float32, L = ceil(frames / F per latent
    frame). The DiT never sees the decoder's output, so `decode_latents` of these gives `generate`'s frames."""
    dit.start(encoder.encode(image), seed)
    fc = dit.cfg.model.generation.frames_per_chunk
    return torch.cat([dit.step(chunk_pcm(pcm, k, fc))[0] for k in range(-(-frames // fc))], dim=1).cpu()


def decode_latents(decoder: DecoderRunner, latents: torch.Tensor, frames: int,
                   reference: np.ndarray | None = None) -> np.ndarray:
    """The decoder's half of `generate`: latents (C, L, h, w) -> the first `frames` frames (F, H, W, 3) uint8,
    streamed chunk by chunk from a fresh state as a session decodes them; `reference`: anchored on it, as
    `generate`'s frames are (None: as decoded)."""
    decoder.start(reference=reference)
    cf = decoder.cfg.model.generation.latent_frames_per_chunk
    out = [decoder.decode(latents[None, :, k:k + cf]).cpu().numpy() for k in range(0, latents.shape[1], cf)]
    return np.concatenate(out)[:frames]


@dataclass
class Generated:
    frames: list[np.ndarray]
    references: list[np.ndarray]


def generate_clips(cfg: SessionConfig, clips: list[Clip], seed: int = 0, anchor: bool = True) -> Generated:
    """Every clip through one in-process engine (restarted per clip, noise seeded per clip)."""
    engine = CharacterEngine(cfg)
    frames, refs = [], []
    for i, clip in enumerate(clips):
        ref = reference_image(clip.identity)
        frames.append(generate(engine.dit, engine.encoder, engine.decoder, ref, clip.pcm, clip.frames, seed + i,
                               anchor))
        refs.append(ref)
    return Generated(frames, refs)  # type: ignore[arg-type]


def score_clips(cfg: SessionConfig, clips: list[Clip], seed: int = 0) -> LipSync:
    gen = generate_clips(cfg, clips, seed)
    return lipsync_score(gen.frames, [c.pcm for c in clips], [c.identity for c in clips], gen.references)


def ground_truth_score(clips: list[Clip]) -> LipSync:
    """The renderer's own frames: the ceiling the score can reach on these clips."""
    from characters.train.data import render_clip

    return lipsync_score([render_clip(c) for c in clips], [c.pcm for c in clips], [c.identity for c in clips],
                         [reference_image(c.identity) for c in clips])
