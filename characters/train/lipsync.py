"""The lip-sync score: does the generated mouth open with the speech? And does the face stay itself?

Lip-sync. The renderer's layout says where an identity's mouth is (`mouth_box`); an open mouth is a dark
hole where a closed one shows skin and a lip line, so the mouth signal of a frame is the mean luminance
*drop* inside the mouth box against the reference image (which is drawn with the mouth closed). It is
correlated (Pearson) with the audio envelope (log RMS of each frame's samples) at offsets -5..+5 frames;
offset d pairs video frame f with audio frame f - d (d > 0: the video lags). Over many clips, the score
is the mean per-clip r at the offset that is best for the mean; the offset is reported with it.

Identity. Over a long session, per window of frames: the mean absolute difference (0..255) of the face's
mean colour (face box, mouth box excluded) from the reference's, and the PSNR of the frame outside the
mouth box against the reference. A face that drifts shows both getting worse window after window.

Fidelity (`fidelity`). Against the renderer's own frames of the same clip: the PSNR of the whole frame and of
the mouth box, and the flicker (mean absolute change from one frame to the next, 0..255) beside the
ground truth's own.

Everything takes plain arrays (frames (F, H, W, 3) uint8, PCM float32 16 kHz), so any pipeline's output
(in-process engine, tensor-parallel ranks, a Ray pipeline) can be scored the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from characters.train.face import Identity, face_box, mouth_box
from characters.train.speech import frame_envelope

MAX_OFFSET = 5
_LUMA = np.array([0.299, 0.587, 0.114])


def luminance(frames: np.ndarray) -> np.ndarray:
    """(..., H, W, 3) uint8 -> (..., H, W) float64."""
    return frames.astype(np.float64) @ _LUMA


def mouth_signal(frames: np.ndarray, identity: Identity, reference: np.ndarray) -> np.ndarray:
    """Per-frame mouth opening proxy: mean luminance drop in the mouth box against the reference. (F,)"""
    top, bot, left, right = mouth_box(identity)
    region = luminance(frames[:, top:bot, left:right])  # (F, h, w)
    ref = luminance(reference[top:bot, left:right])  # (h, w)
    return np.clip(ref[None] - region, 0.0, None).mean(axis=(1, 2))


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    den = float(np.sqrt((a * a).sum() * (b * b).sum()))
    return float((a * b).sum() / den) if den > 1e-12 else 0.0


def offset_correlations(video: np.ndarray, audio: np.ndarray, max_offset: int = MAX_OFFSET) -> dict[int, float]:
    """Pearson r of video[f] with audio[f - d] over the overlap, for d in -max_offset..max_offset."""
    n = min(len(video), len(audio))
    out = {}
    for d in range(-max_offset, max_offset + 1):
        v = video[max(0, d):n + min(0, d)]
        a = audio[max(0, -d):n - max(0, d)]
        out[d] = _pearson(v, a)
    return out


@dataclass
class LipSync:
    r: float  # mean per-clip Pearson r at `offset`
    offset: int  # frames; > 0: the video lags the audio
    clips: int
    r_per_offset: dict[int, float] = field(default_factory=dict)  # mean r at every offset
    r_clips: list[float] = field(default_factory=list)  # per-clip r at `offset`

    def as_dict(self) -> dict[str, object]:
        return {"r": self.r, "offset": self.offset, "clips": self.clips,
                "r_per_offset": {str(k): v for k, v in self.r_per_offset.items()},
                "r_median": float(np.median(self.r_clips)) if self.r_clips else 0.0,
                "r_min": float(np.min(self.r_clips)) if self.r_clips else 0.0}


def lipsync_score(frames: Sequence[np.ndarray], pcm: Sequence[np.ndarray], identities: Sequence[Identity],
                  references: Sequence[np.ndarray], max_offset: int = MAX_OFFSET) -> LipSync:
    """Score clips of generated frames against their audio. frames[i] (F, H, W, 3) uint8; pcm[i] its
    float32 16 kHz speech (frame f = samples [f*16000/24, (f+1)*16000/24)); identities / references say
    where the mouth is and how it looks closed."""
    signals = [mouth_signal(fr, ident, ref) for fr, ident, ref in zip(frames, identities, references, strict=True)]
    return lipsync_of_signals(signals, pcm, max_offset)


def lipsync_of_signals(signals: Sequence[np.ndarray], pcm: Sequence[np.ndarray], max_offset: int = MAX_OFFSET
                       ) -> LipSync:
    """`lipsync_score` from the clips' mouth signals (`mouth_signal`, (F,) each), e.g. computed where the frames
    were made, so that only the signals travel."""
    per_clip = [offset_correlations(video, frame_envelope(p, len(video)), max_offset)
                for video, p in zip(signals, pcm, strict=True)]
    mean = {d: float(np.mean([c[d] for c in per_clip])) for d in range(-max_offset, max_offset + 1)}
    best = max(mean, key=lambda d: (mean[d], -abs(d)))
    return LipSync(mean[best], best, len(per_clip), mean, [c[best] for c in per_clip])


@dataclass
class IdentityWindow:
    start_s: float
    end_s: float
    face_color_mae: float  # |mean face colour - reference's|, 0..255, mean over frames and channels
    psnr_db: float  # frame vs reference outside the mouth box, mean over frames


def identity_drift(frames: np.ndarray, identity: Identity, reference: np.ndarray, window_s: float = 10.0,
                   fps: int = 24) -> list[IdentityWindow]:
    """Per window of `window_s` seconds: how far the face's colours and the whole frame are from the reference."""
    top, bot, left, right = mouth_box(identity)
    ft, fb, fl, fr = face_box(identity)
    face_mask = np.zeros(reference.shape[:2], bool)
    face_mask[ft:fb, fl:fr] = True
    face_mask[top:bot, left:right] = False
    keep = np.ones(reference.shape[:2], bool)
    keep[top:bot, left:right] = False
    ref = reference.astype(np.float64)
    ref_face = ref[face_mask].mean(axis=0)  # (3,)
    per = int(window_s * fps)
    out = []
    for s in range(0, len(frames), per):
        win = frames[s:s + per].astype(np.float64)  # (n, H, W, 3)
        face = win[:, face_mask].mean(axis=1)  # (n, 3)
        mse = ((win - ref[None]) ** 2)[:, keep].mean(axis=(1, 2))  # (n,)
        psnr = 10 * np.log10(255.0**2 / np.maximum(mse, 1e-10))
        out.append(IdentityWindow(s / fps, (s + len(win)) / fps, float(np.abs(face - ref_face).mean()),
                                  float(psnr.mean())))
    return out


@dataclass
class Fidelity:
    """Generated clips against the renderer's frames of the same clips, means over clips."""

    psnr_db: float  # whole frame
    mouth_psnr_db: float  # the mouth box
    flicker: float  # mean |frame f - frame f-1|, 0..255
    flicker_truth: float  # the same of the ground truth
    clips: int

    def as_dict(self) -> dict[str, float | int]:
        return {"psnr_db": self.psnr_db, "mouth_psnr_db": self.mouth_psnr_db, "flicker": self.flicker,
                "flicker_truth": self.flicker_truth, "clips": self.clips}


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over frames of the PSNR of (n, ...) frames a against b."""
    mse = ((a - b) ** 2).reshape(len(a), -1).mean(axis=1)
    return float(np.mean(10 * np.log10(255.0**2 / np.maximum(mse, 1e-10))))


def fidelity(frames: Sequence[np.ndarray], truth: Sequence[np.ndarray], identities: Sequence[Identity]) -> Fidelity:
    """How close generated clips are to the ground truth's frames (see the module docstring)."""
    psnr, mouth, flicker, flicker_t = [], [], [], []
    for gen, real, ident in zip(frames, truth, identities, strict=True):
        n = min(len(gen), len(real))
        g, t = gen[:n].astype(np.float64), real[:n].astype(np.float64)
        top, bot, left, right = mouth_box(ident)
        psnr.append(_psnr(g, t))
        mouth.append(_psnr(g[:, top:bot, left:right], t[:, top:bot, left:right]))
        flicker.append(float(np.abs(np.diff(g, axis=0)).mean()))
        flicker_t.append(float(np.abs(np.diff(t, axis=0)).mean()))
    return Fidelity(float(np.mean(psnr)), float(np.mean(mouth)), float(np.mean(flicker)), float(np.mean(flicker_t)),
                    len(psnr))
