"""Pure-PyTorch references: what a correct answer is. Never imports triton."""

from qflash.reference.matmul import fp8_matmul_ref, int8_matmul_ref
from qflash.reference.quantize import dequantize_ref, quantize_ref

from qflash.reference.attention import (
    alibi_bias,
    attention_kvcache_ref,
    attention_ref,
    attention_varlen_ref,
    online_softmax_attention,
    sdpa_ref,
    visible_mask,
)

__all__ = [
    "dequantize_ref",
    "fp8_matmul_ref",
    "int8_matmul_ref",
    "quantize_ref",
    "alibi_bias",
    "attention_kvcache_ref",
    "attention_ref",
    "attention_varlen_ref",
    "online_softmax_attention",
    "sdpa_ref",
    "visible_mask",
]
