"""Audio schedule, frontend windows, the DFT-matmul encoder and decoding rules."""

from __future__ import annotations

import io
import itertools
import struct
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from characters.audio import (
    SAMPLE_AUDIO,
    AudioEncoder,
    AudioFrontend,
    PcmConverter,
    chunk_sample_range,
    convert_pcm,
    frame_end_sample,
    load_audio,
    mel_filterbank,
    pcm16_to_float,
)
from characters.config import AudioConfig
from characters.media import MediaError

SR = 16000


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """16-bit PCM WAV; `samples` is (n,) or (n, channels) float in [-1, 1]."""
    data = samples if samples.ndim == 2 else samples[:, None]
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(data.shape[1])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.round(data * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def float_wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """Mono IEEE-float WAV (format tag 3), which can carry NaN."""
    payload = samples.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(payload)) + payload
    return b"RIFF" + struct.pack("<I", len(body)) + body


# ---------------------------------------------------------------------------------------------- schedule


def test_three_chunks_are_exactly_half_a_second() -> None:
    ranges = [chunk_sample_range(k, 4) for k in range(3)]
    assert ranges == [(0, 2666), (2666, 5333), (5333, 8000)]


def test_schedule_tiles_the_stream_without_drift() -> None:
    ranges = [chunk_sample_range(k, 4) for k in range(600)]  # 100 s
    assert ranges[0][0] == 0 and ranges[-1][1] == 600 * 4 * SR // 24 == 1_600_000
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert {end - start for start, end in ranges} == {2666, 2667}
    assert all(chunk_sample_range(k, 4)[1] == frame_end_sample(4 * k + 3) for k in range(600))
    assert chunk_sample_range(2, 12) == (16000, 24000)


# ---------------------------------------------------------------------------------------------- frontend


@pytest.mark.parametrize(
    ("cfg", "fc"),
    [
        (AudioConfig(), 4),
        (AudioConfig(window_samples=4096, context_frames=9), 4),
        (AudioConfig(context_frames=0), 12),
        (AudioConfig(window_samples=64, n_fft=64, context_frames=0), 4),  # window shorter than a chunk
    ],
)
def test_frontend_windows_equal_slicing_the_stream(cfg: AudioConfig, fc: int) -> None:
    stream = np.random.default_rng(0).uniform(-1, 1, 3 * SR).astype(np.float32)
    pad = 20000
    padded = np.concatenate([np.zeros(pad, np.float32), stream])  # zeros before the stream start
    fe = AudioFrontend(cfg, fc)
    fa = cfg.context_frames + fc
    k = 0
    while chunk_sample_range(k, fc)[1] <= stream.size:
        start, end = chunk_sample_range(k, fc)
        windows = fe.push(stream[start:end])
        assert windows.shape == (fa, cfg.window_samples) and windows.dtype == np.float32
        assert windows.flags.c_contiguous
        for i, frame in enumerate(range((k + 1) * fc - fa, (k + 1) * fc)):
            e = frame_end_sample(frame) + pad
            np.testing.assert_array_equal(windows[i], padded[e - cfg.window_samples : e])
        k += 1
    assert k == 72 // fc  # every chunk of the 3 s stream


def test_frontend_reuses_its_buffer_and_resets() -> None:
    cfg = AudioConfig()
    fe = AudioFrontend(cfg, 4)
    rng = np.random.default_rng(1)
    first = rng.uniform(-1, 1, 2666).astype(np.float32)
    out0 = fe.push(first).copy()
    buf = fe.push(rng.uniform(-1, 1, 2667).astype(np.float32))
    assert fe.push(rng.uniform(-1, 1, 2667).astype(np.float32)) is buf
    assert fe.chunk_index == 3
    fe.reset()
    assert fe.chunk_index == 0 and fe.expected_samples == 2666
    np.testing.assert_array_equal(fe.push(first), out0)
    silence = fe.silence_windows()
    assert silence.shape == (8, 1024) and not silence.any()


def test_frontend_refuses_wrong_length() -> None:
    fe = AudioFrontend(AudioConfig(), 4)
    with pytest.raises(ValueError, match=r"exactly 2666 .* got shape \(2667,\)"):
        fe.push(np.zeros(2667, np.float32))
    with pytest.raises(ValueError, match="exactly 2666"):
        fe.push(np.zeros((2666, 2), np.float32))
    with pytest.raises(ValueError, match="NaN"):
        fe.push(np.full(2666, np.nan, np.float32))
    assert fe.chunk_index == 0


# ----------------------------------------------------------------------------------------------- encoder


def test_encoder_shape_finite_and_deterministic() -> None:
    cfg = AudioConfig()
    windows = torch.from_numpy(np.random.default_rng(2).uniform(-1, 1, (2, 8, 1024)).astype(np.float32))
    torch.manual_seed(0)
    a = AudioEncoder(cfg, 128)
    torch.manual_seed(0)
    b = AudioEncoder(cfg, 128)
    out = a(windows)
    assert out.shape == (2, 8, 128) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert torch.equal(out, b(windows))
    assert torch.isfinite(a(torch.zeros(1, 8, 1024))).all()  # silence: log(eps), no -inf
    assert set(a.state_dict()) == {"proj_in.weight", "proj_in.bias", "proj_out.weight", "proj_out.bias"}


def test_bfloat16_cast_keeps_the_spectral_front_end_in_float32() -> None:
    torch.manual_seed(0)
    enc = AudioEncoder(AudioConfig(), 64)
    windows = torch.from_numpy(np.random.default_rng(5).uniform(-1, 1, (1, 8, 1024)).astype(np.float32))
    ref_feats, ref = enc.band_features(windows), enc(windows)
    enc = enc.to(torch.bfloat16)
    assert enc.dft_basis.dtype == enc.filterbank.dtype == torch.float32
    assert enc.proj_in.weight.dtype == torch.bfloat16
    assert torch.equal(enc.band_features(windows), ref_feats)
    out = enc(windows)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.05)


def test_dft_matmul_matches_numpy_rfft() -> None:
    cfg = AudioConfig()
    enc = AudioEncoder(cfg, 16)
    t = np.arange(cfg.window_samples) / SR
    tone = 0.5 * np.sin(2 * np.pi * 1000.0 * t + 0.3) + 0.01 * np.random.default_rng(3).standard_normal(t.size)
    x = torch.from_numpy(tone.astype(np.float32)).view(1, 1, -1)  # (B, Fa, window)
    power = enc.power_spectrum(x)[0, 0].double().numpy()  # (Sf, K)
    hann = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(cfg.n_fft) / cfg.n_fft)
    subs = np.stack([tone[i * cfg.hop : i * cfg.hop + cfg.n_fft] for i in range(cfg.sub_frames)])
    ref = np.abs(np.fft.rfft(subs * hann, axis=-1)) ** 2  # (Sf, K)
    assert power.shape == ref.shape == (cfg.sub_frames, cfg.n_fft // 2 + 1)
    np.testing.assert_allclose(power, ref, rtol=1e-3, atol=1e-4 * ref.max())
    bands = enc.band_features(x)[0, 0]  # (Sf, n_bands)
    fbank = mel_filterbank(cfg.n_fft, cfg.n_bands)
    tone_bin = round(1000.0 * cfg.n_fft / SR)  # bin 16
    assert (bands.argmax(dim=-1) == int(fbank[tone_bin].argmax())).all()


def test_filterbank_bands_cover_the_spectrum() -> None:
    fbank = mel_filterbank(256, 32)
    assert fbank.shape == (129, 32)
    np.testing.assert_allclose(fbank.sum(axis=0), 1.0, rtol=1e-5)
    centres = (fbank * np.arange(129)[:, None]).sum(axis=0)
    assert np.all(np.diff(centres) > 0)


# ---------------------------------------------------------------------------------------------- decoding


def test_load_audio_downmixes_and_resamples(tmp_path: Path) -> None:
    t = np.arange(int(1.5 * 44100)) / 44100
    tone = 0.5 * np.sin(2 * np.pi * 440 * t)
    path = tmp_path / "stereo.wav"
    path.write_bytes(wav_bytes(np.stack([tone, tone * 0.5], axis=1), 44100))
    pcm = load_audio(path)
    assert pcm.dtype == np.float32 and pcm.ndim == 1
    assert pcm.size == 24000
    rms = float(np.sqrt(np.mean(pcm[1000:-1000] ** 2)))
    assert rms == pytest.approx(0.375 / np.sqrt(2), rel=0.02)  # average of the channels
    np.testing.assert_array_equal(load_audio(path.read_bytes()), pcm)


def test_load_audio_accepts_silence() -> None:
    pcm = load_audio(wav_bytes(np.zeros(8000), 16000))
    assert pcm.shape == (8000,) and not pcm.any()


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (float_wav_bytes(np.where(np.arange(4000) == 100, np.nan, 0.1), 16000), "NaN or infinite"),
        (float_wav_bytes(np.full(4000, np.inf), 16000), "NaN or infinite"),
        (wav_bytes(np.zeros(0), 16000), "contains no samples"),
        (b"just some text, not audio at all\n" * 20, "cannot decode"),
        (b"", "cannot decode"),
    ],
)
def test_load_audio_refuses(data: bytes, match: str) -> None:
    with pytest.raises(MediaError, match=match):
        load_audio(data)


def test_load_audio_refuses_images_and_missing_files(tmp_path: Path) -> None:
    from PIL import Image

    png = tmp_path / "x.png"
    Image.new("RGB", (32, 32)).save(png)
    with pytest.raises(MediaError, match="has no audio stream"):
        load_audio(png)
    with pytest.raises(MediaError, match="does not exist"):
        load_audio(tmp_path / "missing.wav")


def test_pcm16_and_streaming_conversion() -> None:
    assert pcm16_to_float(b"\x00\x80\xff\x7f\x00\x00").tolist() == [-1.0, 32767 / 32768, 0.0]
    np.testing.assert_array_equal(pcm16_to_float(np.array([16384], np.int16)), [0.5])
    with pytest.raises(ValueError, match="even byte count"):
        pcm16_to_float(b"\x00")
    stereo = np.random.default_rng(4).uniform(-0.5, 0.5, (48000, 2)).astype(np.float32)
    whole = convert_pcm(stereo, 48000, 2)
    assert whole.size == 16000
    conv = PcmConverter(48000, 2)
    pieces = [conv.convert(stereo[i : i + 480]) for i in range(0, 48000, 480)] + [conv.flush()]
    np.testing.assert_allclose(np.concatenate(pieces), whole, atol=1e-6)
    np.testing.assert_array_equal(convert_pcm(stereo, 16000, 2), stereo.mean(axis=1))


def test_bundled_sample_speech() -> None:
    pcm = load_audio(SAMPLE_AUDIO)
    assert 8.0 <= pcm.size / SR <= 10.5
    assert 0.05 < float(np.abs(pcm).max()) <= 1.0
