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
from kernels.attention_cudnn_fp8 import attention_cudnn_fp8, attention_fp8_tensor, attention_fp8_tensor_ref
from kernels.attention_fp8 import attention_fp8, attention_fp8_ref, attention_fp8_triton
from kernels.cross_attention_fp8 import cross_attention_fp8, cross_attention_fp8_ref, cross_attention_fp8_triton
from kernels.fp8 import FP8, Fp8Act, fp8_linear, fp8_linear_ref, quantize_rows, quantize_rows_ref, quantize_weight
from kernels.qkv_prep import QKVPrepBackend, qkv_prep, qkv_prep_ref, qkv_prep_triton, rms_norm_ref, rope_ref
from kernels.qkv_prep_fp8 import qk_scale_bound, qkv_prep_fp8, qkv_prep_fp8_ref, qkv_prep_fp8_triton
from kernels.row_quant import row_quant, row_quant_ref, row_quant_triton

__all__ = [
    "ATTENTION_BACKENDS",
    "FP8",
    "AttentionBackend",
    "Fp8Act",
    "QKVPrepBackend",
    "attention",
    "attention_cudnn_fp8",
    "attention_fp8",
    "attention_fp8_ref",
    "attention_fp8_tensor",
    "attention_fp8_tensor_ref",
    "attention_fp8_triton",
    "attention_ref",
    "available_backends",
    "cross_attention_fp8",
    "cross_attention_fp8_ref",
    "cross_attention_fp8_triton",
    "fp8_linear",
    "fp8_linear_ref",
    "pick_backend",
    "qk_scale_bound",
    "qkv_prep",
    "qkv_prep_fp8",
    "qkv_prep_fp8_ref",
    "qkv_prep_fp8_triton",
    "qkv_prep_ref",
    "qkv_prep_triton",
    "quantize_rows",
    "quantize_rows_ref",
    "quantize_weight",
    "rms_norm_ref",
    "rope_ref",
    "row_quant",
    "row_quant_ref",
    "row_quant_triton",
]
