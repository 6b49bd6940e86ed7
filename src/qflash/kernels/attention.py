"""FlashAttention in Triton: forward and backward kernels and their launchers.

One program owns BLOCK_M query rows of one (batch, head). Its Q tile stays on chip
while K/V tiles of BLOCK_N keys stream past. For each tile it keeps the online
softmax state (running max ``m``, running sum ``l``, unnormalized ``acc``) and
divides once at the end, so the (seqlen_q x seqlen_k) score matrix never exists
in device memory.

Scores live in the log2 domain: ``log2(e)`` is folded into the scale so the kernel
calls ``exp2``, which maps to one hardware instruction.

Masking (causal, sliding window, sequence end) is only paid for where it can bite:
the key range of a program is split into

    [lo, full_lo)        left edge of the window: masked
    [full_lo, full_hi)   every key visible to every row: no mask at all
    [full_hi, hi)        diagonal / right window edge / sequence end: masked

and blocks outside [lo, hi) are never loaded.

Where the (batch, head, row block) programs are too few to fill the GPU (decoding: one query
row a sequence), the key range is also cut into ``num_splits`` shares, one program each
(flash-decoding): each writes its share's normalized output and log-sum-exp in float32, and
``_attn_fwd_combine_kernel`` weighs them together, exactly, as the online softmax would have.

The backward pass recomputes the probabilities from the saved log-sum-exp instead
of storing them (FlashAttention-2): a preprocess pass computes
``delta = rowsum(dO * O)``, one kernel holds a K/V block and sweeps the query
blocks (and, for GQA, every query head of its group) to accumulate dK and dV, and
another holds a Q block and sweeps the key blocks for dQ. No atomics: the
gradients are bitwise identical from run to run. (On Hopper the public backward takes the
Gluon kernels instead, ``attention_gluon.py``, unless determinism is asked for.)
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from qflash.kernels.common import (CachedLauncher, cdiv, ensure_descriptor_allocator, gluon_enabled, has_tma,
                                   next_power_of_2, sm_count, tma_compatible)
from qflash.testing import new_output

RCP_LN2 = tl.constexpr(1.4426950408889634)  # 1 / ln(2) = log2(e): exp(x) == exp2(x * RCP_LN2)
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): log(x) == log2(x) * LN2

# Bias kinds (constexpr BIAS_KIND): what the optional bias/mask tensor means.
BIAS_NONE, BIAS_BOOL, BIAS_ADD = 0, 1, 2


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1); exp2 overflowing to inf gives exactly 1.
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * RCP_LN2)) + 1.0)


@triton.jit
def _sequence(cu_seqlens, b, seqlen, IS_VARLEN: tl.constexpr):
    """(first row, length, valid) of sequence b. Dense: (0, seqlen, True). Packed: rows
    cu_seqlens[b] : cu_seqlens[b + 1] of the ``seqlen`` packed rows, and whether they lie inside
    them in order. Contents that leave the packed rows or go backwards (an end past the rows, an
    end before its start, a start before the previous sequence's, a first start that is not 0)
    are bad input, which ``set_debug(True)`` refuses on the host at the cost of a sync. Unchecked,
    they would make the kernels read and write past the tensors; a sequence that is not valid
    gets NaN outputs instead (``_rows_to_spoil``, inside the packed rows) and no product."""
    if IS_VARLEN:
        start = tl.load(cu_seqlens + b).to(tl.int64)
        end = tl.load(cu_seqlens + b + 1)
        prev = tl.load(cu_seqlens + b - 1, mask=b > 0, other=0)
        valid = (prev <= start) & (start <= end) & (end <= seqlen) & ((b > 0) | (start == 0))
        seqlen = (end - start).to(tl.int32)
    else:
        start = tl.full([], 0, tl.int64)
        valid = True
    return start, seqlen, valid


@triton.jit
def _cache_keys(cache_seqlens, cu_seqlens_k, cache_batch_idx, cache_leftpad, b, seqlen_new, slots, cache_rows,
                HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr, PAGED: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(cache row, first slot, keys, valid) of sequence b in a KV cache (cache_rows, slots, ...):
    slots cache_leftpad[b] to cache_seqlens[b] + seqlen_new - 1 of row cache_batch_idx[b] (or b);
    with packed queries (IS_VARLEN), cache_seqlens[b] is counted from cu_seqlens_k instead.
    PAGED: the slots of the sequence's block-table row (its pages x the page size; each program
    checks the pages it reads, ``_pages_ok``). A row outside the cache, or slots that leave the
    row or go backwards, are bad input (``set_debug(True)`` refuses them on the host): no
    product, NaN outputs."""
    if IS_VARLEN:  # (no launch on the host to take the differences)
        start = tl.load(cu_seqlens_k + b + 1) - tl.load(cu_seqlens_k + b)
    else:
        start = tl.load(cache_seqlens + b).to(tl.int32)  # int32 or int64 tensors, read as they are
    row = tl.load(cache_batch_idx + b).to(tl.int32) if HAS_BATCH_IDX else b
    pad = tl.load(cache_leftpad + b).to(tl.int32) if HAS_LEFTPAD else 0
    end = start + seqlen_new
    valid = (start >= 0) & (end <= slots) & (pad >= 0) & (pad <= start)
    if not PAGED:
        valid &= (row >= 0) & (row < cache_rows)
    return tl.where(valid, row, 0), tl.where(valid, pad, 0).to(tl.int64), tl.where(valid, end - pad, 0), valid


@triton.jit
def _pages_ok(table_row, first, end, num_pages, BLOCK: tl.constexpr = 128):
    """Whether block-table entries first : end all name pages of the cache (0 <= page < num_pages)."""
    bad = 0
    for i0 in range(first, end, BLOCK):
        i = i0 + tl.arange(0, BLOCK)  # [BLOCK]
        page = tl.load(table_row + i, mask=i < end, other=0)
        bad += tl.sum(((page < 0) | (page >= num_pages)).to(tl.int32))
    return bad == 0


@triton.jit
def _page_slots(table_row, first_slot, cols, bound, PAGE_SIZE: tl.constexpr):
    """(page, row in the page) of keys ``cols`` ([BLOCK_N] each, int64) of a paged cache: key c is
    slot first_slot + c of its sequence, in page table_row[slot // PAGE_SIZE]; keys past ``bound``
    give page 0 (their loads are masked). The slots stay int32 and the page size a constant: with
    a run-time page size and int64 slots, each key block cost 64-bit divisions (a software
    routine), and the paged decode step ran at half the dense one's speed (s48a)."""
    slot = first_slot + cols  # [BLOCK_N] int32
    page = tl.load(table_row + slot // PAGE_SIZE, mask=cols < bound, other=0)
    return page.to(tl.int64), (slot % PAGE_SIZE).to(tl.int64)


@triton.jit
def _rows_to_spoil(start, seqlen, total, r0, last_block, BLOCK_R: tl.constexpr):
    """The packed rows (first, end) that a program of a bad sequence fills with NaN: its own rows
    r0 : r0 + BLOCK_R of the sequence, and in the grid's last program every row after them too (a
    max_seqlen under the truth leaves those to no program), cut to the ``total`` packed rows."""
    first = tl.minimum(tl.maximum(start + r0, 0), total)
    end = tl.minimum(tl.maximum(start + tl.where(last_block, seqlen, tl.minimum(r0 + BLOCK_R, seqlen)), first), total)
    return first, end


@triton.jit
def _fill_rows(base, stride_row, stride_col, first, end, width, value, step0, step, BLOCK: tl.constexpr):
    """``value`` into rows first : end (``width`` entries each, ``stride_col`` apart) of an output,
    the rows flattened, BLOCK values a step: the steps from flat index ``step0`` on, ``step``
    apart (one program: 0 and BLOCK; a grid: its share)."""
    count = (end - first) * width  # <= 0: no step
    for i0 in range(step0, count, step):
        i = i0 + tl.arange(0, BLOCK)  # [BLOCK] flat index into the rows
        row = (first + i // width).to(tl.int64)
        tl.store(base + row * stride_row + (i % width) * stride_col, tl.full([BLOCK], value, base.dtype.element_ty),
                 mask=i < count)


@triton.jit
def _nan_rows(base, stride_row, first, end, WIDTH: tl.constexpr, BLOCK: tl.constexpr = 256):
    """NaN into rows first : end (``WIDTH`` contiguous columns) of an output, all by this program.
    The kernels call it on a branch of its own that ends the program: where the checks came after
    the product (NaN by selects, the rows past the grid after the store), the D = 128 forward ran
    2-3 % slower (attention_varlen_bounds_ab_h200_2026-12-02_s40a.json), and a branch that went on
    to the product after the rows past the grid still cost ptxas spills there."""
    _fill_rows(base, stride_row, 1, first, end, WIDTH, float("nan"), 0, BLOCK, BLOCK)


@triton.jit
def _padding_start(cu_seqlens, batch, total, BLOCK_B: tl.constexpr = 128):
    """Where the packed rows that no sequence holds begin (padding, which flash-attn's API allows
    after the last sequence): after the furthest entry of cu_seqlens, the last one unless the
    contents are bad, and at most ``total``. No kernel writes past it, bad contents' NaN
    included (``_rows_to_spoil`` keeps to a sequence's own rows)."""
    first = tl.load(cu_seqlens + batch)
    for b0 in range(0, batch, BLOCK_B):
        offs = b0 + tl.arange(0, BLOCK_B)  # [BLOCK_B]
        first = tl.maximum(first, tl.max(tl.load(cu_seqlens + offs, mask=offs < batch, other=0)))
    return tl.minimum(tl.maximum(first, 0).to(tl.int64), total)


@triton.jit
def _fill_padding_kernel(
    X, Y, cu_seqlens, batch, total,
    stride_xr, stride_xc, width_x, stride_yr, stride_yc, width_y,
    X_VALUE: tl.constexpr, Y_VALUE: tl.constexpr, HAS_Y: tl.constexpr, BLOCK: tl.constexpr,
):
    """The padding rows of packed outputs (``_padding_start`` on): X's rows (dimension 0, say out
    or dK) set to X_VALUE, and Y's (where HAS_Y: the log-sum-exp, rows along its dimension 1) to
    Y_VALUE."""
    first = _padding_start(cu_seqlens, batch, total)
    step0, step = tl.program_id(0).to(tl.int64) * BLOCK, tl.num_programs(0).to(tl.int64) * BLOCK  # a grid's share
    _fill_rows(X, stride_xr, stride_xc, first, total, width_x, X_VALUE, step0, step, BLOCK)
    if HAS_Y:
        _fill_rows(Y, stride_yr, stride_yc, first, total, width_y, Y_VALUE, step0, step, BLOCK)


@triton.jit
def _rng_row0(b, h, num_heads, q_start, rng_rows, IS_VARLEN: tl.constexpr):
    """Row of the dropout counter space where this (batch, head)'s query rows begin.

    Dense: (b * heads + h) * seqlen_q; packed: h * total_q + q_start. Row i of the plane has the
    counters from (rng_row0 + i) * ceil(rng_cols / 8) on (``_dropout_keep``), unique across the call."""
    if IS_VARLEN:
        row0 = h.to(tl.int64) * rng_rows + q_start
    else:
        row0 = (b * num_heads + h).to(tl.int64) * rng_rows
    return row0


@triton.jit
def _dropout_keep(dropout_seed, rng_row0, rows, col0, rng_cols, dropout_p, BLOCK_N: tl.constexpr):
    """Which probabilities survive dropout in the tile of ``rows`` x keys [col0, col0 + BLOCK_N)
    (col0 a multiple of 8): counter-based (Philox), so the backward pass regenerates exactly the
    forward's mask from (seed, position).

    A Philox call gives four 32-bit numbers, eight 16-bit halves, so each counter serves eight
    neighbouring keys: (i, j) takes half (j % 2) (low, high) of number (j % 8) // 2 of counter
    (rng_row0 + i) * ceil(rng_cols / 8) + j // 8, and is kept when that half is at least
    ceil(p * 65536): p is rounded up to a multiple of 2^-16 for the draw (the kept values are
    still scaled by 1 / (1 - p)). Against four keys a call, a float each, the forward at p = 0.1
    ran 1.39 / 1.22 x as fast at D = 64 / 128 (attention_dropout_h200_2026-11-30_s16a.json)."""
    octets = col0 // 8 + tl.arange(0, BLOCK_N // 8)  # [BLOCK_N // 8]
    counters = (rng_row0 + rows[:, None]).to(tl.int64) * ((rng_cols + 7) // 8) + octets[None, :]
    r0, r1, r2, r3 = tl.randint4x(dropout_seed, counters)  # [BLOCK_M, BLOCK_N // 8] each, uint32
    threshold = tl.math.ceil(dropout_p * 65536.0).to(tl.uint32)
    HALF: tl.constexpr = 0xFFFF
    # join(join(x0, x2), join(x1, x3)) is [.., 2, 2]: its element [.., c, d] is x_(2c + d); the
    # low and high halves joined last make [.., 2, 2, 2], element [.., c, d, a] half a of number
    # 2c + d, which the reshape puts at key 8 * octet + 2 * (2c + d) + a.
    lo = tl.join(tl.join(r0 & HALF, r2 & HALF), tl.join(r1 & HALF, r3 & HALF))
    hi = tl.join(tl.join(r0 >> 16, r2 >> 16), tl.join(r1 >> 16, r3 >> 16))
    halves = tl.reshape(tl.join(lo, hi), [rows.shape[0], BLOCK_N])  # [BLOCK_M, BLOCK_N]
    return halves >= threshold


@triton.jit
def _key_blocks(m0, seqlen_q, seqlen_k, shift, window_left, window_right,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Keys that query rows [m0, m0 + BLOCK_M) can see: [lo, hi), in BLOCK_N steps from lo.

    Key (column) j is visible from row i when i + shift - left <= j <= i + shift + right.
    Blocks in [full_lo, full_hi) are visible from every row and inside seqlen_k, so they
    skip the mask; the ones around them (window edges, diagonal, sequence end) pay for it.
    """
    last_row = tl.minimum(m0 + BLOCK_M, seqlen_q) - 1
    lo = 0
    hi = seqlen_k
    full_lo = 0
    full_hi = (seqlen_k // BLOCK_N) * BLOCK_N  # the partial last block needs the bound mask
    if HAS_LEFT:
        lo = (tl.maximum(m0 + shift - window_left, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(last_row + shift - window_left, 0), BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(hi, tl.maximum(last_row + shift + window_right + 1, 0))
        full_hi = tl.minimum(full_hi, (tl.maximum(m0 + shift + window_right + 1, 0) // BLOCK_N) * BLOCK_N)
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_blocks(n0, seqlen_q, seqlen_k, shift, window_left, window_right,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Query rows that can see a key of [n0, n0 + BLOCK_N): [lo, hi), in BLOCK_M steps from lo;
    [full_lo, full_hi) see every key of the block and skip the mask.

    Rows past seqlen_q (lse = +inf, so p = 0) and keys past seqlen_k (their dK/dV rows are
    never stored) need no bound mask here, only the causal/window edges do.
    """
    last_col = tl.minimum(n0 + BLOCK_N, seqlen_k) - 1
    lo = 0
    hi = seqlen_q
    full_lo = 0
    full_hi = seqlen_q
    if HAS_RIGHT:  # j <= i + shift + right  <=>  i >= j - shift - right
        lo = (tl.maximum(n0 - shift - window_right, 0) // BLOCK_M) * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(last_col - shift - window_right, 0), BLOCK_M) * BLOCK_M
    if HAS_LEFT:  # j >= i + shift - left  <=>  i <= j - shift + left
        hi = tl.minimum(hi, tl.maximum(last_col - shift + window_left + 1, 0))
        full_hi = (tl.maximum(n0 - shift + window_left + 1, 0) // BLOCK_M) * BLOCK_M
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _stretch(part: tl.constexpr, lo, full_lo, full_hi, hi, EDGES_LAST: tl.constexpr = False):
    """Bounds of stretch ``part`` of a block range: 0 = [lo, full_lo) and 2 = [full_hi, hi)
    need the mask, 1 = [full_lo, full_hi) does not. EDGES_LAST swaps 0 and 1."""
    if EDGES_LAST and part < 2:
        part = 1 - part
    if part == 0:
        return lo, full_lo
    elif part == 1:
        return full_lo, full_hi
    else:
        return full_hi, hi


@triton.jit
def _split_share(lo, hi, split, num_splits, BLOCK_N: tl.constexpr):
    """Keys [s_lo, s_hi) of share ``split`` of [lo, hi): whole BLOCK_N blocks from lo, as even as
    they come; the last shares may be empty."""
    per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits) * BLOCK_N
    s_lo = tl.minimum(lo + split * per_split, hi)
    return s_lo, tl.minimum(s_lo + per_split, hi)


@triton.jit
def _scores_log2(
    qk, rows, cols, bias_base, stride_bm, stride_bn,
    seqlen_q, seqlen_k, shift, window_left, window_right,
    qk_scale, softcap_log2, slope_log2,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, BIAS_KIND: tl.constexpr,
):
    """Raw products q.k of a [rows, cols] tile -> final scores in the log2 domain, -inf where hidden.

    Order as in the reference: scale, softcap, ALiBi, mask/bias, then causal/window/bounds.
    """
    if HAS_SOFTCAP:
        s = softcap_log2 * _tanh(qk * qk_scale)
    else:
        s = qk * qk_scale
    if HAS_ALIBI:
        s -= slope_log2 * tl.abs(rows[:, None] + shift - cols[None, :]).to(s.dtype)
    if BIAS_KIND != 0:
        b_ok = (rows[:, None] < seqlen_q) & (cols[None, :] < seqlen_k)
        b_ptrs = bias_base + rows[:, None].to(tl.int64) * stride_bm + cols[None, :] * stride_bn
        bias = tl.load(b_ptrs, mask=b_ok, other=0)
        if BIAS_KIND == 1:
            s = tl.where(bias != 0, s, float("-inf"))
        else:
            s += bias.to(s.dtype) * RCP_LN2
    if MASKED:
        keep = (cols[None, :] < seqlen_k) & (rows[:, None] < seqlen_q)
        if HAS_RIGHT:
            keep &= cols[None, :] <= rows[:, None] + shift + window_right
        if HAS_LEFT:
            keep &= cols[None, :] >= rows[:, None] + shift - window_left
        s = tl.where(keep, s, float("-inf"))
    return s


@triton.jit
def _tile_source(base, num_rows, stride_s, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                 HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr):
    """What ``_load_tile`` reads [BLOCK_R, BLOCK_D] tiles of a (rows, HEAD_DIM) plane through: a
    tensor descriptor bounded by this sequence's ``num_rows`` (the copy engine zero-fills past
    them and clips partial stores), or, without descriptors, the plane's base pointer."""
    if USE_TMA:
        src = tl.make_tensor_descriptor(base, shape=[num_rows, HEAD_DIM], strides=[stride_s, 1],
                                        block_shape=[BLOCK_R, BLOCK_D])
    else:
        src = base
    return src


@triton.jit
def _load_tile(src, ptrs, stride_s, start, idx, d_ok, bound,
               TRANSPOSE: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
               MASKED: tl.constexpr, USE_TMA: tl.constexpr):
    """The tile of rows [start, start + BLOCK) of a (rows, HEAD_DIM) plane: K or V tiles of keys
    in the forward and dQ kernels, Q or dO tiles of query rows in the dK/dV kernel.

    ``src`` is what ``_tile_source`` made (a descriptor, or the base pointer), ``ptrs`` point at
    the first tile, ``idx`` are the tile's row indices and ``bound`` the plane's row count.
    Returns [BLOCK, BLOCK_D], or [BLOCK_D, BLOCK] when TRANSPOSE (K, so that q @ k is the product).
    """
    if USE_TMA:  # the copy engine zero-fills rows past the bound and columns past HEAD_DIM
        t = src.load([start, 0])
        if TRANSPOSE:
            t = t.T
    else:
        if TRANSPOSE:  # rows of the plane along the tile's columns
            row_ok, dim_ok = idx[None, :] < bound, d_ok[:, None]
        else:
            row_ok, dim_ok = idx[:, None] < bound, d_ok[None, :]
        ptrs += tl.cast(start, tl.int64) * stride_s  # int64: one sequence may pass 2^31 elements
        if MASKED:
            t = tl.load(ptrs, mask=row_ok & dim_ok, other=0.0)
        elif BLOCK_D != HEAD_DIM:
            t = tl.load(ptrs, mask=dim_ok, other=0.0)
        else:
            t = tl.load(ptrs)
    return t


@triton.jit
def _online_softmax(
    qk, m_i, l_i, rows, cols, col0, bias_base, stride_bm, stride_bn,
    seqlen_q, seqlen_k, shift, window_left, window_right,
    qk_scale, softcap_log2, slope_log2,
    dropout_p, dropout_seed, rng_row0, rng_cols,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, BIAS_KIND: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
):
    """Raw products of one tile -> (p, alpha, m_new, l_new): the probabilities that multiply V
    (relative to the new running max, after dropout), and the factor that rescales what the
    accumulator already holds."""
    if not (MASKED or HAS_SOFTCAP or HAS_ALIBI or BIAS_KIND != 0):
        # Plain scores: take the max of the raw products (scale > 0 keeps the argmax), so
        # that scaling and subtracting the max fuse into one FMA per element.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # [BLOCK_M]
        m_new_safe = m_new
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])  # [BLOCK_M, BLOCK_N]
    else:
        s = _scores_log2(qk, rows, cols, bias_base, stride_bm, stride_bn, seqlen_q, seqlen_k, shift,
                         window_left, window_right, qk_scale, softcap_log2, slope_log2,
                         MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, BIAS_KIND)
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
        # A row that has seen no visible key yet has m = -inf: shift by 0 instead,
        # so exp2(-inf - (-inf)) = NaN never appears.
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_new_safe[:, None])  # [BLOCK_M, BLOCK_N]
    alpha = tl.math.exp2(m_i - m_new_safe)  # [BLOCK_M]
    l_i = l_i * alpha + tl.sum(p, 1)
    if HAS_DROPOUT:  # l keeps every probability; only what reaches V is dropped and rescaled
        keep = _dropout_keep(dropout_seed, rng_row0, rows, col0, rng_cols, dropout_p, qk.shape[1])
        p = tl.where(keep, p / (1.0 - dropout_p), 0.0)
    return p, alpha, m_new, l_i


@triton.jit
def _attn_fwd_stretch(
    acc, m_i, l_i, q, start, end,
    k_desc, v_desc, k_ptrs, v_ptrs, bias_base,
    stride_ks, stride_vs, stride_bm, stride_bn,
    rows, offs_n, offs_d,
    seqlen_q, seqlen_k, shift, window_left, window_right,
    qk_scale, softcap_log2, slope_log2,
    dropout_p, dropout_seed, rng_row0, rng_cols,
    table_row, first_slot, stride_kp, stride_vp, PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, BIAS_KIND: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, PAGED: tl.constexpr = False,
):
    """The online softmax over key blocks [start, end): returns the updated (acc, m_i, l_i).
    PAGED: k_desc / v_desc are the head's base pointers in a paged cache, each key's row looked up
    in the sequence's block-table row (``_page_slots``)."""
    d_ok = offs_d < HEAD_DIM  # [BLOCK_D]
    for start_n in range(start, end, BLOCK_N):
        if not MASKED:
            start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n  # [BLOCK_N]
        if PAGED:
            in_seq = cols < seqlen_k  # [BLOCK_N]
            page, in_page = _page_slots(table_row, first_slot, cols, seqlen_k, PAGE_SIZE)
            k_rows = page * stride_kp + in_page * stride_ks  # [BLOCK_N]
            k = tl.load(k_desc + k_rows[None, :] + offs_d[:, None], mask=in_seq[None, :] & d_ok[:, None],
                        other=0.0)  # [BLOCK_D, BLOCK_N]
        else:
            k = _load_tile(k_desc, k_ptrs, stride_ks, start_n, cols, d_ok, seqlen_k, True, BLOCK_D, HEAD_DIM,
                           MASKED, USE_TMA)  # [BLOCK_D, BLOCK_N]
        qk = tl.dot(q, k, input_precision=DOT_PRECISION, out_dtype=acc.dtype)  # [BLOCK_M, BLOCK_N]
        p, alpha, m_i, l_i = _online_softmax(
            qk, m_i, l_i, rows, cols, start_n, bias_base, stride_bm, stride_bn, seqlen_q, seqlen_k, shift,
            window_left, window_right, qk_scale, softcap_log2, slope_log2, dropout_p, dropout_seed,
            rng_row0, rng_cols, MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, BIAS_KIND, HAS_DROPOUT)
        acc = acc * alpha[:, None]  # rescale what we already hold
        if PAGED:
            v_rows = page * stride_vp + in_page * stride_vs
            v = tl.load(v_desc + v_rows[:, None] + offs_d[None, :], mask=in_seq[:, None] & d_ok[None, :],
                        other=0.0)  # [BLOCK_N, BLOCK_D]
        else:
            v = _load_tile(v_desc, v_ptrs, stride_vs, start_n, cols, d_ok, seqlen_k, False, BLOCK_D, HEAD_DIM,
                           MASKED, USE_TMA)  # [BLOCK_N, BLOCK_D]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION, out_dtype=acc.dtype)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["dropout_seed"])  # a seed a call: no compile for its value
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, Bias, Slopes,
    cu_seqlens_q, cu_seqlens_k, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, stride_ls,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_sb, stride_sh,
    stride_o_split, stride_l_split,
    seqlen_q, seqlen_k, num_heads, kv_group, num_m_blocks, num_splits,
    qk_scale: tl.float64, softcap_log2: tl.float64, window_left, window_right,
    dropout_p, dropout_seed, rng_rows, rng_cols, seqlen_new, cache_rows, stride_table, Sinks,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, BIAS_KIND: tl.constexpr,
    IS_VARLEN: tl.constexpr, HEAVY_FIRST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, ACC: tl.constexpr, HAS_DROPOUT: tl.constexpr, EDGES_LAST: tl.constexpr = False,
    SPLIT_KV: tl.constexpr = False, PACK_GQA: tl.constexpr = False,
    KV_CACHE: tl.constexpr = False, HAS_BATCH_IDX: tl.constexpr = False, HAS_LEFTPAD: tl.constexpr = False,
    PAGED: tl.constexpr = False, PAGE_SIZE: tl.constexpr = 1, HAS_SINKS: tl.constexpr = False,
):
    # HAS_SINKS (gpt-oss's attention sinks): Sinks holds a score a query head that its rows take into
    # the softmax beside the keys, with a value of zero.
    # KV_CACHE (``flash_attn_with_kvcache``): K / V are a cache of rows of seqlen_k slots, sequence
    # b's keys where ``_cache_keys`` puts them; PAGED: a cache of ``cache_rows`` pages of
    # PAGE_SIZE slots, sequence b's slot j in page block_table[b, j // PAGE_SIZE] (a compile a page size).
    # PACK_GQA (decoding with grouped heads): one program's rows are the query rows of every query
    # head of one key/value head, which it then reads once for all of them; num_heads counts
    # key/value heads, and one row block holds them all. A mask or bias plane is then one that
    # every head shares (head stride 0), read at the rows' query positions.
    tl.static_assert(not (PACK_GQA and (HAS_ALIBI or HAS_DROPOUT)))
    tl.static_assert(not (PAGED and USE_TMA))  # pages are gathered key by key
    # ---- which (batch, head, row block) this program owns -------------------------------
    pid = tl.program_id(0)
    if SPLIT_KV:  # and which share of its keys: Out / Lse are then the float32 partials
        split = pid % num_splits
        pid = pid // num_splits
        Out += split.to(tl.int64) * stride_o_split
        Lse += split.to(tl.int64) * stride_l_split
    # Float arguments arrive in float64 (a plain Python float would be rounded to float32,
    # which float64 inputs would notice); compute in the accumulator's precision.
    qk_scale = tl.full([], qk_scale, ACC)
    softcap_log2 = tl.full([], softcap_log2, ACC)
    num_bh = tl.num_programs(0) // (num_m_blocks * num_splits)
    if HEAVY_FIRST:
        # Causal-like masks make late row blocks the most expensive: launch them first,
        # across every head, so the last wave is made of cheap blocks.
        m_block = num_m_blocks - 1 - pid // num_bh
        bh = pid % num_bh
    else:
        # Row blocks of one head side by side: they share its K/V through L2.
        m_block = pid % num_m_blocks
        bh = pid // num_m_blocks
    b = bh // num_heads
    h = bh % num_heads
    h_kv = h // kv_group
    if PACK_GQA:
        h_kv = h
        h = h * kv_group  # the group's first query head; each row adds its own below

    total_q = seqlen_q  # varlen: the packed rows
    q_start, seqlen_q, valid_q = _sequence(cu_seqlens_q, b, seqlen_q, IS_VARLEN)
    kv_b = b  # the K / V batch row
    table_row = block_table + b.to(tl.int64) * stride_table  # (PAGED only)
    if KV_CACHE:
        kv_b, k_start, seqlen_k, valid_k = _cache_keys(cache_seqlens, cu_seqlens_k, cache_batch_idx, cache_leftpad, b,
                                                       seqlen_new, seqlen_k, cache_rows, HAS_BATCH_IDX, HAS_LEFTPAD,
                                                       PAGED, IS_VARLEN)
    else:
        k_start, seqlen_k, valid_k = _sequence(cu_seqlens_k, b, seqlen_k, IS_VARLEN)
    m0 = m_block * BLOCK_M
    if m0 >= seqlen_q:  # varlen: this sequence is shorter than the longest one
        return
    shift = seqlen_k - seqlen_q if BOTTOM_RIGHT else 0
    # ---- the range of key blocks this row block can see (and this share of them) ---------
    lo, full_lo, full_hi, hi = _key_blocks(m0, seqlen_q, seqlen_k, shift, window_left, window_right,
                                           BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if SPLIT_KV:
        s_lo, s_hi = _split_share(lo, hi, split, num_splits, BLOCK_N)
    else:
        s_lo, s_hi = lo, hi
    first_slot = k_start.to(tl.int32)  # (PAGED: slots of a block-table row, int32)
    if PAGED:  # the table entries of the keys this program reads name pages of the cache; a bad
        # one makes this share NaN, whose weight in the combine is then NaN: the whole row is NaN.
        # (Not every share the whole row: 4096 entries in 32 dependent steps at 64k keys in pages of 16.)
        valid_k &= _pages_ok(table_row, (first_slot + s_lo) // PAGE_SIZE, tl.cdiv(first_slot + s_hi, PAGE_SIZE),
                             cache_rows)
    if IS_VARLEN or KV_CACHE:  # bad contents (see _sequence), or a sequence longer than the grid: NaN
        if PACK_GQA:  # the one row block holds every head of the group
            fits = seqlen_q * kv_group <= BLOCK_M
        else:
            fits = seqlen_q <= num_m_blocks * BLOCK_M
        if not (valid_q & valid_k & fits):
            nan_first, nan_end = _rows_to_spoil(q_start, seqlen_q, total_q, m0, m_block == num_m_blocks - 1, BLOCK_M)
            for g in range(kv_group if PACK_GQA else 1):  # the group's query heads where packed
                # (dense: this batch's plane; packed sequences' batch strides are 0)
                o_plane = Out + b.to(tl.int64) * stride_ob + (h + g).to(tl.int64) * stride_oh
                _nan_rows(o_plane, stride_os, nan_first, nan_end, HEAD_DIM)
                _nan_rows(Lse + b.to(tl.int64) * stride_lb + (h + g).to(tl.int64) * stride_lh, stride_ls,
                          nan_first, nan_end, 1)
            return

    # ---- pointers (int64: batch*seqlen*heads*headdim may pass 2^31) ----------------------
    b64 = b.to(tl.int64)
    rows = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    if PACK_GQA:  # row r is query row r % seqlen_q of the group's query head r // seqlen_q
        head_of_row = (rows // seqlen_q).to(tl.int64)  # [BLOCK_M]
        row_ok = rows < seqlen_q * kv_group
        rows = rows % seqlen_q  # query positions: what the masks compare
        q_rows = rows.to(tl.int64) * stride_qs + head_of_row * stride_qh  # [BLOCK_M] offsets
        o_rows = rows.to(tl.int64) * stride_os + head_of_row * stride_oh
        l_rows = rows.to(tl.int64) * stride_ls + head_of_row * stride_lh
    else:
        row_ok = rows < seqlen_q
        q_rows = rows.to(tl.int64) * stride_qs
        o_rows = rows.to(tl.int64) * stride_os
        l_rows = rows.to(tl.int64) * stride_ls
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    q_base = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + q_start * stride_qs
    if PAGED:  # each key's row is looked up in the block table (_page_slots): the head's column only
        k_base = K + h_kv.to(tl.int64) * stride_kh
        v_base = V + h_kv.to(tl.int64) * stride_vh
    else:
        k_base = K + kv_b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh + k_start * stride_ks
        v_base = V + kv_b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh + k_start * stride_vs
    q_ptrs = q_base + q_rows[:, None] + offs_d[None, :]  # [BLOCK_M, BLOCK_D]
    k_ptrs = k_base + offs_n[None, :] * stride_ks + offs_d[:, None]  # [BLOCK_D, BLOCK_N]
    v_ptrs = v_base + offs_n[:, None] * stride_vs + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
    # Tensor descriptors of this (batch, head) when USE_TMA, else the base pointers.
    q_desc = _tile_source(q_base, seqlen_q, stride_qs, BLOCK_M, BLOCK_D, HEAD_DIM, USE_TMA)
    k_desc = _tile_source(k_base, seqlen_k, stride_ks, BLOCK_N, BLOCK_D, HEAD_DIM, USE_TMA)
    v_desc = _tile_source(v_base, seqlen_k, stride_vs, BLOCK_N, BLOCK_D, HEAD_DIM, USE_TMA)
    bias_base = Bias + b64 * stride_bb + h.to(tl.int64) * stride_bh  # this (batch, head)'s mask plane
    if HAS_ALIBI:
        slope_log2 = tl.load(Slopes + b * stride_sb + h * stride_sh).to(ACC) * RCP_LN2
    else:
        slope_log2 = 0.0

    rng_row0 = _rng_row0(b, h, num_heads, q_start, rng_rows, IS_VARLEN)

    # ---- the Q tile stays resident -------------------------------------------------------
    if USE_TMA and not PACK_GQA:
        q = q_desc.load([m0, 0])  # [BLOCK_M, BLOCK_D]
    else:
        q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
    l_i = tl.zeros([BLOCK_M], dtype=ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
    if HAS_SINKS:  # the sink is the first score the running max and sum hold (in one key share only)
        sink_heads = h + (head_of_row if PACK_GQA else tl.zeros([BLOCK_M], tl.int64))  # [BLOCK_M]
        m_i = tl.load(Sinks + sink_heads, mask=row_ok, other=0.0).to(ACC) * RCP_LN2
        if SPLIT_KV:
            m_i = tl.where(split == 0, m_i, float("-inf"))
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0).to(ACC)  # exp(sink - sink), or no sink (-inf)

    # Three stretches: left window edge (masked), interior (no mask), diagonal / right window
    # edge / sequence end (masked); static_range makes MASKED a compile-time constant in each.
    # EDGES_LAST (windows with a left edge) visits the interior first: with the left edge's loop
    # first, ptxas serialized the D = 64 build's wgmma (C7515), as it did the backward's dK/dV.
    for i in tl.static_range(3):
        start, end = _stretch(i, lo, full_lo, full_hi, hi, EDGES_LAST)
        if SPLIT_KV:  # this share's part of the stretch (block-aligned: the mask-free one stays so)
            start, end = tl.maximum(start, s_lo), tl.minimum(end, s_hi)
        acc, m_i, l_i = _attn_fwd_stretch(
            acc, m_i, l_i, q, start, end, k_desc, v_desc, k_ptrs, v_ptrs, bias_base, stride_ks, stride_vs,
            stride_bm, stride_bn, rows, offs_n, offs_d, seqlen_q, seqlen_k, shift, window_left, window_right,
            qk_scale, softcap_log2, slope_log2, dropout_p, dropout_seed, rng_row0, rng_cols,
            table_row, first_slot, stride_kb, stride_vb, PAGE_SIZE,
            HEAD_DIM, BLOCK_D, BLOCK_N, i != 1 - EDGES_LAST, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, BIAS_KIND,
            HAS_DROPOUT, DOT_PRECISION, USE_TMA, PAGED)

    # ---- one division at the end; empty rows give 0 and lse = +inf -----------------------
    # (a share with no visible key: lse = -inf, so that the combine gives it no weight; a row
    # with a sink is never empty: it gives 0 and lse = the sink where it sees no key)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf") if SPLIT_KV else float("inf"),
                   (m_i + tl.math.log2(l_safe)) * tl.full([], LN2, ACC))
    o_base = Out + b64 * stride_ob + h.to(tl.int64) * stride_oh + q_start * stride_os
    if USE_TMA and not (SPLIT_KV or PACK_GQA):
        o_desc = _tile_source(o_base, seqlen_q, stride_os, BLOCK_M, BLOCK_D, HEAD_DIM, USE_TMA)
        o_desc.store([m0, 0], out.to(Out.dtype.element_ty))
    else:
        o_ptrs = o_base + o_rows[:, None] + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    l_ptrs = Lse + b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start * stride_ls + l_rows
    tl.store(l_ptrs, lse.to(Lse.dtype.element_ty), mask=row_ok)


@triton.jit
def _attn_fwd_combine_kernel(
    OutPart, LsePart, Out, Lse, cu_seqlens,
    stride_o_split, stride_l_split,
    num_rows, num_heads, rows_per_batch, num_splits, batch,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
    IS_VARLEN: tl.constexpr = False,
):
    """out = sum_s exp(lse_s - lse) * out_s with lse = log(sum_s exp(lse_s)): the key shares of
    a split forward weighed together, BLOCK_R (row, head) pairs a program, all BLOCK_S >=
    num_splits shares of them loaded at once (a loop over the shares waited for each share's
    loads in turn: 11-14 us for 16-17 shares at batch 1, more than the forward's shares took). Out
    (rows, heads, HEAD_DIM) and the partials are contiguous; Lse is (batch, heads, rows_per_batch),
    or (heads, rows) for varlen (rows_per_batch = rows). Rows no share sees: 0 and lse = +inf,
    as are IS_VARLEN's padding rows, which no share wrote (``_padding_start``)."""
    pid = tl.program_id(0)
    pairs = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R] (row, head) pairs
    ok = pairs < num_rows * num_heads
    row = pairs // num_heads
    h = pairs % num_heads
    offs_s = tl.arange(0, BLOCK_S)  # [BLOCK_S] shares
    offs_d = tl.arange(0, BLOCK_D)
    l_offs = ((row // rows_per_batch) * num_heads + h).to(tl.int64) * rows_per_batch + row % rows_per_batch
    seen = ok
    if IS_VARLEN:
        seen &= row < _padding_start(cu_seqlens, batch, num_rows)
    ls_ok = seen[:, None] & (offs_s[None, :] < num_splits)  # [BLOCK_R, BLOCK_S]
    lse_s = tl.load(LsePart + offs_s[None, :] * stride_l_split + l_offs[:, None], mask=ls_ok,
                    other=float("-inf"))  # [BLOCK_R, BLOCK_S]
    o_offs = pairs[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :]  # [BLOCK_R, BLOCK_D]
    o_ok = ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    o_s = tl.load(OutPart + offs_s[None, :, None] * stride_o_split + o_offs[:, None, :],
                  mask=ls_ok[:, :, None] & o_ok[:, None, :], other=0.0)  # [BLOCK_R, BLOCK_S, BLOCK_D]
    m = tl.max(lse_s, axis=1)  # [BLOCK_R]
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # no share saw a key: no NaN from -inf - -inf
    w = tl.exp(lse_s - m_safe[:, None])  # [BLOCK_R, BLOCK_S]
    weight = tl.sum(w, axis=1)  # [BLOCK_R]
    acc = tl.sum(w[:, :, None] * o_s, axis=1)  # [BLOCK_R, BLOCK_D]
    empty = weight == 0.0
    w_safe = tl.where(empty, 1.0, weight)
    tl.store(Out + o_offs, (acc / w_safe[:, None]).to(Out.dtype.element_ty), mask=o_ok)
    tl.store(Lse + l_offs, tl.where(empty, float("inf"), m_safe + tl.log(w_safe)).to(Lse.dtype.element_ty), mask=ok)


def _combine_rows(num_splits: int, block_d: int) -> int:
    """(row, head) pairs a combine program: 16, fewer as the shares grow, so that a program holds
    at most 4096 partial values (32 registers a thread at 4 warps); one at batch 1 with 17 shares of
    D = 128, which spreads the pairs over as many programs as there are pairs."""
    return max(1, min(16, 4096 // (next_power_of_2(num_splits) * block_d)))


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttnFwdConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool = False  # tensor descriptors (Hopper's copy engine) when strides allow
    num_splits: int = 0  # key shares a row block (split_kv); 0: chosen by kv_splits
    pack_gqa: bool = True  # where packs_gqa allows: a key/value head's query heads in one row block
    maxnreg: Optional[int] = None  # registers a thread, at most (ptxas spills past it)
    # Decoding: where two programs an SM would leave shares of at most this many keys, one an SM
    # (kv_splits); 0: two an SM whatever the shares' length
    short_share_keys: int = 0
    # Decoding: where one program an SM takes all the keys in one share (no combine kernel), one
    # an SM for up to this many keys (kv_splits); 0: never for that reason
    one_share_keys: int = 0


# Decoding's key shares of at most this many keys take shallower pipelines (_fwd_tiles).
SHORT_SHARE_KEYS = 512
# Keys per (batch, head) up to which D = 256 loads through pointers: there the descriptors' set-up
# is not paid back (512 tokens, two tile searches: 331 / 340 vs 314 / 311 TFLOP/s non-causal, 203
# vs 182 / 183 causal); from 4k on they win (510 vs 480, 540 vs 493).
SHORT_KEYS = 512


def default_config(head_dim: int, dtype: torch.dtype, device: torch.device, causal: bool = False,
                   seqlen_k: Optional[int] = None, dropout: bool = False, rows: Optional[int] = None,
                   paged: bool = False, share_keys: Optional[int] = None) -> AttnFwdConfig:
    """Tile shapes searched on the H200 (benchmarks/results/), by head-dim bucket and, for D = 256,
    by length bucket (``seqlen_k``: keys per sequence, the longest for varlen), and for dropout;
    small and quick to interpret on CPU. ``rows``: the query rows one row block must hold (the
    group's heads times the query rows where heads are packed); up to DECODE_ROWS, decoding's tiles
    (``decode_config``), ``paged`` ones for keys gathered through a block table, and for
    ``share_keys``, the keys of a share (``forward_plan`` asks again once it knows them)."""
    decoding = rows is not None and rows <= DECODE_ROWS
    if device.type != "cuda":
        cfg = AttnFwdConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)
    else:
        cfg = _fwd_tiles(head_dim, dtype, has_tma(device), seqlen_k, dropout, decoding, paged, share_keys)
    return decode_config(cfg, rows) if decoding else cfg


def _fwd_tiles(head_dim: int, dtype: torch.dtype, hopper: bool, seqlen_k: Optional[int],
               dropout: bool = False, decoding: bool = False, paged: bool = False,
               share_keys: Optional[int] = None) -> AttnFwdConfig:
    block_d = _block_d(head_dim)
    one_block_shares = share_keys is not None and share_keys <= 128
    short_shares = share_keys is not None and share_keys <= SHORT_SHARE_KEYS
    if dtype in (torch.float32, torch.float64):  # wider elements: smaller tiles fit shared memory
        return AttnFwdConfig(block_m=64, block_n=32, num_warps=4, num_stages=2, use_tma=hopper)
    if dropout and block_d <= 128:
        # The mask's random numbers need registers: 64-row tiles (D = 128: no spill instead of 992
        # bytes) ran the forward at p = 0.1 in 0.87 / 0.62 x the time of the plain tiles at D = 64 /
        # 128 (attention_dropout_h200_2026-11-30_s16a.json).
        return AttnFwdConfig(block_m=64, block_n=64, num_warps=4, num_stages=2 if block_d > 64 else 3,
                             use_tma=hopper and block_d > 64)
    if decoding and paged and block_d <= 128:
        # Keys gathered through the block table (no descriptors): blocks of 128 keys took 0.89-0.92
        # x the time of the dense cache's 64-key tiles on the same pages at D = 128 (pages of 16 and
        # 256, batch 1 and 16, 4k and 64k keys); at D = 64 five stages took 0.86 x the time of three
        # (one shape: batch 1, 64k keys; the pipeliner spends stages on the page numbers too)
        # (attention_decode_paged_tiles_*_h200_2026-12-03_s48c.json). Where a share holds one such
        # block, two of 64 keys in two stages took 0.76-0.87 x the time at D = 64, 0.83-0.99 at D =
        # 128 (1.03-1.59 with longer shares); where it holds up to four, three stages instead of D =
        # 64's five 0.86-0.95 x (1.14-1.20 from eight blocks on) (pages of 16 and 256, batch 1 / 4 /
        # 16, 1k-4k keys: attention_decode_paged_tiles_{16,256}_h200_2026-12-03_s50a.json). At D = 128
        # eight warps for the 64-key blocks: 0.92-0.95 x the time (_s50b.json).
        if one_block_shares:
            return AttnFwdConfig(block_m=128, block_n=64, num_warps=4 if block_d <= 64 else 8, num_stages=2,
                                 use_tma=False)
        return AttnFwdConfig(block_m=128, block_n=128, num_warps=4,
                             num_stages=5 if block_d <= 64 and not short_shares else 3, use_tma=False)
    if decoding and block_d <= 128:
        # A few rows against many keys: the time is the cache's bytes, which one program an SM
        # pulls as fast as it keeps bytes in flight: three stages of 128 keys at D = 64 (32 KB of K
        # and V a stage), of 64 keys at D = 128 (attention_decode_tiles_h200_2026-12-02_s46a.json, _s46b).
        # Through pointers, not tensor descriptors: at D = 128 one query row a sequence took 0.82-1.00
        # x the time with them (batch 1, 4, 16; 1k-64k keys; attention_decode_shares_tma_h200_2026-12-03_s48f.json).
        # block_m is decode_config's. At D = 128, where two programs an SM would leave shares of at
        # most 512 keys, one an SM (``short_share_keys``) took 0.86 x the time at batch 1 with 4k keys,
        # 0.94 with 16k, 0.85 at batch 16 with 1k (one share: no combine), 0.99-1.01 at batch 1 with 1k
        # and batch 4 with 1k / 4k; with longer shares 0.97-1.03 (attention_decode_shares_tma_h200_
        # 2026-12-03_s48f.json, both through pointers). Not at D = 64, where one an SM ran 0.89-1.10 x
        # the time, nor at D = 256, 1.0-1.21 x (attention_decode_shares_d64_d256_h200_2026-12-03_s49a.json).
        # Where one an SM takes all the keys in one share (no combine kernel): 0.89-0.90 x the time at
        # D = 64 and batch 16 with 1k keys, 0.93-0.95 with 4k, 0.97 at D = 128 with 4k; 0.98-1.03 from
        # 16k (three runs at D = 64: s49a and attention_decode_shares_d64_{1,2}_h200_2026-12-03_s50a.json;
        # attention_decode_shares_h200_2026-12-03_s49b.json). At D = 64, shares of up to 512 keys in two
        # stages: 0.87-0.98 x the time at batch 1 and 4 with 1k-4k keys, but 1.25-1.59 x for batch 16's
        # one share of 1k-4k (attention_decode_tiles_d64_h200_2026-12-03_s50b.json).
        return AttnFwdConfig(block_m=128, block_n=128 if block_d <= 64 else 64, num_warps=4,
                             num_stages=2 if block_d <= 64 and short_shares else 3, use_tma=False,
                             short_share_keys=0 if block_d <= 64 else 512, one_share_keys=4096)
    if block_d <= 64:  # small tiles: pointer loads pipeline as well as descriptors and skip their setup
        return AttnFwdConfig(block_m=128, block_n=64, num_warps=4, num_stages=3, use_tma=False)
    if block_d <= 128:
        return AttnFwdConfig(block_m=128, block_n=64, num_warps=4, num_stages=2, use_tma=hopper)
    short = seqlen_k is not None and seqlen_k <= SHORT_KEYS
    cfg = AttnFwdConfig(block_m=128, block_n=64, num_warps=8, num_stages=2, use_tma=hopper and not short)
    if decoding and paged:
        # At most 128 registers, so that two programs of 8 warps share an SM (decoding's shares
        # count on two an SM): ptxas gave the paged forward 128 registers (8 bytes spilled) as
        # flash_attn_with_kvcache launches it, but 184 as flash_attn_varlen_func does (batch 1,
        # 64k keys in pages of 16, built offline as launched), and that launch took 1.62-1.80 x
        # the other's time (attention_decode_paged_d256_h200_2026-12-03_s48e.json).
        cfg = dataclasses.replace(cfg, use_tma=False, maxnreg=128)
    return cfg


# Split the keys only where each share keeps at least this many keys (a share's fixed cost, the
# Q tile and the float32 partial it writes, is then a small part), into at most MAX_KV_SPLITS
# shares.
MIN_KEYS_PER_SPLIT = 256
MAX_KV_SPLITS = 64
# Decoding's row blocks (at most DECODE_ROWS rows) leave room for two programs an SM: their shares
# go down to one key block, as many as give every SM two programs and no more (a third program on
# some SMs makes those the last to finish: 17 shares of 8 key heads, 136 programs, ran 0.81-0.86 x
# as fast as 16 at batch 1 and 4k keys; attention_decode_shares_h200_2026-12-02_s47c.json); one an
# SM where that leaves short shares, or one share of a short cache, and the tiles say so
# (AttnFwdConfig.short_share_keys, one_share_keys).
DECODE_PROGRAMS_PER_SM = 2


def kv_splits(programs: int, keys: int, block_n: int, sms: int, decoding: bool = False,
              short_share_keys: int = 0, one_share_keys: int = 0) -> int:
    """Key shares a row block for a call of ``programs`` (batch x heads x row blocks) whose rows
    see ``keys`` keys in blocks of ``block_n``: 1 where the programs fill the SMs, else enough
    shares to fill them once, each of whole blocks and at least MIN_KEYS_PER_SPLIT keys; where
    ``decoding``, shares of a block or more, DECODE_PROGRAMS_PER_SM an SM at most, or one an SM
    where those shares would hold at most ``short_share_keys`` keys, or where one an SM leaves a
    single share of at most ``one_share_keys`` keys."""
    if programs >= sms:
        return 1
    if decoding:
        shares = max(1, min(DECODE_PROGRAMS_PER_SM * sms // programs, cdiv(keys, block_n), MAX_KV_SPLITS))
        one_an_sm = max(1, min(sms // programs, cdiv(keys, block_n), MAX_KV_SPLITS))
        if keys <= shares * short_share_keys or (one_an_sm == 1 and keys <= one_share_keys):
            shares = one_an_sm
        return shares
    min_blocks = max(1, MIN_KEYS_PER_SPLIT // block_n)
    return max(1, min(cdiv(sms, programs), cdiv(keys, block_n) // min_blocks, MAX_KV_SPLITS))


# Row blocks of at most this many rows take decoding's tiles; packed heads (query rows x group
# size together) go into one such block.
DECODE_ROWS = 64


def packs_gqa(q: torch.Tensor, k: torch.Tensor, opts: AttnOptions) -> bool:
    """Whether a call's query heads may share their key/value head's row block (``PACK_GQA``):
    grouped heads, at most DECODE_ROWS rows together (the longest sequence's for varlen), and
    nothing that differs by query head (ALiBi slopes, dropout's counters, a mask or bias plane of
    its own: a plane broadcast over the heads is shared)."""
    group = q.shape[-2] // k.shape[-2]
    rows = opts.max_seqlen_q if opts.varlen else q.shape[1]
    shared_bias = opts.bias is None or opts.bias.shape[1] == 1 or opts.bias.stride(1) == 0
    return (group > 1 and group * rows <= DECODE_ROWS and opts.alibi_slopes is None and shared_bias
            and opts.dropout_p == 0)


def decode_config(cfg: AttnFwdConfig, rows: int) -> AttnFwdConfig:
    """``cfg`` for calls whose row blocks need at most 64 rows (decoding: one query row a sequence,
    times the group where heads are packed): row blocks of the next power of two from 16 (tl.dot's
    least), not 128 of mostly padding, whose products would bound a key block's time instead of
    its loads."""
    if rows > DECODE_ROWS or cfg.block_m <= 16:
        return cfg
    return dataclasses.replace(cfg, block_m=min(cfg.block_m, max(16, next_power_of_2(rows))))


_TL_ACC = {torch.float32: tl.float32, torch.float64: tl.float64}


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # Accumulate (and keep the log-sum-exp) in float32; float64 inputs, used for gradient
    # checks, stay in float64 throughout.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 products in IEEE float32, not tf32: as exact as PyTorch's float32 attention.
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def _block_d(head_dim: int) -> int:
    # tl.dot needs every dimension >= 16 and a power of two.
    return max(16, next_power_of_2(head_dim))


def _bshd_strides(t: torch.Tensor, varlen: bool):
    # Dense (B, S, H, D) or packed (total, H, D): the kernels take (batch, seq, head) strides.
    return (0, t.stride(0), t.stride(1)) if varlen else (t.stride(0), t.stride(1), t.stride(2))


def _lse_strides(lse: torch.Tensor, varlen: bool):
    # Dense (B, H, Sq) or packed (H, total_q): the kernels take (batch, head, row) strides.
    return (0, lse.stride(0), lse.stride(1)) if varlen else tuple(lse.stride())


@dataclass(frozen=True, eq=False)
class KVCache:
    """Where each sequence's keys lie when k / v are a KV cache (cache_rows, slots, heads_kv,
    headdim), which ``flash_attn_with_kvcache`` passes (forward only): sequence b sees slots
    ``leftpad[b]`` to ``seqlens[b] + new - 1`` of cache row ``batch_idx[b]`` (or b). Tensors are
    (batch,) int32 / int64 on the device, read by the kernel as they are (no host sync, nothing
    launched to convert them)."""
    seqlens: torch.Tensor  # keys before the new ones (packed queries: from cu_seqlens_k, not read)
    new: int = 0  # new keys a sequence, already in the cache
    batch_idx: Optional[torch.Tensor] = None
    leftpad: Optional[torch.Tensor] = None
    # A paged cache (num_pages, page_size, heads_kv, headdim): int32 (batch, pages a sequence), slot
    # j of sequence b in page block_table[b, j // page_size] (no batch_idx then).
    block_table: Optional[torch.Tensor] = None

    def slots(self, k: torch.Tensor) -> int:
        """Slots a sequence: its cache row's, or its block-table row's pages x page_size."""
        return k.shape[1] * (self.block_table.shape[1] if self.block_table is not None else 1)


@dataclass(frozen=True, eq=False)
class AttnOptions:
    """Everything a call asks for besides q, k, v: the forward and backward launchers take the
    same options, so that a backward pass recomputes exactly what its forward computed.

    ``window_right = 0`` is causal (``bottom_right`` aligns it to the last key); ``bias`` is a
    bool (True = attend) or additive float tensor already expanded to (B, H, Sq, Sk); varlen
    calls pass int32 ``cu_seqlens_*`` and the longest lengths; ``dropout_p > 0`` drops with a
    mask drawn from ``dropout_seed``.
    """
    softmax_scale: float
    window_left: int = -1
    window_right: int = -1
    bottom_right: bool = True
    softcap: float = 0.0
    alibi_slopes: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_k: Optional[int] = None
    dropout_p: float = 0.0
    dropout_seed: int = 0
    deterministic: bool = False  # the backward: bitwise-identical gradients (no atomics)
    kv_cache: Optional[KVCache] = None  # k / v are a KV cache (dense forward only)
    sinks: Optional[torch.Tensor] = None  # (heads,) attention sinks: a score a query head, value zero

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None


def _variant(q, k, opts: AttnOptions):
    """What forward and backward launches share: optional pointers, their strides, and the
    scalar and constexpr arguments that select the kernel variant."""
    varlen, bias, slopes = opts.varlen, opts.bias, opts.alibi_slopes
    dummy = q  # stands in for absent optional pointers; never dereferenced
    pointers = (bias if bias is not None else dummy, slopes if slopes is not None else dummy,
                opts.cu_seqlens_q if varlen else dummy, opts.cu_seqlens_k if varlen else dummy)
    if slopes is None:
        slope_strides = (0, 0)
    elif slopes.dim() == 2:  # (batch, heads)
        slope_strides = tuple(slopes.stride())
    else:  # (heads,): the same slopes for every batch
        slope_strides = (0, slopes.stride(0))
    bias_strides = (0, 0, 0, 0) if bias is None else tuple(bias.stride())
    has_softcap = opts.softcap > 0
    kwargs = dict(
        qk_scale=opts.softmax_scale / opts.softcap if has_softcap else opts.softmax_scale * RCP_LN2.value,
        softcap_log2=opts.softcap * RCP_LN2.value,
        window_left=opts.window_left,
        window_right=opts.window_right,
        HAS_LEFT=opts.window_left >= 0,
        HAS_RIGHT=opts.window_right >= 0,
        BOTTOM_RIGHT=opts.bottom_right,
        HAS_SOFTCAP=has_softcap,
        HAS_ALIBI=slopes is not None,
        BIAS_KIND=BIAS_NONE if bias is None else (BIAS_BOOL if bias.dtype == torch.bool else BIAS_ADD),
        IS_VARLEN=varlen,
        DOT_PRECISION=_dot_precision(q.dtype),
        ACC=_TL_ACC[_acc_dtype(q.dtype)],
        HAS_DROPOUT=opts.dropout_p > 0,
        dropout_p=float(opts.dropout_p),
        dropout_seed=int(opts.dropout_seed),
        # Dropout counters: one per (head, query row, key) of the whole call.
        rng_rows=q.shape[0] if varlen else q.shape[1],
        rng_cols=k.shape[0] if varlen else k.shape[1],
    )
    return pointers, bias_strides, slope_strides, kwargs


def _plain(q: torch.Tensor, opts: AttnOptions) -> bool:
    """No mask or a causal one, nothing else on top, on a GPU: what the Gluon kernels take."""
    return (q.is_cuda and opts.window_left < 0 and opts.window_right in (-1, 0) and opts.softcap == 0
            and opts.alibi_slopes is None and opts.bias is None and not opts.varlen and opts.dropout_p == 0
            and opts.kv_cache is None and gluon_enabled())


def _fast_path_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: AttnOptions) -> bool:
    """Whether the warp-specialized Gluon kernel (Hopper) takes this call: ``_plain`` and the
    shapes and strides it needs. ``QFLASH_GLUON=0`` turns it off."""
    if not _plain(q, opts):
        return False
    from qflash.kernels import attention_gluon

    return attention_gluon.why_not(q, k, v) is None


def _fast_backward_fits(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, opts: AttnOptions) -> bool:
    """Whether the Gluon backward (Hopper, D = 64 / 128 / 256) takes this call: as the forward, and
    where ``deterministic`` or ``torch.use_deterministic_algorithms`` asks for the same bits from
    run to run, only at a head dim where it gives them (D = 256; at D = 64 / 128 its dQ is summed
    in any order)."""
    if not _plain(q, opts):
        return False
    from qflash.kernels import attention_gluon

    deterministic = opts.deterministic or torch.are_deterministic_algorithms_enabled()
    if deterministic and not attention_gluon.bwd_deterministic(q.shape[-1]):
        return False
    return (attention_gluon.bwd_preferred(q.shape[-1], opts.window_right == 0, k.shape[1])
            and lse.dtype == torch.float32 and lse.is_contiguous() and lse.data_ptr() % 16 == 0  # read by TMA
            and attention_gluon.bwd_why_not(q, k, v, out, dout) is None)


_fwd_launcher = CachedLauncher(_attn_fwd_kernel)
_combine_launcher = CachedLauncher(_attn_fwd_combine_kernel)
_fill_padding_launcher = CachedLauncher(_fill_padding_kernel)
FILL_BLOCK = 1024  # values a step of a padding fill
FILL_PROGRAMS = 64  # at most: padding is rare and short, and a grid of idle programs costs


def _region(t: torch.Tensor, row_dim: int):
    """(stride between rows, stride between a row's entries, entries a row) of a contiguous packed
    output whose rows run along ``row_dim`` (0: out / dQ / dK / dV (total, heads, D); 1: the
    log-sum-exp (heads, total))."""
    return (t.stride(row_dim), 1 if row_dim == 0 else t.stride(0), t.numel() // max(t.shape[row_dim], 1))


def fill_padding(cu_seqlens: torch.Tensor, x: torch.Tensor, y: Optional[torch.Tensor] = None, *,
                 y_is_lse: bool = False) -> None:
    """One launch that writes the packed rows after every sequence (``_fill_padding_kernel``):
    zeros into x's (total, ...) and y's, where y is x's shape, or +inf into the log-sum-exp's
    (heads, total) where ``y_is_lse``. Contiguous outputs, as the launchers allocate them."""
    if x.numel() == 0:
        return
    y_region = (0, 0, 0) if y is None else _region(y, 1 if y_is_lse else 0)
    _fill_padding_launcher[(min(FILL_PROGRAMS, cdiv(x.numel(), FILL_BLOCK)),)](
        x, x if y is None else y, cu_seqlens, cu_seqlens.numel() - 1, x.shape[0], *_region(x, 0), *y_region,
        X_VALUE=0.0, Y_VALUE=float("inf") if y_is_lse else 0.0, HAS_Y=y is not None, BLOCK=FILL_BLOCK,
    )


@dataclass(frozen=True)
class FwdPlan:
    """How the tl forward runs a call: its tiles, whether grouped heads share a row block
    (``PACK_GQA``), the (batch, head, row block) programs and the key shares of each."""
    config: AttnFwdConfig
    pack: bool
    grid_heads: int  # key/value heads where packed, else query heads
    num_m_blocks: int
    programs: int
    num_splits: int


def forward_plan(q: torch.Tensor, k: torch.Tensor, opts: AttnOptions,
                 config: Optional[AttnFwdConfig] = None) -> FwdPlan:
    """The tl forward's plan for a call (``attention_forward`` launches by it; the tests and the
    decode benchmark read it): ``config`` or the default tiles, made for decoding where rows are few
    (for the length of their key shares, which the key blocks bound: a second look at the tiles)."""
    if opts.varlen:  # rows and keys: the longest sequence's
        _, num_heads, head_dim = q.shape
        batch, rows, keys = opts.cu_seqlens_q.numel() - 1, opts.max_seqlen_q, opts.max_seqlen_k
    else:
        batch, rows, num_heads, head_dim = q.shape
        keys = k.shape[1] if opts.kv_cache is None else opts.kv_cache.slots(k)
    kv_group = num_heads // k.shape[-2]
    packable = packs_gqa(q, k, opts) and (config is None or config.pack_gqa)
    paged = opts.kv_cache is not None and opts.kv_cache.block_table is not None
    tiles = functools.partial(default_config, head_dim, q.dtype, q.device, causal=opts.window_right >= 0,
                              seqlen_k=keys, dropout=opts.dropout_p > 0,
                              rows=rows * kv_group if packable else rows, paged=paged)
    cfg = config or tiles()
    pack = packable and cfg.block_m >= rows * kv_group  # one row block holds a whole group
    grid_heads = num_heads // kv_group if pack else num_heads
    num_m_blocks = 1 if pack else cdiv(max(rows, 1), cfg.block_m)
    programs = num_m_blocks * batch * grid_heads
    decoding = cfg.block_m <= DECODE_ROWS and (rows * kv_group if pack else rows) <= DECODE_ROWS

    def shares(cfg):
        return cfg.num_splits or (kv_splits(programs, keys, cfg.block_n, sm_count(q.device), decoding,
                                            cfg.short_share_keys, cfg.one_share_keys)
                                  if q.is_cuda and rows > 0 and programs > 0 else 1)

    num_splits = shares(cfg)
    if config is None and decoding and q.is_cuda:  # decoding's tiles for the shares' length
        cfg = tiles(share_keys=cdiv(keys, num_splits))
        num_splits = shares(cfg)
    return FwdPlan(cfg, pack, grid_heads, num_m_blocks, programs, num_splits)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: AttnOptions,
                      config: Optional[AttnFwdConfig] = None):
    """Launch the forward kernel. Inputs are already validated by the public op.

    Dense: q (B, Sq, H, D), k/v (B, Sk, Hkv, D), any strides with unit last stride.
    Varlen: q (total_q, H, D), k/v (total_k, Hkv, D) with int32 cu_seqlens.
    Returns (out, lse): lse float32 (float64 for float64 inputs) of shape (B, H, Sq),
    or (H, total_q) for varlen. Without an explicit ``config``, calls that the Gluon kernel
    takes (``attention_gluon.py``: Hopper, causal or no mask, D = 64 / 128 / 256, lengths multiple
    of 128) go there.
    """
    if config is None and _fast_path_fits(q, k, v, opts):
        from qflash.kernels import attention_gluon

        return attention_gluon.launch(q, k, v, opts.softmax_scale, causal=opts.window_right == 0,
                                      bottom_right=opts.bottom_right, sinks=opts.sinks)
    varlen = opts.varlen
    if varlen:
        total_q, num_heads, head_dim = q.shape
        # Per sequence, read in the kernel, which bounds the sequences by the packed rows (a
        # paged cache: by the pages a block-table row names).
        seqlen_q, seqlen_k = total_q, k.shape[0] if opts.kv_cache is None else opts.kv_cache.slots(k)
        lse_shape = (num_heads, total_q)
    else:
        batch, seqlen_q, num_heads, head_dim = q.shape
        seqlen_k = k.shape[1] if opts.kv_cache is None else opts.kv_cache.slots(k)
        lse_shape = (batch, num_heads, seqlen_q)
    plan = forward_plan(q, k, opts, config)
    cfg, num_splits = plan.config, plan.num_splits
    out = new_output(q.shape, dtype=q.dtype, device=q.device)
    lse = new_output(lse_shape, dtype=_acc_dtype(q.dtype), device=q.device)
    if plan.programs == 0:
        return out, lse
    if num_splits > 1:  # the kernel writes float32 shares, which the combine kernel weighs together
        out_part = new_output((num_splits, *q.shape), dtype=lse.dtype, device=q.device)
        lse_part = new_output((num_splits, *lse_shape), dtype=lse.dtype, device=q.device)
        # Share 0 starts where the parts do, laid out as out and lse are (all contiguous); share s
        # lies s split strides on. (The parts themselves, not share 0's views: a view is one aten op
        # more for a replay's recording to follow.)
        out_dst, lse_dst = out_part, lse_part
        split_strides = (out_part.stride(0), lse_part.stride(0))
    else:
        out_dst, lse_dst, split_strides = out, lse, (0, 0)
    cache = opts.kv_cache
    paged = cache is not None and cache.block_table is not None
    use_tma = cfg.use_tma and tma_compatible(q, k, v, out) and not paged
    if use_tma:
        ensure_descriptor_allocator(q.device)
    pointers, bias_strides, slope_strides, variant = _variant(q, k, opts)
    packed_kv = varlen and cache is None
    cache_pointers = (q, q, q, q) if cache is None else tuple(  # (absent ones stand in, never dereferenced)
        t if t is not None else q for t in (cache.seqlens, cache.batch_idx, cache.leftpad, cache.block_table))

    grid = (plan.programs * num_splits,)
    _fwd_launcher[grid](
        q, k, v, out_dst, lse_dst, *pointers, *cache_pointers,
        # (a cache's K / V keep their (rows or pages, slots, heads) strides, also under packed queries)
        *_bshd_strides(q, varlen), *_bshd_strides(k, packed_kv), *_bshd_strides(v, packed_kv),
        *_bshd_strides(out, varlen), *_lse_strides(lse, varlen), *bias_strides, *slope_strides,
        *split_strides,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        num_heads=plan.grid_heads,
        kv_group=num_heads // k.shape[-2],
        num_m_blocks=plan.num_m_blocks,
        num_splits=num_splits,
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        HEAVY_FIRST=opts.window_right >= 0,
        EDGES_LAST=opts.window_left >= 0,  # see the stretch loop
        USE_TMA=use_tma,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **_maxnreg(cfg),
        SPLIT_KV=num_splits > 1,
        PACK_GQA=plan.pack,
        seqlen_new=0 if cache is None else cache.new,
        cache_rows=k.shape[0],
        stride_table=cache.block_table.stride(0) if paged else 0,
        KV_CACHE=cache is not None,
        HAS_BATCH_IDX=cache is not None and cache.batch_idx is not None,
        HAS_LEFTPAD=cache is not None and cache.leftpad is not None,
        PAGED=paged,
        PAGE_SIZE=k.shape[1] if paged else 1,  # (a constant: one compile a page size)
        Sinks=q if opts.sinks is None else opts.sinks,
        HAS_SINKS=opts.sinks is not None,
        **variant,
    )
    if num_splits > 1:
        block_r = _combine_rows(num_splits, _block_d(head_dim))
        pairs = q.numel() // head_dim  # (query row, head) pairs
        _combine_launcher[(cdiv(pairs, block_r),)](
            out_part, lse_part, out, lse, opts.cu_seqlens_q if varlen else lse, *split_strides,
            num_rows=pairs // num_heads,
            num_heads=num_heads,
            rows_per_batch=q.shape[0] if varlen else seqlen_q,
            num_splits=num_splits,
            batch=opts.cu_seqlens_q.numel() - 1 if varlen else 0,
            HEAD_DIM=head_dim,
            BLOCK_D=_block_d(head_dim),
            BLOCK_R=block_r,
            BLOCK_S=next_power_of_2(num_splits),
            IS_VARLEN=varlen,
            num_warps=4,
        )
    elif varlen:  # rows after the last sequence: as rows that see no key (the combine writes them where it runs)
        fill_padding(opts.cu_seqlens_q, out, lse, y_is_lse=True)
    return out, lse


# ----------------------------------------------------------------------------------------------
# A KV cache's step: rotary embeddings and the new keys written in place, one launch
# ----------------------------------------------------------------------------------------------
@triton.jit
def _rotary_tile(src, offs, offs_d, ok, Cos, Sin, stride_cos, stride_sin, pos,
                 ROT_HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The tile at ``src + offs`` ([BLOCK_H, BLOCK_D] head rows of one position) in float32 with
    its first 2 * ROT_HALF dims rotated by the angles of table row ``pos``: pairs (2i, 2i + 1) when
    INTERLEAVED (GPT-J), else (i, i + ROT_HALF) (GPT-NeoX, Llama); a pair (x1, x2) becomes
    (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x = tl.load(src + offs, mask=ok, other=0.0).to(tl.float32)
    if ROT_HALF > 0:
        rotated = offs_d < 2 * ROT_HALF  # [BLOCK_D]
        if INTERLEAVED:
            partner, freq, first = offs_d ^ 1, offs_d // 2, offs_d % 2 == 0
        else:
            first = offs_d < ROT_HALF
            partner, freq = tl.where(first, offs_d + ROT_HALF, offs_d - ROT_HALF), offs_d % ROT_HALF
        pair = tl.load(src + offs - offs_d[None, :] + partner[None, :], mask=ok & rotated[None, :],
                       other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D] each dim's partner
        cos = tl.load(Cos + pos * stride_cos + freq, mask=rotated, other=1.0).to(tl.float32)  # [BLOCK_D]
        sin = tl.load(Sin + pos * stride_sin + freq, mask=rotated, other=0.0).to(tl.float32)
        x = x * cos[None, :] + tl.where(first[None, :], -pair, pair) * sin[None, :]
    return x


@triton.jit
def _kvcache_update_kernel(
    Q, QRot, K, V, KCache, VCache, Cos, Sin, cache_seqlens, cache_batch_idx, block_table,
    stride_qb, stride_qs, stride_qh, stride_rb, stride_rs, stride_rh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_cos, stride_sin, stride_table,
    batch, seqlen_q, seqlen_new, num_heads, num_heads_kv, slots, cache_rows, seqlen_ro, page_size,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_B: tl.constexpr,
    ROT_HALF: tl.constexpr, INTERLEAVED: tl.constexpr, Q_MOVES: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
    PAGED: tl.constexpr = False,
):
    """Program (b, t, head block): t < seqlen_new writes new key / value row t of sequence b
    (keys rotated) into its cache row at slot cache_seqlens[b] + t (PAGED: into row slot %
    page_size of page block_table[b, slot // page_size]); t >= seqlen_new rotates query row t -
    seqlen_new into QRot (only launched with rotary tables). A write lands only inside its cache
    row (or a page of the cache), and a row that several sequences name takes the last one's
    (none for a row outside the cache), so a bad position never reaches another sequence's slots
    (pages are the caller's to keep apart)."""
    pid, hb = tl.program_id(0), tl.program_id(1)
    rows_a_seq = seqlen_new + (seqlen_q if ROT_HALF > 0 else 0)
    b, t = pid // rows_a_seq, pid % rows_a_seq
    start = tl.load(cache_seqlens + b).to(tl.int32)  # the slot of the first new key
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_ok = offs_d[None, :] < HEAD_DIM
    if t < seqlen_new:
        row = tl.load(cache_batch_idx + b).to(tl.int32) if HAS_BATCH_IDX else b
        if HAS_BATCH_IDX:  # a later sequence that names the same row takes it
            for b0 in range(b + 1, batch, BLOCK_B):
                later = b0 + tl.arange(0, BLOCK_B)
                names = tl.load(cache_batch_idx + later, mask=later < batch, other=-1).to(tl.int32)
                row = tl.where(tl.sum((names == row).to(tl.int32)) > 0, -1, row)
        slot = start + t  # the key's position
        in_row = (slot >= 0) & (slot < slots)
        dst_slot = slot
        if PAGED:  # the page's number stands for the row, the slot in it for the slot
            row = tl.load(block_table + b.to(tl.int64) * stride_table + slot // page_size, mask=in_row, other=-1)
            dst_slot = slot % page_size
        if (row >= 0) & (row < cache_rows) & in_row:
            ok = (offs_h[:, None] < num_heads_kv) & d_ok  # [BLOCK_H, BLOCK_D]
            src = b.to(tl.int64) * stride_kb + t.to(tl.int64) * stride_ks
            pos = tl.minimum(slot, seqlen_ro - 1)
            key = _rotary_tile(K + src, offs_h[:, None] * stride_kh + offs_d[None, :], offs_d, ok, Cos, Sin,
                               stride_cos, stride_sin, pos, ROT_HALF, INTERLEAVED)
            dst = row.to(tl.int64) * stride_kcb + dst_slot.to(tl.int64) * stride_kcs
            tl.store(KCache + dst + offs_h[:, None] * stride_kch + offs_d[None, :], key.to(KCache.dtype.element_ty),
                     mask=ok)
            src = b.to(tl.int64) * stride_vb + t.to(tl.int64) * stride_vs
            value = tl.load(V + src + offs_h[:, None] * stride_vh + offs_d[None, :], mask=ok)
            dst = row.to(tl.int64) * stride_vcb + dst_slot.to(tl.int64) * stride_vcs
            tl.store(VCache + dst + offs_h[:, None] * stride_vch + offs_d[None, :], value, mask=ok)
    else:
        i = t - seqlen_new
        ok = (offs_h[:, None] < num_heads) & d_ok
        # rows move with the keys where causal or a window aligns them; positions past the table
        # (bad cache_seqlens, whose outputs are NaN anyway) read its ends
        pos = tl.minimum(tl.maximum(start + i * Q_MOVES, 0), seqlen_ro - 1)
        src = b.to(tl.int64) * stride_qb + i.to(tl.int64) * stride_qs
        x = _rotary_tile(Q + src, offs_h[:, None] * stride_qh + offs_d[None, :], offs_d, ok, Cos, Sin,
                         stride_cos, stride_sin, pos, ROT_HALF, INTERLEAVED)
        dst = b.to(tl.int64) * stride_rb + i.to(tl.int64) * stride_rs
        tl.store(QRot + dst + offs_h[:, None] * stride_rh + offs_d[None, :], x.to(QRot.dtype.element_ty), mask=ok)


_kvcache_update_launcher = CachedLauncher(_kvcache_update_kernel)


def kvcache_update(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: Optional[torch.Tensor],
                   v: Optional[torch.Tensor], cache: KVCache, rotary=None, q_moves: bool = False) -> torch.Tensor:
    """One launch before a KV-cache forward: k / v (batch, seqlen_new, heads_kv, D) into the caches
    in place at slots ``cache.seqlens[b]`` of rows ``cache.batch_idx[b]`` (or b; or of the pages
    ``cache.block_table`` names), the keys rotated, and q (batch, seqlen_q, heads, D) rotated into
    a new tensor, returned (q itself without ``rotary``). ``rotary``: (cos, sin, interleaved),
    tables (seqlen_ro, rotary_dim / 2); q's rows at cache_seqlens[b] + i where ``q_moves``, else at
    cache_seqlens[b]. Inputs validated by the public op."""
    batch, seqlen_q, heads, head_dim = q.shape
    new = 0 if k is None else k.shape[1]
    q_rot = q if rotary is None else new_output(q.shape, dtype=q.dtype, device=q.device)
    rows_a_seq = new + (0 if rotary is None else seqlen_q)
    if batch * rows_a_seq == 0:
        return q_rot
    cos, sin, interleaved = rotary if rotary is not None else (q, q, False)  # (q stands in, never read)
    k_, v_ = (k, v) if new else (k_cache, v_cache)  # (ditto)
    table = cache.block_table
    block_d = _block_d(head_dim)
    block_h = min(16, next_power_of_2(max(heads, k_cache.shape[2])))
    grid = (batch * rows_a_seq, cdiv(max(heads if rotary is not None else 0, k_cache.shape[2]), block_h))
    _kvcache_update_launcher[grid](
        q, q_rot, k_, v_, k_cache, v_cache, cos, sin, cache.seqlens,
        cache.batch_idx if cache.batch_idx is not None else cache.seqlens,
        table if table is not None else cache.seqlens,
        *q.stride()[:3], *q_rot.stride()[:3], *k_.stride()[:3], *v_.stride()[:3],
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        cos.stride(0) if rotary is not None else 0, sin.stride(0) if rotary is not None else 0,
        table.stride(0) if table is not None else 0,
        batch=batch, seqlen_q=seqlen_q, seqlen_new=new, num_heads=heads, num_heads_kv=k_cache.shape[2],
        slots=cache.slots(k_cache), cache_rows=k_cache.shape[0], seqlen_ro=cos.shape[0] if rotary is not None else 1,
        page_size=k_cache.shape[1], PAGED=table is not None,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_B=128,
        ROT_HALF=0 if rotary is None else cos.shape[1], INTERLEAVED=bool(interleaved), Q_MOVES=bool(q_moves),
        HAS_BATCH_IDX=cache.batch_idx is not None,
        num_warps=4,
    )
    return q_rot


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------
@triton.jit
def _attn_bwd_preprocess_kernel(
    Out, dOut, Delta, cu_seqlens_q, Lse, Sinks, SinkParts,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    stride_lb, stride_lh, stride_ls,
    seqlen_q, num_heads, num_m_blocks,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    IS_VARLEN: tl.constexpr, ACC: tl.constexpr, HAS_SINKS: tl.constexpr = False,
):
    """delta = rowsum(dO * O): the softmax backward's correction term, one value per query row.

    HAS_SINKS: also this block's share of its head's sink gradient, -sum over its rows of
    exp(sink - lse) * delta (the sink's probability times delta), to SinkParts[pid]; the launcher
    sums the shares in a fixed order (deterministic, unlike atomics)."""
    pid = tl.program_id(0)
    m_block = pid % num_m_blocks
    bh = pid // num_m_blocks
    b = bh // num_heads
    h = bh % num_heads
    q_start, seqlen_q, valid = _sequence(cu_seqlens_q, b, seqlen_q, IS_VARLEN)
    if not valid:  # bad cu_seqlens contents: the products that read delta give NaN without it
        if HAS_SINKS:
            tl.store(SinkParts + pid, float("nan"))
        return
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_d = tl.arange(0, BLOCK_D)
    ok = (rows[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    b64 = b.to(tl.int64)
    r64 = (q_start + rows[:, None]).to(tl.int64)
    o = tl.load(Out + b64 * stride_ob + h * stride_oh + r64 * stride_os + offs_d[None, :], mask=ok, other=0.0)
    do = tl.load(dOut + b64 * stride_dob + h * stride_doh + r64 * stride_dos + offs_d[None, :], mask=ok, other=0.0)
    delta = tl.sum(o.to(ACC) * do.to(ACC), axis=1)  # [BLOCK_M]
    row_offs = b64 * stride_lb + h * stride_lh + (q_start + rows) * stride_ls  # [BLOCK_M]
    tl.store(Delta + row_offs, delta, mask=rows < seqlen_q)
    if HAS_SINKS:
        lse = tl.load(Lse + row_offs, mask=rows < seqlen_q, other=float("inf"))  # rows past the end: p_sink = 0
        p_sink = tl.exp(tl.load(Sinks + h).to(ACC) - lse.to(ACC))  # [BLOCK_M]
        tl.store(SinkParts + pid, -tl.sum(p_sink * delta, axis=0))


@triton.jit
def _attn_bwd_p_ds(
    q, k, v, do, lse_log2, delta, rows, cols, col0, bias_base, stride_bm, stride_bn,
    seqlen_q, seqlen_k, shift, window_left, window_right, qk_scale, softcap_log2, slope_log2,
    dropout_p, dropout_seed, rng_row0, rng_cols,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, BIAS_KIND: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Recompute P for a [rows, cols] tile from the saved lse, and dS = dL/d(q.k) / scale.

    q, do: [BLOCK_M, BLOCK_D]; k, v: [BLOCK_N, BLOCK_D]. Returns the probabilities that
    multiplied V in the forward pass (after dropout), ds, and the gradient of the final scores
    (of an additive mask: ds before soft-capping's chain rule), all [BLOCK_M, BLOCK_N].
    """
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=delta.dtype)  # [BLOCK_M, BLOCK_N]
    s = _scores_log2(qk, rows, cols, bias_base, stride_bm, stride_bn, seqlen_q, seqlen_k, shift,
                     window_left, window_right, qk_scale, softcap_log2, slope_log2,
                     MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, BIAS_KIND)
    # lse = +inf for rows that see no key (and padding rows): p = 0 there, never NaN.
    p = tl.math.exp2(s - lse_log2[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION, out_dtype=delta.dtype)  # [BLOCK_M, BLOCK_N]
    if HAS_DROPOUT:  # the same mask as the forward, regenerated from its counters
        keep = _dropout_keep(dropout_seed, rng_row0, rows, col0, rng_cols, dropout_p, k.shape[0])
        dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
    ds = p * (dp - delta[:, None])
    if HAS_DROPOUT:
        p = tl.where(keep, p / (1.0 - dropout_p), 0.0)
    dbias = ds
    if HAS_SOFTCAP:  # d/dx [cap * tanh(x / cap)] = 1 - tanh^2
        t = _tanh(qk * qk_scale)
        ds = ds * (1.0 - t * t)
    return p, ds, dbias


@triton.jit
def _attn_bwd_dq_tile(
    dq, q, do, lse_log2, delta, k_desc, v_desc, k_ptrs, v_ptrs, stride_ks, stride_vs, bias_base, stride_bm, stride_bn,
    dbias_base, stride_dbm, stride_dbn,
    start_n, rows, offs_n, offs_d, seqlen_q, seqlen_k, shift, window_left, window_right,
    qk_scale, softcap_log2, slope_log2, dropout_p, dropout_seed, rng_row0, rng_cols,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, BIAS_KIND: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, HAS_DBIAS: tl.constexpr,
):
    """One K/V tile of the dQ sum: dq += dS @ K (and with HAS_DBIAS, the mask's gradient of the
    tile: each (query, key) tile comes here once, so it is stored, not added)."""
    cols = start_n + offs_n  # [BLOCK_N]
    d_ok = offs_d < HEAD_DIM
    k = _load_tile(k_desc, k_ptrs, stride_ks, start_n, cols, d_ok, seqlen_k, False, BLOCK_D, HEAD_DIM,
                 MASKED, USE_TMA)  # [BLOCK_N, BLOCK_D]
    v = _load_tile(v_desc, v_ptrs, stride_vs, start_n, cols, d_ok, seqlen_k, False, BLOCK_D, HEAD_DIM,
                 MASKED, USE_TMA)  # [BLOCK_N, BLOCK_D]
    p, ds, dbias = _attn_bwd_p_ds(q, k, v, do, lse_log2, delta, rows, cols, start_n, bias_base, stride_bm, stride_bn,
                                  seqlen_q, seqlen_k, shift, window_left, window_right, qk_scale, softcap_log2,
                                  slope_log2, dropout_p, dropout_seed, rng_row0, rng_cols,
                                  MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, BIAS_KIND, HAS_DROPOUT,
                                  DOT_PRECISION)
    if HAS_DBIAS:
        ok = (rows[:, None] < seqlen_q) & (cols[None, :] < seqlen_k)
        ptrs = dbias_base + rows[:, None].to(tl.int64) * stride_dbm + cols[None, :] * stride_dbn
        tl.store(ptrs, dbias.to(dbias_base.dtype.element_ty), mask=ok)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION, out_dtype=dq.dtype)  # [BLOCK_M, BLOCK_D]


@triton.jit
def _attn_bwd_dkdv_tile(
    dk, dv, k, v, q_desc, do_desc, q_ptrs, do_ptrs, lse_base, delta_base, stride_qs, stride_dos, stride_ls,
    bias_base, stride_bm, stride_bn, start_m, cols, col0, offs_m, offs_d, seqlen_q, seqlen_k, shift,
    window_left, window_right, qk_scale, softcap_log2, slope_log2, dropout_p, dropout_seed, rng_row0, rng_cols,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, BIAS_KIND: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
):
    """One Q/dO tile of the dK, dV sums: dv += P^T @ dO, dk += dS^T @ Q."""
    rows = start_m + offs_m  # [BLOCK_M]
    row_ok = rows < seqlen_q
    d_ok = offs_d < HEAD_DIM
    # Row blocks, even the unmasked ones, may run past seqlen_q: pointer loads always take the
    # bound mask (descriptors zero-fill by themselves).
    q = _load_tile(q_desc, q_ptrs, stride_qs, start_m, rows, d_ok, seqlen_q, False, BLOCK_D, HEAD_DIM,
                 True, USE_TMA)  # [BLOCK_M, BLOCK_D]
    do = _load_tile(do_desc, do_ptrs, stride_dos, start_m, rows, d_ok, seqlen_q, False, BLOCK_D, HEAD_DIM,
                  True, USE_TMA)  # [BLOCK_M, BLOCK_D]
    # Rows past the end get lse = +inf: p = 0, so they add nothing.
    lse = tl.load(lse_base + rows * stride_ls, mask=row_ok, other=float("inf"))
    lse_log2 = lse * tl.full([], RCP_LN2, lse.dtype)  # [BLOCK_M]; the constant as precise as lse
    delta = tl.load(delta_base + rows * stride_ls, mask=row_ok, other=0.0)  # [BLOCK_M]
    p, ds, _ = _attn_bwd_p_ds(q, k, v, do, lse_log2, delta, rows, cols, col0, bias_base, stride_bm, stride_bn,
                              seqlen_q, seqlen_k, shift, window_left, window_right, qk_scale, softcap_log2,
                              slope_log2, dropout_p, dropout_seed, rng_row0, rng_cols,
                              MASKED, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI, BIAS_KIND, HAS_DROPOUT,
                              DOT_PRECISION)
    p_t, ds_t = tl.trans(p), tl.trans(ds)  # [BLOCK_N, BLOCK_M]
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION, out_dtype=dv.dtype)  # [BLOCK_N, BLOCK_D]
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION, out_dtype=dk.dtype)  # [BLOCK_N, BLOCK_D]
    return dk, dv


@triton.jit(do_not_specialize=["dropout_seed"])  # a seed a call: no compile for its value
def _attn_bwd_dq_kernel(
    Q, K, V, dOut, dQ, Lse, Delta, Bias, Slopes, cu_seqlens_q, cu_seqlens_k, DBias,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh, stride_ls,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_sb, stride_sh,
    stride_dbb, stride_dbh, stride_dbm, stride_dbn,
    seqlen_q, seqlen_k, num_heads, kv_group, num_m_blocks,
    qk_scale: tl.float64, softcap_log2: tl.float64, window_left, window_right, softmax_scale: tl.float64,
    dropout_p, dropout_seed, rng_rows, rng_cols,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, BIAS_KIND: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    USE_TMA: tl.constexpr, HAS_DBIAS: tl.constexpr,
):
    """dQ for BLOCK_M query rows of one (batch, head): a Q block stays, K/V blocks stream."""
    pid = tl.program_id(0)
    # Float arguments arrive in float64 (a plain Python float would be rounded to float32,
    # which float64 inputs would notice); compute in the accumulator's precision.
    qk_scale = tl.full([], qk_scale, ACC)
    softcap_log2 = tl.full([], softcap_log2, ACC)
    softmax_scale = tl.full([], softmax_scale, ACC)
    # Row blocks of one head side by side: they share its K/V through L2. (Launching the causal
    # mask's heaviest blocks first across every head, as the forward does, ran 0.82-0.99 x as
    # fast: attention_bwd_heavy_first_h200_2026-11-30_s16a.json.)
    m_block = pid % num_m_blocks
    bh = pid // num_m_blocks
    b = bh // num_heads
    h = bh % num_heads
    h_kv = h // kv_group
    total_q = seqlen_q  # varlen: the packed rows
    q_start, seqlen_q, valid_q = _sequence(cu_seqlens_q, b, seqlen_q, IS_VARLEN)
    k_start, seqlen_k, valid_k = _sequence(cu_seqlens_k, b, seqlen_k, IS_VARLEN)
    m0 = m_block * BLOCK_M
    if m0 >= seqlen_q:
        return
    if IS_VARLEN:  # bad contents (see _sequence), or a sequence longer than the grid: NaN
        if not (valid_q & valid_k & (seqlen_q <= num_m_blocks * BLOCK_M)):
            nan_first, nan_end = _rows_to_spoil(q_start, seqlen_q, total_q, m0, m_block == num_m_blocks - 1, BLOCK_M)
            _nan_rows(dQ + h.to(tl.int64) * stride_dqh, stride_dqs, nan_first, nan_end, HEAD_DIM)
            return
    shift = seqlen_k - seqlen_q if BOTTOM_RIGHT else 0
    b64 = b.to(tl.int64)
    rows = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row_ok = rows < seqlen_q
    r64 = (q_start + rows[:, None]).to(tl.int64)
    q = tl.load(Q + b64 * stride_qb + h * stride_qh + r64 * stride_qs + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    do = tl.load(dOut + b64 * stride_dob + h * stride_doh + r64 * stride_dos + offs_d[None, :],
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    l_off = b64 * stride_lb + h * stride_lh + (q_start + rows) * stride_ls
    lse_log2 = tl.load(Lse + l_off, mask=row_ok, other=float("inf")) * tl.full([], RCP_LN2, ACC)  # [BLOCK_M]
    delta = tl.load(Delta + l_off, mask=row_ok, other=0.0)  # [BLOCK_M]
    k_base = K + b64 * stride_kb + h_kv * stride_kh + k_start * stride_ks
    v_base = V + b64 * stride_vb + h_kv * stride_vh + k_start * stride_vs
    k_ptrs = k_base + offs_n[:, None] * stride_ks + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
    v_ptrs = v_base + offs_n[:, None] * stride_vs + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
    k_desc = _tile_source(k_base, seqlen_k, stride_ks, BLOCK_N, BLOCK_D, HEAD_DIM, USE_TMA)
    v_desc = _tile_source(v_base, seqlen_k, stride_vs, BLOCK_N, BLOCK_D, HEAD_DIM, USE_TMA)
    bias_base = Bias + b64 * stride_bb + h.to(tl.int64) * stride_bh
    dbias_base = DBias + b64 * stride_dbb + h.to(tl.int64) * stride_dbh
    if HAS_ALIBI:
        slope_log2 = tl.load(Slopes + b * stride_sb + h * stride_sh).to(ACC) * RCP_LN2
    else:
        slope_log2 = 0.0

    rng_row0 = _rng_row0(b, h, num_heads, q_start, rng_rows, IS_VARLEN)

    # The forward pass's key range, with the same masked / unmasked split.
    lo, full_lo, full_hi, hi = _key_blocks(m0, seqlen_q, seqlen_k, shift, window_left, window_right,
                                           BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
    for part in tl.static_range(3):  # left window edge (masked), interior (no mask), diagonal / end (masked)
        start, end = _stretch(part, lo, full_lo, full_hi, hi)
        for start_n in range(start, end, BLOCK_N):
            if part == 1:
                start_n = tl.multiple_of(start_n, BLOCK_N)
            dq = _attn_bwd_dq_tile(
                dq, q, do, lse_log2, delta, k_desc, v_desc, k_ptrs, v_ptrs, stride_ks, stride_vs, bias_base,
                stride_bm, stride_bn, dbias_base, stride_dbm, stride_dbn, start_n, rows, offs_n, offs_d, seqlen_q,
                seqlen_k, shift, window_left, window_right, qk_scale, softcap_log2, slope_log2, dropout_p,
                dropout_seed, rng_row0, rng_cols, HEAD_DIM, BLOCK_D, part != 1, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP,
                HAS_ALIBI, BIAS_KIND, HAS_DROPOUT, DOT_PRECISION, USE_TMA, HAS_DBIAS)
    dq *= softmax_scale
    tl.store(dQ + b64 * stride_dqb + h * stride_dqh + r64 * stride_dqs + offs_d[None, :],
             dq.to(dQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["dropout_seed"])  # a seed a call: no compile for its value
def _attn_bwd_dkdv_kernel(
    Q, K, V, dOut, dK, dV, Lse, Delta, Bias, Slopes, cu_seqlens_q, cu_seqlens_k,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_lb, stride_lh, stride_ls,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_sb, stride_sh,
    seqlen_q, seqlen_k, num_heads_kv, kv_group, num_n_blocks,
    qk_scale: tl.float64, softcap_log2: tl.float64, window_left, window_right, softmax_scale: tl.float64,
    dropout_p, dropout_seed, rng_rows, rng_cols,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, BIAS_KIND: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, ACC: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    USE_TMA: tl.constexpr, EDGES_LAST: tl.constexpr = False,
):
    """dK, dV for BLOCK_N keys of one (batch, kv head): the K/V block stays, every query
    block of every query head in its GQA group streams past, so the sum over the group
    happens in registers (no atomics, deterministic)."""
    pid = tl.program_id(0)
    # Float arguments arrive in float64 (a plain Python float would be rounded to float32,
    # which float64 inputs would notice); compute in the accumulator's precision.
    qk_scale = tl.full([], qk_scale, ACC)
    softcap_log2 = tl.full([], softcap_log2, ACC)
    softmax_scale = tl.full([], softmax_scale, ACC)
    n_block = pid % num_n_blocks  # key blocks of one head side by side: they share its Q/dO through L2
    bh = pid // num_n_blocks
    b = bh // num_heads_kv
    h_kv = bh % num_heads_kv
    total_k = seqlen_k  # varlen: the packed rows
    q_start, seqlen_q, valid_q = _sequence(cu_seqlens_q, b, seqlen_q, IS_VARLEN)
    k_start, seqlen_k, valid_k = _sequence(cu_seqlens_k, b, seqlen_k, IS_VARLEN)
    n0 = n_block * BLOCK_N
    if n0 >= seqlen_k:
        return
    if IS_VARLEN:  # bad contents (see _sequence), or a sequence longer than the grid: NaN
        if not (valid_q & valid_k & (seqlen_k <= num_n_blocks * BLOCK_N)):
            nan_first, nan_end = _rows_to_spoil(k_start, seqlen_k, total_k, n0, n_block == num_n_blocks - 1, BLOCK_N)
            _nan_rows(dK + h_kv.to(tl.int64) * stride_dkh, stride_dks, nan_first, nan_end, HEAD_DIM)
            _nan_rows(dV + h_kv.to(tl.int64) * stride_dvh, stride_dvs, nan_first, nan_end, HEAD_DIM)
            return
    shift = seqlen_k - seqlen_q if BOTTOM_RIGHT else 0
    b64 = b.to(tl.int64)
    cols = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    col_ok = cols < seqlen_k
    c64 = (k_start + cols[:, None]).to(tl.int64)
    kv_ok = col_ok[:, None] & d_ok[None, :]
    k = tl.load(K + b64 * stride_kb + h_kv * stride_kh + c64 * stride_ks + offs_d[None, :], mask=kv_ok, other=0.0)
    v = tl.load(V + b64 * stride_vb + h_kv * stride_vh + c64 * stride_vs + offs_d[None, :], mask=kv_ok, other=0.0)

    lo, full_lo, full_hi, hi = _query_blocks(n0, seqlen_q, seqlen_k, shift, window_left, window_right,
                                             BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC)
    # num_stages=1: the pipeliner must leave this loop alone. When the query loops below fold
    # away (seqlen_q specialized to 1), it becomes the innermost loop, and the pipeliner cannot
    # predicate the descriptor creation inside it.
    for g in tl.range(kv_group, num_stages=1):
        h = h_kv * kv_group + g
        q_base = Q + b64 * stride_qb + h * stride_qh + q_start * stride_qs
        do_base = dOut + b64 * stride_dob + h * stride_doh + q_start * stride_dos
        q_ptrs = q_base + offs_m[:, None].to(tl.int64) * stride_qs + offs_d[None, :]  # [BLOCK_M, BLOCK_D]
        do_ptrs = do_base + offs_m[:, None].to(tl.int64) * stride_dos + offs_d[None, :]  # [BLOCK_M, BLOCK_D]
        q_desc = _tile_source(q_base, seqlen_q, stride_qs, BLOCK_M, BLOCK_D, HEAD_DIM, USE_TMA)
        do_desc = _tile_source(do_base, seqlen_q, stride_dos, BLOCK_M, BLOCK_D, HEAD_DIM, USE_TMA)
        l_base = b64 * stride_lb + h * stride_lh + q_start * stride_ls
        bias_base = Bias + b64 * stride_bb + h.to(tl.int64) * stride_bh
        if HAS_ALIBI:
            slope_log2 = tl.load(Slopes + b * stride_sb + h * stride_sh).to(ACC) * RCP_LN2
        else:
            slope_log2 = 0.0
        rng_row0 = _rng_row0(b, h, num_heads_kv * kv_group, q_start, rng_rows, IS_VARLEN)
        # Three stretches of query blocks: the diagonal / right window edge (masked), the
        # interior (no mask), the left window edge (masked); static_range unrolls them, so
        # MASKED is a compile-time constant in each. EDGES_LAST visits the interior first: when
        # the masked loop came first, ptxas serialized every wgmma of the causal kernel (C7515).
        # (Its left-edge loop is built only for a left window; leaving out the empty loop in the
        # other order cost the unmasked D = 64 build its unserialized form.)
        for i in tl.static_range(3):
            if (i < 2) | HAS_LEFT | (EDGES_LAST == 0):  # constexpr operators: a compile-time if
                start, end = _stretch(i, lo, full_lo, full_hi, hi, EDGES_LAST)
                for start_m in range(start, end, BLOCK_M):
                    if i == 1 - EDGES_LAST:  # the interior
                        start_m = tl.multiple_of(start_m, BLOCK_M)
                    dk, dv = _attn_bwd_dkdv_tile(
                        dk, dv, k, v, q_desc, do_desc, q_ptrs, do_ptrs, Lse + l_base, Delta + l_base, stride_qs,
                        stride_dos, stride_ls, bias_base, stride_bm, stride_bn, start_m, cols, n0, offs_m, offs_d,
                        seqlen_q, seqlen_k, shift, window_left, window_right, qk_scale, softcap_log2, slope_log2,
                        dropout_p, dropout_seed, rng_row0, rng_cols,
                        HEAD_DIM, BLOCK_D, i != 1 - EDGES_LAST, HAS_LEFT, HAS_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                        BIAS_KIND, HAS_DROPOUT, DOT_PRECISION, USE_TMA)
    dk *= softmax_scale
    tl.store(dK + b64 * stride_dkb + h_kv * stride_dkh + c64 * stride_dks + offs_d[None, :],
             dk.to(dK.dtype.element_ty), mask=kv_ok)
    tl.store(dV + b64 * stride_dvb + h_kv * stride_dvh + c64 * stride_dvs + offs_d[None, :],
             dv.to(dV.dtype.element_ty), mask=kv_ok)


@dataclass(frozen=True)
class AttnBwdConfig:
    block_m: int  # query rows per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    use_tma: bool = False  # tensor descriptors for the streamed tiles (K/V for dQ, Q/dO for dK/dV)
    maxnreg: Optional[int] = None  # registers a thread, at most (ptxas spills past it)
    edges_last: bool = False  # dK/dV: the interior stretch before the masked diagonal / window edge


def default_bwd_configs(head_dim: int, dtype: torch.dtype, device: torch.device):
    """(dQ config, dK/dV config), searched on the H200 for 16-bit types
    (benchmarks/results/attention_bwd_tiles_*); float32/64 are sized to fit shared memory."""
    if device.type != "cuda":
        return AttnBwdConfig(32, 16, 4, 1), AttnBwdConfig(16, 32, 4, 1, edges_last=True)
    block_d = _block_d(head_dim)
    if dtype == torch.float64 and block_d > 128:  # 8-byte tiles: shared memory (232 KB) sets the size
        return AttnBwdConfig(16, 16, 4, 1), AttnBwdConfig(16, 16, 4, 1)
    if dtype == torch.float64 and block_d > 64 or dtype == torch.float32 and block_d > 128:
        # float32 at D = 256: its IEEE products are unrolled multiply-add loops, and with the tiles
        # below both kernels took over five minutes to build for sm_90 (these: 22 s, built offline;
        # its H200 test then ran in 40 s, gpu_tests_wide_dtypes_h200_2026-11-30_s11h.log).
        return AttnBwdConfig(32, 16, 4, 1), AttnBwdConfig(16, 32, 4, 1)
    if dtype in (torch.float32, torch.float64):
        return AttnBwdConfig(64, 32, 4, 1), AttnBwdConfig(32, 64, 4, 1)
    return _bwd_tiles(block_d, has_tma(device))


def _bwd_tiles(block_d: int, tma: bool):
    """The 16-bit defaults on a GPU. Tensor descriptors (``tma``, Hopper) for the streamed tiles:
    their address arithmetic leaves the registers, and ptxas's spills drop (dK/dV at D = 128:
    716 -> 180 bytes a thread)."""
    if block_d > 128:
        # Products of 64 rows a warpgroup, which Hopper's wgmma needs (the 32-row tiles used
        # before compiled to mma.sync): 104-116 -> 167-239 TFLOP/s (attention_bwd_tiles_*_s5).
        # dQ: 128 query rows, 32-key tiles (two stages fit 196 KB): the whole backward +17-28 % over
        # (64, 64) dQ tiles (attention_bwd_tiles_dq_..._s15b).
        return AttnBwdConfig(128, 32, 8, 2, tma), AttnBwdConfig(128, 64, 8, 1, tma, edges_last=True)
    # dK/dV under a causal mask: the interior before the diagonal (edges_last). With the masked
    # loop first, ptxas serialized every wgmma of the kernel (C7515). dK/dV time with a causal
    # mask: -20 to -27 % at D = 64 / 128, -2 to -9 % at D = 256 (attention_bwd_kernels_*_s14e/f/h).
    if block_d <= 64:  # square 64 x 64 tiles, 3 stages: dK/dV +49% over (64, 128, 8 warps) at 8k
        return AttnBwdConfig(64, 64, 4, 3, tma), AttnBwdConfig(64, 64, 4, 3, tma, edges_last=True)
    return AttnBwdConfig(64, 64, 4, 2, tma), AttnBwdConfig(64, 64, 4, 2, tma, edges_last=True)


_bwd_preprocess_launcher = CachedLauncher(_attn_bwd_preprocess_kernel)
_bwd_dq_launcher = CachedLauncher(_attn_bwd_dq_kernel)
_bwd_dkdv_launcher = CachedLauncher(_attn_bwd_dkdv_kernel)


def _maxnreg(cfg) -> dict:
    """The launch option for a config's register cap, if it has one."""
    cap = getattr(cfg, "maxnreg", None)
    return {} if cap is None else dict(maxnreg=cap)


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, opts: AttnOptions, configs=None, bias_grad: bool = False):
    """Gradients (dq, dk, dv, dbias, dsinks) of the forward pass, from its output and log-sum-exp.

    Same layouts and options as ``attention_forward`` (the same dropout seed regenerates
    the same mask); ``dout`` has out's shape and a unit last stride. dk and dv are summed over the
    query heads of each GQA group. ``bias_grad`` (an additive ``opts.bias``, dense calls): dbias is
    the gradient of the scores, (B, H, Sq, Sk) in the bias's dtype, written by the dQ kernel, which
    visits each (query, key) tile once; else None. dsinks: that of ``opts.sinks``, summed by the
    delta pass, else None: a sink's value is zero, so raising its score only takes weight from
    what a row's output holds, and d loss / d sink = -sum over the head's rows of
    exp(sink - lse) * delta. Without explicit ``configs``, calls that the Gluon backward takes
    (``attention_gluon.py``: Hopper, causal or no mask, D = 64 / 128 / 256, lengths multiple of
    128, not ``deterministic``) go there after the delta pass where ``bwd_preferred`` says so
    (every head dim it has).
    """
    if opts.kv_cache is not None:
        raise ValueError("kv_cache (keys read from a KV cache) is a forward-only option: no backward")
    varlen = opts.varlen
    if varlen:
        _, num_heads, head_dim = q.shape
        batch = opts.cu_seqlens_q.numel() - 1
        grid_q, grid_k = opts.max_seqlen_q, opts.max_seqlen_k
        seqlen_q, seqlen_k = q.shape[0], k.shape[0]  # the packed rows, which bound each sequence
    else:
        batch, seqlen_q, num_heads, head_dim = q.shape
        seqlen_k = k.shape[1]
        grid_q, grid_k = seqlen_q, seqlen_k
    heads_kv = k.shape[-2]
    dq_cfg, dkdv_cfg = configs or default_bwd_configs(head_dim, q.dtype, q.device)
    acc = _acc_dtype(q.dtype)
    dbias = None
    if bias_grad:  # every entry is written or stays 0 (tiles the masks skip)
        dbias = torch.zeros((batch, num_heads, seqlen_q, seqlen_k), dtype=opts.bias.dtype, device=q.device)
    if q.numel() == 0 or k.numel() == 0:
        dsinks = None if opts.sinks is None else torch.zeros_like(opts.sinks)
        return (*(torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)), dbias, dsinks)
    delta = torch.empty_like(lse, dtype=acc)
    pointers, bias_strides, slope_strides, variant = _variant(q, k, opts)
    block_d = _block_d(head_dim)
    shared = dict(softmax_scale=opts.softmax_scale, HEAD_DIM=head_dim, BLOCK_D=block_d, **variant)
    sl = _lse_strides(lse, varlen)
    strides = (*_bshd_strides(q, varlen), *_bshd_strides(k, varlen), *_bshd_strides(v, varlen),
               *_bshd_strides(dout, varlen))
    tail = (*sl, *bias_strides, *slope_strides)

    num_m = cdiv(max(grid_q, 1), 64)
    sink_parts = None if opts.sinks is None else torch.empty((batch, num_heads, num_m), dtype=acc, device=q.device)
    _bwd_preprocess_launcher[(num_m * batch * num_heads,)](
        out, dout, delta, pointers[2], lse, delta if opts.sinks is None else opts.sinks,
        delta if sink_parts is None else sink_parts,
        *_bshd_strides(out, varlen), *_bshd_strides(dout, varlen), *sl,
        seqlen_q=seqlen_q, num_heads=num_heads, num_m_blocks=num_m,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=64, IS_VARLEN=varlen, ACC=variant["ACC"],
        HAS_SINKS=opts.sinks is not None,
    )
    # the sinks need nothing more than this: lse holds them, so the products below leave them out
    dsinks = None if sink_parts is None else sink_parts.sum((0, 2)).to(opts.sinks.dtype)
    if configs is None and _fast_backward_fits(dout, q, k, v, out, lse, opts):
        from qflash.kernels import attention_gluon

        return (*attention_gluon.launch_backward(dout, q, k, v, lse, delta, opts.softmax_scale,
                                                 causal=opts.window_right == 0, bottom_right=opts.bottom_right),
                None, dsinks)
    dq = new_output(q.shape, dtype=q.dtype, device=q.device)
    dk = new_output(k.shape, dtype=k.dtype, device=k.device)
    dv = new_output(v.shape, dtype=v.dtype, device=v.device)
    tma_ok = tma_compatible(q, k, v, dout)
    if tma_ok and (dq_cfg.use_tma or dkdv_cfg.use_tma):
        ensure_descriptor_allocator(q.device)
    num_m = cdiv(max(grid_q, 1), dq_cfg.block_m)
    _bwd_dq_launcher[(num_m * batch * num_heads,)](
        q, k, v, dout, dq, lse, delta, *pointers, dq if dbias is None else dbias, *strides, *_bshd_strides(dq, varlen),
        *tail, *(dbias.stride() if dbias is not None else (0, 0, 0, 0)),
        seqlen_q=seqlen_q, seqlen_k=seqlen_k, num_heads=num_heads, kv_group=num_heads // heads_kv,
        num_m_blocks=num_m, BLOCK_M=dq_cfg.block_m, BLOCK_N=dq_cfg.block_n,
        num_warps=dq_cfg.num_warps, num_stages=dq_cfg.num_stages, USE_TMA=dq_cfg.use_tma and tma_ok,
        HAS_DBIAS=dbias is not None, **_maxnreg(dq_cfg), **shared,
    )
    num_n = cdiv(max(grid_k, 1), dkdv_cfg.block_n)
    _bwd_dkdv_launcher[(num_n * batch * heads_kv,)](
        q, k, v, dout, dk, dv, lse, delta, *pointers, *strides, *_bshd_strides(dk, varlen),
        *_bshd_strides(dv, varlen), *tail,
        seqlen_q=seqlen_q, seqlen_k=seqlen_k, num_heads_kv=heads_kv, kv_group=num_heads // heads_kv,
        num_n_blocks=num_n, BLOCK_M=dkdv_cfg.block_m, BLOCK_N=dkdv_cfg.block_n,
        num_warps=dkdv_cfg.num_warps, num_stages=dkdv_cfg.num_stages, USE_TMA=dkdv_cfg.use_tma and tma_ok,
        EDGES_LAST=dkdv_cfg.edges_last and opts.window_right >= 0,
        **_maxnreg(dkdv_cfg), **shared,
    )
    if varlen:  # query and key rows after the last sequence: no part in any output
        fill_padding(opts.cu_seqlens_q, dq)
        fill_padding(opts.cu_seqlens_k, dk, dv)
    return dq, dk, dv, dbias, dsinks


def compile_for_sm90(head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, causal: bool = True,
                     kernel: str = "dkdv", config=None, window_left: int = -1, dropout: bool = False,
                     varlen: bool = False):
    """Build the ``tl`` forward ("fwd") or the backward's "dq" / "dkdv" kernel for sm_90 without a
    GPU (what the CPU tests read), specialized as a launch of its default tiles (or ``config``) on
    Hopper would be: contiguous (1, 16k, 2048 / head_dim, head_dim) q, k, v and dO, causal
    (top-left) or no mask, a left window edge if ``window_left`` >= 0, dropout if ``dropout``;
    ``varlen``: the same rows packed (16k, heads, head_dim) with ``cu_seqlens``. (Decode steps, whose
    register use moves with the launch's exact arguments: tests/launch_builds.py builds those from
    a real call's launch.)"""
    from qflash.kernels.common import SIGNATURE_NAMES, build_tl_for_sm90

    seqlen, heads = 16384, 2048 // head_dim
    dq_cfg, dkdv_cfg = _bwd_tiles(_block_d(head_dim), tma=True)
    defaults = dict(fwd=_fwd_tiles(head_dim, dtype, True, seqlen, dropout), dq=dq_cfg, dkdv=dkdv_cfg)
    cfg = config or defaults[kernel]
    fn = dict(fwd=_attn_fwd_kernel, dq=_attn_bwd_dq_kernel, dkdv=_attn_bwd_dkdv_kernel)[kernel]
    has_left = window_left >= 0
    strides = {"b": 0 if varlen else seqlen * heads * head_dim, "s": heads * head_dim, "h": head_dim}  # (B, S, H, D)
    lse_strides = {"b": 0 if varlen else heads * seqlen, "h": seqlen, "s": 1}  # packed: (H, total)
    elem = SIGNATURE_NAMES[dtype]
    args = dict(seqlen_q=seqlen, seqlen_k=seqlen, num_heads=heads, num_heads_kv=heads, kv_group=1,
                num_m_blocks=seqlen // cfg.block_m, num_n_blocks=seqlen // cfg.block_n,
                window_left=window_left if has_left else -1, window_right=0 if causal else -1,
                rng_rows=seqlen, rng_cols=seqlen, dropout_seed="i32",
                dropout_p="fp32", qk_scale="fp64", softcap_log2="fp64", softmax_scale="fp64",
                Lse="*fp32", Delta="*fp32", cu_seqlens_q="*i32", cu_seqlens_k="*i32", cache_seqlens="*i32",
                cache_batch_idx="*i32", cache_leftpad="*i32", block_table="*i32", seqlen_new=1, cache_rows="i32",
                stride_table=0,
                num_splits=1,
                stride_o_split=seqlen * heads * head_dim, stride_l_split=heads * seqlen)  # (keys not split)
    for name in fn.arg_names:
        if name in args:
            continue
        if name.startswith("stride_l"):
            args[name] = lse_strides[name[-1]]
        elif name.startswith(("stride_b", "stride_s", "stride_db")):  # bias, slopes, dbias: none
            args[name] = 0
        elif name.startswith("stride_"):
            args[name] = strides[name[-1]]
        elif name not in args and (name[0].isupper() or name in ("dOut", "dQ", "dK", "dV")):
            args[name] = f"*{elem}"  # Bias, Slopes, DBias: the launch passes q in their place
    constants = dict(HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                     HAS_LEFT=has_left, HAS_RIGHT=causal, BOTTOM_RIGHT=False, HAS_SOFTCAP=False, HAS_ALIBI=False,
                     BIAS_KIND=BIAS_NONE, IS_VARLEN=varlen, DOT_PRECISION=_dot_precision(dtype), ACC=tl.float32,
                     HAS_DROPOUT=dropout, USE_TMA=cfg.use_tma)
    if kernel == "fwd":
        constants.update(HEAVY_FIRST=causal, EDGES_LAST=has_left, SPLIT_KV=False, PACK_GQA=False,
                         KV_CACHE=False, HAS_BATCH_IDX=False, HAS_LEFTPAD=False, PAGED=False, PAGE_SIZE=1,
                         HAS_SINKS=False)
    elif kernel == "dq":
        constants.update(HAS_DBIAS=False)
    else:
        constants.update(EDGES_LAST=cfg.edges_last and causal)
    return build_tl_for_sm90(fn, args, constants, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                             **_maxnreg(cfg))


@triton.jit
def _dropout_mask_kernel(Mask, dropout_p, dropout_seed, seqlen_q, seqlen_k, num_heads,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, pid_n, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rng_row0 = _rng_row0(bh // num_heads, bh % num_heads, num_heads, 0, seqlen_q, False)
    keep = _dropout_keep(dropout_seed, rng_row0, rows, pid_n * BLOCK_N, seqlen_k, dropout_p, BLOCK_N)
    ptrs = Mask + bh.to(tl.int64) * seqlen_q * seqlen_k + rows[:, None].to(tl.int64) * seqlen_k + cols[None, :]
    tl.store(ptrs, keep, mask=(rows[:, None] < seqlen_q) & (cols[None, :] < seqlen_k))


def dropout_keep_mask(batch: int, heads: int, seqlen_q: int, seqlen_k: int, *, dropout_p: float,
                      dropout_seed: int, device) -> torch.Tensor:
    """The keep mask (batch, heads, seqlen_q, seqlen_k) that a dense call with this seed uses.

    For tests and debugging: a reference that applies it reproduces the kernel's dropout.
    """
    mask = torch.empty(batch, heads, seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    grid = (cdiv(seqlen_q, 32), cdiv(seqlen_k, 32), batch * heads)
    _dropout_mask_kernel[grid](mask, float(dropout_p), int(dropout_seed), seqlen_q, seqlen_k, heads,
                               BLOCK_M=32, BLOCK_N=32)
    return mask
