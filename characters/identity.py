"""The identity anchor: decoded frames stay the reference outside the region that speech moves.

`tiny` was trained on procedural cartoon faces only, so on any other picture it paints its training set
(colour cast, blur, a cartoon mouth). No retraining: once per avatar, the framed reference and the mouth
region (below the face the Haar cascade finds: `characters.media.detect_face`) give a soft mask, 1 over the
mouth and jaw, feathered to 0 around them. Every decoded chunk is then

    out = reference * (1 - mask) + matched(generated) * mask

where `matched` maps the generated pixels' per-channel mean and standard deviation in the mask's ring (the
feathered band around the mouth, skin on the reference) onto the reference's in the same ring, so the
generated mouth carries the reference's colours: no seam and no cast. The statistics are taken over the
chunk's frames and smoothed from chunk to chunk (`SMOOTHING`) so the match itself does not flicker.
Everything is done on the mask's bounding box only, vectorised, on the decoder's device.

Dimension names: F frames in a chunk, H x W the frame, h x w the mask's bounding box, C = 3 colours.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# the mouth region inside a Haar face box (x, y, w, h), in face widths/heights: centre and half-sizes of
# the core (mask 1), then the feather (mask falls to 0 over this many face heights)
MOUTH_CX, MOUTH_CY = 0.5, 0.8
MOUTH_HALF_W, MOUTH_HALF_H = 0.22, 0.12
FEATHER = 0.09
RING = (0.02, 0.6)  # mask values that make the ring where colours are matched
SMOOTHING = 0.3  # weight of a new chunk's colour statistics against the running ones
SKIN_TOLERANCE = 40.0  # ring pixels whose reference colour is this close (mean abs, 0-255) to the face's skin
STD_RATIO = (0.8, 1.25)  # bounds on the per-channel contrast change (wider tints a dark mouth green)


def mouth_box(face: tuple[int, int, int, int]) -> tuple[float, float, float, float]:
    """The mouth's core box (x0, y0, x1, y1) in pixels, from a face box (x, y, w, h)."""
    x, y, w, h = face
    cx, cy = x + MOUTH_CX * w, y + MOUTH_CY * h
    return cx - MOUTH_HALF_W * w, cy - MOUTH_HALF_H * h, cx + MOUTH_HALF_W * w, cy + MOUTH_HALF_H * h


def soft_mask(height: int, width: int, core: tuple[float, float, float, float], feather: float) -> np.ndarray:
    """(H, W) float32: 1 inside an ellipse filling `core`, falling smoothly (cosine) to 0 over `feather` pixels."""
    x0, y0, x1, y1 = core
    cx, cy, rx, ry = (x0 + x1) / 2, (y0 + y1) / 2, max(1.0, (x1 - x0) / 2), max(1.0, (y1 - y0) / 2)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32) + 0.5  # (H, W) each
    # distance outside the ellipse, in pixels (approximately: radial scaling of the normalised radius)
    r = np.sqrt(((xs - cx) / rx) ** 2 + ((ys - cy) / ry) ** 2)  # (H, W); 1 on the ellipse
    outside = (r - 1) * np.minimum(rx, ry)
    t = np.clip(outside / max(feather, 1e-6), 0, 1)
    return (0.5 * (1 + np.cos(np.pi * t))).astype(np.float32)


@dataclass
class _Stats:
    mean: torch.Tensor  # (C,)
    std: torch.Tensor  # (C,)


class IdentityAnchor:
    """Built once per avatar from its framed reference; `apply` to every decoded chunk, `reset` per session."""

    def __init__(self, reference: np.ndarray, mask: np.ndarray, device: torch.device | str = "cpu",
                 skin: np.ndarray | None = None) -> None:
        """`reference` (H, W, 3) uint8, `mask` (H, W) float in [0, 1] (1: generated, 0: reference); `skin`: the
        face's colour (3,): the ring keeps only pixels of about that colour (not background past a narrow jaw)."""
        if reference.ndim != 3 or reference.shape[2] != 3 or reference.dtype != np.uint8:
            raise ValueError(f"reference must be (H, W, 3) uint8, got {reference.shape} {reference.dtype}")
        if mask.shape != reference.shape[:2]:
            raise ValueError(f"mask is {mask.shape}, the reference {reference.shape[:2]}; build them at one size")
        rows, cols = np.nonzero(mask > 1e-3)
        if rows.size == 0:
            raise ValueError("the mask is empty: nothing would be generated; give a mask with a region of 1s")
        self.device = torch.device(device)
        self.box = (int(rows.min()), int(rows.max()) + 1, int(cols.min()), int(cols.max()) + 1)  # y0, y1, x0, x1
        y0, y1, x0, x1 = self.box
        self.reference = torch.tensor(reference, device=self.device)  # (H, W, C) uint8
        self._ref = self.reference[y0:y1, x0:x1].float()  # (h, w, C)
        self._mask = torch.tensor(mask[y0:y1, x0:x1, None], dtype=torch.float32, device=self.device)  # (h, w, 1)
        m = self._mask[..., 0]
        self._ring = ((m > RING[0]) & (m < RING[1])).reshape(-1)  # (h*w,)
        if skin is not None:
            near = (self._ref - torch.tensor(skin, dtype=torch.float32, device=self.device)).abs().mean(-1)  # (h, w)
            on_skin = self._ring & (near.reshape(-1) < SKIN_TOLERANCE)
            if int(on_skin.sum()) >= 8:
                self._ring = on_skin
        if int(self._ring.sum()) < 8:
            raise ValueError(f"the mask's ring (values in {RING}) has {int(self._ring.sum())} pixels; feather it")
        ring_ref = self._ref.reshape(-1, 3)[self._ring]  # (n, C)
        self._target = _Stats(ring_ref.mean(0), ring_ref.std(0).clamp_min(1.0))
        self._running: _Stats | None = None

    @classmethod
    def for_face(cls, reference: np.ndarray, face: tuple[int, int, int, int],
                 device: torch.device | str = "cpu") -> IdentityAnchor:
        """The anchor whose mask covers the mouth and jaw of `face` (x, y, w, h) in the reference's pixels."""
        h, w = reference.shape[:2]
        x, y, fw, fh = face  # the skin: the median colour between the eyes and the mouth (cheeks and nose)
        cheeks = reference[int(y + 0.5 * fh):int(y + 0.62 * fh) + 1, int(x + 0.2 * fw):int(x + 0.8 * fw) + 1]
        skin = np.median(cheeks.reshape(-1, 3), axis=0) if cheeks.size else None
        return cls(reference, soft_mask(h, w, mouth_box(face), FEATHER * face[3]), device, skin)

    @classmethod
    def build(cls, reference: np.ndarray, device: torch.device | str = "cpu") -> IdentityAnchor | None:
        """The anchor of a framed reference, or None when no face is found in it (frames then pass unchanged)."""
        from characters.media import detect_face

        face = detect_face(reference)
        return None if face is None else cls.for_face(reference, face, device)

    def reset(self) -> None:
        """A new session: forget the running colour statistics."""
        self._running = None

    def apply(self, frames: torch.Tensor) -> torch.Tensor:
        """(F, H, W, 3) uint8 decoded frames -> (F, H, W, 3) uint8 anchored frames (a new tensor)."""
        if frames.shape[1:] != self.reference.shape:
            raise ValueError(f"frames are {tuple(frames.shape)}, the anchor's reference {tuple(self.reference.shape)}")
        y0, y1, x0, x1 = self.box
        gen = frames[:, y0:y1, x0:x1].to(self.device).float()  # (F, h, w, C)
        ring = gen.reshape(gen.shape[0], -1, 3)[:, self._ring]  # (F, n, C)
        now = _Stats(ring.mean((0, 1)), ring.std((0, 1)).clamp_min(1.0))
        run = self._running
        if run is not None:
            now = _Stats(run.mean + SMOOTHING * (now.mean - run.mean), run.std + SMOOTHING * (now.std - run.std))
        self._running = now
        gain = (self._target.std / now.std).clamp(*STD_RATIO)  # (C,)
        matched = (gen - now.mean) * gain + self._target.mean  # (F, h, w, C)
        mixed = self._ref + (matched - self._ref) * self._mask  # (F, h, w, C)
        out = self.reference.expand(frames.shape[0], -1, -1, -1).clone()  # (F, H, W, C) uint8
        out[:, y0:y1, x0:x1] = mixed.round_().clamp_(0, 255).to(torch.uint8)
        return out


@dataclass(frozen=True)
class IdentityScores:
    """Generated frames against their framed reference (`identity_scores`)."""

    psnr_outside_mouth_db: float  # PSNR over every frame, outside the mouth box (`mouth_box` of the face)
    signed_error: tuple[float, float, float]  # mean (generated - reference) per channel R, G, B, whole frame
    flicker: float  # mean absolute difference between consecutive frames, whole frame
    frames: int

    def as_dict(self) -> dict[str, object]:
        return {"psnr_outside_mouth_db": self.psnr_outside_mouth_db, "signed_error_rgb": list(self.signed_error),
                "flicker": self.flicker, "frames": self.frames}


def identity_scores(frames: np.ndarray, reference: np.ndarray, face: tuple[int, int, int, int]) -> IdentityScores:
    """Score (F, H, W, 3) uint8 frames against the (H, W, 3) uint8 reference; the mouth box comes from `face`
    (x, y, w, h). The box is the mask's core, so the feathered band around it counts: seams show in the PSNR."""
    x0, y0, x1, y1 = mouth_box(face)
    keep = np.ones(reference.shape[:2], bool)  # (H, W)
    keep[max(0, int(y0)):int(np.ceil(y1)), max(0, int(x0)):int(np.ceil(x1))] = False
    diff = frames.astype(np.float32) - reference.astype(np.float32)  # (F, H, W, C)
    mse = float(np.mean(diff[:, keep] ** 2))
    psnr = float("inf") if mse == 0 else 10 * float(np.log10(255.0**2 / mse))
    signed = diff.mean(axis=(0, 1, 2))  # (C,)
    flicker = float(np.abs(np.diff(frames.astype(np.float32), axis=0)).mean()) if len(frames) > 1 else 0.0
    return IdentityScores(psnr, (float(signed[0]), float(signed[1]), float(signed[2])), flicker, len(frames))
