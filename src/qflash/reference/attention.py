"""Pure-PyTorch attention: the definition of a correct answer.

Nothing here imports triton. Every function runs on CPU or GPU in any floating
dtype, float64 included, and takes the same arguments as the public op it
checks, so a test can call both with one set of keyword arguments.

Layout is flash-attn's: ``(batch, seqlen, heads, headdim)``. Query row ``i``
sees key ``j`` when

    i + (seqlen_k - seqlen_q) - window_left  <=  j  <=  i + (seqlen_k - seqlen_q) + window_right

with a negative window side meaning "unbounded" and ``causal=True`` meaning
``window_right = 0``. The ``seqlen_k - seqlen_q`` shift aligns the causal mask
to the bottom-right corner, as flash-attn >= 2.1 does::

    seqlen_q = 2, seqlen_k = 5, causal        seqlen_q = 5, seqlen_k = 2, causal
        k: 0 1 2 3 4                              k: 0 1
    q0     x x x x .                          q0     . .    <- no visible key: output 0
    q1     x x x x x                          q1     . .
                                              q2     . .
                                              q3     x .
                                              q4     x x

Rows with no visible key give output 0 (not NaN) and log-sum-exp ``+inf``, the
flash-attn convention that makes ``exp(score - lse)`` vanish in a backward pass.
With attention sinks (``sinks``: a score a head, gpt-oss's) such a row's softmax holds the
sink alone: output 0 and log-sum-exp the sink's score.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

__all__ = [
    "attention_ref",
    "attention_kvcache_ref",
    "attention_varlen_ref",
    "sdpa_ref",
    "visible_mask",
    "alibi_bias",
    "online_softmax_attention",
]


def visible_mask(
    seqlen_q: int,
    seqlen_k: int,
    *,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    bottom_right: bool = True,
    device=None,
) -> Optional[torch.Tensor]:
    """Boolean (seqlen_q, seqlen_k) matrix, True where query i may attend to key j.

    Returns None when every key is visible (no causal flag, no window).
    """
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    if left < 0 and right < 0:
        return None
    shift = seqlen_k - seqlen_q if bottom_right else 0
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= j <= i + shift + right
    if left >= 0:
        visible &= j >= i + shift - left
    return visible


def alibi_bias(slopes: torch.Tensor, seqlen_q: int, seqlen_k: int, dtype=torch.float32) -> torch.Tensor:
    """ALiBi bias ``-slope * |i + seqlen_k - seqlen_q - j|``, flash-attn's definition.

    ``slopes`` is (heads,) or (batch, heads); the result broadcasts against scores of
    shape (batch, heads, seqlen_q, seqlen_k).
    """
    device = slopes.device
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    distance = (i + seqlen_k - seqlen_q - j).abs().to(dtype)  # [Sq, Sk]
    slopes = slopes.to(dtype)
    if slopes.dim() == 1:
        slopes = slopes.unsqueeze(0)  # [1, H]
    return -slopes[:, :, None, None] * distance  # [B or 1, H, Sq, Sk]


def _repeat_kv(x: torch.Tensor, heads_q: int, dim: int = 2) -> torch.Tensor:
    """(B, S, Hkv, D) -> (B, S, Hq, D), the heads at ``dim``: query head h reads key/value head
    h // (Hq / Hkv)."""
    heads_kv = x.shape[dim]
    if heads_q % heads_kv != 0:
        raise ValueError(f"heads of q ({heads_q}) must be a multiple of heads of k/v ({heads_kv})")
    return x.repeat_interleave(heads_q // heads_kv, dim=dim)


def _softmax_with_lse(scores: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, dropout_mask=None,
                      sinks: Optional[torch.Tensor] = None):
    """softmax(scores) @ v and logsumexp(scores) over the last axis, safe for all -inf rows.

    scores: [..., H, Sq, Sk] in the compute dtype, -inf where masked; v: [..., H, Sk, Dv].
    With dropout, the probabilities that multiply v are ``p * keep / (1 - dropout_p)``
    (``dropout_mask``, bool, True = keep); the log-sum-exp is that of the full softmax.
    ``sinks`` (H,): one more score a row for each head, beside the keys, whose value is zero
    (gpt-oss's attention sinks): it takes its share of the softmax and adds nothing.
    """
    if sinks is not None:
        column = sinks.to(scores.dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, column], dim=-1)
        v = torch.cat([v, v.new_zeros(*v.shape[:-2], 1, v.shape[-1])], dim=-2)
        if dropout_mask is not None:  # (the sink's value is zero: dropping it changes nothing)
            dropout_mask = torch.cat([dropout_mask, dropout_mask.new_ones(*dropout_mask.shape[:-1], 1)], dim=-1)
    # amax refuses an empty axis: no keys at all is a row with every key masked
    row_max = (scores.amax(dim=-1, keepdim=True) if scores.shape[-1]
               else scores.new_full((*scores.shape[:-1], 1), -math.inf))
    empty = torch.isneginf(row_max)
    row_max = torch.where(empty, torch.zeros_like(row_max), row_max)
    p = torch.exp(scores - row_max)
    row_sum = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(empty, torch.ones_like(row_sum), row_sum)
    if dropout_p > 0:
        if dropout_mask is None:
            raise ValueError("dropout_p > 0 needs the dropout_mask to apply")
        p = p.masked_fill(~dropout_mask, 0.0) / (1.0 - dropout_p)
    out = p @ v
    lse = torch.where(empty, torch.full_like(row_max, math.inf), row_max + torch.log(row_sum))
    return out, lse.squeeze(-1)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    upcast: bool = True,
    reorder_ops: bool = False,
    dropout_p: float = 0.0,
    dropout_mask: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
):
    """Attention in three plain steps: scores, softmax, weighted sum.

    Args:
        q: (batch, seqlen_q, heads, headdim).
        k, v: (batch, seqlen_k, heads_kv, headdim), heads % heads_kv == 0 (MQA/GQA).
        causal: mask aligned to the bottom-right corner (see the module docstring).
        softmax_scale: defaults to 1 / sqrt(headdim).
        window_size: (left, right) sliding window; -1 leaves that side unbounded.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)``.
        alibi_slopes: (heads,) or (batch, heads); adds ``-slope * |i + Sk - Sq - j|``.
        upcast: compute in float32 when the inputs are half precision, else in their dtype.
        reorder_ops: scale q before the product instead of the scores after it
            (changes rounding only; flash-attn's tests use it to measure PyTorch's error).
        dropout_p, dropout_mask: drop probabilities where the bool (batch, heads, seqlen_q,
            seqlen_k) mask is False and scale the rest by 1 / (1 - dropout_p).
        sinks: (heads,) attention sinks (gpt-oss): a score a head that every row of that head
            takes into its softmax beside the keys, with a value of zero.

    Returns:
        out: (batch, seqlen_q, heads, headdim) in q's dtype.
        lse: (batch, heads, seqlen_q) natural-log log-sum-exp of the final scores (the sink's
            among them), in the compute dtype; +inf for rows with no visible key and no sink.
    """
    dtype_out = q.dtype
    if upcast and q.dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    batch, seqlen_q, heads, headdim = q.shape
    seqlen_k = k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(headdim)
    k = _repeat_kv(k, heads)
    v = _repeat_kv(v, heads)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, S, D]
    if reorder_ops:
        scores = (qt * scale) @ kt.transpose(-1, -2)
    else:
        scores = (qt @ kt.transpose(-1, -2)) * scale  # [B, H, Sq, Sk]
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, seqlen_q, seqlen_k, dtype=scores.dtype)
    visible = visible_mask(seqlen_q, seqlen_k, causal=causal, window_size=window_size, device=q.device)
    if visible is not None:
        scores = scores.masked_fill(~visible, -math.inf)
    out, lse = _softmax_with_lse(scores, vt, dropout_p, dropout_mask, sinks)
    return out.transpose(1, 2).to(dtype_out), lse


def attention_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    **kwargs,
):
    """``attention_ref`` over packed sequences.

    q: (total_q, heads, headdim); k, v: (total_k, heads_kv, headdim); cu_seqlens_*:
    (batch + 1,) cumulative offsets starting at 0. Sequence b is rows
    ``cu_seqlens[b]:cu_seqlens[b+1]``. ``alibi_slopes`` of shape (batch, heads) gives
    each sequence its own slopes. Rows after the last sequence (``cu_seqlens_q[-1] <
    total_q``: padding) are as rows that see no key, out 0 and lse +inf (so their gradients, and
    those of keys after ``cu_seqlens_k[-1]``, are 0). Returns out (total_q, heads, headdim) and
    lse (heads, total_q). The max_seqlen arguments are accepted for signature parity.
    """
    slopes = kwargs.pop("alibi_slopes", None)
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    outs, lses = [], []
    for b in range(len(cq) - 1):
        s = None
        if slopes is not None:
            s = slopes[b] if slopes.dim() == 2 else slopes
        o, lse = attention_ref(
            q[cq[b] : cq[b + 1]].unsqueeze(0),
            k[ck[b] : ck[b + 1]].unsqueeze(0),
            v[ck[b] : ck[b + 1]].unsqueeze(0),
            alibi_slopes=s,
            **kwargs,
        )
        outs.append(o[0])
        lses.append(lse[0])
    out, lse = torch.cat(outs, dim=0), torch.cat(lses, dim=1)
    padding = q.shape[0] - out.shape[0]
    if padding > 0:
        out = torch.cat([out, out.new_zeros(padding, *out.shape[1:])])
        lse = torch.cat([lse, lse.new_full((lse.shape[0], padding), math.inf)], dim=1)
    return out, lse


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, first: int, moving: bool, interleaved: bool):
    """x (1, S, H, D) rotated as flash-attn's ``apply_rotary_emb`` does, row i at position first + i
    (``moving``) or every row at ``first``, in float32 (back in x's dtype)."""
    pos = first + torch.arange(x.shape[1], device=x.device) * int(moving)
    ro = 2 * cos.shape[1]
    # each angle twice: (d 2) interleaved, (2 d) in halves; [S, 1, ro]
    twice = (lambda t: t.repeat_interleave(2, dim=-1)) if interleaved else (lambda t: torch.cat((t, t), dim=-1))
    c, s = (twice(t.double()[pos])[:, None, :] for t in (cos, sin))
    head = x[..., :ro].double()
    rotated = head * c + _rotate_half(head, interleaved) * s
    return torch.cat((rotated.to(x.dtype), x[..., ro:]), dim=-1)


def attention_kvcache_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    cache_seqlens=None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    rotary_interleaved: bool = True,
    **kwargs,
):
    """``flash_attn_with_kvcache`` in plain steps, leaving its inputs as they are.

    q: (batch, seqlen_q, heads, headdim); k_cache, v_cache: (batch_cache, seqlen_cache, heads_kv,
    headdim); k, v: None or (batch, seqlen_new, heads_kv, headdim), the new keys that go in at slot
    ``cache_seqlens[b]`` (an int, a (batch,) tensor, or None: seqlen_cache - seqlen_new, so that
    every slot is a key) of sequence b's cache row (``cache_batch_idx[b]``, or b; distinct rows).
    Sequence b's queries then see slots ``cache_leftpad[b]`` (or 0) to ``cache_seqlens[b] +
    seqlen_new - 1`` of its row, with ``attention_ref``'s keyword arguments (``alibi_slopes``
    (batch, heads): per sequence).
    ``rotary_cos`` / ``rotary_sin`` (seqlen_ro, rotary_dim / 2): the new keys rotated at their
    positions, q at cache_seqlens[b] + i (causal or a window) or cache_seqlens[b] (neither),
    ``rotary_interleaved`` as in flash-attn's ``apply_rotary_emb``. ``block_table`` (batch, pages
    a sequence): paged caches (num_pages, page_size, heads_kv, headdim), sequence b's cache row
    the pages its table row names, one after another (distinct pages in the whole table).
    Returns out (batch, seqlen_q, heads, headdim), lse (batch, heads, seqlen_q), and the caches
    as they are after the new keys went in (copies).
    """
    if block_table is not None:  # each sequence's pages gathered into a row of its own, and back
        pages = block_table.long()
        rows_of = lambda c: c[pages].flatten(1, 2)  # noqa: E731 - (batch, pages x page_size, ...)
        out, lse, k_rows, v_rows = attention_kvcache_ref(q, rows_of(k_cache), rows_of(v_cache), k, v, cache_seqlens,
                                                         rotary_cos, rotary_sin, None, cache_leftpad, None,
                                                         rotary_interleaved, **kwargs)
        k_cache, v_cache = k_cache.clone(), v_cache.clone()
        k_cache[pages] = k_rows.unflatten(1, (pages.shape[1], k_cache.shape[1]))
        v_cache[pages] = v_rows.unflatten(1, (pages.shape[1], v_cache.shape[1]))
        return out, lse, k_cache, v_cache
    batch, slots = q.shape[0], k_cache.shape[1]
    rows = list(range(batch)) if cache_batch_idx is None else [int(x) for x in cache_batch_idx.tolist()]
    pads = [0] * batch if cache_leftpad is None else [int(x) for x in cache_leftpad.tolist()]
    new = 0 if k is None else k.shape[1]
    if cache_seqlens is None:  # every slot a key, the new ones in the last
        lens = [slots - new] * batch
    elif isinstance(cache_seqlens, int):
        lens = [cache_seqlens] * batch
    else:
        lens = [int(x) for x in cache_seqlens.tolist()]
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    if rotary_cos is not None:
        window = kwargs.get("window_size", (-1, -1))
        moving = kwargs.get("causal", False) or tuple(window) != (-1, -1)
        q = torch.cat([_rotate(q[b : b + 1], rotary_cos, rotary_sin, n, moving, rotary_interleaved)
                       for b, n in enumerate(lens)])
        k = torch.cat([_rotate(k[b : b + 1], rotary_cos, rotary_sin, n, True, rotary_interleaved)
                       for b, n in enumerate(lens)])
    if new:
        for b, n in enumerate(lens):
            k_cache[rows[b], n : n + new] = k[b]
            v_cache[rows[b], n : n + new] = v[b]
    slopes = kwargs.pop("alibi_slopes", None)
    outs, lses = [], []
    for b, n in enumerate(lens):
        r, pad = rows[b], pads[b]
        if n + new - pad == 0:  # no key: out 0 and lse +inf (or the sink's score), as every row that sees no key
            outs.append(torch.zeros_like(q[b : b + 1]))
            upcast = kwargs.get("upcast", True) and q.dtype in (torch.float16, torch.bfloat16)
            lse_dtype = torch.float32 if upcast else q.dtype
            sinks = kwargs.get("sinks")
            lses.append(torch.full((1, q.shape[2], q.shape[1]), math.inf, dtype=lse_dtype, device=q.device)
                        if sinks is None else sinks.to(lse_dtype).view(1, -1, 1).expand(1, -1, q.shape[1]))
            continue
        s = slopes[b] if slopes is not None and slopes.dim() == 2 else slopes
        o, lse = attention_ref(q[b : b + 1], k_cache[r : r + 1, pad : n + new], v_cache[r : r + 1, pad : n + new],
                               alibi_slopes=s, **kwargs)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), k_cache, v_cache


def sdpa_ref(
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
    upcast: bool = True,
):
    """``F.scaled_dot_product_attention`` semantics, written out.

    Layout (batch, ..., heads, seqlen, headdim) or (seqlen, headdim); causal aligned top-left (query i sees
    keys j <= i); ``attn_mask`` boolean (True = attend) or additive float,
    broadcastable to (batch, heads, seqlen_q, seqlen_k). ``softcap`` > 0 (qflash's
    extension) makes the scaled scores ``softcap * tanh(scores / softcap)`` before
    the masks; ``sinks`` (heads,) as in ``attention_ref`` (qflash's extension too). Unlike
    PyTorch, a row whose every key is masked gives 0, not NaN. Returns the output only.
    """
    if dropout_p != 0.0:
        raise NotImplementedError("sdpa_ref: dropout_p must be 0")
    if query.dim() == 2:  # (seqlen, headdim): one head
        return sdpa_ref(query[None], key[None], value[None], attn_mask, dropout_p, is_causal, scale, enable_gqa,
                        softcap=softcap, sinks=sinks, upcast=upcast)[0]
    dtype_out = query.dtype
    if upcast and query.dtype in (torch.float16, torch.bfloat16):
        query, key, value = query.float(), key.float(), value.float()
    heads, seqlen_q, headdim = query.shape[-3], query.shape[-2], query.shape[-1]
    seqlen_k = key.shape[-2]
    scale = scale if scale is not None else 1.0 / math.sqrt(headdim)
    if key.shape[-3] != heads:
        if not enable_gqa:
            raise ValueError("sdpa_ref: key heads differ from query heads and enable_gqa is False")
        key, value = _repeat_kv(key, heads, dim=-3), _repeat_kv(value, heads, dim=-3)
    scores = (query @ key.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        visible = visible_mask(seqlen_q, seqlen_k, causal=True, bottom_right=False, device=query.device)
        scores = scores.masked_fill(~visible, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, -math.inf)
        else:
            scores = scores + attn_mask.to(scores.dtype)
    out, _ = _softmax_with_lse(scores, value, sinks=sinks)
    return out.to(dtype_out)


def online_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_n: int,
    order: Optional[Sequence[int]] = None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    on_block: Optional[Callable[[dict], None]] = None,
):
    """FlashAttention's recurrence, one K/V block at a time, in any block order.

    For each block of ``block_n`` keys, with running max ``m`` and running sum ``l``
    per query row and an unnormalized accumulator ``acc``::

        s      = q @ k_blk.T * scale             scores of this block
        m_new  = max(m, rowmax(s))
        alpha  = exp(m - m_new)                  how much the old state shrinks
        p      = exp(s - m_new)
        l      = alpha * l + rowsum(p)
        acc    = alpha * acc + p @ v_blk
        m      = m_new

    and one division at the end: ``out = acc / l``, ``lse = m + log(l)``. Because
    every block is rescaled to the same final max, the order of blocks does not
    matter: the result equals ``attention_ref`` up to rounding.

    Args:
        q, k, v: flash-attn layout (batch, seqlen, heads, headdim), heads equal.
        block_n: keys per block.
        order: permutation of block indices; default 0, 1, 2, ...
        causal: bottom-right aligned causal mask, as in ``attention_ref``.
        on_block: called after each block with a dict of the state (for teaching).

    Returns (out, lse) like ``attention_ref``, computed in q's dtype.
    """
    batch, seqlen_q, heads, headdim = q.shape
    seqlen_k = k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(headdim)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, S, D]
    num_blocks = math.ceil(seqlen_k / block_n)
    order = list(range(num_blocks)) if order is None else list(order)
    if sorted(order) != list(range(num_blocks)):
        raise ValueError(f"order must be a permutation of range({num_blocks}), got {order}")
    visible = visible_mask(seqlen_q, seqlen_k, causal=causal, device=q.device)

    m = torch.full((batch, heads, seqlen_q, 1), -math.inf, dtype=q.dtype, device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros(batch, heads, seqlen_q, v.shape[-1], dtype=q.dtype, device=q.device)
    for step, blk in enumerate(order):
        cols = slice(blk * block_n, min((blk + 1) * block_n, seqlen_k))
        s = (qt @ kt[:, :, cols].transpose(-1, -2)) * scale  # [B, H, Sq, block]
        if visible is not None:
            s = s.masked_fill(~visible[:, cols], -math.inf)
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        # A row that has seen no visible key yet keeps m = -inf; shift it by 0 instead
        # so that exp(-inf - (-inf)) never appears.
        m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe)
        l = alpha * l + p.sum(dim=-1, keepdim=True)
        acc = alpha * acc + p @ vt[:, :, cols]
        m = m_new
        if on_block is not None:
            on_block({"step": step, "block": blk, "keys": (cols.start, cols.stop), "m": m, "l": l, "alpha": alpha, "acc": acc})
    empty = l == 0
    out = acc / torch.where(empty, torch.ones_like(l), l)
    lse = torch.where(empty, torch.full_like(m, math.inf), m + torch.log(l))
    return out.transpose(1, 2), lse.squeeze(-1)
