"""The character model and the single-session engine (no Ray here).

Public API: configs and presets, the engine pieces that Ray actors wrap, and the demo.
"""

from characters.config import (
    MODEL_PRESETS,
    TOPOLOGIES,
    AudioConfig,
    DiTConfig,
    GenerationConfig,
    ModelConfig,
    SessionConfig,
    TopologyConfig,
    VAEConfig,
    model_preset,
    session_config,
)
from characters.engine import CharacterEngine, DecoderRunner, DiTRunner, ReferenceEncoder

__all__ = [
    "MODEL_PRESETS",
    "TOPOLOGIES",
    "AudioConfig",
    "CharacterEngine",
    "DecoderRunner",
    "DiTConfig",
    "DiTRunner",
    "GenerationConfig",
    "ModelConfig",
    "ReferenceEncoder",
    "SessionConfig",
    "TopologyConfig",
    "VAEConfig",
    "model_preset",
    "session_config",
]
