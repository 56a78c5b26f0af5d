"""3-D rotary position tables (time, height, width) for one chunk's tokens.

Head-dim pairs are split between the axes as `DiTConfig.rope_split` says (time first). Tokens are
ordered (frame, row, column). The time position of latent frame `f` of the session is `f + 1`;
the reference frame (the cache's permanent sink) has no time position: its time channels are zero
(cos = sin = 0), so attention to the reference is the same from every chunk, however long the
session runs. Angles are formed in float64 so positions stay exact over hours of frames.
"""

from __future__ import annotations

import torch

from characters.config import DiTConfig


def _inv_freq(axis_dim: int, theta: float) -> torch.Tensor:
    return theta ** (-torch.arange(0, axis_dim, 2, dtype=torch.float64) / axis_dim)  # (axis_dim/2,)


class RopeTables:
    """Builds (cos, sin) tables of shape (T, Dh/2), float32, for a chunk at a given frame position."""

    def __init__(self, cfg: DiTConfig, frames: int, grid: tuple[int, int], device: torch.device | str) -> None:
        dt, dh, dw = cfg.rope_split
        gh, gw = grid
        self.frames, self.tokens_per_frame = frames, gh * gw
        self.t_freq = _inv_freq(dt, cfg.rope_theta).to(device)  # (dt/2,)
        rows = torch.arange(gh, dtype=torch.float64).repeat_interleave(gw)  # (N,)
        cols = torch.arange(gw, dtype=torch.float64).repeat(gh)  # (N,)
        hw = torch.cat([rows[:, None] * _inv_freq(dh, cfg.rope_theta), cols[:, None] * _inv_freq(dw, cfg.rope_theta)],
                       dim=1).repeat(frames, 1)  # (T, (dh+dw)/2)
        self.hw_cos, self.hw_sin = hw.cos().float().to(device), hw.sin().float().to(device)
        self.frame_offset = torch.arange(frames, dtype=torch.float64, device=device).repeat_interleave(
            self.tokens_per_frame)  # (T,)

    def chunk(self, first_frame: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for frames first_frame .. first_frame+frames-1 (time positions +1). `first_frame`
        may be a device tensor (float64 or int64, shape ()) so the call can sit inside a graph."""
        pos = self.frame_offset + 1 + first_frame  # (T,)
        ang = pos[:, None] * self.t_freq  # (T, dt/2)
        cos = torch.cat([ang.cos().float(), self.hw_cos], dim=1)  # (T, Dh/2)
        sin = torch.cat([ang.sin().float(), self.hw_sin], dim=1)
        return cos, sin

    def sink(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for the reference frame (one frame): spatial channels only, time channels zero."""
        n, zeros = self.tokens_per_frame, torch.zeros(self.tokens_per_frame, self.t_freq.numel(),
                                                       device=self.hw_cos.device)
        return torch.cat([zeros, self.hw_cos[:n]], dim=1), torch.cat([zeros, self.hw_sin[:n]], dim=1)
