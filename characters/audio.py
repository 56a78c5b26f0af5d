"""Audio: decoding, the exact per-chunk sample schedule, per-frame windows and the audio encoder.

Details: docs/dit.md (`characters.audio`)."""

from __future__ import annotations

import io
import math
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from characters.config import AudioConfig
from characters.media import MediaError

if TYPE_CHECKING:
    import av  # PyAV is imported where audio is decoded or resampled: the chunk path needs neither

SAMPLE_AUDIO = Path(__file__).parent / "assets" / "sample_speech.wav"

SAMPLE_RATE = 16000
_MONO_OPTIONS = {"rematrix_maxval": "1.0"}  # downmix = channel average, never a gain above 1


# ---------------------------------------------------------------------------------------- sample schedule


def frame_end_sample(frame: int, sample_rate: int = SAMPLE_RATE, fps: int = 24) -> int:
    """The sample at which video frame `frame` (0-based) ends (exclusive)."""
    return (frame + 1) * sample_rate // fps


def chunk_sample_range(k: int, frames_per_chunk: int, sample_rate: int = SAMPLE_RATE, fps: int = 24) -> tuple[int, int]:
    """Samples `[start, end)` of chunk `k`, which covers video frames `[k * Fc, (k + 1) * Fc)`."""
    return k * frames_per_chunk * sample_rate // fps, (k + 1) * frames_per_chunk * sample_rate // fps


class AudioFrontend:
    """Host-side PCM history -> per-frame analysis windows for one chunk at a time.

    `push` returns the same `(Fa, window_samples)` float32 buffer every call (contiguous, fixed shape);
    copy it if it must outlive the next `push`.
    """

    def __init__(self, cfg: AudioConfig, frames_per_chunk: int, fps: int = 24) -> None:
        if frames_per_chunk < 1:
            raise ValueError(f"frames_per_chunk={frames_per_chunk} must be >= 1")
        self.cfg, self.frames_per_chunk, self.fps = cfg, frames_per_chunk, fps
        self.num_frames = cfg.context_frames + frames_per_chunk  # Fa
        # Enough history for the earliest window ((Fa - 1) frames back from the chunk end, plus one window)
        # and for a whole chunk: one window plus Fa frames' worth of samples, rounded up.
        span = -(-self.num_frames * cfg.sample_rate // fps) + 1
        self.history_samples = cfg.window_samples + span
        self._history = np.zeros(self.history_samples, np.float32)
        self._out = np.zeros((self.num_frames, cfg.window_samples), np.float32)  # (Fa, window)
        self._offsets = np.arange(cfg.window_samples, dtype=np.int64)  # (window,)
        self._chunk = 0

    @property
    def chunk_index(self) -> int:
        """Index of the next chunk `push` expects."""
        return self._chunk

    @property
    def expected_samples(self) -> int:
        """Sample count the next `push` must receive."""
        start, end = chunk_sample_range(self._chunk, self.frames_per_chunk, self.cfg.sample_rate, self.fps)
        return end - start

    def reset(self) -> None:
        """Forget the stream: zero history, back to chunk 0."""
        self._history.fill(0.0)
        self._chunk = 0

    def silence_windows(self) -> np.ndarray:
        """The windows of pure silence, `(Fa, window_samples)` float32 (a new array)."""
        return np.zeros_like(self._out)

    def push(self, pcm: np.ndarray) -> np.ndarray:
        """Take chunk k's samples (float32 mono in [-1, 1]); return its `(Fa, window_samples)` windows."""
        want = self.expected_samples
        if pcm.ndim != 1 or pcm.shape[0] != want:
            raise ValueError(
                f"chunk {self._chunk} needs exactly {want} mono samples "
                f"(frames {self._chunk * self.frames_per_chunk}..{(self._chunk + 1) * self.frames_per_chunk - 1} "
                f"at {self.cfg.sample_rate} Hz / {self.fps} fps), got shape {pcm.shape}; "
                "slice the stream with chunk_sample_range"
            )
        if not np.isfinite(pcm).all():
            raise ValueError(f"chunk {self._chunk} has NaN or infinite samples; the PCM source is broken")
        hist = self._history
        hist[:-want] = hist[want:]  # shift left (numpy copes with the overlap)
        np.clip(pcm, -1.0, 1.0, out=hist[-want:])
        end = frame_end_sample((self._chunk + 1) * self.frames_per_chunk - 1, self.cfg.sample_rate, self.fps)
        first = (self._chunk + 1) * self.frames_per_chunk - self.num_frames  # may be negative: before the start
        ends = np.array(
            [frame_end_sample(f, self.cfg.sample_rate, self.fps) for f in range(first, first + self.num_frames)]
        )  # (Fa,) absolute end samples
        starts = self.history_samples - (end - ends) - self.cfg.window_samples  # (Fa,) history indices
        np.take(hist, starts[:, None] + self._offsets[None, :], out=self._out)  # (Fa, window)
        self._chunk += 1
        return self._out


# ------------------------------------------------------------------------------------------------ encoder


def mel_filterbank(n_fft: int, n_bands: int, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Triangular bands equally spaced on the mel scale over [0, sr/2]: `(n_fft // 2 + 1, n_bands)` float32.

    Each band's weights sum to 1, so a band is a weighted mean of bin powers.
    """

    def mel(hz: np.ndarray) -> np.ndarray:
        return 2595.0 * np.log10(1.0 + hz / 700.0)

    def hz(m: np.ndarray) -> np.ndarray:
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)

    bins = np.arange(n_fft // 2 + 1) * sample_rate / n_fft  # (K,) bin centre frequencies
    edges = hz(np.linspace(0.0, mel(np.array(sample_rate / 2)), n_bands + 2))  # (n_bands + 2,)
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]  # each (n_bands, 1)
    up = (bins[None, :] - lo) / (mid - lo)
    down = (hi - bins[None, :]) / (hi - mid)
    tri = np.clip(np.minimum(up, down), 0.0, None)  # (n_bands, K)
    empty = tri.sum(axis=1) == 0  # a band narrower than a bin: take the nearest bin
    tri[empty, np.abs(bins[None, :] - mid[empty]).argmin(axis=1)] = 1.0
    return (tri / tri.sum(axis=1, keepdims=True)).T.astype(np.float32)  # (K, n_bands)


def spectral_constants(audio: AudioConfig, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Hann-windowed real-DFT basis `(n_fft, 2K)` and the band filterbank `(K, n_bands)`, float32.

    `x @ basis` is `rfft(hann * x)` laid out as `[real | -imag]` (periodic Hann, folded into the basis).
    """
    n_fft = audio.n_fft
    n = torch.arange(n_fft, dtype=torch.float64)
    freqs = torch.arange(n_fft // 2 + 1, dtype=torch.float64)
    angle = 2 * math.pi * n[:, None] * freqs[None, :] / n_fft  # (n_fft, K)
    hann = 0.5 - 0.5 * torch.cos(2 * math.pi * n / n_fft)  # (n_fft,)
    basis = torch.cat([torch.cos(angle), torch.sin(angle)], dim=1) * hann[:, None]  # (n_fft, 2K)
    fbank = torch.from_numpy(mel_filterbank(n_fft, audio.n_bands, audio.sample_rate))  # (K, n_bands)
    return basis.to(device=device, dtype=torch.float32), fbank.to(device=device)


class AudioEncoder(nn.Module):
    """Per-frame windows -> per-frame features: log mel-band power of sub-frames, then a 2-layer MLP.

    Graph-friendly: static shapes, matmul DFT (no stft, no complex), no host syncs. The spectral front
    end always runs in float32; the MLP runs in the module's parameter dtype.
    """

    dft_basis: torch.Tensor
    filterbank: torch.Tensor

    def __init__(self, audio: AudioConfig, out_dim: int, hidden_dim: int | None = None, eps: float = 1e-6) -> None:
        super().__init__()
        self.cfg, self.out_dim, self.eps = audio, out_dim, eps
        basis, fbank = spectral_constants(audio)
        self.register_buffer("dft_basis", basis, persistent=False)  # (n_fft, 2K)
        self.register_buffer("filterbank", fbank, persistent=False)  # (K, n_bands)
        in_dim = audio.sub_frames * audio.n_bands
        hidden = hidden_dim or out_dim
        self.proj_in = nn.Linear(in_dim, hidden)
        self.proj_out = nn.Linear(hidden, out_dim)

    def _apply(self, fn: Any, recurse: bool = True) -> AudioEncoder:
        """Module casts (`.to(bfloat16)`, `.half()`) move the spectral constants but keep them exact float32."""
        super()._apply(fn, recurse)
        if self.dft_basis.dtype != torch.float32:
            basis, fbank = spectral_constants(self.cfg, self.dft_basis.device)
            self.dft_basis, self.filterbank = basis, fbank
        return self

    def power_spectrum(self, windows: torch.Tensor) -> torch.Tensor:
        """`(B, Fa, window_samples)` -> Hann-windowed sub-frame power `(B, Fa, Sf, K)`, float32."""
        cfg = self.cfg
        x = windows.float().unfold(-1, cfg.n_fft, cfg.hop)  # (B, Fa, Sf, n_fft)
        spec = x @ self.dft_basis  # (B, Fa, Sf, 2K)
        re, im = spec.chunk(2, dim=-1)  # each (B, Fa, Sf, K)
        return re * re + im * im  # (B, Fa, Sf, K)

    def band_features(self, windows: torch.Tensor) -> torch.Tensor:
        """`(B, Fa, window_samples)` -> log band power `(B, Fa, Sf, n_bands)`, float32."""
        power = self.power_spectrum(windows)  # (B, Fa, Sf, K)
        bands = power @ self.filterbank  # (B, Fa, Sf, n_bands)
        return torch.log(bands + self.eps)  # (B, Fa, Sf, n_bands)

    def project(self, bands: torch.Tensor) -> torch.Tensor:
        """Log band power `(..., Sf, n_bands)` -> features `(..., out_dim)`: the trainable part."""
        feats = bands.flatten(-2)  # (..., Sf * n_bands)
        hidden = F.gelu(self.proj_in(feats.to(self.proj_in.weight.dtype)))  # (..., hidden)
        return self.proj_out(hidden)  # (..., out_dim)

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        """`(B, Fa, window_samples)` -> `(B, Fa, out_dim)`."""
        return self.project(self.band_features(windows))


# ------------------------------------------------------------------------------------------------ decoding


def _check_finite(samples: np.ndarray, what: str) -> None:
    if not np.isfinite(samples).all():
        raise MediaError(f"audio {what} contains NaN or infinite samples; re-export it as ordinary PCM")


AGENT_RATE_RANGE = (8000, 48000)  # agent audio accepted at any ingress (HTTP, gRPC, LiveKit byte streams), Hz
AGENT_MAX_CHANNELS = 2


class PcmFormatError(ValueError):
    """Agent audio in a format no ingress takes: `field` (sample_rate, channels, pcm) and what of it is wrong."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field} {detail}")
        self.field, self.detail = field, detail


def check_agent_pcm(nbytes: int, sample_rate: int, channels: int) -> None:
    """The one check of agent audio (16-bit PCM, interleaved), at whichever ingress it arrives."""
    lo, hi = AGENT_RATE_RANGE
    if not lo <= sample_rate <= hi:
        raise PcmFormatError("sample_rate", f"is {sample_rate}; send PCM at {lo}..{hi} Hz")
    if not 1 <= channels <= AGENT_MAX_CHANNELS:
        raise PcmFormatError("channels", f"is {channels}; send mono (1) or stereo (2)")
    if nbytes % (2 * channels):
        raise PcmFormatError("pcm", f"is {nbytes} bytes, not whole 16-bit frames of {channels} channel(s) "
                                    f"({2 * channels} bytes each); send signed 16-bit little-endian PCM")


class PcmConverter:
    """Interleaved float32 PCM at any rate and channel count -> float32 mono 16 kHz, piece by piece.

    Keeps libswresample's state across `convert` calls, so a stream converted in pieces matches the
    whole stream converted at once; call `flush` at the end of the stream for the resampler's tail.
    """

    def __init__(self, sample_rate: int, channels: int) -> None:
        if sample_rate < 1 or channels < 1:
            raise ValueError(f"sample_rate={sample_rate} and channels={channels} must both be >= 1")
        self.sample_rate, self.channels = sample_rate, channels
        self._passthrough = sample_rate == SAMPLE_RATE
        self._pts = 0
        if self._passthrough:  # 16 kHz needs only the channel average: no resampler (nor PyAV)
            return
        import av

        self._resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)

    def convert(self, samples: np.ndarray) -> np.ndarray:
        """Interleaved `(n * channels,)` or `(n, channels)` float32 -> float32 mono 16 kHz."""
        flat = np.asarray(samples, dtype=np.float32).reshape(-1)
        if flat.size % self.channels:
            raise ValueError(f"{flat.size} samples do not split into {self.channels} interleaved channels")
        _check_finite(flat, "stream")
        mono = flat.reshape(-1, self.channels).mean(axis=1, dtype=np.float32)  # (n,) channel average
        if self._passthrough:
            return np.clip(mono, -1.0, 1.0)
        import av

        frame = av.AudioFrame.from_ndarray(mono[None, :], format="flt", layout="mono")
        frame.sample_rate = self.sample_rate
        frame.pts, frame.time_base = self._pts, Fraction(1, self.sample_rate)
        self._pts += mono.size
        return self._collect(self._resampler.resample(frame))

    def flush(self) -> np.ndarray:
        """The resampler's remaining samples (empty for 16 kHz input)."""
        return np.zeros(0, np.float32) if self._passthrough else self._collect(self._resampler.resample(None))

    @staticmethod
    def _collect(frames: list[av.AudioFrame]) -> np.ndarray:
        parts = [f.to_ndarray().reshape(-1) for f in frames]  # packed mono: (1, n) each
        out = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        return np.clip(out.astype(np.float32, copy=False), -1.0, 1.0)


def convert_pcm(samples: np.ndarray, sample_rate: int, channels: int) -> np.ndarray:
    """One-shot `PcmConverter`: interleaved float32 PCM -> float32 mono 16 kHz."""
    conv = PcmConverter(sample_rate, channels)
    head = conv.convert(samples)
    return np.concatenate([head, conv.flush()])


def pcm16_to_float(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """Raw signed 16-bit little-endian PCM (bytes or an int16 array) -> float32 in [-1, 1), same layout."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.int16:
            raise ValueError(f"pcm16_to_float needs an int16 array, got {data.dtype}")
        ints = data
    else:
        if len(data) % 2:
            raise ValueError(f"16-bit PCM must have an even byte count, got {len(data)} bytes")
        ints = np.frombuffer(data, dtype="<i2")
    return ints.astype(np.float32) / 32768.0


def load_audio(source: str | Path | bytes, max_seconds: float = 3600.0) -> np.ndarray:
    """Decode any audio PyAV reads to float32 mono 16 kHz by the rules in the module docstring."""
    import av

    what = f"<{len(source)} bytes>" if isinstance(source, bytes) else str(source)
    fp: Any = io.BytesIO(source) if isinstance(source, bytes) else str(source)
    limit = int(max_seconds * SAMPLE_RATE)
    parts: list[np.ndarray] = []
    total = 0
    try:
        with av.open(fp, mode="r") as container:
            if not container.streams.audio:
                raise MediaError(f"{what} has no audio stream; provide a WAV, MP3, FLAC or OGG file")
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE, options=_MONO_OPTIONS)
            for frame in container.decode(stream):
                if frame.format.name in ("flt", "fltp", "dbl", "dblp"):
                    _check_finite(frame.to_ndarray(), what)
                for out in resampler.resample(frame):
                    parts.append(out.to_ndarray().reshape(-1))  # (n,)
                    total += parts[-1].size
                if total > limit:
                    raise MediaError(
                        f"audio {what} is longer than max_seconds={max_seconds}; cut it into shorter pieces"
                    )
            parts += [out.to_ndarray().reshape(-1) for out in resampler.resample(None)]
    except MediaError:
        raise
    except FileNotFoundError as e:
        raise MediaError(f"audio file {what} does not exist; check the path") from e
    except (av.FFmpegError, OSError, ValueError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise MediaError(f"cannot decode audio {what} ({reason}); provide a WAV, MP3, FLAC or OGG file") from e
    pcm = np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros(0, np.float32)
    if pcm.size == 0:
        raise MediaError(f"audio {what} contains no samples; provide a file with at least some audio")
    _check_finite(pcm, what)
    return np.clip(pcm, -1.0, 1.0)
