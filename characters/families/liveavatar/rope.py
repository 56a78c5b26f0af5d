"""LiveAvatar's 3-D RoPE: position grids per token group (noisy frames, reference, packed motion) sampled as
Wan2.2-S2V samples them, with its tables rounded to float16 as its `rope_precompute` stores them.

A group is (start, end, extent) triples over (time, height, width), as the authors' `grid_sizes`: `end - start`
tokens per axis, whose positions are `extent` positions spread over that many tokens (np.linspace, truncated);
a negative start counts time backwards (conjugate frequencies). Their tables are complex and written into a
complex-half buffer, so cos and sin carry float16 precision; we keep that rounding and apply the rotation in
float32 on (even, odd) channel pairs, which is what their complex product computes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

Triple = tuple[int, int, int]
Group = tuple[Triple, Triple, Triple]  # (start, end, extent) per (time, height, width)


def rope_angles(positions: int, dim: int, theta: float = 10000.0) -> torch.Tensor:
    """(positions, dim/2) float64 angles pos * theta^(-2i/dim), as Wan's rope_params before polar()."""
    inv = 1.0 / torch.pow(theta, torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return torch.outer(torch.arange(positions, dtype=torch.float64), inv)


class RopeTable:
    """Per-axis angle tables for one head size (Wan's split of head_dim / 2 into time, height, width)."""

    def __init__(self, head_dim: int, positions: int, split: tuple[int, int, int]) -> None:
        self.split = split
        # Wan builds the time axis from dim d - 4 (d // 6) and the two spatial axes from 2 (d // 6) each.
        self.axes = [rope_angles(positions, 2 * n) for n in split]

    def group(self, group: Group) -> torch.Tensor:
        """(tokens, head_dim/2, 2) float32 [cos, sin] for one group, float16-rounded, in (t, h, w) token order."""
        (f0, h0, w0), (f1, h1, w1), (tf, th, tw) = group
        nf, nh, nw = f1 - f0, h1 - h0, w1 - w0
        if nf * nh * nw <= 0:
            return torch.zeros(0, sum(self.split), 2)
        if tf <= 0:
            raise ValueError(f"rope group {group} has no positive time extent (their learned-frequency branch)")
        if f0 >= 0:
            f_pos = np.linspace(f0, tf + f0 - 1, nf).astype(int)
            f_sign = 1.0
        else:
            f_pos = np.linspace(-f0, -tf - f0 + 1, nf).astype(int)
            f_sign = -1.0  # conjugate: the angle's sign flips
        h_pos = np.linspace(h0, th + h0 - 1, nh).astype(int)
        w_pos = np.linspace(w0, tw + w0 - 1, nw).astype(int)
        ang_f = self.axes[0][torch.as_tensor(f_pos)] * f_sign  # (nf, c0)
        ang_h = self.axes[1][torch.as_tensor(h_pos)]  # (nh, c1)
        ang_w = self.axes[2][torch.as_tensor(w_pos)]  # (nw, c2)
        ang = torch.cat([
            ang_f[:, None, None, :].expand(nf, nh, nw, -1),
            ang_h[None, :, None, :].expand(nf, nh, nw, -1),
            ang_w[None, None, :, :].expand(nf, nh, nw, -1),
        ], dim=-1).reshape(nf * nh * nw, -1)
        cs = torch.stack([torch.cos(ang), torch.sin(ang)], dim=-1)
        return cs.to(torch.float16).to(torch.float32)

    def groups(self, groups: Sequence[Group]) -> torch.Tensor:
        """(tokens, head_dim/2, 2) for groups laid one after another."""
        return torch.cat([self.group(g) for g in groups], dim=0)


def shift_time(group: Group, frames: int) -> Group:
    """The group moved `frames` later in time (their rollout_grid_sizes on a start/end pair)."""
    (f0, h0, w0), (f1, h1, w1), ext = group
    return (f0 + frames, h0, w0), (f1 + frames, h1, w1), ext


def apply_rope(x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """Rotate (B, L, Hh, Dh) by (L, Dh/2, 2) [cos, sin] on adjacent channel pairs; float32 result."""
    b, n, hh, d = x.shape
    xp = x.float().reshape(b, n, hh, d // 2, 2)
    x0, x1 = xp[..., 0], xp[..., 1]
    c = cs[None, :, None, :, 0]
    s = cs[None, :, None, :, 1]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).reshape(b, n, hh, d)


def noisy_group(frames: int, hp: int, wp: int, start_frame: int) -> Group:
    """A block of `frames` latent frames at time `start_frame` on the full token grid."""
    return (start_frame, 0, 0), (start_frame + frames, hp, wp), (frames, hp, wp)


def reference_group(hp: int, wp: int, frame: int) -> Group:
    """The reference frame: one frame at time index `frame` (their 30, rolled later)."""
    return (frame, 0, 0), (frame + 1, hp, wp), (1, hp, wp)


def motion_groups(hp: int, wp: int, buckets: tuple[int, int, int]) -> list[Group]:
    """Frame-packed motion: the nearest frame at full grid, then 2x and 4x packed frames, at negative times
    (FramePackMotioner's grid sizes)."""
    b1, b2, b4 = buckets
    return [
        ((-b1, 0, 0), (-b1 + b1, hp, wp), (b1, hp, wp)),
        ((-(b1 + b2), 0, 0), (-(b1 + b2) + b2 // 2, hp // 2, wp // 2), (b2, hp, wp)),
        ((-(b1 + b2 + b4), 0, 0), (-(b1 + b2 + b4) + b4 // 4, hp // 4, wp // 4), (b4, hp, wp)),
    ]
