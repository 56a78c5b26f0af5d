"""LiveAvatar's VAE: Wan2.1's (`Wan2.1_VAE.pth`), as the shared decoder and a Wan2.1 encoder.

The decoder IS `characters.vae.CausalDecoder` with four `VAEConfig` options (`wan21_vae_config`): RMSNorm
epsilon 1e-24 (their F.normalize), halving up-samplings with widening 1x1x1 shortcuts, a 1x1x1 conv on the latents
(their `conv2`, with the latent de-normalisation folded in), and a stream's first latent frame decoded to one frame.
So the decoder worker, its serving windows and CUDA graphs serve it unchanged. The encoder is the one part that is
its own (`WanEncoder`): ours (`characters.vae.VAEEncoder`) is per-frame 2-D with the frames folded into channels,
theirs causal 3-D with strided time convs; it is built from `characters.vae`'s blocks (CausalConv3d, ResBlock,
FrameAttention, RMSNorm) and runs their 1, 4, 4, ... frame chunks, so its memory stays one chunk's.

Checkpoint names are those of the authors' `WanVAE_` (liveavatar/models/wan/wan_2_2/modules/vae2_1.py):
`encoder.*`, `conv1` (the posterior's 1x1x1), `conv2` (the latents' 1x1x1), `decoder.*`; `wan_vae_spec` lists them.
Parity: tests/unit/test_liveavatar_vae.py against goldens of their code (scripts/liveavatar/golden_vae.py).

Shapes: B batch, C latent channels (16), F video frames, H/W frame size, T latent frames, h/w latent size (H/8).
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from characters.config import VAEConfig
from characters.vae import CausalConv3d, CausalDecoder, DecoderState, FrameAttention, ResBlock, RMSNorm, Upsample

__all__ = ["LATENT_MEAN", "LATENT_STD", "LIVEAVATAR_VAE", "MOTION_PRIME_LATENTS", "WanEncoder", "load_wan_vae",
           "motion_latents", "prime_decoder", "reference_latents", "wan21_vae_config", "wan_vae_from_state_dict",
           "wan_vae_spec"]

# Per-channel statistics of Wan2.1's latents (their Wan2_1_VAE.__init__): the DiT works on (mu - mean) / std.
LATENT_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
               0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
LATENT_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
              3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)
# Their streaming decode (causal_s2v_pipeline_tpp.py L1118-1121) first decodes the first 7 motion latents and
# drops the frames: the decoder's caches then hold a real past before the first generated block.
MOTION_PRIME_LATENTS = 7
REFERENCE_FRAMES = 5  # causal_s2v_pipeline.py L891-892: the reference image repeated 5 times, latent 0 dropped


def wan21_vae_config(dim: int = 96) -> VAEConfig:
    """Wan2.1's VAE (`_video_vae`: z_dim 16, dim_mult 1-2-4-4, 2 residual blocks, temporal down-sampling at the two
    lower stages) at width `dim` (96 in the checkpoint; the parity test runs a narrower one)."""
    return VAEConfig(latent_channels=16, base_channels=dim, channel_mult=(1, 2, 4, 4), num_res_blocks=2,
                     encoder_base_channels=dim, norm_eps=1e-24, upsample_halves=True, latent_in_conv=True,
                     first_latent_frames=1)


LIVEAVATAR_VAE = wan21_vae_config()


# ----------------------------------------------------------------------------------------------- encoder


class WanDownsample(nn.Module):
    """2x spatial down-sampling per frame (zeros on the right and bottom, a stride-2 3x3 conv), then optionally 2x
    temporal: a stride-2 (3, 1, 1) conv over the previous chunk's last frame and this chunk's frames. A stream's
    first chunk (one frame) passes the temporal step unchanged. Wan2.1's `Resample` 'downsample2d'/'downsample3d'."""

    def __init__(self, c: int, temporal: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, stride=2)
        self.time_conv = nn.Conv3d(c, c, (3, 1, 1), stride=(2, 1, 1)) if temporal else None

    def forward(self, x: torch.Tensor, prev: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, c, t, h', w'), prev: the last frame of the previous chunk's spatial output (None: x starts the
        stream) -> ((B, c, t', h'/2, w'/2), this chunk's last frame for the next), t' = t/2 (t on the first)."""
        b, c, t, h, w = x.shape
        y = self.conv(F.pad(x.transpose(1, 2).reshape(b * t, c, h, w), (0, 1, 0, 1)))  # (B*t, c, h'/2, w'/2)
        y = y.view(b, t, c, *y.shape[-2:]).transpose(1, 2)  # (B, c, t, h'/2, w'/2)
        if self.time_conv is None:
            return y, None
        last = y[:, :, -1:]
        if prev is None:
            return y, last
        return self.time_conv(torch.cat([prev, y], dim=2)), last  # (B, c, t/2, h'/2, w'/2)


class WanEncoder(nn.Module):
    """Video (B, 3, F, H, W) in [-1, 1], F = 1 + 4k -> normalised latent mean (B, C, 1 + k, H/8, W/8).

    Wan2.1's `Encoder3d` + `conv1`: causal 3x3x3 residual stages (widths dim x 1, 1, 2, 4, 4), three 2x spatial
    down-samplings (the last two also 2x in time), a mid block with per-frame attention, then a 1x1x1 conv to the
    posterior's mean, with (mu - mean) / std folded into it (the log-variance half is not kept). The frames go in
    their chunks: the first alone, then 4 at a time, each causal conv carrying its last 2 input frames."""

    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        eps, dims = cfg.norm_eps, [cfg.encoder_base_channels * m for m in (1, *cfg.channel_mult)]
        scale, frames = 8, 4  # spatial size relative to the latent; frames per latent frame
        self.conv_in = CausalConv3d(3, dims[0], (3, 3, 3), scale, frames)
        self.blocks = nn.ModuleList()
        for i, (cin, c) in enumerate(itertools.pairwise(dims)):
            self.blocks.extend(ResBlock(c, scale, frames, cin=c if j else cin, eps=eps)
                               for j in range(cfg.num_res_blocks))
            if i < len(dims) - 2:
                temporal = i > 0  # Wan2.1's temperal_downsample (False, True, True)
                self.blocks.append(WanDownsample(c, temporal))
                scale, frames = scale // 2, (frames // 2 if temporal else frames)
        c = dims[-1]
        self.mid = nn.ModuleList([ResBlock(c, scale, frames, eps=eps), FrameAttention(c, scale, frames, eps),
                                  ResBlock(c, scale, frames, eps=eps)])
        self.norm_out = RMSNorm(c, eps)
        self.conv_out = CausalConv3d(c, 2 * cfg.latent_channels, (3, 3, 3), scale, frames)
        self.to_mean = CausalConv3d(2 * cfg.latent_channels, cfg.latent_channels, (1, 1, 1), scale, frames)
        self.cached_convs = [m for m in self.modules() if isinstance(m, CausalConv3d) and m.past > 0]
        for slot, conv in enumerate(self.cached_convs):
            conv.slot = slot

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        b, _, f, hh, ww = video.shape
        t, s = self.cfg.temporal_factor, self.cfg.spatial_factor
        if (f - 1) % t or hh % s or ww % s:
            raise ValueError(f"video shape {tuple(video.shape)} needs 1 + {t}k frames and height/width multiples of "
                             f"{s}; trim or pad the clip")
        h, w = hh // s, ww // s
        caches = [video.new_zeros(b, conv.in_channels, conv.past, h * conv.scale, w * conv.scale)
                  for conv in self.cached_convs]  # (B, cin, 2, h', w') each: zeros before the stream
        carry: dict[int, torch.Tensor | None] = {}
        out = [self._chunk(video[:, :, :1], caches, carry)]  # their encode: frame 0 alone, then 4 at a time
        out += [self._chunk(video[:, :, 1 + t * i : 1 + t * (i + 1)], caches, carry) for i in range(f // t)]
        return self.to_mean(torch.cat(out, dim=2), caches)  # (B, C, 1 + k, h, w)

    def _chunk(self, x: torch.Tensor, caches: list[torch.Tensor], carry: dict[int, torch.Tensor | None]
               ) -> torch.Tensor:
        """One chunk (B, 3, 1 or 4, H, W) -> its (B, 2C, 1, h, w) moments; `caches` and `carry` move on."""
        x = self.conv_in(x, caches)
        for i, block in enumerate(self.blocks):
            if isinstance(block, WanDownsample):
                x, carry[i] = block(x, carry.get(i))
            else:
                x = block(x, caches)
        for block in self.mid:
            x = block(x, caches)
        return self.conv_out(F.silu(self.norm_out(x)), caches)


def reference_latents(encoder: WanEncoder, image: torch.Tensor) -> torch.Tensor:
    """The reference image (B, 3, H, W) in [-1, 1] -> its latent (B, C, 1, h, w), as their single-GPU pipeline
    makes it: the image repeated 5 times, encoded, the first latent frame dropped."""
    return encoder(image.unsqueeze(2).expand(-1, -1, REFERENCE_FRAMES, -1, -1))[:, :, 1:]


def motion_latents(encoder: WanEncoder, image: torch.Tensor, frames: int = 73) -> torch.Tensor:
    """The initial motion context: the reference image repeated `frames` (73) times, encoded: (B, C, 19, h, w)."""
    return encoder(image.unsqueeze(2).expand(-1, -1, frames, -1, -1))


def prime_decoder(decoder: CausalDecoder, state: DecoderState, motion: torch.Tensor) -> None:
    """Start a stream as their streaming decode does: decode the first `MOTION_PRIME_LATENTS` motion latents
    (B, C, >= 7, h, w) from a fresh state and drop the frames; the generated blocks then decode as chunks."""
    decoder.reset_state(state)
    decoder.decode_chunk(motion[:, :, :MOTION_PRIME_LATENTS], state)


# ------------------------------------------------------------------------------------------- checkpoint


def _block_pairs(block: nn.Module) -> list[tuple[str, str, tuple[int, ...]]]:
    """(our parameter, Wan's key, Wan's shape) within one block; our shapes are theirs without unit dims."""
    p = {name: tuple(t.shape) for name, t in block.named_parameters()}
    if isinstance(block, ResBlock):
        pairs = [("norm1.weight", "residual.0.gamma", (*p["norm1.weight"], 1, 1, 1)),
                 ("conv1.weight", "residual.2.weight", p["conv1.weight"]), ("conv1.bias", "residual.2.bias", None),
                 ("norm2.weight", "residual.3.gamma", (*p["norm2.weight"], 1, 1, 1)),
                 ("conv2.weight", "residual.6.weight", p["conv2.weight"]), ("conv2.bias", "residual.6.bias", None)]
        if block.shortcut is not None:
            pairs += [("shortcut.weight", "shortcut.weight", None), ("shortcut.bias", "shortcut.bias", None)]
    elif isinstance(block, FrameAttention):
        pairs = [("norm.weight", "norm.gamma", (*p["norm.weight"], 1, 1)),
                 ("qkv.weight", "to_qkv.weight", (*p["qkv.weight"], 1, 1)), ("qkv.bias", "to_qkv.bias", None),
                 ("proj.weight", "proj.weight", (*p["proj.weight"], 1, 1)), ("proj.bias", "proj.bias", None)]
    elif isinstance(block, Upsample | WanDownsample):
        w = p["conv.weight"]
        pairs = [("conv.weight", "resample.1.weight", (w[0], w[1], *w[-2:])), ("conv.bias", "resample.1.bias", None)]
        if block.time_conv is not None:
            pairs += [("time_conv.weight", "time_conv.weight", None), ("time_conv.bias", "time_conv.bias", None)]
    else:
        raise TypeError(f"no Wan2.1 names for {type(block).__name__}")
    return [(ours, wan, shape or p[ours]) for ours, wan, shape in pairs]


def _mapping(decoder: CausalDecoder, encoder: WanEncoder) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """Wan's key -> (our model, our parameter, Wan's shape), for every tensor of `Wan2.1_VAE.pth` but the folded
    `conv1` / `conv2` (see `_fold`)."""
    out: dict[str, tuple[str, str, tuple[int, ...]]] = {}

    def add(model: str, ours: str, wan: str, shape: tuple[int, ...]) -> None:
        out[wan] = (model, ours, shape)

    for model, m, prefix, groups in (
        ("decoder", decoder, "decoder", [("blocks", "middle", 0, 3), ("blocks", "upsamples", 3, len(decoder.blocks))]),
        ("encoder", encoder, "encoder", [("blocks", "downsamples", 0, len(encoder.blocks)), ("mid", "middle", 0, 3)]),
    ):
        for name in ("conv_in", "conv_out"):
            conv = getattr(m, name)
            wan = "conv1" if name == "conv_in" else "head.2"
            add(model, f"{name}.weight", f"{prefix}.{wan}.weight", tuple(conv.weight.shape))
            add(model, f"{name}.bias", f"{prefix}.{wan}.bias", tuple(conv.bias.shape))
        add(model, "norm_out.weight", f"{prefix}.head.0.gamma", (m.norm_out.weight.shape[0], 1, 1, 1))
        for ours_list, wan_list, lo, hi in groups:
            for k in range(lo, hi):
                for ours, wan, shape in _block_pairs(getattr(m, ours_list)[k]):
                    add(model, f"{ours_list}.{k}.{ours}", f"{prefix}.{wan_list}.{k - lo}.{wan}", shape)
    return out


def _check_config(cfg: VAEConfig) -> None:
    if not (cfg.latent_in_conv and cfg.upsample_halves and cfg.first_latent_frames == 1
            and cfg.decoder_output == "conv" and cfg.channel_mult == (1, 2, 4, 4)):
        raise ValueError(f"{cfg} is not a Wan2.1 VAE config; build it with wan21_vae_config(dim)")


def wan_vae_spec(cfg: VAEConfig = LIVEAVATAR_VAE) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Wan2.1 VAE checkpoint at `cfg`'s width: key -> shape (float32 in the file)."""
    _check_config(cfg)
    with torch.device("meta"):
        decoder, encoder = CausalDecoder(cfg), WanEncoder(cfg)
    spec = {wan: shape for wan, (_, _, shape) in _mapping(decoder, encoder).items()}
    c = cfg.latent_channels
    spec |= {"conv1.weight": (2 * c, 2 * c, 1, 1, 1), "conv1.bias": (2 * c,),
             "conv2.weight": (c, c, 1, 1, 1), "conv2.bias": (c,)}
    return spec


def _fold(state: Mapping[str, torch.Tensor], c: int) -> dict[str, dict[str, torch.Tensor]]:
    """Their latent normalisation folded into the 1x1x1 convs, in float64: the decoder's `latent_in` is
    conv2(z * std + mean); the encoder's `to_mean` is (conv1(x)[:C] - mean) / std."""
    mean = torch.tensor(LATENT_MEAN, dtype=torch.float64)
    std = torch.tensor(LATENT_STD, dtype=torch.float64)
    w2, b2 = state["conv2.weight"].double(), state["conv2.bias"].double()  # (C, C, 1, 1, 1), (C,)
    w1, b1 = state["conv1.weight"].double()[:c], state["conv1.bias"].double()[:c]  # the mean's rows
    return {
        "decoder": {"latent_in.weight": w2 * std.view(1, c, 1, 1, 1), "latent_in.bias": b2 + w2[:, :, 0, 0, 0] @ mean},
        "encoder": {"to_mean.weight": w1 / std.view(c, 1, 1, 1, 1), "to_mean.bias": (b1 - mean) / std},
    }


def wan_vae_from_state_dict(state: Mapping[str, object], cfg: VAEConfig = LIVEAVATAR_VAE, *, source: str = "state dict",
                            device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
                            ) -> tuple[CausalDecoder, WanEncoder]:
    """Our decoder and encoder from a Wan2.1 VAE state dict (names as their `WanVAE_` has them), every tensor
    checked by name and shape; a missing, misshapen or unknown tensor is refused naming `source` and the tensor."""
    spec = wan_vae_spec(cfg)
    missing = [k for k in spec if k not in state]
    if missing:
        raise ValueError(f"{source}: tensor {missing[0]!r} (shape {spec[missing[0]]}) is missing ({len(missing)} of "
                         f"{len(spec)} missing); expected Wan2.1_VAE.pth (z_dim 16, dim {cfg.base_channels})")
    unknown = sorted(k for k in state if k not in spec)
    if unknown:
        raise ValueError(f"{source}: tensor {unknown[0]!r} is not in Wan2.1's VAE ({len(unknown)} unknown); "
                         f"expected Wan2.1_VAE.pth (z_dim 16, dim {cfg.base_channels}), not another model's file")
    checked: dict[str, torch.Tensor] = {}
    for key, shape in spec.items():
        t = state[key]
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{source}: tensor {key!r} is {type(t).__name__} "
                             f"{getattr(t, 'dtype', '')}, not a float tensor")
        if tuple(t.shape) != shape:
            raise ValueError(f"{source}: tensor {key!r} has shape {tuple(t.shape)}; Wan2.1's VAE at dim "
                             f"{cfg.base_channels} needs {shape}")
        checked[key] = t
    tensors = _fold(checked, cfg.latent_channels)
    with torch.device("meta"):
        decoder, encoder = CausalDecoder(cfg), WanEncoder(cfg)
    models: dict[str, nn.Module] = {"decoder": decoder, "encoder": encoder}
    params = {name: dict(m.named_parameters()) for name, m in models.items()}
    for wan, (model, ours, _) in _mapping(decoder, encoder).items():
        tensors[model][ours] = checked[wan].reshape(params[model][ours].shape)
    for name, m in models.items():
        m.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in tensors[name].items()},
                          strict=True, assign=True)
        m.eval().requires_grad_(False)
    return decoder, encoder


def load_wan_vae(path: str | Path, cfg: VAEConfig = LIVEAVATAR_VAE, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> tuple[CausalDecoder, WanEncoder]:
    """`Wan2.1_VAE.pth` (a torch pickle of the state dict, as the hub serves it) -> (decoder, encoder)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, pickle.UnpicklingError) as e:
        raise ValueError(f"{path}: not a readable torch state dict ({e}); download Wan2.1_VAE.pth again") from e
    if not isinstance(state, Mapping):
        raise ValueError(f"{path}: holds a {type(state).__name__}, not a state dict; expected Wan2.1_VAE.pth")
    return wan_vae_from_state_dict(state, cfg, source=str(path), device=device, dtype=dtype)
