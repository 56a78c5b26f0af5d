"""Kernels for the DiT's hot path, each beside its plain PyTorch reference (the CPU path).

No Ray and nothing from `characters/` is imported here: the model depends on kernels, never the reverse.
"""

from kernels.attention import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    attention,
    attention_ref,
    available_backends,
    pick_backend,
)
from kernels.qkv_prep import QKVPrepBackend, qkv_prep, qkv_prep_ref, qkv_prep_triton, rms_norm_ref, rope_ref

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "QKVPrepBackend",
    "attention",
    "attention_ref",
    "available_backends",
    "pick_backend",
    "qkv_prep",
    "qkv_prep_ref",
    "qkv_prep_triton",
    "rms_norm_ref",
    "rope_ref",
]
