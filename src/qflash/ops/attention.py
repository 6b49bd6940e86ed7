"""Public attention ops: flash-attn 2's functions and ``F.scaled_dot_product_attention``.

Every entry point validates its arguments, normalizes them to one form and calls
the Triton launcher: eagerly through a ``torch.autograd.Function`` (without gradients on a GPU,
the launches of an earlier call of the same kind replayed: ``kernels/replay.py``), and under
``torch.compile`` through the custom op ``qflash::attention_forward`` (with a fake
implementation for shapes), which lets ``torch.compile(fullgraph=True)`` take these
functions whole. CUDA graphs capture either path.

Two causal alignments exist and both are supported::

    flash_attn_func(causal=True): bottom-right      sdpa(is_causal=True): top-left
    query i sees keys j <= i + Sk - Sq               query i sees keys j <= i

    Sq = 2, Sk = 4:                                  Sq = 2, Sk = 4:
         k0 k1 k2 k3                                      k0 k1 k2 k3
    q0    x  x  x  .                                 q0    x  .  .  .
    q1    x  x  x  x                                 q1    x  x  .  .

Gradients flow to q, k and v (and through the packed forms to qkv / kv); the
log-sum-exp output is not differentiated, as in flash-attn; a float ``attn_mask`` that
requires grad gets the gradient of the scores (summed over what it was broadcast along).
Dropout draws its mask in the kernel from a counter-based generator and regenerates it in the
backward pass.
"""

from __future__ import annotations

import math
import operator
from typing import Optional, Sequence, Tuple

import torch

from qflash.kernels.replay import Replays
from qflash.ops.common import debug_enabled, on_device_of, require_runnable, require_tensor, through_custom_op

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "sdpa",
]

MAX_HEADDIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # float64: for gradient checks
# ----------------------------------------------------------------------------------------------
# Launch paths. The launchers are reached three ways that share one forward, one setup_context and
# one backward function:
#   eager:          _Attention (torch.autograd.Function) -> launchers, a few microseconds of Python;
#   eager, no grad: the launchers, their launches replayed on a GPU (_EAGER_FORWARDS);
#   torch.compile:  the custom ops qflash::attention_forward / _backward, with fake
#                   implementations for shapes and autograd registered on the forward op.
# The custom ops' dispatch costs tens of microseconds a call, as much as a short kernel runs, so
# eager calls skip it; under torch.compile the ops are what the graph records.
# ----------------------------------------------------------------------------------------------
def _attention_forward_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    dropout_seed: int,
    deterministic: bool,
    sinks: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    from qflash.kernels.attention import AttnOptions, attention_forward

    with on_device_of(q):
        return attention_forward(q, k, v, AttnOptions(
            softmax_scale, window_left, window_right, bottom_right, softcap, alibi_slopes, bias,
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, dropout_seed, deterministic,
            sinks=sinks))


def _attention_backward_impl(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    dropout_seed: int,
    deterministic: bool,
    bias_grad: bool,
    sinks: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dbias, dsinks); dbias has no elements unless ``bias_grad``, dsinks none without
    sinks (a custom op returns tensors)."""
    from qflash.kernels.attention import AttnOptions, attention_backward

    with on_device_of(q):
        dq, dk, dv, dbias, dsinks = attention_backward(dout, q, k, v, out, lse, AttnOptions(
            softmax_scale, window_left, window_right, bottom_right, softcap, alibi_slopes, bias,
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, dropout_seed, deterministic,
            sinks=sinks), bias_grad=bias_grad)
    return dq, dk, dv, dbias if dbias is not None else q.new_empty(0), dsinks if dsinks is not None else q.new_empty(0)


# Where the inputs besides q, k, v with a gradient stand among the forward op's 18: the bias
# (qflash.sdpa's attn_mask) and the attention sinks; and dropout's probability.
_BIAS = 9
_DROPOUT_P = 14
_SINKS = 17
_NUM_INPUTS = 18

_attention_forward_op = torch.library.custom_op("qflash::attention_forward", mutates_args=())(
    _attention_forward_impl)
_attention_backward_op = torch.library.custom_op("qflash::attention_backward", mutates_args=())(
    _attention_backward_impl)


def _empty_outputs(q: torch.Tensor, varlen: bool):
    """(out, lse) as the forward launcher makes them, empty: shapes for fake and meta tensors. lse
    is (heads, total_q) for packed q, else (batch, heads, seqlen_q), in float32 (float64 for
    float64 q)."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if varlen:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dtype)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=lse_dtype)
    return out, lse


@_attention_forward_op.register_fake
def _(q, k, v, softmax_scale, window_left, window_right, bottom_right, softcap,
      alibi_slopes, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, dropout_seed,
      deterministic, sinks):
    return _empty_outputs(q, varlen=cu_seqlens_q is not None)


@_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, window_left, window_right, bottom_right, softcap, alibi_slopes, bias,
      *args):
    bias_grad, sinks = args[-2:]
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            bias.new_empty(bias.shape) if bias_grad else q.new_empty(0),
            sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty(0))


def _setup_context(ctx, inputs, output):
    (q, k, v, softmax_scale, window_left, window_right, bottom_right, softcap,
     alibi_slopes, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, dropout_seed,
     deterministic, sinks) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, bias, cu_seqlens_q, cu_seqlens_k, sinks)
    ctx.options = (softmax_scale, window_left, window_right, bottom_right, softcap)
    # An additive mask that requires grad (qflash.sdpa) gets the gradient of the scores.
    ctx.rest = (max_seqlen_q, max_seqlen_k, dropout_p, dropout_seed, deterministic, ctx.needs_input_grad[_BIAS])


def _backward(ctx, dout, dlse):
    # lse is returned for inspection, not differentiated (as in flash-attn): dlse is ignored.
    q, k, v, out, lse, alibi_slopes, bias, cu_seqlens_q, cu_seqlens_k, sinks = ctx.saved_tensors
    if dout.dtype != out.dtype or dout.shape != out.shape:
        raise TypeError(f"the gradient of the attention output (dout) must match the output: expected "
                        f"{out.dtype} {tuple(out.shape)}, got {dout.dtype} {tuple(dout.shape)}")
    # Traced (torch.compile's joint graph: fake, functional tensors, where torch 2.11 does not say it is
    # compiling) or on meta tensors, the backward is the opaque op; eager, the launcher itself.
    traced = through_custom_op(dout) or type(dout) is not torch.Tensor
    backward = torch.ops.qflash.attention_backward if traced else _attention_backward_impl
    dq, dk, dv, dbias, dsinks = backward(_unit_last_stride(dout), q, k, v, out, lse, *ctx.options, alibi_slopes,
                                         bias, cu_seqlens_q, cu_seqlens_k, *ctx.rest, sinks)
    grads = [dq, dk, dv] + [None] * (_NUM_INPUTS - 3)
    grads[_BIAS] = dbias if ctx.rest[-1] else None
    grads[_SINKS] = dsinks if ctx.needs_input_grad[_SINKS] else None
    return tuple(grads)


_attention_forward_op.register_autograd(_backward, setup_context=_setup_context)


class _Attention(torch.autograd.Function):
    """The eager path: the same forward, context and backward as the custom op's autograd."""

    @staticmethod
    def forward(ctx, *inputs):
        # ctx in forward, not a separate setup_context: that form binds every call's arguments
        # through inspect.signature, ~50 microseconds.
        output = _attention_forward_impl(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    backward = staticmethod(_backward)


# Eager forwards without gradients on a GPU (decoding: every layer of a step calls with the same
# shapes) replay the launches of an earlier call of their kind, as QuantizedLinear does: a
# forward's checks, plan and launches cost a decode step a few hundred microseconds of Python.
# A growing cache gives each step a new kind, which its first layer records at once where the
# step before replayed (record_after_replay); the step's other layers replay it.
_EAGER_FORWARDS = Replays(record_after_replay=True)


def _attention(*args) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) through the custom op under torch.compile and on meta tensors (its fake
    implementation: shapes only), through ``_Attention`` where a gradient is wanted, and otherwise
    through the launchers, replayed on a GPU (``_EAGER_FORWARDS``) but where dropout draws a new
    mask."""
    if through_custom_op(args[0]):
        return torch.ops.qflash.attention_forward(*args)
    differentiable = (*args[:3], args[_BIAS], args[_SINKS])
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in differentiable):
        return _Attention.apply(*args)
    if args[0].is_cuda and not args[_DROPOUT_P]:
        return _EAGER_FORWARDS(_attention_forward_impl, args)
    return _attention_forward_impl(*args)


# ----------------------------------------------------------------------------------------------
# Validation shared by every entry point.
# ----------------------------------------------------------------------------------------------
def _check_tensors(names: Sequence[str], tensors: Sequence[torch.Tensor], ndim: int, what: str) -> None:
    for name, t in zip(names, tensors):
        require_tensor(name, t, ndim, what)
    q = tensors[0]
    if q.dtype not in _DTYPES:
        raise TypeError(f"{names[0]} must be float16, bfloat16, float32 or float64, got {q.dtype}")
    for name, t in zip(names[1:], tensors[1:]):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {names[0]} has {q.dtype}: they must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but {names[0]} is on {q.device}: they must match")
    require_runnable(names[0], q)


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    # The kernel reads rows of headdim contiguous elements; any other stride is fine.
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_heads(k: torch.Tensor, v: torch.Tensor, heads: int, heads_kv: int, headdim: int,
                 names: Tuple[str, str] = ("k", "v")) -> None:
    if k.shape != v.shape:
        raise ValueError(
            f"{names[0]} and {names[1]} must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    headdim_k = headdim_v = k.shape[-1]
    if heads < 1 or heads_kv < 1:
        raise ValueError(f"attention needs at least one head: got {heads} query and {heads_kv} key/value heads")
    if heads % heads_kv != 0:
        raise ValueError(f"number of query heads ({heads}) must be a multiple of key/value heads ({heads_kv})")
    if headdim_k != headdim or headdim_v != headdim:
        raise ValueError(f"q, k and v must share the head dimension, got {headdim}, {headdim_k}, {headdim_v}")
    if not 1 <= headdim <= MAX_HEADDIM:
        raise ValueError(f"head dimension must be between 1 and {MAX_HEADDIM}, got {headdim}")


def _window(window_size, causal: bool) -> Tuple[int, int]:
    try:
        left, right = window_size
        left, right = operator.index(left), operator.index(right)  # ints, not floats that int() would cut
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair of ints (left, right), got {window_size!r}") from None
    for side, w in (("left", left), ("right", right)):
        if w < -1:
            raise ValueError(f"window_size {side} must be >= 0, or -1 for unbounded; got {w}")
    if causal:
        right = 0
    return left, right


def _as_float(value) -> float:
    """``float(value)``, or NaN where it has none (which the callers' finiteness checks refuse)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _scale(softmax_scale, headdim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    scale = _as_float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return scale


def _sdpa_scale(query: torch.Tensor, scale, headdim: int) -> Tuple[torch.Tensor, float]:
    """(query, scale) for the kernels, which take a positive scale (they subtract each row's
    maximum of the raw products before scaling). PyTorch takes any finite scale: a negative one is
    its magnitude on -query, and zero makes every score 0 before the mask: query * 0 at scale 1.
    Either costs a copy of query; the gradient reaches the original through it."""
    if scale is None:
        return query, 1.0 / math.sqrt(headdim)
    value = _as_float(scale)
    if not math.isfinite(value):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if value > 0:
        return query, value
    return (-query, -value) if value < 0 else (query * 0, 1.0)


def autocast_inputs(*tensors: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
    """The tensors as PyTorch's autocast hands them to ``F.scaled_dot_product_attention`` (one of
    its lower-precision ops): where autocast is on for the first one's device type, floating tensors other
    than float64 go in its dtype (a copy where they are not already); otherwise as they are."""
    device_type = tensors[0].device.type
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in tensors)


def _dropout(dropout_p) -> Tuple[float, int]:
    """Validated dropout probability and a fresh seed for its mask.

    The seed comes from PyTorch's default CPU generator, so ``torch.manual_seed`` makes
    the mask reproducible; the backward pass regenerates the same mask from it.
    """
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    seed = int(torch.randint(0, 2**31 - 1, ())) if p > 0 else 0
    return p, seed


def _check_softcap(softcap) -> float:
    softcap = float(softcap)
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 disables it), got {softcap}")
    return softcap


def _check_alibi(alibi_slopes, batch: int, heads: int, device) -> Optional[torch.Tensor]:
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a tensor of shape (heads,) or (batch, heads), got "
                        f"{type(alibi_slopes).__name__}")
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(
            f"alibi_slopes must have shape ({heads},) or ({batch}, {heads}), got {tuple(alibi_slopes.shape)}"
        )
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device}, expected {device}")
    if not alibi_slopes.dtype.is_floating_point:
        raise TypeError(f"alibi_slopes must be floating point, got {alibi_slopes.dtype}")
    return alibi_slopes.to(torch.float32)


def _check_sinks(sinks, heads: int, device) -> Optional[torch.Tensor]:
    """Attention sinks: None, or a floating (heads,) tensor on the inputs' device, one score a query head."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must be a floating tensor of shape ({heads},) (a score a query head), got "
                         f"{_shape(sinks)}")
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {device}: they must match")
    return sinks.contiguous()


def _finish(out, lse, return_attn_probs: bool):
    if return_attn_probs:
        # flash-attn returns (out, softmax_lse, S_dmask); qflash never materializes the
        # probabilities, so the third item is None.
        return out, lse, None
    return out


# ----------------------------------------------------------------------------------------------
# flash-attn 2 API, dense (batch, seqlen, heads, headdim).
# ----------------------------------------------------------------------------------------------
def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    sinks: Optional[torch.Tensor] = None,
):
    """Exact attention, a drop-in for ``flash_attn.flash_attn_func``.

    Args:
        q: (batch, seqlen_q, heads, headdim), float16 / bfloat16 / float32.
        k, v: (batch, seqlen_k, heads_kv, headdim); heads % heads_kv == 0 (MQA / GQA).
            Any strides with a unit last stride; nothing is copied.
        dropout_p: probability of dropping each attention probability (training); the mask is
            drawn in the kernel from a seed taken from PyTorch's CPU generator and regenerated
            in the backward pass, never stored.
        softmax_scale: defaults to 1 / sqrt(headdim).
        causal: mask aligned bottom-right: query i sees keys j <= i + seqlen_k - seqlen_q.
        window_size: (left, right); query i sees keys in
            [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right], -1 = unbounded.
        softcap: > 0 applies ``softcap * tanh(scores / softcap)`` before the softmax.
        alibi_slopes: (heads,) or (batch, heads) fp32; adds ``-slope * |i + Sk - Sq - j|``.
        deterministic: bitwise-identical gradients from run to run. The tl backward always is.
            On Hopper (``bwd_preferred``) the default backward is the Gluon one
            (``attention_gluon.py``), whose dQ sums arrive in any order at head dims 64 and
            128, as flash-attn's do by default; there ``deterministic=True`` or
            ``torch.use_deterministic_algorithms(True)`` keeps a call on the tl kernels. At
            head dim 256 the Gluon backward sums in a fixed order and takes such calls too.
        return_attn_probs: also return the log-sum-exp (and None in place of probabilities).
        sinks: (heads,) attention sinks (gpt-oss; ``s_aux`` in vLLM's flash-attn, ``learnable_sink``
            in flash-attn 4): a score a query head that each of its rows takes into the softmax
            beside the keys, with a value of zero, so that a row may give part of its weight to
            nothing; a floating tensor of any precision (the kernels read it in their accumulator's:
            float32, float64 for float64 inputs). With gradients where it requires grad. A NaN or
            +inf sink gives NaN rows, as in PyTorch.

    Returns:
        out (batch, seqlen_q, heads, headdim), or ``(out, softmax_lse, None)`` with
        ``softmax_lse`` (batch, heads, seqlen_q) float32, natural log (the sink's score among
        the terms). Rows that see no key give out = 0 and lse = +inf (the sink's score with one).
    """
    _check_tensors(("q", "k", "v"), (q, k, v), 4, "(batch, seqlen, heads, headdim)")
    batch, seqlen_q, heads, headdim = q.shape
    _check_heads(k, v, heads, k.shape[2], headdim)
    if k.shape[0] != batch:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {batch}")
    left, right = _window(window_size, causal)
    out, lse = _attention(
        _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v),
        _scale(softmax_scale, headdim), left, right, True, _check_softcap(softcap),
        _check_alibi(alibi_slopes, batch, heads, q.device), None, None, None, seqlen_q, k.shape[1],
        *_dropout(dropout_p), bool(deterministic), _check_sinks(sinks, heads, q.device),
    )
    return _finish(out, lse, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, sinks=None):
    """``flash_attn_func`` with kv packed as (batch, seqlen_k, 2, heads_kv, headdim)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must have shape (batch, seqlen_k, 2, heads_kv, headdim), got {_shape(kv)}")
    k, v = kv.unbind(dim=2)  # views; the gradient comes back as one stack (indexing: a zero-fill per part)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs, sinks)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                              sinks=None):
    """``flash_attn_func`` with qkv packed as (batch, seqlen, 3, heads, headdim)."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must have shape (batch, seqlen, 3, heads, headdim), got {_shape(qkv)}")
    q, k, v = qkv.unbind(dim=2)  # views; the gradient comes back as one stack (indexing: a zero-fill per part)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal,
                           window_size, softcap, alibi_slopes, deterministic, return_attn_probs, sinks)


def _shape(t):
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


# ----------------------------------------------------------------------------------------------
# flash-attn 2 API, packed variable-length sequences (total, heads, headdim).
# ----------------------------------------------------------------------------------------------
def _check_cu_seqlens(name: str, cu: torch.Tensor, batch: Optional[int], total: int,
                      device) -> Tuple[torch.Tensor, int]:
    """(cu, batch): cu made contiguous (the kernels read entry b at offset b), and its batch size."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (as flash-attn), got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(cu.shape)}")
    if batch is not None and cu.numel() != batch + 1:
        raise ValueError(f"{name} has {cu.numel()} entries but cu_seqlens_q has {batch + 1}: they must match")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device}, expected {device}")
    if debug_enabled() and not cu.is_meta:  # contents: a host sync, so only on request (meta has none)
        c = cu.cpu().long()
        if int(c[0]) != 0 or bool((c[1:] < c[:-1]).any()) or int(c[-1]) > total:
            raise ValueError(f"{name} must start at 0, never decrease and end at most at {total}, got {c.tolist()}")
    return cu.contiguous(), cu.numel() - 1


def _max_seqlen(name: str, value, total: int) -> int:
    """A validated max_seqlen, cut to the packed rows (no sequence is longer, and a larger value
    would only size a grid of idle programs)."""
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return min(value, total)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
):
    """Attention over packed sequences, a drop-in for ``flash_attn.flash_attn_varlen_func``.

    Args:
        q: (total_q, heads, headdim); k, v: (total_k, heads_kv, headdim).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,), cumulative sequence starts
            beginning at 0: sequence b is rows ``cu_seqlens[b] : cu_seqlens[b + 1]``.
            Their contents are read on the GPU, unchecked on the host (a check costs a
            sync; ``set_debug(True)`` makes it). Contents that leave the packed rows or
            go backwards never make a kernel read or write past the tensors: each
            sequence that the kernels see is wrong (an end past the rows, an end before
            its start, a start before the previous one) gives NaN outputs and gradients.
            The last sequence may end before the packed rows do (padding, as fixed-size
            buffers leave): query rows after it come out 0 with lse +inf, and they and the
            key rows after cu_seqlens_k[-1] get zero gradients (written by a small launch of
            their own, or by the split-key combine where that runs).
        max_seqlen_q: the longest query sequence (sizes the launch grid: a sequence longer
            than the value given comes out NaN; ``set_debug(True)`` checks).
        max_seqlen_k: the longest key sequence (sizes the backward pass's dK / dV grid: a
            sequence longer than it gets NaN dK and dV).
        block_table: None (k and v packed), or an int32 tensor (batch, pages a sequence): k
            and v are then a paged cache (num_pages, page_size, heads_kv, headdim) and sequence
            b's key j lies in row j % page_size of page block_table[b, j // page_size], its key
            count cu_seqlens_k[b + 1] - cu_seqlens_k[b] (a count past its pages, or a page
            outside the cache: NaN). Inference only: no dropout, no gradient (a clear error
            where one is asked for). One compile a page size.
        Other arguments as in ``flash_attn_func``, applied per sequence (causal is
        bottom-right within each sequence; alibi_slopes may be (batch, heads); sinks (heads,)
        the same for every sequence).

    Returns:
        out (total_q, heads, headdim), or ``(out, softmax_lse, None)`` with lse of shape
        (heads, total_q), float32.
    """
    if block_table is not None:
        return _finish(*_paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                      softmax_scale, causal, window_size, softcap, alibi_slopes, block_table, sinks),
                       return_attn_probs)
    _check_tensors(("q", "k", "v"), (q, k, v), 3, "(total, heads, headdim)")
    total_q, heads, headdim = q.shape
    _check_heads(k, v, heads, k.shape[1], headdim)
    cu_seqlens_q, batch = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, total_q, q.device)
    cu_seqlens_k, _ = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, batch, k.shape[0], q.device)
    max_seqlen_q = _max_seqlen("max_seqlen_q", max_seqlen_q, total_q)
    max_seqlen_k = _max_seqlen("max_seqlen_k", max_seqlen_k, k.shape[0])
    if debug_enabled() and not cu_seqlens_q.is_meta:
        for name, cu, given in (("max_seqlen_q", cu_seqlens_q, max_seqlen_q),
                                ("max_seqlen_k", cu_seqlens_k, max_seqlen_k)):
            longest = int((cu[1:] - cu[:-1]).max())
            if longest > given:
                raise ValueError(f"{name}={given} but the longest sequence has {longest} rows")
    left, right = _window(window_size, causal)
    out, lse = _attention(
        _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v),
        _scale(softmax_scale, headdim), left, right, True, _check_softcap(softcap),
        _check_alibi(alibi_slopes, batch, heads, q.device), None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, *_dropout(dropout_p), bool(deterministic), _check_sinks(sinks, heads, q.device),
    )
    return _finish(out, lse, return_attn_probs)


def _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                  window_size, softcap, alibi_slopes, block_table, sinks):
    """``flash_attn_varlen_func`` on a paged cache: the KV-cache forward with packed queries, each
    sequence's keys counted by cu_seqlens_k and found through its block-table row."""
    _check_tensors(("q",), (q,), 3, "(total, heads, headdim)")
    _check_tensors(("k", "v"), (k, v), 4, "(num_pages, page_size, heads_kv, headdim) with block_table")
    total_q, heads, headdim = q.shape
    _check_heads(k, v, heads, k.shape[2], headdim)
    if dropout_p != 0:
        raise ValueError(f"dropout_p must be 0 with block_table (a paged cache is read for inference), got {dropout_p}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, sinks) if t is not None):
        raise ValueError("block_table (a paged cache) is forward-only: call it under torch.no_grad() or with inputs "
                         "that do not require grad")
    for name, t in (("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit last stride with block_table, got strides {tuple(t.stride())}")
    cu_seqlens_q, batch = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, total_q, q.device)
    block_table = _check_block_table(block_table, None, batch, q.device)
    slots = k.shape[1] * block_table.shape[1]
    cu_seqlens_k, _ = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, batch, 2**31 - 1, q.device)
    max_seqlen_q = _max_seqlen("max_seqlen_q", max_seqlen_q, total_q)
    max_seqlen_k = _max_seqlen("max_seqlen_k", max_seqlen_k, slots)
    if debug_enabled() and batch and not q.is_meta:  # (the kernel counts each sequence's keys: negative, NaN)
        _check_cache_positions(cu_seqlens_k[1:] - cu_seqlens_k[:-1], None, None, k.shape[0], slots, block_table, 0,
                               k.shape[1])
    left, right = _window(window_size, causal)
    opts_args = (_scale(softmax_scale, headdim), left, right, True, _check_softcap(softcap),
                 _check_alibi(alibi_slopes, batch, heads, q.device))
    if q.is_meta:
        return _empty_outputs(q, varlen=True)
    from qflash.kernels.attention import AttnOptions, KVCache, attention_forward

    opts = AttnOptions(*opts_args, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                       max_seqlen_k=max_seqlen_k, kv_cache=KVCache(cu_seqlens_k, 0, None, None, block_table),
                       sinks=_check_sinks(sinks, heads, q.device))
    with torch.no_grad(), on_device_of(q):
        return attention_forward(_unit_last_stride(q), k, v, opts)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, sinks=None):
    """``flash_attn_varlen_func`` with kv packed as (total_k, 2, heads_kv, headdim)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError(f"kv must have shape (total_k, 2, heads_kv, headdim), got {_shape(kv)}")
    k, v = kv.unbind(dim=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs, sinks=sinks)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, sinks=None):
    """``flash_attn_varlen_func`` with qkv packed as (total, 3, heads, headdim)."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv must have shape (total, 3, heads, headdim), got {_shape(qkv)}")
    q, k, v = qkv.unbind(dim=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs, sinks=sinks)


# ----------------------------------------------------------------------------------------------
# PyTorch API: (batch, heads, seqlen, headdim), top-left causal, masks.
# ----------------------------------------------------------------------------------------------
def _per_sequence(name: str, value, batch: int, device, scalar: bool = True) -> torch.Tensor:
    """(batch,) int32 / int64: a tensor of that shape on ``device`` as it is, or an int (where
    ``scalar``: the same for every sequence) as int32."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in (torch.int32, torch.int64) or tuple(value.shape) != (batch,):
            raise ValueError(f"{name} must be {'an int or ' if scalar else ''}an int32 / int64 tensor of shape "
                             f"({batch},), got {value.dtype} {tuple(value.shape)}")
        if value.device != device:
            raise ValueError(f"{name} is on {value.device} but q is on {device}: they must match")
        return value.contiguous()  # the kernels read int32 and int64 as they are
    if not scalar:
        raise TypeError(f"{name} must be an int32 / int64 tensor of shape ({batch},), got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int or a tensor, got {value!r}") from None
    return torch.full((batch,), value, dtype=torch.int32, device=device)


def _check_block_table(block_table, cache_batch_idx, batch: int, device) -> torch.Tensor:
    if cache_batch_idx is not None:
        raise ValueError("cache_batch_idx and block_table cannot be given together: a paged cache's rows are its "
                         "block table's")
    if (not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2
            or block_table.shape[0] != batch or block_table.shape[1] == 0):
        raise ValueError(f"block_table must be an int32 tensor ({batch}, pages a sequence >= 1), got "
                         f"{_shape(block_table)}")
    if block_table.device != device:
        raise ValueError(f"block_table is on {block_table.device} but q is on {device}: they must match")
    return _unit_last_stride(block_table)


def _check_cache_positions(start, batch_idx, leftpad, cache_rows: int, last_start: int, block_table=None,
                           new: int = 0, page_size: int = 0) -> None:
    """set_debug(True): the per-sequence cache positions checked on the host (a sync)."""
    low, high = int(start.min()), int(start.max())
    if low < 0 or high > last_start:
        raise ValueError(f"cache_seqlens must lie in [0, {last_start}] (seqlen_cache - seqlen_new), "
                         f"got values from {low} to {high}")
    if batch_idx is not None and (int(batch_idx.min()) < 0 or int(batch_idx.max()) >= cache_rows):
        raise ValueError(f"cache_batch_idx must lie in [0, {cache_rows}) (the cache's rows), got values from "
                         f"{int(batch_idx.min())} to {int(batch_idx.max())}")
    if leftpad is not None and bool(((leftpad < 0) | (leftpad > start)).any()):
        raise ValueError("cache_leftpad must lie in [0, cache_seqlens[b]] for every sequence")
    if block_table is not None:  # the pages each sequence's keys touch
        pads = [0] * len(start) if leftpad is None else leftpad.tolist()
        for b, (first, end) in enumerate(zip(pads, (start + new).tolist())):
            used = block_table[b, first // page_size: -(-end // page_size)]
            if used.numel() and (int(used.min()) < 0 or int(used.max()) >= cache_rows):
                raise ValueError(f"block_table[{b}] names pages outside [0, {cache_rows}) (the cache's pages) for "
                                 f"its keys, from {int(used.min())} to {int(used.max())}")


def _check_rotary(rotary_cos, rotary_sin, k, q: torch.Tensor, slots: int, q_moves: bool) -> None:
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is None:
        return
    if k is None:
        raise ValueError("rotary_cos / rotary_sin rotate the new keys: they need k and v")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor (seqlen_ro, rotary_dim / 2), got {_shape(t)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}: they must match")
    if rotary_cos.shape != rotary_sin.shape:
        raise ValueError(f"rotary_cos and rotary_sin must have the same shape, got {tuple(rotary_cos.shape)} and "
                         f"{tuple(rotary_sin.shape)}")
    if not 1 <= 2 * rotary_cos.shape[1] <= q.shape[-1] or rotary_cos.shape[0] < slots:
        raise ValueError(f"rotary_cos must be (seqlen_ro >= seqlen_cache = {slots}, rotary_dim / 2 with rotary_dim "
                         f"<= headdim = {q.shape[-1]}), got {tuple(rotary_cos.shape)}")
    # q's rows at cache_seqlens[b] + i (causal, a window) reach past the cache's slots where q has
    # more rows than new keys: the table must hold the furthest one
    last = slots - k.shape[1] + q.shape[1]
    if q_moves and rotary_cos.shape[0] < last:
        raise ValueError(f"rotary_cos must have seqlen_ro >= {last} rows (seqlen_cache - seqlen_new + seqlen_q: q's "
                         f"rows sit at positions cache_seqlens[b] + i with causal or a window), got "
                         f"{tuple(rotary_cos.shape)}")


@torch.compiler.disable  # under torch.compile: run eagerly (a graph break), caches written in place
def _kvcache_forward(q, k_cache, v_cache, k, v, positions, options, rotary=None):
    """``flash_attn_with_kvcache``'s work on validated arguments: one launch rotates q and the new
    keys (``rotary``: cos, sin, interleaved) and writes the new rows into the caches, then the
    forward reads each sequence's slots of its cache row (``positions``: the per-sequence
    tensors of a ``KVCache``; a sequence whose positions do not fit gets NaN). Returns (out, lse
    (batch, heads, seqlen_q))."""
    if q.is_meta:  # shapes only, as the launcher's outputs would have them
        return _empty_outputs(q, varlen=False)
    args = (q, k_cache, v_cache, k, v, *positions, *options, *(rotary or (None, None, None)))
    if not q.is_cuda:
        return _kvcache_launch(*args)
    # Replayed as the eager forwards are (_EAGER_FORWARDS): a decode loop calls with one kind a layer
    return _EAGER_FORWARDS(_kvcache_launch, args)


def _kvcache_launch(q, k_cache, v_cache, k, v, start, batch_idx, leftpad, block_table, scale, left, right, softcap,
                    alibi_slopes, sinks, cos, sin, interleaved):
    """``_kvcache_forward``'s launches, on its arguments laid out flat."""
    from qflash.kernels.attention import AttnOptions, KVCache, attention_forward, kvcache_update

    cache = KVCache(start, 0 if k is None else k.shape[1], batch_idx, leftpad, block_table)
    with torch.no_grad(), on_device_of(q):
        if cos is not None or k is not None:
            rotary = None if cos is None else (cos, sin, interleaved)
            q = kvcache_update(q, k_cache, v_cache, k, v, cache, rotary, q_moves=left >= 0 or right >= 0)
        opts = AttnOptions(scale, left, right, True, softcap, alibi_slopes, kv_cache=cache, sinks=sinks)
        return attention_forward(q, k_cache, v_cache, opts)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens=None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    sinks: Optional[torch.Tensor] = None,
):
    """Attention of new query rows against a KV cache (decoding), a drop-in for
    ``flash_attn.flash_attn_with_kvcache``. Inference only: no gradient flows.

    Sequence b's queries see slots ``cache_leftpad[b]`` (0 by default) to ``cache_seqlens[b] +
    seqlen_new - 1`` of its cache row (``cache_batch_idx[b]``, or b), ``n_b`` keys, after the new
    keys ``k`` / ``v`` (if given) went in at ``cache_seqlens[b]``. Causal is aligned bottom-right
    to those keys: query i sees key j (counted from the first seen) when j <= i + n_b - seqlen_q::

        cache_leftpad[b] = 1, cache_seqlens[b] = 4, seqlen_new = 2, seqlen_q = 2:   n_b = 5
             pad c1 c2 c3 k0 k1 (unused slots)
        q0    .   x  x  x  x  .  .  .
        q1    .   x  x  x  x  x  .  .

    Args:
        q: (batch, seqlen_q, heads, headdim), float16 / bfloat16 / float32.
        k_cache, v_cache: (batch_cache, seqlen_cache, heads_kv, headdim), q's dtype, batch_cache =
            batch without cache_batch_idx; any strides with a unit last stride. Not copied. With
            ``block_table``: (num_pages, page_size, heads_kv, headdim), pages of any size.
        k, v: None, or the new keys and values (batch, seqlen_new, heads_kv, headdim), written
            **in place** into k_cache / v_cache at slots cache_seqlens[b] ... + seqlen_new - 1.
        cache_seqlens: the end of each sequence's keys in its cache row before the new ones: an
            int (one outside [0, seqlen_cache - seqlen_new] raises), or an int32 / int64 tensor
            (batch,) on q's device; None: seqlen_cache - seqlen_new (every slot a key, the new
            ones in the last slots; flash-attn asks for cache_seqlens with new keys).
        cache_batch_idx: None, or an int32 / int64 tensor (batch,): the cache row of each
            sequence. Where two sequences name one row, that row takes the new keys of the later.
        cache_leftpad: None, or an int32 / int64 tensor (batch,): the first slot of each
            sequence's keys (left padding), at most cache_seqlens[b].
            A sequence whose tensor values do not fit (cache_seqlens[b] outside [0, seqlen_cache -
            seqlen_new], cache_leftpad[b] outside [0, cache_seqlens[b]], a row outside the cache)
            gets NaN outputs; its new rows go in where they land inside its cache row (none for
            a row outside the cache), so no other sequence's slots change; ``qflash.set_debug(True)``
            raises instead (a sync).
        softmax_scale, causal, window_size, softcap, alibi_slopes, sinks: as in ``flash_attn_func``,
            per sequence of n_b keys (alibi_slopes may be (batch, heads)).
        rotary_cos, rotary_sin: None, or the rotary tables (seqlen_ro >= seqlen_cache, and >=
            seqlen_cache - seqlen_new + seqlen_q where q's rows move; rotary_dim / 2), floating,
            on q's device (needs k and v): the new keys are rotated at positions
            cache_seqlens[b] + j before they go in, and q at cache_seqlens[b] + i where
            causal or a window is set, else every row at cache_seqlens[b] (flash-attn's rule);
            the first rotary_dim dims of each head, computed in float32, q left as it was.
        rotary_interleaved: rotate dim pairs (2i, 2i + 1) (GPT-J), else (i, i + rotary_dim / 2)
            (GPT-NeoX, Llama).
        num_splits: flash-attn's hint for splitting the keys; accepted (an int >= 0) and left to
            the launcher, which splits where the programs do not fill the SMs.
        block_table: None, or an int32 tensor (batch, pages a sequence): a paged cache, sequence
            b's slot j in row j % page_size of page block_table[b, j // page_size] (seqlen_cache
            = pages a sequence x page_size; no cache_batch_idx). Pages that a sequence's keys
            touch outside the cache make it NaN (set_debug(True): raises); pages that the new
            keys go into should not be shared between sequences (which one's keys land is then
            unspecified, as in flash-attn). Pages are gathered key by key (no TMA), one compile a
            page size.
        return_softmax_lse: also return the log-sum-exp.

    Returns:
        out (batch, seqlen_q, heads, headdim), or ``(out, softmax_lse)`` with lse (batch,
        heads, seqlen_q) float32, natural log.
    """
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
    _check_tensors(("q", "k_cache", "v_cache"), (q, k_cache, v_cache), 4, "(batch, seqlen, heads, headdim)")
    batch, seqlen_q, heads, headdim = q.shape
    heads_kv = k_cache.shape[2]
    _check_heads(k_cache, v_cache, heads, heads_kv, headdim, names=("k_cache", "v_cache"))
    cache_rows = k_cache.shape[0]
    if block_table is not None:
        block_table = _check_block_table(block_table, cache_batch_idx, batch, q.device)
    elif cache_batch_idx is None and cache_rows != batch:
        raise ValueError(f"k_cache has batch {cache_rows} but q has batch {batch} (and no cache_batch_idx)")
    # a sequence's slots: its cache row's, or the pages its block-table row names
    slots = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(-1) != 1:  # written in place: no copy to fix it
            raise ValueError(f"{name} must have a unit last stride, got strides {tuple(cache.stride())}")
    if (k is None) != (v is None):
        raise ValueError("k and v (the new keys and values) must be given together")
    new = 0
    if k is not None:
        _check_tensors(("k_cache", "k", "v"), (k_cache, k, v), 4, "(batch, seqlen_new, heads_kv, headdim)")
        if k.shape != v.shape or k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:]:
            raise ValueError(f"k and v must have shape ({batch}, seqlen_new, {heads_kv}, {headdim}), got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        new = k.shape[1]
        if new > slots:
            raise ValueError(f"k has {new} new keys a sequence but the cache holds {slots}")
    left, right = _window(window_size, causal)
    _check_rotary(rotary_cos, rotary_sin, k, q, slots, q_moves=left >= 0 or right >= 0)
    if max(slots, seqlen_q) >= 2**31:
        raise ValueError(f"seqlen_cache and seqlen_q must be under 2^31, got {slots} and {seqlen_q}")
    start = (torch.full((batch,), slots - new, dtype=torch.int32, device=q.device) if cache_seqlens is None
             else _per_sequence("cache_seqlens", cache_seqlens, batch, q.device))
    batch_idx = None if cache_batch_idx is None else _per_sequence("cache_batch_idx", cache_batch_idx, batch,
                                                                    q.device, scalar=False)
    leftpad = None if cache_leftpad is None else _per_sequence("cache_leftpad", cache_leftpad, batch, q.device,
                                                                scalar=False)
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        # An int is known here, so checked at no cost (a tensor's values only under set_debug: a sync)
        if not 0 <= operator.index(cache_seqlens) <= slots - new:
            raise ValueError(f"cache_seqlens must lie in [0, {slots - new}] (seqlen_cache - seqlen_new), "
                             f"got {cache_seqlens}")
    if debug_enabled() and batch and not q.is_meta:
        _check_cache_positions(start, batch_idx, leftpad, cache_rows, slots - new, block_table, new, k_cache.shape[1])
    scale, softcap = _scale(softmax_scale, headdim), _check_softcap(softcap)
    alibi_slopes = _check_alibi(alibi_slopes, batch, heads, q.device)
    rotary = None if rotary_cos is None else (_unit_last_stride(rotary_cos), _unit_last_stride(rotary_sin),
                                              bool(rotary_interleaved))
    new_kv = (None, None) if k is None else (_unit_last_stride(k), _unit_last_stride(v))
    positions = (start, batch_idx, leftpad, block_table)
    options = (scale, left, right, softcap, alibi_slopes, _check_sinks(sinks, heads, q.device))
    out, lse = _kvcache_forward(_unit_last_stride(q), k_cache, v_cache, *new_kv, positions, options, rotary)
    return (out, lse) if return_softmax_lse else out


def sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with the same semantics, on qflash's kernel.

    Args:
        query: (batch, heads, seqlen_q, headdim), or as PyTorch (batch, ..., heads, seqlen_q,
            headdim) with any number of leading dims (none included), or (seqlen_q, headdim).
        key, value: (batch, ..., heads_kv, seqlen_k, headdim), the same leading dims as query.
            value's head dim may differ from query's and key's, as PyTorch allows (MLA's 192 / 128):
            the narrower side then goes to the kernel zero-padded (exact; a copy of it).
        attn_mask: boolean (True = take part in attention) or additive float, of float32 or
            query's dtype (as PyTorch), broadcastable to (batch, heads, seqlen_q, seqlen_k). A
            float mask that requires grad (a learned bias) gets its gradient, in its own dtype.
        is_causal: top-left causal mask (query i sees keys j <= i); exclusive with attn_mask.
        scale: defaults to 1 / sqrt(headdim); any finite number, as PyTorch (negative or zero:
            on a copy of query, see ``_sdpa_scale``).
        enable_gqa: allow heads_kv < heads (heads % heads_kv == 0).
        softcap: qflash's extension: > 0 makes the scaled scores ``softcap * tanh(scores /
            softcap)`` before the masks (Gemma 2's logit soft-capping), as ``flash_attn_func``.
        sinks: qflash's extension: (heads,) attention sinks (gpt-oss), as ``flash_attn_func``'s.

    Under ``torch.autocast`` the floating inputs (mask included) go in autocast's dtype first, as
    PyTorch casts them for its own SDPA (float64 excepted).

    Returns:
        (batch, ..., heads, seqlen_q, headdim_v), query's shape but value's head dim, in query's
        dtype. A row whose keys are all masked gives 0, as PyTorch's SDPA has since 2.5 (NaN
        before).
    """
    if isinstance(query, torch.Tensor):
        query, key, value, attn_mask = autocast_inputs(query, key, value, attn_mask)
    if isinstance(query, torch.Tensor) and query.dim() == 2:  # (seqlen, headdim): one head, as PyTorch takes it
        for name, t in (("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                raise ValueError(f"{name} must be (seqlen_k, headdim) as query is (seqlen_q, headdim), got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        return sdpa(query[None], key[None], value[None], attn_mask, dropout_p, is_causal, scale, enable_gqa,
                    softcap=softcap, sinks=sinks)[0]
    if isinstance(query, torch.Tensor) and query.dim() != 4 and query.dim() >= 3:
        return _sdpa_leading_dims(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap,
                                  sinks)
    _check_tensors(("query", "key", "value"), (query, key, value), 4, "(batch, heads, seqlen, headdim)")
    batch, heads, seqlen_q, headdim = query.shape
    heads_kv, seqlen_k = key.shape[1], key.shape[2]
    if value.shape[-1] != headdim and value.shape[:-1] == key.shape[:-1] and key.shape[-1] == headdim:
        return _sdpa_value_head_dim(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap,
                                    sinks)
    _check_heads(key, value, heads, heads_kv, headdim, names=("key", "value"))
    if key.shape[0] != batch:
        raise ValueError(f"key has batch {key.shape[0]} but query has batch {batch}")
    if heads_kv != heads and not enable_gqa:
        raise ValueError(f"query has {heads} heads but key/value have {heads_kv}: pass enable_gqa=True for GQA")
    if is_causal and attn_mask is not None:
        raise ValueError("pass either attn_mask or is_causal=True, not both (as in PyTorch)")
    bias = None
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a tensor, got {type(attn_mask).__name__}")
        if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
            # PyTorch's rule: a float32 mask goes with any query (the kernel adds it in float32).
            allowed = ("bool or torch.float32" if query.dtype == torch.float32
                       else f"bool, torch.float32 or {query.dtype} (query's dtype)")
            raise TypeError(f"attn_mask must be {allowed}, got {attn_mask.dtype}")
        if attn_mask.device != query.device:
            raise ValueError(f"attn_mask is on {attn_mask.device}, expected {query.device}")
        if attn_mask.dtype == torch.bool and query.dtype == torch.float64:
            # Triton 3.6 cannot build the boolean-mask kernel in float64 for sm_90 (an assertion in
            # its float64 MMA lowering); the same mask added as 0 / -inf gives the same result.
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
                ~attn_mask, -math.inf)
        try:
            bias = attn_mask.expand(batch, heads, seqlen_q, seqlen_k)  # a view: zero strides, no copy
        except RuntimeError:
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                f"(batch, heads, seqlen_q, seqlen_k) = {(batch, heads, seqlen_q, seqlen_k)}"
            ) from None
    query, scale = _sdpa_scale(query, scale, headdim)
    q, k, v = (_unit_last_stride(t.transpose(1, 2)) for t in (query, key, value))  # views in (B, S, H, D)
    out, _ = _attention(
        q, k, v, scale, -1, 0 if is_causal else -1, False, _check_softcap(softcap), None, bias, None,
        None, seqlen_q, seqlen_k, *_dropout(dropout_p), False, _check_sinks(sinks, heads, query.device),
    )
    return out.transpose(1, 2)


def pad_head_dims(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """(query, key, value) with one head dim, for a value whose head dim is not the query's and
    key's (MLA): the kernels take one, so the narrower side is zero-padded to the wider, which is
    exact (zero columns of q and k add nothing to the scores; zero columns of v give zero columns
    of the output, to be cut off). The caller keeps the scale of the query's own head dim."""
    headdim, headdim_v = query.shape[-1], value.shape[-1]
    width = max(headdim, headdim_v)
    if width > MAX_HEADDIM:
        raise ValueError(f"head dimensions must be at most {MAX_HEADDIM}, got {headdim} (query, key) and "
                         f"{headdim_v} (value)")
    return tuple(t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))
                 for t in (query, key, value))  # (the wider side as it is: no copy)


def _sdpa_value_head_dim(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks):
    """``sdpa`` of a value whose head dim is not the query's (``pad_head_dims``)."""
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])  # the query's own head dim
    out = sdpa(*pad_head_dims(query, key, value), attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap=softcap,
               sinks=sinks)
    return out[..., :value.shape[-1]].contiguous()


def _sdpa_leading_dims(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, sinks):
    """``sdpa`` of (..., heads, seqlen, headdim) inputs other than 4-D: their leading dims as one
    batch (views where the strides allow), the mask expanded over them, the output shaped back."""
    lead = query.shape[:-3]
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.shape[:-3] != lead or t.dim() != query.dim():
            raise ValueError(f"{name} must have query's leading dims {tuple(lead)} before (heads, seqlen, headdim), "
                             f"got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    flat = [t.reshape(-1, *t.shape[-3:]) for t in (query, key, value)]
    if isinstance(attn_mask, torch.Tensor) and attn_mask.dim() > 3:  # it reaches into the leading dims
        heads, seqlen_q, seqlen_k = query.shape[-3], query.shape[-2], key.shape[-2]
        try:
            attn_mask = attn_mask.expand(*lead, heads, seqlen_q, seqlen_k)
        except RuntimeError:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                             f"{(*lead, heads, seqlen_q, seqlen_k)}") from None
        attn_mask = attn_mask.reshape(-1, heads, seqlen_q, seqlen_k)  # a copy only where its strides do not merge
    out = sdpa(*flat, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
               enable_gqa=enable_gqa, softcap=softcap, sinks=sinks)
    return out.reshape(*lead, *out.shape[-3:])
