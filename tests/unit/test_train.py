"""Training agrees with inference: the training sequence (one `forward_sequence` under the cache's mask)
gives the velocities the cached, chunk-by-chunk `DiTRunner` computes, audio windows included; and the
procedural data behaves as the lip-sync score assumes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from characters.config import session_config
from characters.engine import DiTRunner, ForwardRecord
from characters.train.data import load_split
from characters.train.evaluate import chunk_pcm
from characters.train.face import Pose, render
from characters.train.fit_dit import SequenceBatcher, check_windows, clip_windows, sequence_velocity
from characters.train.lipsync import mouth_signal

CLIP = load_split(Path(__file__).parent / "data" / "lipsync_heldout.npz")[0]


def test_training_audio_windows_equal_the_streaming_frontend() -> None:
    cfg = session_config("tiny", "cpu").model
    assert check_windows(cfg, CLIP.pcm, CLIP.frames) == 0.0


def test_training_sequence_equals_cached_inference() -> None:
    cfg = session_config("tiny", "cpu", seed=3, weights="random", model={"dit": {"num_layers": 2}})
    m = cfg.model
    k = m.generation.ring_slots + 2  # past the ring: the oldest chunks are evicted, as the mask says
    runner = DiTRunner(cfg)
    h, w = m.latent_hw
    ref = torch.randn(1, m.dit.latent_channels, h, w, generator=torch.Generator().manual_seed(1))
    runner.start(ref)
    record: list[ForwardRecord] = []
    for j in range(k):
        runner.step(chunk_pcm(CLIP.pcm, j), record)
    batcher = SequenceBatcher(m, [], k, seed=0)
    ctx, tf = m.audio.context_frames, m.vae.temporal_factor
    with torch.inference_mode():
        windows = torch.from_numpy(clip_windows(CLIP.pcm, CLIP.frames, m.audio))[None]  # (1, ctx + F, W)
        rows = runner.audio_encoder.band_features(windows)[0]  # (ctx + F, Sf, n_bands)
        bands = torch.stack([rows[tf * j:tf * j + tf + ctx] for j in range(k)])[None]  # (1, K, A, Sf, n_bands)
        silence = runner.audio_encoder.band_features(torch.zeros(1, tf + ctx, m.audio.window_samples))[:, None]
        xt = torch.cat([r.x for r in record], dim=2)  # (1, C, K, h, w): each chunk's last-step input
        t = torch.tensor([[r.t for r in record]])
        v = sequence_velocity(runner.dit, runner.audio_encoder, silence, batcher, ref, xt, bands, t)
    assert all(r.t == batcher.t_last for r in record)
    for j, r in enumerate(record):
        torch.testing.assert_close(v[:, :, j:j + 1], r.v, atol=2e-4, rtol=1e-3)


def test_mouth_signal_grows_with_the_mouth_opening() -> None:
    ident = CLIP.identity
    ref = render(ident)
    frames = np.stack([render(ident, Pose(o)) for o in (0.0, 0.25, 0.5, 0.75, 1.0)])
    sig = mouth_signal(frames, ident, ref)
    assert sig[0] == 0.0 and np.all(np.diff(sig) > 0), sig
    moved = np.stack([render(ident, Pose(0.0, 0.0, -2.0))])  # a head nod alone barely registers
    assert mouth_signal(moved, ident, ref)[0] < 0.2 * sig[-1]


def test_decoder_only_training_keeps_the_encoder_and_learns_its_latents() -> None:
    """A new decoder is fitted to a frozen encoder (the DiT's latent space does not move): the encoder's weights
    are bit for bit the same after training, and a few steps already render its latents better than the seeded
    starting point does."""
    from dataclasses import replace

    from characters.config import model_preset
    from characters.train.fit_vae import VAETrainConfig, reconstruction_error, train_decoder
    from characters.vae import CausalDecoder, VAEEncoder
    from characters.weights import seeded_build

    cfg = model_preset("tiny", vae={"decoder_output": "pixel_shuffle"})
    torch.manual_seed(0)
    encoder = VAEEncoder(cfg.vae).eval()
    before = {k: v.clone() for k, v in encoder.state_dict().items()}
    tc = replace(VAETrainConfig(), steps=6, batch=1, latents=1, crop=(6, 8), lr=4e-3)
    decoder, history = train_decoder(cfg, [CLIP], tc, encoder, log=lambda s: None)
    assert all(torch.equal(v, before[k]) for k, v in encoder.state_dict().items())
    assert [h["step"] for h in history] == [0, 5] and isinstance(decoder, CausalDecoder)
    start = seeded_build(lambda: CausalDecoder(cfg.vae), tc.seed + 3).eval()  # where training began
    with torch.no_grad():
        new, old = reconstruction_error(encoder, decoder, [CLIP], 4), reconstruction_error(encoder, start, [CLIP], 4)
    assert new["mae"] < old["mae"] and new["psnr_db"] > 0 and new["clips"] == 1, (new, old)
