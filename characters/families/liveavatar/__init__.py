"""LiveAvatar (Alibaba-Quark/LiveAvatar: Wan2.2-S2V-14B with its streaming LoRA), a model family: its config,
transformer, audio path, streaming loop, VAE on the shared decoder, and checkpoint mappings. Parity with the
authors' code is tested against golden tensors their code produced (scripts/liveavatar/).

The encoders that need the `liveavatar` extra (transformers) are imported from their modules:
`characters.families.liveavatar.text` (umT5) and `characters.families.liveavatar.speech` (wav2vec2)."""

from characters.families.liveavatar.checkpoint import CheckpointError, load_liveavatar
from characters.families.liveavatar.config import LiveAvatarConfig, LiveAvatarDiTConfig, LiveAvatarLoopConfig
from characters.families.liveavatar.dit import LiveAvatarDiT
from characters.families.liveavatar.loop import LiveAvatarStream
from characters.families.liveavatar.vae import (
    LIVEAVATAR_VAE,
    WanEncoder,
    load_wan_vae,
    motion_latents,
    prime_decoder,
    reference_latents,
)

__all__ = [
    "LIVEAVATAR_VAE",
    "CheckpointError",
    "LiveAvatarConfig",
    "LiveAvatarDiT",
    "LiveAvatarDiTConfig",
    "LiveAvatarLoopConfig",
    "LiveAvatarStream",
    "WanEncoder",
    "load_liveavatar",
    "load_wan_vae",
    "motion_latents",
    "prime_decoder",
    "reference_latents",
]
