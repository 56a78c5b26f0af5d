"""Training agrees with inference: the training sequence (one `forward_sequence` under the cache's mask)
gives the velocities the cached, chunk-by-chunk `DiTRunner` computes, audio windows included; and the
procedural data behaves as the lip-sync score assumes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from characters.config import TOPOLOGIES, session_config
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
    # float32 GEMMs whatever the CPU (`cpu_matmul`): training runs them so, and bf16 ones round by shape
    topology = TOPOLOGIES["cpu"].model_copy(update={"cpu_matmul": "float32"}).model_dump()
    cfg = session_config("tiny", topology, seed=3, weights="random", model={"dit": {"num_layers": 2}})
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


def test_the_differentiable_mouth_signal_is_the_scores() -> None:
    from characters.train.face import mouth_box
    from characters.train.fit_decoder import mouth_signal_torch

    ident = CLIP.identity
    ref = render(ident)
    frames = np.stack([render(ident, Pose(o)) for o in (0.0, 0.3, 0.9)])  # (F, H, W, 3) uint8
    want = mouth_signal(frames, ident, ref)
    video = torch.from_numpy(frames).permute(3, 0, 1, 2)[None].double() / 127.5 - 1  # (1, 3, F, H, W)
    luma = torch.from_numpy(ref).double() @ torch.tensor([0.299, 0.587, 0.114], dtype=torch.float64)
    top, bot, left, right = mouth_box(ident)
    mask = torch.zeros_like(luma)
    mask[top:bot, left:right] = 1
    got = mouth_signal_torch(video, luma[None], mask[None])[0]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-9, atol=1e-9)


@torch.inference_mode()
def test_init_from_keeps_a_per_frame_stage_as_the_current_frame_tap_of_a_temporal_one() -> None:
    """A light decoder's weights start a decoder whose last stage has kt = 3 as the same function (past taps zero);
    a wider last stage takes over everything below it and keeps its own initialisation."""
    from characters.config import model_preset
    from characters.train.fit_decoder import init_from
    from characters.vae import CausalDecoder

    light = model_preset("tiny").vae
    torch.manual_seed(0)
    source = CausalDecoder(light).eval()
    lifted = CausalDecoder(light.model_copy(update={"decoder_last_kt": 3})).eval()
    assert len(init_from(lifted, source.state_dict())) == len(source.state_dict())
    z = torch.randn(1, light.latent_channels, 3, 3, 4)
    torch.testing.assert_close(lifted.decode(z), source.decode(z), atol=1e-5, rtol=0)
    wide = CausalDecoder(light.model_copy(update={"decoder_last_channels": 12}))
    fresh = {k: v.clone() for k, v in wide.state_dict().items()}
    taken = set(init_from(wide, source.state_dict()))
    assert "conv_in.weight" in taken and "conv_out.weight" not in taken and "conv_out.bias" in taken
    assert torch.equal(wide.state_dict()["conv_out.weight"], fresh["conv_out.weight"])


def test_generated_latents_decoded_give_the_generated_frames() -> None:
    """`score_decoder` decodes the DiT's latents of a clip generated once: the same frames as a session."""
    from characters.engine import CharacterEngine, DecoderRunner
    from characters.train.data import reference_image, trim_clip
    from characters.train.evaluate import decode_latents, generate, generate_latents

    clip = trim_clip(CLIP, 24)
    cfg = session_config("tiny", "cpu")
    engine = CharacterEngine(cfg)
    ref = reference_image(clip.identity)
    want = generate(engine.dit, engine.encoder, engine.decoder, ref, clip.pcm, clip.frames, seed=5)
    latents = generate_latents(engine.dit, engine.encoder, ref, clip.pcm, clip.frames, seed=5)  # (C, L, h, w)
    assert latents.shape == (8, 6, *cfg.model.latent_hw)
    assert np.array_equal(decode_latents(DecoderRunner(cfg), latents, clip.frames, reference=ref), want)


def test_fit_decoder_trains_on_whole_frames_of_encoder_and_dit_latents() -> None:
    """A few steps of the GPU recipe on the CPU: encoder and teacher untouched; both losses logged; the decoder
    renders the encoder's latents better than where it started (the shipped light decoder's weights, re-seeded)."""
    from dataclasses import replace

    from characters.train.data import render_clip, trim_clip
    from characters.train.fit_decoder import DecoderFitConfig, build_data, dit_latents, fit_decoder
    from characters.train.fit_vae import reconstruction_error
    from characters.vae import CausalDecoder, VAEEncoder
    from characters.weights import seeded_build

    clip = trim_clip(CLIP, 32)
    cfg = session_config("tiny", "cpu")
    m = cfg.model
    torch.manual_seed(0)
    encoder = VAEEncoder(m.vae).eval()
    teacher = CausalDecoder(m.vae.model_copy(update={"decoder_output": "conv"})).eval()
    before = [{k: v.clone() for k, v in x.state_dict().items()} for x in (encoder, teacher)]
    dit = [dit_latents(cfg, [clip], [7], workers=0)]
    data = build_data(m, [clip], encoder, [render_clip(clip)], dit, "cpu")
    assert data.frames.shape == (32, m.generation.height, m.generation.width, 3)
    assert data.encoder_latents.shape == (8, 8, *m.latent_hw)
    assert data.dit_latents is not None and data.dit_latents.shape == (1, 8, 8, *m.latent_hw)
    fc = replace(DecoderFitConfig(), steps=6, batch=2, latents=2, lr=4e-3, signal_weight=2.0, dit_share=0.5,
                 device="cpu")
    decoder, history = fit_decoder(m, data, fc, teacher=teacher, log=lambda s: None)
    for x, b in zip((encoder, teacher), before, strict=True):
        assert all(torch.equal(v, b[k]) for k, v in x.state_dict().items())
    assert [h["step"] for h in history] == [0, 5] and all(h["signal"] > 0 for h in history)
    start = seeded_build(lambda: CausalDecoder(m.vae), fc.seed + 3).eval()
    with torch.no_grad():
        new, old = reconstruction_error(encoder, decoder, [clip], 8), reconstruction_error(encoder, start, [clip], 8)
    assert new["mae"] < old["mae"], (new, old)
