"""LiveAvatar (Alibaba-Quark/LiveAvatar: Wan2.2-S2V-14B with its streaming LoRA), a model family: its config,
transformer, audio path, streaming loop and checkpoint mapping. Parity with the authors' code is tested
against golden tensors their code produced (scripts/liveavatar/)."""

from characters.families.liveavatar.config import LiveAvatarConfig, LiveAvatarDiTConfig, LiveAvatarLoopConfig
from characters.families.liveavatar.dit import LiveAvatarDiT
from characters.families.liveavatar.loop import LiveAvatarStream

__all__ = ["LiveAvatarConfig", "LiveAvatarDiT", "LiveAvatarDiTConfig", "LiveAvatarLoopConfig", "LiveAvatarStream"]
