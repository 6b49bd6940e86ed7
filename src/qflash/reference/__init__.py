"""Pure-PyTorch references: what a correct answer is. Never imports triton."""

from qflash.reference.attention import (
    alibi_bias,
    attention_ref,
    attention_varlen_ref,
    online_softmax_attention,
    sdpa_ref,
    visible_mask,
)

__all__ = [
    "alibi_bias",
    "attention_ref",
    "attention_varlen_ref",
    "online_softmax_attention",
    "sdpa_ref",
    "visible_mask",
]
