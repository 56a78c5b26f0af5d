"""LiveAvatar's configuration: the Wan2.2-S2V-14B transformer as its authors configure it, and their
streaming loop's constants (`liveavatar/configs/s2v_causal_sft.yaml`, `wan_s2v_14B_modified.py`,
`infinite_inference_*.sh`).

Shape names used in this package:
    C   latent channels (16)             f   latent frames in a block (3)
    h,w latent height / width            hp,wp  token grid (h/2, w/2)
    N   tokens per latent frame (hp*wp)  T   tokens per block (f*N)
    Lc  condition tokens (reference + packed motion: 2.5 N)
    S   self-attention cache slots (blocks_in_window * T)
    D   model dim; Dh head dim; Hh heads
    La  audio layers of wav2vec2 (25); Da its width (1024); Fa video frames of audio
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LiveAvatarDiTConfig(_Frozen):
    """The causal Wan2.2-S2V transformer (`CausalWanModel_S2V`)."""

    num_layers: int = Field(default=40, ge=1, description="Transformer blocks.")
    dim: int = Field(default=5120, ge=8, description="Model width D.")
    num_heads: int = Field(default=40, ge=1, description="Attention heads Hh.")
    ffn_dim: int = Field(default=13824, ge=8, description="MLP hidden width.")
    freq_dim: int = Field(default=256, ge=2, description="Sinusoidal timestep embedding width.")
    text_dim: int = Field(default=4096, ge=1, description="umT5 output width (text context).")
    text_len: int = Field(default=512, ge=1, description="Text tokens the context is padded to (all attended).")
    latent_channels: int = Field(default=16, ge=1, description="VAE latent channels C (in and out).")
    audio_dim: int = Field(default=1024, ge=1, description="wav2vec2 feature width Da.")
    audio_layers: int = Field(default=25, ge=1, description="wav2vec2 hidden states averaged by learned weights.")
    audio_tokens: int = Field(default=4, ge=1, description="Local audio tokens per latent frame (+1 padding token).")
    audio_inject_layers: tuple[int, ...] = Field(
        default=(0, 4, 8, 12, 16, 20, 24, 27, 30, 33, 36, 39),
        description="Blocks followed by an audio cross-attention (the audio injector).")
    cond_dim: int = Field(default=16, ge=0, description="Pose/condition latent channels (zeros when unused).")
    eps: float = Field(default=1e-6, gt=0, description="Norm epsilon.")
    rope_positions: int = Field(default=45000, ge=1, description="Positions in the RoPE table.")
    motion_buckets: tuple[int, int, int] = Field(
        default=(1, 2, 16), description="Frame packing: latent frames packed at 1x, 2x and 4x (nearest first).")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def rope_split(self) -> tuple[int, int, int]:
        """Complex RoPE frequencies per (time, height, width) axis, as Wan splits head_dim / 2."""
        c = self.head_dim // 2
        return c - 2 * (c // 3), c // 3, c // 3

    @model_validator(mode="after")
    def _check(self) -> LiveAvatarDiTConfig:
        if self.dim % self.num_heads or self.head_dim % 2:
            raise ValueError(f"liveavatar dit.dim={self.dim} must split into num_heads={self.num_heads} even heads")
        bad = [i for i in self.audio_inject_layers if i >= self.num_layers]
        if bad:
            raise ValueError(f"liveavatar dit.audio_inject_layers {bad} are past num_layers={self.num_layers}; "
                             "drop them or add layers")
        return self


class LiveAvatarLoopConfig(_Frozen):
    """The block-causal streaming loop of `WanS2V.generate` (single GPU) as `infinite_inference_*.sh` runs it."""

    height: int = Field(default=384, ge=64, description="Frame height H (a multiple of 64, as their sizing pads).")
    width: int = Field(default=704, ge=64, description="Frame width W (a multiple of 64).")
    fps: Literal[25] = Field(default=25, description="Video frame rate (Wan2.2's sample_fps).")
    frames_per_block: int = Field(default=3, ge=1, description="Latent frames f per block (num_frames_per_block).")
    blocks_per_clip: int = Field(default=4, ge=1, description="Blocks per clip (infer_frames 48 = 4 blocks of 12).")
    steps: int = Field(default=4, ge=1, description="Denoising steps per block (sample_steps), one KV cache each.")
    shift: float = Field(default=3.0, gt=0, description="Flow-matching shift of the Euler scheduler.")
    train_timesteps: int = Field(default=1000, ge=1, description="num_train_timesteps of the scheduler.")
    motion_frames: int = Field(default=73, ge=1, description="Video frames of motion context (19 latent frames).")
    cond_capacity: int = Field(default=2800, ge=1, description="Condition-cache slots (their cond_k buffer).")
    cond_rollout_base: int = Field(
        default=30, description="Their reference frame's RoPE time index; the reference's position rolls with a "
        "random distance in [4, 30] once generation passes it (`relative_dist` in _forward_inference).")

    @property
    def temporal_factor(self) -> int:
        return 4

    @property
    def latent_hw(self) -> tuple[int, int]:
        return self.height // 8, self.width // 8

    @property
    def tokens_per_frame(self) -> int:
        h, w = self.latent_hw
        return (h // 2) * (w // 2)

    @property
    def block_tokens(self) -> int:
        return self.frames_per_block * self.tokens_per_frame

    @property
    def cache_slots(self) -> int:
        """The rolling self-attention window: one clip of latent frames (their kv_cache_size = max_seq_len)."""
        return self.blocks_per_clip * self.block_tokens

    @property
    def motion_latent_frames(self) -> int:
        return (self.motion_frames + 3) // 4

    @property
    def video_frames_per_block(self) -> int:
        return self.frames_per_block * self.temporal_factor

    @property
    def block_seconds(self) -> float:
        return self.video_frames_per_block / self.fps

    @model_validator(mode="after")
    def _check(self) -> LiveAvatarLoopConfig:
        if self.height % 64 or self.width % 64:
            raise ValueError(f"liveavatar loop height x width = {self.height}x{self.width} must be multiples of 64 "
                             "(their sizing pads to 64); e.g. 384x704 for a 720x400 request")
        return self


def size_for_area(height: int, width: int, target_area: int, divisor: int = 64) -> tuple[int, int]:
    """The frame size their pipeline picks for an image of `height` x `width` (WanS2V.get_size_less_than_area):
    the largest scale whose size, padded to multiples of 64, fits `target_area`."""
    if height * width <= target_area:
        min_scale, max_scale = 0.1, 1.0
    else:
        d = divisor - 1
        b = d * (height + width)
        a = height * width
        c = d**2 - target_area
        min_scale = (-b + math.sqrt(b**2 - 2 * a * c)) / (2 * a)
        max_scale = math.sqrt(target_area / (height * width))
    for i in range(100):
        scale = max_scale - (max_scale - min_scale) * i / 100
        nh, nw = int(height * scale), int(width * scale)
        ph, pw = nh + (64 - nh % 64) % 64, nw + (64 - nw % 64) % 64
        if ph * pw <= target_area:
            return ph, pw
    aspect = width / height
    tw = int((target_area * aspect) ** 0.5 // divisor * divisor)
    th = int((target_area / aspect) ** 0.5 // divisor * divisor)
    if tw >= width or th >= height:
        tw, th = int(width // divisor * divisor), int(height // divisor * divisor)
    return th, tw


class LiveAvatarConfig(_Frozen):
    """One LiveAvatar model: the transformer and its streaming loop."""

    name: str = Field(default="liveavatar-14b", description="Preset name.")
    family: Literal["liveavatar"] = Field(default="liveavatar", description="Model family.")
    dit: LiveAvatarDiTConfig = LiveAvatarDiTConfig()
    loop: LiveAvatarLoopConfig = LiveAvatarLoopConfig()
