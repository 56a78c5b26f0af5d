"""LiveAvatar's audio features: wav2vec2 (the authors' `wav2vec2-large-xlsr-53-english`, through `transformers`)
hidden states, one (La, Da) vector set per 25 fps video frame.

`clip_features` is the authors' offline computation (`AudioEncoder.extract_audio_feat` +
`get_audio_embed_bucket_fps`): the whole waveform normalised to zero mean and unit variance, every hidden
state (25 = the CNN projection + 24 layers) at 50 Hz, linearly interpolated (align_corners) to 30 Hz, then the
30 Hz frame nearest each 25 fps frame, zeros past the end. `StreamingSpeech` does the same over a window of
the most recent audio as it streams in, so a live session never waits for the whole utterance; the
difference to the offline features (normalisation and context over the window, not the file) is what a
window of `window_s` seconds costs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

SAMPLE_RATE = 16000
HIDDEN_RATE = 50  # wav2vec2 frames per second
INTERP_RATE = 30  # the authors' intermediate `video_rate`
VIDEO_FPS = 25


def _load(model_dir: Path | str, device: str | torch.device, dtype: torch.dtype):
    try:
        from transformers import Wav2Vec2FeatureExtractor, Wav2Vec2Model
    except ImportError as err:
        raise ImportError("LiveAvatar's audio encoder needs transformers: pip install 'realtime-characters[liveavatar]'"
                          ) from err
    extractor = Wav2Vec2FeatureExtractor.from_pretrained(str(model_dir))
    model = Wav2Vec2Model.from_pretrained(str(model_dir)).to(device=device, dtype=dtype).eval()
    return extractor, model


def frame_indices(frames: int) -> np.ndarray:
    """30 Hz indices of `frames` 25 fps frames from t = 0 (their get_sample_indices with fixed_start=0)."""
    times = np.linspace(0, frames / VIDEO_FPS, frames, endpoint=False)
    return np.round(times * INTERP_RATE).astype(int)


class SpeechEncoder:
    """wav2vec2 hidden states at 30 Hz for a waveform (normalised over what it is given)."""

    def __init__(self, model_dir: Path | str | None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, *, parts: tuple[Any, Any] | None = None) -> None:
        """From a wav2vec2 folder as the hub serves it, or from a (feature extractor, model) pair (`parts`)."""
        if parts is None:
            if model_dir is None:
                raise ValueError("SpeechEncoder needs a wav2vec2 folder or parts=(extractor, model)")
            parts = _load(model_dir, device, dtype)
        self.extractor, self.model = parts
        self.device, self.dtype = device, dtype

    @torch.no_grad()
    def hidden30(self, pcm: np.ndarray) -> torch.Tensor:
        """(samples,) float32 16 kHz -> (La, T30, Da) float32."""
        values = self.extractor(pcm, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_values
        out = self.model(values.to(self.device, self.dtype), output_hidden_states=True)
        feat = torch.cat(out.hidden_states)  # (La, T50, Da)
        t30 = int(feat.shape[1] / HIDDEN_RATE * INTERP_RATE)
        feat = F.interpolate(feat.transpose(1, 2), size=t30, mode="linear", align_corners=True).transpose(1, 2)
        return feat.float()

    def clip_features(self, pcm: np.ndarray, frames_per_clip: int = 48) -> torch.Tensor:
        """The authors' offline features: (1, La, Da, clips * frames_per_clip), zeros past the audio."""
        z = self.hidden30(pcm)
        layers, t30, dim = z.shape
        clips = int(t30 / (frames_per_clip * INTERP_RATE / VIDEO_FPS)) + 1
        n = clips * frames_per_clip
        idx = np.clip(frame_indices(n), 0, math.ceil(n / VIDEO_FPS * INTERP_RATE) - 1)
        out = torch.zeros(n, layers, dim)
        inside = idx < t30
        out[torch.from_numpy(inside)] = z[:, idx[inside]].transpose(0, 1)
        return out.permute(1, 2, 0)[None]  # (1, La, Da, n)


class StreamingSpeech:
    """Per-block features for audio that streams in: each block's frames from wav2vec2 over the last
    `window_s` seconds (the block's audio included)."""

    def __init__(self, encoder: SpeechEncoder, window_s: float = 4.0) -> None:
        self.encoder = encoder
        self.window = int(window_s * SAMPLE_RATE)
        self.pcm = np.zeros(0, dtype=np.float32)
        self.start = 0  # sample index of self.pcm[0] in the session
        self.frames_done = 0

    def push(self, pcm: np.ndarray) -> None:
        self.pcm = np.concatenate([self.pcm, pcm.astype(np.float32)])
        excess = len(self.pcm) - 2 * self.window
        if excess > 0:
            self.pcm, self.start = self.pcm[excess:], self.start + excess

    def block(self, frames: int) -> torch.Tensor:
        """(1, La, Da, frames) for the next `frames` video frames (their audio must have been pushed)."""
        first, end = self.frames_done, self.frames_done + frames
        end_sample = end * SAMPLE_RATE // VIDEO_FPS
        if end_sample > self.start + len(self.pcm):
            raise ValueError(f"speech: frames up to {end} need {end_sample} samples, {self.start + len(self.pcm)} "
                             "arrived; push the block's audio first (silence when the agent is quiet)")
        lo = max(self.start, end_sample - self.window)
        z = self.encoder.hidden30(self.pcm[lo - self.start:end_sample - self.start])  # (La, T30, Da)
        # the window's 30 Hz grid starts at sample `lo`; pick the frame nearest each 25 fps frame's time
        t = np.arange(first, end) / VIDEO_FPS - lo / SAMPLE_RATE
        idx = np.clip(np.round(t * INTERP_RATE).astype(int), 0, z.shape[1] - 1)
        self.frames_done = end
        return z[:, idx].permute(0, 2, 1)[None]  # (1, La, Da, frames)
