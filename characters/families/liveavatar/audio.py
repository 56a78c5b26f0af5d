"""LiveAvatar's audio path inside the DiT: wav2vec2 hidden states -> per-latent-frame audio tokens
(`CausalAudioEncoder`), and the cross-attentions that inject them after some blocks (`AudioInjector_WAN`).

The encoder is causal in time (left-replicate padding, two stride-2 convolutions: 4 video frames per latent
frame). As the authors' loop runs it, each block's audio is encoded on its own, prefixed by its first frame
repeated over the motion window; the block's latent frames take the last outputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from characters.families.liveavatar.layers import CrossAttention

if TYPE_CHECKING:
    from characters.families.liveavatar.config import LiveAvatarDiTConfig


class CausalConv1d(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1) -> None:
        super().__init__()
        self.pad = kernel - 1
        self.conv = nn.Conv1d(cin, cout, kernel, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (self.pad, 0), mode="replicate"))


def _ln(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), eps=1e-6)


class MotionEncoderTC(nn.Module):
    """(B, Fa, Da) features -> ((B, t, 1, D) global, (B, t, A + 1, D) local tokens); t = ceil(ceil(Fa/2)/2)."""

    def __init__(self, in_dim: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.conv1_local = CausalConv1d(in_dim, hidden // 4 * heads)
        self.conv1_global = CausalConv1d(in_dim, hidden // 4)
        self.conv2 = CausalConv1d(hidden // 4, hidden // 2, stride=2)
        self.conv3 = CausalConv1d(hidden // 2, hidden, stride=2)
        self.final_linear = nn.Linear(hidden, hidden)
        self.padding_tokens = nn.Parameter(torch.zeros(1, 1, 1, hidden))

    def _tail(self, x: torch.Tensor) -> torch.Tensor:
        """(B', C/4, t) after the first conv -> (B', t', D) through norm/act and the two strided convs."""
        x = F.silu(_ln(x.transpose(1, 2))).transpose(1, 2)
        x = F.silu(_ln(self.conv2(x).transpose(1, 2))).transpose(1, 2)
        return F.silu(_ln(self.conv3(x).transpose(1, 2)))

    def forward(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = feats.shape[0]
        x = feats.transpose(1, 2)  # (B, Da, Fa)
        loc = self.conv1_local(x)  # (B, heads * C/4, Fa)
        loc = loc.unflatten(1, (self.heads, -1)).flatten(0, 1)  # (B*heads, C/4, Fa)
        loc = self._tail(loc)  # (B*heads, t, D)
        loc = loc.unflatten(0, (b, self.heads)).transpose(1, 2)  # (B, t, heads, D)
        loc = torch.cat([loc, self.padding_tokens.expand(b, loc.shape[1], 1, -1)], dim=2)
        glob = self.final_linear(self._tail(self.conv1_global(x)))[:, :, None]  # (B, t, 1, D)
        return glob, loc


class CausalAudioEncoder(nn.Module):
    """Learned softmax-free average of the wav2vec2 layers, then the causal conv encoder (float32)."""

    def __init__(self, cfg: LiveAvatarDiTConfig) -> None:
        super().__init__()
        self.encoder = MotionEncoderTC(cfg.audio_dim, cfg.dim, cfg.audio_tokens)
        self.weights = nn.Parameter(torch.ones(1, cfg.audio_layers, 1, 1) * 0.01)

    def forward(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, La, Da, Fa) hidden states -> (global, local) tokens per latent frame."""
        w = F.silu(self.weights.float())
        mixed = (feats.float() * w / w.sum(dim=1, keepdim=True)).sum(dim=1)  # (B, Da, Fa)
        return self.encoder(mixed.transpose(1, 2).to(self.weights.dtype))


class AdaLayerNorm(nn.Module):
    """diffusers' AdaLayerNorm with chunk_dim=1: LayerNorm(eps 1e-5) shifted then scaled by a SiLU-linear."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim * 2)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """x (f, N, D), emb (f, D) -> (f, N, D)."""
        shift, scale = self.linear(F.silu(emb)).chunk(2, dim=1)
        return F.layer_norm(x, (x.shape[-1],), eps=1e-5) * (1 + scale[:, None]) + shift[:, None]


class AudioInjector(nn.Module):
    """One audio cross-attention (+ its AdaLN) per injected block, in block order."""

    def __init__(self, cfg: LiveAvatarDiTConfig) -> None:
        super().__init__()
        layers = sorted(set(cfg.audio_inject_layers))
        self.slot = {layer: i for i, layer in enumerate(layers)}
        self.injector = nn.ModuleList(CrossAttention(cfg.dim, cfg.num_heads, cfg.eps) for _ in layers)
        self.injector_adain_layers = nn.ModuleList(AdaLayerNorm(cfg.dim) for _ in layers)


def block_audio(encoder: CausalAudioEncoder, feats: torch.Tensor, motion_frames: int, motion_latent_frames: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's audio tokens as their loop makes them: (1, La, Da, Fa) features of the block's video frames,
    prefixed by the first frame repeated `motion_frames` times, encoded, the motion part dropped.
    Returns ((f, D) global, (f, A + 1, D) local) in `dtype`."""
    feats = torch.cat([feats[..., :1].expand(-1, -1, -1, motion_frames), feats], dim=-1)
    glob, loc = encoder(feats)
    return glob[0, motion_latent_frames:, 0].to(dtype), loc[0, motion_latent_frames:].to(dtype)
