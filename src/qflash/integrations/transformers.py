"""qflash's attention inside Hugging Face ``transformers`` models.

    import qflash.integrations.transformers as qflash_hf

    qflash_hf.register()  # once per process: adds attn_implementation="qf_attention"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="qf_attention", dtype=torch.bfloat16)
    model.set_attn_implementation("qf_attention")  # or switch a model already loaded

Every attention layer of the model then calls ``attention_forward`` where it called PyTorch's
SDPA, with the same arguments, and transformers builds the same masks as for "sdpa": none when
the causal flag says everything (then the kernel masks by position), else a boolean mask (True =
attend) of padding, sliding windows or packed sequences, which the kernel reads tile by tile.
Inference (prefill and decoding with any cache) and training (gradients and attention dropout),
grouped-query heads, sliding windows, logit soft-capping (Gemma 2), learned position biases
added to the scores (T5), which get their gradients through ``qflash.sdpa``'s float mask, a
value head dim other than the query's (DeepSeek's MLA), zero-padded to one (exact), and
attention sinks (gpt-oss's ``s_aux``: a learned score a head, with its gradient).

``output_attentions=True`` returns no attention weights, as with "sdpa".

The name has neither "flash" nor "sdpa" in it: transformers takes a name with "flash" in it for a
flash-attn package (unpadded inputs, a kernel looked up by that name), and one with "sdpa" only
for models that declare SDPA support (Gemma 2, whose soft-capping SDPA cannot do, does not).
"""

from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch

NAME = "qf_attention"


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    **kwargs,
) -> Tuple[torch.Tensor, None]:
    """transformers' attention function: ``query`` (batch, heads, seqlen_q, headdim), ``key`` and
    ``value`` (batch, heads_kv, seqlen_k, headdim), ``attention_mask`` boolean (True = attend) or
    additive, broadcastable to (batch, heads, seqlen_q, seqlen_k), or None. Returns (output
    (batch, seqlen_q, heads, headdim), None).

    Without a mask the causal flag (``is_causal``, else the module's own) aligns queries and keys
    top-left, as transformers' SDPA path does: query i sees keys j <= i. Keys past seqlen_q are
    then empty slots of a static cache (prefill) and are left out, as there::

        seqlen_q = 3, seqlen_k = 5      keys  0 1 2 | 3 4 (empty slots)
                              query 0         x . . | . .
                              query 1         x x . | . .
                              query 2         x x x | . .

    A single query (decoding) sees every key: transformers passes a mask wherever it must not.
    """
    from qflash.ops.attention import autocast_inputs, flash_attn_func, pad_head_dims, sdpa

    sinks = kwargs.get("s_aux")  # gpt-oss: a score a query head beside the keys (value zero)
    if kwargs.get("output_attentions", False):
        warnings.warn("qflash attention returns no attention weights (output_attentions=True)", stacklevel=2)
    # Under autocast with float32 weights, rotary embeddings leave query and key in float32 beside a
    # 16-bit value; SDPA gets all three in autocast's dtype, and so do the kernels.
    query, key, value = autocast_inputs(query, key, value)
    headdim_v = value.shape[-1]
    if headdim_v != query.shape[-1]:  # MLA (DeepSeek): value's head dim of its own, zero-padded (exact)
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        query, key, value = pad_head_dims(query, key, value)
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:  # T5: one float mask of bias and mask together (as transformers' SDPA path)
        attention_mask = _with_position_bias(position_bias, attention_mask, bool(causal) and q_len > 1, query, key)
    if attention_mask is None:
        causal = bool(causal) and q_len > 1
        if causal and kv_len > q_len:
            key, value = key[:, :, :q_len], value[:, :, :q_len]
            kv_len = q_len
        # transformers' sliding window: query i sees keys i - window < j (<= i when causal).
        window = (sliding_window - 1, sliding_window - 1) if sliding_window and kv_len > sliding_window else (-1, -1)
        out = flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), dropout_p=dropout,
                              softmax_scale=scaling, causal=causal, window_size=window, softcap=softcap or 0.0,
                              sinks=sinks)
        return out[..., :headdim_v], None  # (batch, seqlen_q, heads, headdim_v)
    mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask.to(query.dtype)
    out = sdpa(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
               enable_gqa=key.shape[1] != query.shape[1], softcap=softcap or 0.0, sinks=sinks)
    return out.transpose(1, 2)[..., :headdim_v], None  # a view of the kernel's (batch, seqlen_q, heads, headdim)


def _with_position_bias(position_bias: torch.Tensor, attention_mask: Optional[torch.Tensor], causal: bool,
                        query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The additive mask of a position bias (batch or 1, heads, seqlen_q, seqlen_k) and a mask:
    -inf where the mask (or, without one, the top-left causal order) hides a key."""
    if attention_mask is None:
        if not causal:
            return position_bias
        from qflash.reference.attention import visible_mask

        attention_mask = visible_mask(query.shape[2], key.shape[2], causal=True, bottom_right=False,
                                      device=query.device)
    if attention_mask.dtype == torch.bool:
        return position_bias.masked_fill(~attention_mask, float("-inf"))
    return position_bias + attention_mask


def register(name: str = NAME) -> str:
    """Registers ``attention_forward`` with transformers as ``attn_implementation=name`` (and, where
    transformers has the registry, the masks it builds for "sdpa"). Calling it again does no harm.
    Returns the name. Raises ImportError without transformers (``pip install 'qflash[integrations]'``)."""
    try:
        from transformers import AttentionInterface
    except ImportError as err:
        raise ImportError("qflash.integrations.transformers needs transformers >= 4.48 "
                          "(pip install 'qflash[integrations]')") from err
    AttentionInterface.register(name, attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # before 4.53 transformers made the masks inside each model
        pass
    else:
        AttentionMaskInterface.register(name, sdpa_mask)
    return name
