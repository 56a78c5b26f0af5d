"""LiveAvatar end to end on one device: a snapshot folder as `characters weights fetch liveavatar` lays it out ->
an avatar (reference and motion latents, prompt states: computed once) -> video blocks from speech, decoded by
the shared decoder as a stream. What the serving path will run per session, in one process (offline generation,
quality checks on a user's own clips).

    pipe = LiveAvatarPipeline.from_snapshot("ckpt", device="cuda")
    avatar = pipe.avatar(image_rgb, prompt)            # once per avatar
    for frames in pipe.frames(avatar, pcm_16k):        # (12, H, W, 3) uint8 per 480 ms block
        ...
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from characters.config import VAEConfig
from characters.families.liveavatar.checkpoint import LORA_FILE, load_liveavatar
from characters.families.liveavatar.config import LiveAvatarDiTConfig, LiveAvatarLoopConfig, size_for_area
from characters.families.liveavatar.dit import LiveAvatarDiT
from characters.families.liveavatar.hub import BASE, LORA
from characters.families.liveavatar.loop import LiveAvatarStream
from characters.families.liveavatar.vae import (
    LIVEAVATAR_VAE,
    load_wan_vae,
    motion_latents,
    prime_decoder,
    reference_latents,
)

WAV2VEC = "wav2vec2-large-xlsr-53-english"
# config.json keys of the published transformer that our config takes (the rest are training or unused switches)
_CONFIG_KEYS = ("num_layers", "dim", "num_heads", "ffn_dim", "freq_dim", "text_dim", "text_len", "audio_dim",
                "cond_dim", "eps")


def dit_config(snapshot: Path) -> LiveAvatarDiTConfig:
    """The transformer's config from the snapshot's config.json (diffusers' layout), defaults where it is silent;
    the audio layers it averages are the wav2vec2's hidden states (its layers + the CNN projection)."""
    raw: dict[str, Any] = json.loads((snapshot / "config.json").read_text())
    fields: dict[str, Any] = {k: raw[k] for k in _CONFIG_KEYS if k in raw}
    wav = snapshot / WAV2VEC / "config.json"
    if wav.exists():
        fields["audio_layers"] = json.loads(wav.read_text())["num_hidden_layers"] + 1
    layers = fields.get("num_layers", LiveAvatarDiTConfig().num_layers)
    if "audio_inject_layers" in raw:
        fields["audio_inject_layers"] = tuple(i for i in raw["audio_inject_layers"] if i < layers)
    return LiveAvatarDiTConfig(**fields)


@dataclass
class Avatar:
    """What a session needs of an avatar, computed once: its latents and its prompt's umT5 states."""

    reference: torch.Tensor  # (C, 1, h, w)
    motion: torch.Tensor  # (C, 19, h, w)
    text: torch.Tensor  # (Lt, text_dim)
    size: tuple[int, int]  # frame (H, W)


class LiveAvatarPipeline:
    def __init__(self, dit: LiveAvatarDiT, vae: tuple[Any, Any], text: Any, speech: Any, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, max_area: int = 720 * 400,
                 loop: LiveAvatarLoopConfig | None = None) -> None:
        self.dit, (self.decoder, self.encoder), self.text, self.speech = dit, vae, text, speech
        self.device, self.dtype, self.max_area, self.loop = torch.device(device), dtype, max_area, loop

    @classmethod
    def from_snapshot(cls, root: Path | str, *, device: torch.device | str = "cpu",
                      dtype: torch.dtype = torch.bfloat16, text_config: Any = None,
                      vae_config: VAEConfig = LIVEAVATAR_VAE, **kwargs: Any) -> LiveAvatarPipeline:
        """Every part from `root/Wan2.2-S2V-14B` and `root/LiveAvatar` (the LoRA, merged at load)."""
        from characters.families.liveavatar.speech import SpeechEncoder
        from characters.families.liveavatar.text import PromptEncoder

        root = Path(root)
        base, lora = root / BASE.folder, root / LORA.folder / LORA_FILE
        with torch.device("meta"):
            dit = LiveAvatarDiT(dit_config(base))
        dit = dit.to_empty(device=device).to(dtype)
        load_liveavatar(dit, base, lora=lora if lora.exists() else None, dtype=dtype)
        vae = load_wan_vae(base / "Wan2.1_VAE.pth", vae_config, device=device, dtype=dtype)
        text = PromptEncoder.from_snapshot(base, device=device, dtype=dtype,
                                           **({"config": text_config} if text_config is not None else {}))
        speech = SpeechEncoder(base / WAV2VEC, device=device, dtype=dtype)
        return cls(dit.eval(), vae, text, speech, device=device, dtype=dtype, **kwargs)

    @torch.no_grad()
    def avatar(self, image: np.ndarray, prompt: str) -> Avatar:
        """(H0, W0, 3) uint8 RGB -> the avatar at the size the authors' pipeline picks for that picture (resized
        to cover, centre-cropped, as their transforms do)."""
        from PIL import Image

        if self.loop is not None:
            h, w = self.loop.height, self.loop.width
        else:
            h, w = size_for_area(image.shape[0], image.shape[1], self.max_area)
        im = Image.fromarray(image)
        scale = max(h / im.height, w / im.width)
        im = im.resize((max(w, round(im.width * scale)), max(h, round(im.height * scale))), Image.Resampling.BILINEAR)
        left, top = (im.width - w) // 2, (im.height - h) // 2
        arr = np.asarray(im.crop((left, top, left + w, top + h)), dtype=np.float32) / 127.5 - 1.0
        x = torch.from_numpy(arr).permute(2, 0, 1)[None].to(self.device, self.dtype)  # (1, 3, H, W)
        return Avatar(reference_latents(self.encoder, x)[0], motion_latents(self.encoder, x)[0],
                      self.text.encode(prompt).to(self.dtype), (h, w))

    @torch.no_grad()
    def frames(self, avatar: Avatar, pcm: np.ndarray, seed: int = 420) -> Iterator[np.ndarray]:
        """Video for 16 kHz speech, a block of 12 frames (uint8 (12, H, W, 3)) at a time, as it is made."""
        h, w = avatar.size
        loop = self.loop or LiveAvatarLoopConfig(height=h, width=w)
        feats = self.speech.clip_features(pcm, frames_per_clip=loop.blocks_per_clip * loop.video_frames_per_block)
        stream = LiveAvatarStream(self.dit, loop, random.Random(seed))
        stream.start(avatar.reference, avatar.motion, avatar.text)
        state = self.decoder.init_state(1, h // 8, w // 8, self.device, self.dtype)
        prime_decoder(self.decoder, state, avatar.motion[None])
        f, per_clip, vf = loop.frames_per_block, loop.blocks_per_clip, loop.video_frames_per_block
        blocks = feats.shape[-1] // vf
        noise = torch.empty(0)
        for k in range(blocks):
            r, b = divmod(k, per_clip)
            if b == 0:  # a clip's noise, as their loop draws it (seed + clip)
                gen = torch.Generator(device=self.device).manual_seed(seed + r)
                noise = torch.randn(self.dit.cfg.latent_channels, f * per_clip, h // 8, w // 8, generator=gen,
                                    device=self.device)
            latents = stream.block(noise[:, b * f:(b + 1) * f], feats[..., k * vf:(k + 1) * vf].to(self.device))
            video = self.decoder.decode_chunk(latents[None].to(self.dtype), state)  # (1, 3, 12, H, W) in [-1, 1]
            yield ((video[0].float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 3, 0).cpu().numpy()
