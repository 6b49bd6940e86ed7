r"""FlashAttention forward for Hopper in Gluon: warp-specialized.

The ``tl`` kernel in ``attention.py`` is the portable implementation (every option, the
interpreter, any GPU). This one is the fast path for the common case on Hopper, with the
schedule that ``tl`` cannot express in Triton 3.6 (benchmarks/NOTES.md, fourth round):

    one work item = 128 query rows of one (batch, head) (192 at D = 64 without a mask); one CTA per SM takes
    items in rounds (persistent: the next item's loads overlap this item's last tiles), in
    partitions
      consumer 0 (4 warps)   rows  0-63  \  S = Q K^T and O += P V on the tensor cores (wgmma),
      consumer 1 (4 warps)   rows 64-127 |  the online softmax in registers
      [consumer 2 (4 warps)  rows 128-191 / at D = 64 without a mask: the softmax costs as much as the products]
      loader     (1 warp)    Q, then K and V tiles into rings of STAGES shared-memory slots

    ring slot s:  loader --k_ready[s]--> consumers --k_empty[s] (all)--> loader   (same for V)

Causal items with 64-key tiles: each consumer works through the tiles its own 64 rows see and
lets the rest of the block's tiles go as they land (the diagonal costs half a tile less a block).

Each consumer overlaps its own work (FlashAttention-3's intra-warpgroup pipelining): while the
softmax of key tile j runs on the CUDA cores, the tensor cores compute P_{j-1} V_{j-1}:

    issue S_j = Q K_j^T  |  issue O += P_{j-1} V_{j-1}  |  wait S_j  |  softmax(S_j) -> P_j
    |  wait O  |  O *= exp(m_old - m_new)

The loader needs few registers (setmaxnreg gives it 24), so each consumer can hold its 64 x D
float32 accumulator, the 64 x BLOCK_N scores of tile j and the probabilities of tile j - 1
without spilling (232-248 registers with two consumers, 160-168 with three).

At the end of an item a consumer writes its 64 x D output block to shared memory and one thread
issues a bulk copy (TMA store); the consumer goes on to its next item while the copy runs, and
waits for it only before it writes the buffer again (``stores_by_tma``; D = 256 goes out in two
64 x 128 halves through one buffer, a 64 x 256 one a consumer does not fit, and only up to 1k
keys: beyond, plain stores from registers measured faster).

Scope: no mask or a causal one (``shift`` = seqlen_k - seqlen_q aligns it bottom-right, 0
top-left); float16 / bfloat16; head dim 64, 128 or 256; seqlen_q and seqlen_k multiples of 128;
MQA / GQA; (batch, seqlen, heads, headdim) tensors whose (batch * seqlen, heads * headdim) view
has unit column stride (contiguous, or sliced from a packed qkv). ``why_not`` says what a call
does not fit; ``attention_forward`` in ``attention.py`` sends every call that fits here. On the
H200 it ran 1.03-1.44x the tl kernel from 2k tokens on (attention_fwd_h200_2026-11-29_s7d.json),
and 0.98-1.40x at 512-2k tokens replayed from CUDA graphs (..._short_graph_..._s7e.json: D = 64
at 512-1k is the 0.98-1.00x end).

The backward (``_attn_bwd_ws_kernel``, D = 64 / 128, same scope) follows FlashAttention-3: one CTA
per 128 keys, a loader warp for K / V once and Q / dO in a ring, two consumer warpgroups of 64
keys that compute S and dP transposed so that P^T and dS^T feed dV and dK from registers, dS^T
shared for dQ = dS K; lse and delta come with Q and dO through the copy engine (loaded by the
consumers, their latency had been the tile's: 1.08-1.20 x faster without it). Each consumer's dQ
tile goes to a float32 buffer through shared memory and the copy engine's reduce-add
(``cp.reduce.async.bulk.tensor``), which runs on while the consumer starts its next tile (or by
float32 atomic adds from registers, DQ_TMA off); either way the sums arrive in any order, so dQ
is not bitwise reproducible. At D = 256 two kernels run: ``_attn_bwd_dkdv_ws_kernel`` keeps 64
keys a CTA, its two consumers splitting dK and dV by head-dim halves (transposed, P and dS through
shared memory), and ``_attn_bwd_dq_ws_kernel`` keeps 64 query rows a CTA, its consumers splitting
dQ the same way: summed in the first kernel, dQ's reduces (64 KB of float32 a tile pair) took as
long as the rest. Neither has atomics. It is the public backward at every head dim
(``bwd_preferred``; benchmarks/NOTES.md, eighth, sixteenth to eighteenth rounds).
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import numpy as np
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                            warpgroup_mma_wait)

from triton._C.libtriton import ir
from triton.experimental.gluon.language._core import builtin

from qflash.kernels.common import (SIGNATURE_NAMES, CachedLauncher, build_for_sm90, cdiv, is_hopper, nvmma_layout,
                                   sm_count)
from qflash.kernels.gluon_common import barrier, ring_barriers, unchecked_descriptor
from qflash.testing import new_output

RCP_LN2 = gl.constexpr(1.4426950408889634)  # 1 / ln(2): exp(x) == exp2(x * RCP_LN2)
SUB_M = 64  # query rows a consumer warpgroup owns (wgmma's M per warpgroup)
LENGTH_MULTIPLE = 128  # seqlen_q and seqlen_k: whole 128-key tiles, no tail to mask
HEAD_DIMS = (64, 128, 256)
MAX_ITEMS = 2**31 - 1  # work items (batch x heads x query blocks) are counted in int32
# A causal order may load its busiest CTA this much more than the most even one, for locality.
EVEN_ENOUGH = 1.04
SHORT_HEAD = 4  # query blocks a head: at most this many, a group spans at least a round of items


@gluon.constexpr_function
def _acc_layout(cols):
    """The registers of one warpgroup's wgmma accumulator with ``cols`` columns (m64 x cols x k16
    instructions, rows in steps of 64)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cols, 16])


# Row reductions written out: gl.max / gl.sum are triton.jit functions, which Triton's
# interpreter mode (the CPU tests) replaces by Python ones that a Gluon build cannot call.
@gluon.jit
def _maximum(a, b):
    return gl.maximum(a, b)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _item_of(r):
    """The work item a CTA takes in round r: rounds alternate direction over the CTAs (zigzag),
    so that with causal items, sorted heaviest first, each CTA's sum of work comes out even."""
    P = gl.num_programs(0)
    c = gl.program_id(0)
    return r * P + gl.where((r & 1) == 0, c, P - 1 - c)


@gluon.jit
def _work_item(w, seqlen_q, seqlen_k, shift, num_heads, num_bh, num_m_blocks, heads_per_group,
               CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Work item w: (batch, head, first query row) of a block of BLOCK_M queries and its key
    tiles: [0, n_full) need no mask, [n_full, n_tiles) cross the causal diagonal.

    Without a mask, items run query blocks fastest: the blocks of one head run side by side and
    read its K/V from L2 rather than from memory (as the tl kernel orders them). Causal items
    come in groups of ``heads_per_group`` heads; inside a group they run heaviest (most keys)
    first, heads fastest, so that the last to start are short (``causal_heads_per_group``
    picks the group)."""
    n_tiles = seqlen_k // BLOCK_N
    n_full = n_tiles
    if CAUSAL:
        per_group = heads_per_group * num_m_blocks
        first_bh = (w // per_group) * heads_per_group
        group_heads = gl.minimum(heads_per_group, num_bh - first_bh)  # the last group may be short
        w_in = w % per_group
        bh = first_bh + w_in % group_heads
        m_block = num_m_blocks - 1 - w_in // group_heads
    else:
        bh = w // num_m_blocks
        m_block = w % num_m_blocks
    m0 = m_block * BLOCK_M
    if CAUSAL:
        # Row i sees keys j <= i + shift: the block's last row bounds the tiles, its first row
        # the unmasked ones (clamped at 0 before dividing: a block may see no key at all).
        n_tiles = gl.minimum((gl.maximum(m0 + BLOCK_M + shift, 0) + BLOCK_N - 1) // BLOCK_N, n_tiles)
        n_full = gl.minimum(gl.maximum(m0 + 1 + shift, 0) // BLOCK_N, n_tiles)
    return bh // num_heads, bh % num_heads, m0, n_full, n_tiles


@gluon.jit
def _attn_fwd_loader(q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, v_ready, k_empty,
                     v_empty, seqlen_q, seqlen_k, shift, num_heads, kv_group, num_bh, num_m_blocks,
                     heads_per_group, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr):
    """One warp: for each work item, a Q tile for each consumer (with two Q buffers the next
    item's queries arrive while this one runs), then every K/V tile it needs through the rings,
    which run on from one item to the next (c counts tiles over all items)."""
    Q_BUFFERS: gl.constexpr = q_ready.shape[0]
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    num_items = num_bh * num_m_blocks
    c = 0
    i = 0
    for r in range(gl.cdiv(num_items, gl.num_programs(0))):
        w = _item_of(r)
        if w < num_items:
            b, h, m0, n_full, n_tiles = _work_item(w, seqlen_q, seqlen_k, shift, num_heads, num_bh, num_m_blocks,
                                                   heads_per_group, CAUSAL, CONSUMERS * ROWS, BLOCK_N)
            q_row = b * seqlen_q + m0  # rows and columns of the (batch * seqlen, heads * headdim) views
            kv_col = (h // kv_group) * HEAD_DIM
            # A wait on the previous (parity 1) phase of a fresh barrier passes at once: the
            # first lap of every ring needs no release.
            qb = i % Q_BUFFERS
            mbarrier.wait(q_empty.index(qb), ((i // Q_BUFFERS) & 1) ^ 1)
            mbarrier.expect(q_ready.index(qb), CONSUMERS * q_desc.block_type.nbytes)
            for t in gl.static_range(CONSUMERS):  # rows past the sequence are computed, never stored
                tma.async_copy_global_to_shared(q_desc, [q_row + t * ROWS, h * HEAD_DIM], q_ready.index(qb),
                                                q_smem.index(CONSUMERS * qb + t))
            for j in range(n_tiles):
                s = c % STAGES
                empty_phase = ((c // STAGES) & 1) ^ 1
                key_row = b * seqlen_k + j * BLOCK_N
                mbarrier.wait(k_empty.index(s), empty_phase)
                mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [key_row, kv_col], k_ready.index(s), k_ring.index(s))
                mbarrier.wait(v_empty.index(s), empty_phase)
                mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [key_row, kv_col], v_ready.index(s), v_ring.index(s))
                c += 1
            i += 1


@gluon.jit
def _softmax_step(qk, m_i, l_i, rows, key0, shift, qk_scale, MASKED: gl.constexpr):
    """Online softmax of one [ROWS, BLOCK_N] score tile (log2 domain): the probabilities, the
    factor that rescales what the accumulator holds, and the new running max and sum."""
    if MASKED:  # causal diagonal: key j is visible to row i when j <= i + shift
        cols = key0 + gl.arange(0, qk.shape[1], layout=gl.SliceLayout(0, qk.type.layout))
        visible = gl.expand_dims(cols, 0) <= gl.expand_dims(rows + shift, 1)
        qk = gl.where(visible, qk, float("-inf"))
    # scale > 0 keeps the argmax: max of the raw products, then one FMA per element.
    m_new = gl.maximum(m_i, gl.reduce(qk, 1, _maximum) * qk_scale)
    m_use = m_new
    if MASKED:
        # A row that has seen no key yet keeps m = -inf; subtracting 0 instead keeps its p and
        # alpha at 0 rather than NaN (unmasked tiles are visible to every row: m_new is finite).
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(qk * qk_scale - gl.expand_dims(m_use, 1))  # [ROWS, BLOCK_N]
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.reduce(p, 1, _add)
    return p, alpha, m_new, l_i


@gluon.jit
def _attn_fwd_tile(c, j, last, acc, p_op, m_i, l_i, q, k_ring, v_ring, q_free, k_ready, v_ready, k_empty,
                   v_empty, rows, shift, qk_scale, s_layout: gl.constexpr, STAGES: gl.constexpr,
                   MASKED: gl.constexpr):
    """Key tile j (tile c of the rings): S_j = Q K_j^T and O += P_{j-1} V_{j-1} are issued
    together, and the softmax of S_j runs while the latter is on the tensor cores. After the
    item's last S (j == last) its Q tile goes back to the loader (q_free)."""
    ROWS: gl.constexpr = q.shape[0]
    BLOCK_N: gl.constexpr = k_ring.shape[1]
    s = c % STAGES
    prev = (c - 1) % STAGES
    zeros = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=s_layout)
    mbarrier.wait(k_ready.index(s), (c // STAGES) & 1)
    qk = warpgroup_mma(q, k_ring.index(s).permute((1, 0)), zeros, use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(prev), ((c - 1) // STAGES) & 1)
    acc = warpgroup_mma(p_op, v_ring.index(prev), acc, is_async=True)
    qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk,))  # in order: S_j is done, O may run on
    mbarrier.arrive(k_empty.index(s), count=1)
    mbarrier.arrive(q_free, count=1, pred=j == last)
    p, alpha, m_i, l_i = _softmax_step(qk, m_i, l_i, rows, j * BLOCK_N, shift, qk_scale, MASKED)
    acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
    mbarrier.arrive(v_empty.index(prev), count=1)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
    p_op = gl.convert_layout(p.to(v_ring.dtype), p_op.type.layout)
    return acc, p_op, m_i, l_i


@gluon.jit
def _store_block(block, o_desc, o_buf, row, col):
    """Copy a block of the output to [row, col] of o_desc's view through o_buf and one bulk copy,
    which runs on while the consumer goes on (it waits for the previous copy only here)."""
    tma.store_wait(0)  # the previous copy has read o_buf ...
    gl.thread_barrier()  # ... before any of the 128 threads writes it again
    o_buf.store(block)
    fence_async_shared()  # the writes, visible to the copy engine
    gl.thread_barrier()  # ... from all 128 threads before one of them issues the copy
    tma.async_copy_shared_to_global(o_desc, [row, col], o_buf)


@gluon.jit
def _attn_fwd_consumer(Out, o_desc, o_smem, Lse, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, v_ready, k_empty,
                       v_empty, seqlen_q, seqlen_k, shift, num_heads, num_bh, num_m_blocks, heads_per_group, qk_scale,
                       Sinks, which, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                       CAUSAL: gl.constexpr, TMA_STORE: gl.constexpr, HAS_SINKS: gl.constexpr):
    """One warpgroup (consumer ``which``): for each work item, the online softmax over its K/V
    tiles for 64 query rows (HAS_SINKS: starting from the head's sink score, ``Sinks[h]``)."""
    ROWS: gl.constexpr = q_smem.shape[1]
    BLOCK_N: gl.constexpr = k_ring.shape[1]
    Q_BUFFERS: gl.constexpr = q_ready.shape[0]
    # wgmma accumulators: scores [ROWS, BLOCK_N] and output [ROWS, HEAD_DIM], 4 warps down M.
    s_layout: gl.constexpr = _acc_layout(BLOCK_N)
    o_layout: gl.constexpr = _acc_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)  # P from registers
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    num_items = num_bh * num_m_blocks
    c = 0  # K/V tiles consumed
    i = 0  # work items done
    for r in range(gl.cdiv(num_items, gl.num_programs(0))):
        w = _item_of(r)
        if w < num_items:
            b, h, m0, n_full, n_tiles = _work_item(w, seqlen_q, seqlen_k, shift, num_heads, num_bh, num_m_blocks,
                                                   heads_per_group, CAUSAL, CONSUMERS * ROWS, BLOCK_N)
            m0 += which * ROWS
            if CAUSAL:
                # This consumer's own rows bound its tiles: with 64-key tiles the block's last tile
                # is hidden from the first 64 rows, and the second 64 rows see one more unmasked.
                n_mine = gl.minimum((gl.maximum(m0 + ROWS + shift, 0) + BLOCK_N - 1) // BLOCK_N, n_tiles)
                n_full = gl.minimum(gl.maximum(m0 + 1 + shift, 0) // BLOCK_N, n_mine)
            else:
                n_mine = n_tiles
            rows = m0 + gl.arange(0, ROWS, layout=row_s)  # query rows of the sequence
            m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_s)  # running max (log2 domain)
            l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_s)  # running sum
            if HAS_SINKS:  # the sink is the first score they hold (a value of zero: acc stays 0)
                m_i = gl.full([ROWS], 0.0, gl.float32, layout=row_s) + gl.load(Sinks + h).to(gl.float32) * RCP_LN2
                l_i = gl.where(m_i == float("-inf"), 0.0, 1.0)
            acc = gl.zeros((ROWS, HEAD_DIM), dtype=gl.float32, layout=o_layout)  # [ROWS, HEAD_DIM]
            qb = i % Q_BUFFERS
            q = q_smem.index(CONSUMERS * qb + which)
            q_free = q_empty.index(qb)
            mbarrier.wait(q_ready.index(qb), (i // Q_BUFFERS) & 1)
            if n_mine > 0:
                # Tile 0 has no P V before it to overlap with.
                s0 = c % STAGES
                mbarrier.wait(k_ready.index(s0), (c // STAGES) & 1)
                qk = warpgroup_mma(q, k_ring.index(s0).permute((1, 0)),
                                   gl.zeros((ROWS, BLOCK_N), gl.float32, s_layout), use_acc=False, is_async=True)
                qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
                mbarrier.arrive(k_empty.index(s0), count=1)
                mbarrier.arrive(q_free, count=1, pred=n_mine == 1)
                if n_full > 0:
                    p, alpha, m_i, l_i = _softmax_step(qk, m_i, l_i, rows, 0, shift, qk_scale, False)
                else:
                    p, alpha, m_i, l_i = _softmax_step(qk, m_i, l_i, rows, 0, shift, qk_scale, True)
                p_op = gl.convert_layout(p.to(v_ring.dtype), p_layout)
                for j in range(1, n_full):
                    acc, p_op, m_i, l_i = _attn_fwd_tile(c + j, j, n_mine - 1, acc, p_op, m_i, l_i, q, k_ring,
                                                         v_ring, q_free, k_ready, v_ready, k_empty, v_empty, rows,
                                                         shift, qk_scale, s_layout, STAGES, False)
                for j in range(gl.maximum(n_full, 1), n_mine):
                    acc, p_op, m_i, l_i = _attn_fwd_tile(c + j, j, n_mine - 1, acc, p_op, m_i, l_i, q, k_ring,
                                                         v_ring, q_free, k_ready, v_ready, k_empty, v_empty, rows,
                                                         shift, qk_scale, s_layout, STAGES, True)
                # The last tile's P V.
                c += n_mine
                last = (c - 1) % STAGES
                mbarrier.wait(v_ready.index(last), ((c - 1) // STAGES) & 1)
                acc = warpgroup_mma(p_op, v_ring.index(last), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))[0]
                mbarrier.arrive(v_empty.index(last), count=1)
            else:
                mbarrier.arrive(q_free, count=1)
            for j in range(n_mine, n_tiles):
                # Tiles the loader brought for the other consumer's rows: once they have landed (so
                # that this arrival cannot count toward the slot's next lap), let the slot go.
                s = c % STAGES
                mbarrier.wait(k_ready.index(s), (c // STAGES) & 1)
                mbarrier.arrive(k_empty.index(s), count=1)
                mbarrier.wait(v_ready.index(s), (c // STAGES) & 1)
                mbarrier.arrive(v_empty.index(s), count=1)
                c += 1
            i += 1

            # One division at the end; the log-sum-exp in natural log. Rows that see no key
            # (causal, seqlen_q > seqlen_k) give 0 and lse = +inf, as the tl kernel does.
            empty = l_i == 0.0
            l_safe = gl.where(empty, 1.0, l_i)
            out = acc / gl.expand_dims(gl.convert_layout(l_safe, row_o), 1)
            lse = gl.where(empty, float("inf"), (m_i + gl.log2(l_safe)) / RCP_LN2)
            if TMA_STORE:
                # Through shared memory and one bulk copy, which runs on while this consumer starts
                # its next item (plain stores kept both consumers here at once, the tensor cores
                # idle). Rows past the sequence (items of 192 rows) are a whole 64-row part: skipped.
                if m0 < seqlen_q:
                    o_buf = o_smem.index(which)
                    o_16 = out.to(o_desc.dtype)
                    if o_desc.block_type.shape[1] == HEAD_DIM:
                        _store_block(o_16, o_desc, o_buf, b * seqlen_q + m0, h * HEAD_DIM)
                    else:  # D = 256: two 64 x 128 halves through one 16 KB buffer, one after the other
                        HALF: gl.constexpr = HEAD_DIM // 2
                        lo, hi = gl.split(gl.permute(gl.reshape(o_16, [ROWS, 2, HALF]), (0, 2, 1)))
                        _store_block(lo, o_desc, o_buf, b * seqlen_q + m0, h * HEAD_DIM)
                        _store_block(hi, o_desc, o_buf, b * seqlen_q + m0, h * HEAD_DIM + HALF)
            else:
                # Straight from registers: row r of head h sits at (b * seqlen_q + r) * heads * D + h * D.
                # Rows past the sequence (items of 192 rows) are left alone.
                r_o = m0 + gl.arange(0, ROWS, layout=row_o)
                o_rows = (b * seqlen_q + r_o).to(gl.int64) * (num_heads * HEAD_DIM)
                o_cols = h * HEAD_DIM + gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
                o_ok = gl.expand_dims(r_o < seqlen_q, 1) & gl.expand_dims(o_cols >= 0, 0)
                gl.store(Out + gl.expand_dims(o_rows, 1) + gl.expand_dims(o_cols, 0), out.to(Out.dtype.element_ty),
                         mask=o_ok)
            gl.store(Lse + (b * num_heads + h).to(gl.int64) * seqlen_q + rows, lse, mask=rows < seqlen_q)
    if TMA_STORE:
        tma.store_wait(0)  # the last copy has read o_smem before the CTA's shared memory goes away


@gluon.jit
def _attn_fwd_ws_kernel(q_desc, k_desc, v_desc, Out, o_desc, Lse, seqlen_q, seqlen_k, shift, num_heads, kv_group,
                        num_bh, num_m_blocks, heads_per_group, qk_scale, Sinks, HEAD_DIM: gl.constexpr,
                        STAGES: gl.constexpr, Q_BUFFERS: gl.constexpr, CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr,
                        TMA_STORE: gl.constexpr, HAS_SINKS: gl.constexpr = False):
    """Persistent: each CTA takes work items in rounds (a block of CONSUMERS x 64 queries of one
    (batch, head) each), so one item's loads overlap the previous item's last tiles."""
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS * Q_BUFFERS, ROWS, HEAD_DIM], q_desc.layout)
    k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    if TMA_STORE:  # a block of the output for each consumer: 64 x D, or 64 x 128 at D = 256
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [CONSUMERS] + o_desc.block_type.shape, o_desc.layout)
    else:
        o_smem = q_smem  # not used: the output goes out by plain stores
    q_ready, q_empty = ring_barriers(Q_BUFFERS, 1, CONSUMERS)  # every consumer releases Q (and each slot below)
    k_ready, k_empty = ring_barriers(STAGES, 1, CONSUMERS)
    v_ready, v_empty = ring_barriers(STAGES, 1, CONSUMERS)
    # Partitions take runtime arguments as they are: each consumer learns its index from a tensor.
    # The lists are spelled out: Triton 3.6's Gluon frontend rejects an argument tuple built once
    # and reused (constexprs inside it lose their constness, tuples holding them do not lower).
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_attn_fwd_consumer, (Out, o_desc, o_smem, Lse, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready,
                                  v_ready, k_empty, v_empty, seqlen_q, seqlen_k, shift, num_heads, num_bh, num_m_blocks,
                                  heads_per_group, qk_scale, Sinks, gl.to_tensor(0), HEAD_DIM, STAGES, CONSUMERS,
                                  CAUSAL, TMA_STORE, HAS_SINKS)),
            (_attn_fwd_consumer, (Out, o_desc, o_smem, Lse, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready,
                                  v_ready, k_empty, v_empty, seqlen_q, seqlen_k, shift, num_heads, num_bh, num_m_blocks,
                                  heads_per_group, qk_scale, Sinks, gl.to_tensor(1), HEAD_DIM, STAGES, CONSUMERS,
                                  CAUSAL, TMA_STORE, HAS_SINKS)),
            (_attn_fwd_loader, (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, v_ready,
                                k_empty, v_empty, seqlen_q, seqlen_k, shift, num_heads, kv_group, num_bh,
                                num_m_blocks, heads_per_group, HEAD_DIM, STAGES, CONSUMERS, CAUSAL)),
        ], [4, 1], [232, 24])
    else:  # three consumers share the register file: 160 registers a thread each
        gl.warp_specialize([
            (_attn_fwd_consumer, (Out, o_desc, o_smem, Lse, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready,
                                  v_ready, k_empty, v_empty, seqlen_q, seqlen_k, shift, num_heads, num_bh, num_m_blocks,
                                  heads_per_group, qk_scale, Sinks, gl.to_tensor(0), HEAD_DIM, STAGES, CONSUMERS,
                                  CAUSAL, TMA_STORE, HAS_SINKS)),
            (_attn_fwd_consumer, (Out, o_desc, o_smem, Lse, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready,
                                  v_ready, k_empty, v_empty, seqlen_q, seqlen_k, shift, num_heads, num_bh, num_m_blocks,
                                  heads_per_group, qk_scale, Sinks, gl.to_tensor(1), HEAD_DIM, STAGES, CONSUMERS,
                                  CAUSAL, TMA_STORE, HAS_SINKS)),
            (_attn_fwd_consumer, (Out, o_desc, o_smem, Lse, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready,
                                  v_ready, k_empty, v_empty, seqlen_q, seqlen_k, shift, num_heads, num_bh, num_m_blocks,
                                  heads_per_group, qk_scale, Sinks, gl.to_tensor(2), HEAD_DIM, STAGES, CONSUMERS,
                                  CAUSAL, TMA_STORE, HAS_SINKS)),
            (_attn_fwd_loader, (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_ready, q_empty, k_ready, v_ready,
                                k_empty, v_empty, seqlen_q, seqlen_k, shift, num_heads, kv_group, num_bh,
                                num_m_blocks, heads_per_group, HEAD_DIM, STAGES, CONSUMERS, CAUSAL)),
        ], [4, 4, 1], [160, 160, 24])


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


SHORT_D64 = 1024  # up to this many keys, D = 64 runs two consumers, and causal 64-key tiles


def tile_config(head_dim: int, causal: bool = False, seqlen_k: int = 0) -> Tuple[int, int, int, int]:
    """(consumer warpgroups, keys a tile, K/V ring slots, Q buffers), within the H200's 227 KB of
    shared memory. D = 64: three consumers without a mask (192-row items: the softmax costs as
    much as the products there, and a third warpgroup keeps the tensor cores busy;
    FlashAttention-3's choice), two when causal (128-row items: 192 rows cross the diagonal in
    two tiles, and causal ran faster with two consumers up to 8k (1.02-1.37x; 0.96x at 16k),
    attention_fwd_gluon_causal_order_h200_2026-11-29_s7c_d64_two.json), 3 slots of 128 keys, two
    Q buffers, 144 KB. D = 128: two consumers, 2 slots, two Q buffers, 192 KB. D = 256: 2 slots
    of 64 keys and one Q buffer, 192 KB (next to its 64 x 256 float32 accumulator a consumer
    keeps 64-key score tiles). D = 64 up to 1k keys: two consumers without a mask too (128-row
    items divide 512 and 1k rows, 192-row ones leave a part-empty item: 354 / 402 TFLOP/s against
    319 / 381, even at 2k, ..._d64_short_h200_2026-11-29_s9a.json); causal with 64-key tiles and
    4 slots, less of the diagonal tile wasted (512 / 1k tokens: 192 / 255 TFLOP/s against
    172 / 237; from 2k on 11-14% slower, ..._d64_tiles_h200_2026-11-29_s8h.json). With 64-key
    tiles each causal consumer stops at its own rows' last tile (the loader still brings the
    block's): D = 64 at 512 / 1k 195 / 255 -> 207 / 263 TFLOP/s from graphs, 1.24 -> 1.33x and
    1.17 -> 1.21x flash-attn 2 (..._d64_short_..._s10g.json, ..._d64_causal_..._s11c.json)."""
    if head_dim <= 64:
        if seqlen_k <= SHORT_D64:
            return (2, 64, 4, 2) if causal else (2, 128, 3, 2)
        return 2 if causal else 3, 128, 3, 2
    if head_dim <= 128:
        return 2, 128, 2, 2
    return 2, 64, 2, 1


BULK_STORE_D256_KEYS = 1024  # D = 256: the output by bulk copies up to this many keys


def stores_by_tma(head_dim: int, seqlen_k: int = 0) -> bool:
    """Whether the output leaves through shared memory and bulk copies (a 64 x 128 buffer or
    smaller a consumer, next to the rings and Q buffers of ``tile_config``: 24 KB at D = 64, 32 KB
    at D = 128 and 256, which fills the H200's 227 KB) rather than by plain stores from registers.
    Measured beside plain stores on the H200, kernel alone from CUDA graphs: D = 64 / 128 1.00-1.16x
    at 512-16k tokens, causal or not (D = 64 causal 1k 261 -> 286 TFLOP/s,
    attention_fwd_gluon_store_*_h200_2026-11-30_s13a.json). D = 256, two halves: 1.10-1.26x at
    512 / 1k keys (causal 512 273 -> 344), 1.00x at 2k causal, 0.92-0.96x at 16k
    (..._store_d256_*_s13e.json), so only up to ``BULK_STORE_D256_KEYS``."""
    return head_dim <= 128 or seqlen_k <= BULK_STORE_D256_KEYS


def output_block_cols(head_dim: int) -> int:
    """Columns of the output block a bulk copy moves: all of them up to D = 128; D = 256 goes out
    in two halves through one 64 x 128 buffer (a 64 x 256 one a consumer does not fit)."""
    return min(head_dim, 128)


@functools.lru_cache(maxsize=256)
def causal_heads_per_group(num_bh: int, num_m_blocks: int, programs: int, block_m: int, block_n: int,
                           seqlen_k: int, shift: int) -> int:
    """How many heads a group of causal work items spans (``_work_item``): the fewest whose
    static schedule is as even as any. Few heads keep a round's K/V in L2 (at 512 tokens, one
    head a group puts all four query blocks of 33 heads side by side in a round, where heads
    fastest over all heads puts 132 heads in it and reads each head's K/V once per block); but
    the CTAs walk the items in fixed zigzag rounds, and a group that does not line up with the
    rounds can leave some CTAs with twice the work of others (this estimate, per CTA: key tiles
    plus one for each item's start and end). One group of all heads is the even case at long
    lengths."""
    m_block = np.arange(num_m_blocks)
    seen = np.clip(m_block * block_m + block_m + shift, 0, None)
    cost = np.minimum((seen + block_n - 1) // block_n, seqlen_k // block_n) + 1  # [num_m_blocks]
    w = np.arange(num_bh * num_m_blocks)
    rnd, pos = np.divmod(w, programs)
    cta = np.where(rnd % 2 == 0, pos, programs - 1 - pos)

    def busiest(heads: int) -> int:
        w_in = w % (heads * num_m_blocks)
        group_heads = np.minimum(heads, num_bh - (w // (heads * num_m_blocks)) * heads)
        return int(np.bincount(cta, cost[num_m_blocks - 1 - w_in // group_heads], minlength=programs).max())

    a_round = -(-programs // num_m_blocks)  # heads whose items fill one round
    few = set(range(1, 17)) | {2**i for i in range(5, num_bh.bit_length())} | {a_round}
    if num_m_blocks <= SHORT_HEAD:
        # Measured, not explained by this estimate: at 512 tokens and D = 128, groups of 1-8
        # heads ran 25-35% slower than groups of 16-66 (s7c; benchmarks/NOTES.md, seventh round).
        few = {g for g in few if g >= a_round}
    candidates = sorted({g for g in few if g < num_bh} | {num_bh})
    loads = {g: busiest(g) for g in candidates}
    best = min(loads.values())
    return next(g for g in candidates if loads[g] <= EVEN_ENOUGH * best)


def _row_stride(t: torch.Tensor) -> Optional[int]:
    """The row stride of the (batch * seqlen, heads * headdim) view of a (B, S, H, D) tensor, or
    None if its strides do not allow one (heads must sit side by side; sequences one after another)."""
    batch, seqlen, heads, head_dim = t.shape
    stride_b, stride_s, stride_h, stride_d = t.stride()
    if stride_d != 1 or stride_h != head_dim or (batch > 1 and stride_b != seqlen * stride_s):
        return None
    return stride_s


def _rows_descriptor(t: torch.Tensor, rows: int, layout, cols: Optional[int] = None):
    """A tensor descriptor of ``t``'s (batch * seqlen, heads * headdim) view (one head = a column
    band) in [rows, cols] blocks (cols: headdim by default), for a tensor that ``why_not`` has
    accepted (or an output we made), without making the view."""
    batch, seqlen, heads, head_dim = t.shape
    return unchecked_descriptor(t, [batch * seqlen, heads * head_dim], [t.stride(1), 1], [rows, cols or head_dim],
                                layout)


def why_not(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """None if this kernel takes (q, k, v), else what it does not take (a short reason)."""
    if not is_hopper(q.device):
        return f"the Gluon kernel runs on Hopper (compute capability 9.x), got a tensor on {q.device}"
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        return (f"q must be (batch, seqlen_q, heads, headdim) and k, v (batch, seqlen_k, heads_kv, headdim), "
                f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in _GL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q, k, v must all be float16 or bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[3] not in HEAD_DIMS:
        return f"head dim must be one of {HEAD_DIMS}, got {q.shape[3]}"
    if q.shape[2] % k.shape[2]:
        return f"heads ({q.shape[2]}) must be a multiple of heads_kv ({k.shape[2]})"
    for name, n in (("seqlen_q", q.shape[1]), ("seqlen_k", k.shape[1])):
        if n == 0 or n % LENGTH_MULTIPLE:
            return f"{name} must be a positive multiple of {LENGTH_MULTIPLE}, got {n}"
    if q.shape[0] * q.shape[2] * (q.shape[1] // SUB_M) > MAX_ITEMS:
        return f"batch x heads x seqlen_q / {SUB_M} must be below 2^31"
    for name, t in (("q", q), ("k", k), ("v", v)):
        row_stride = _row_stride(t)
        if row_stride is None:
            return f"{name} needs unit stride over heads x headdim and sequences back to back"
        if t.data_ptr() % 16 or (row_stride * t.element_size()) % 16:
            return f"{name} needs a 16-byte aligned base and row stride"
    return None


def attention_forward_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                            causal: bool = False, bottom_right: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) with out like q and lse (batch, heads, seqlen_q) float32, natural log.

    q (B, Sq, H, D), k and v (B, Sk, Hkv, D) with H % Hkv == 0. ``causal`` lets query row i see
    keys j <= i + (Sk - Sq) (``bottom_right``, flash-attn's alignment) or j <= i (top-left,
    PyTorch's). Raises ValueError for what ``why_not`` names.
    """
    reason = why_not(q, k, v)
    if reason is not None:
        raise ValueError(reason)
    return launch(q, k, v, softmax_scale, causal, bottom_right)


_fwd_launcher = CachedLauncher(_attn_fwd_ws_kernel)


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool,
           bottom_right: bool, heads_per_group: Optional[int] = None,
           tma_store: Optional[bool] = None, sinks: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``attention_forward_gluon`` for a call that ``why_not`` has already accepted.
    ``heads_per_group`` overrides ``causal_heads_per_group`` and ``tma_store`` ``stores_by_tma``
    (to measure other choices); ``sinks``: (heads,) attention sinks, contiguous."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    out = new_output(q.shape, dtype=q.dtype, device=q.device)
    lse = new_output((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    consumers, block_n, stages, q_buffers = tile_config(head_dim, causal, seqlen_k)

    def desc(t: torch.Tensor, rows: int, cols: int = head_dim):
        return _rows_descriptor(t, rows, nvmma_layout((rows, cols), _GL_DTYPES[q.dtype]), cols)

    num_m_blocks = cdiv(seqlen_q, consumers * SUB_M)
    grid = (min(batch * heads * num_m_blocks, sm_count(q.device)),)
    shift = seqlen_k - seqlen_q if bottom_right else 0
    if heads_per_group is None:
        heads_per_group = (causal_heads_per_group(batch * heads, num_m_blocks, grid[0], consumers * SUB_M, block_n,
                                                  seqlen_k, shift) if causal else 1)
    if tma_store is None:
        tma_store = stores_by_tma(head_dim, seqlen_k)
    _fwd_launcher[grid](
        desc(q, SUB_M), desc(k, block_n), desc(v, block_n), out, desc(out, SUB_M, output_block_cols(head_dim)), lse,
        seqlen_q, seqlen_k, shift, heads, heads // heads_kv, batch * heads, num_m_blocks, heads_per_group,
        softmax_scale * RCP_LN2.value, q if sinks is None else sinks,
        HEAD_DIM=head_dim, STAGES=stages, Q_BUFFERS=q_buffers, CONSUMERS=consumers, CAUSAL=causal,
        TMA_STORE=tma_store, HAS_SINKS=sinks is not None, num_warps=4,
    )
    return out, lse


def compile_for_sm90(head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, causal: bool = False,
                     backward: bool = False, seqlen_k: int = 0, dq: bool = False, sinks: bool = False):
    """Build the forward (or backward; ``dq``: D = 256's dQ kernel) kernel for sm_90 without a GPU
    (what the CPU tests check): the compiled kernel. ``sinks``: the forward with attention sinks."""
    if backward or dq:
        return _compile_backward_for_sm90(head_dim, dtype, causal, dq=dq)
    name = SIGNATURE_NAMES[dtype]

    def desc(rows: int, cols: int = head_dim) -> str:
        return f"tensordesc<{name}[{rows}, {cols}],{nvmma_layout((rows, cols), _GL_DTYPES[dtype])!r}>"

    consumers, block_n, stages, q_buffers = tile_config(head_dim, causal, seqlen_k)
    types = {"q_desc": desc(SUB_M), "k_desc": desc(block_n), "v_desc": desc(block_n), "Out": f"*{name}",
             "o_desc": desc(SUB_M, output_block_cols(head_dim)), "Lse": "*fp32", "seqlen_q": "i32",
             "seqlen_k": "i32", "shift": "i32", "num_heads": "i32", "kv_group": "i32", "num_bh": "i32",
             "num_m_blocks": "i32", "heads_per_group": "i32", "qk_scale": "fp32", "Sinks": f"*{name}"}
    return build_for_sm90(_attn_fwd_ws_kernel, types, dict(HEAD_DIM=head_dim, STAGES=stages, Q_BUFFERS=q_buffers,
                                                           CONSUMERS=consumers, CAUSAL=causal,
                                                           TMA_STORE=stores_by_tma(head_dim, seqlen_k),
                                                           HAS_SINKS=sinks))


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------
BWD_BLOCK_M = 64  # query rows a tile (the N of S^T = K Q^T)
BWD_BLOCK_N = 128  # keys a CTA keeps: 64 for each consumer warpgroup
WIDE_BLOCK_N = 64  # the D = 256 dK / dV kernel's keys a CTA: 32 of S and dP for each consumer
BWD_STAGES = 2  # Q / dO ring slots: 3 ran 0.81-1.01x as fast (gluon_bwd_variants_h200_2026-11-29_s8c.json,
# at D = 64 0.86-0.91x in ..._stages_d64_h200_2026-11-30_s17f.json; at D = 128 they do not fit beside dQ's buffers)


def _wide_backward(head_dim: int) -> bool:
    """Whether the backward at this head dim is D = 256's: dK / dV in 64-key CTAs
    (``_attn_bwd_dkdv_ws_kernel``), then dQ in a kernel of its own, rather than one kernel."""
    return head_dim > 128


def _bwd_block_n(head_dim: int) -> int:
    """Keys a CTA of the dK / dV kernel keeps."""
    return WIDE_BLOCK_N if _wide_backward(head_dim) else BWD_BLOCK_N


def bwd_variant(head_dim: int, causal: bool) -> dict:
    """The backward kernel's schedule, as measured on the H200. D = 64 / 128: dQ through shared
    memory and the copy engine's reduce-add (DQ_TMA) right after its own tile. At D = 128
    1.07-1.16 x the atomic adds' best schedule and 1.05-1.10 x sending it while the next tile's
    products run (gluon_bwd_dq_tma_h200_2026-11-30_s16c.json, ..._order_..._s16d.json; the atomic
    adds took 5 of 13 ms at 16k tokens, gluon_bwd_ablation_h200_2026-11-30_s16b.json); at D = 64
    1.08 / 1.11 x the atomic adds without a mask at 1k / 16k
    (gluon_bwd_split_rotate_d64_h200_2026-11-30_s17a.json). D = 256 (dK / dV only): two Q slots
    and two dO slots, 1.05-1.08 x one dO slot; three Q slots ran 0.97-0.99 x without a mask and
    0.58-0.67 x causal (gluon_bwd_d256_dkdv_variants_h200_2026-11-30_s18h.json)."""
    if _wide_backward(head_dim):
        return dict(STAGES=BWD_STAGES, DO_SLOTS=2)
    return dict(STAGES=BWD_STAGES, DQ_TMA=True)


@gluon.jit
def _bwd_item(seqlen_q, seqlen_k, shift, num_heads_kv, num_n_blocks, CAUSAL: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """This CTA's key block (key blocks run fastest: the CTAs of one head read its Q and dO from
    L2) and the query blocks that see it: [m_lo, m_full) cross the causal diagonal, [m_full,
    m_end) see all its keys."""
    pid = gl.program_id(0)
    n0 = (pid % num_n_blocks) * BLOCK_N
    bh = pid // num_n_blocks
    m_end = seqlen_q // BLOCK_M
    m_lo = 0
    m_full = 0
    if CAUSAL:
        # Row i sees key j when j <= i + shift: rows from n0 - shift see the block's first key,
        # rows from n0 + BLOCK_N - 1 - shift its last (clamped at 0 before dividing).
        m_lo = gl.minimum(gl.maximum(n0 - shift, 0) // BLOCK_M, m_end)
        m_full = gl.minimum((gl.maximum(n0 + BLOCK_N - 1 - shift, 0) + BLOCK_M - 1) // BLOCK_M, m_end)
        m_full = gl.maximum(m_full, m_lo)
    return bh // num_heads_kv, bh % num_heads_kv, n0, m_lo, m_full, m_end


@gluon.jit
def _attn_bwd_loader(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_ring, do_ring, lse_ring, delta_ring,
                     k_smem, v_smem, kv_ready, q_ready, q_empty, do_ready, do_empty, seqlen_q, seqlen_k, shift,
                     num_heads_kv, kv_group, num_n_blocks, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                     CAUSAL: gl.constexpr, DO_APART: gl.constexpr):
    """One warp: the CTA's K and V block once, then Q, dO, lse and delta of every query block
    of every query head of the GQA group through a ring of STAGES slots (lse and delta by the
    copy engine too: loaded by the consumers, their latency was the tile's). DO_APART (the D = 256
    dK / dV kernel): dO in a ring of its own with its own barriers (``do_ready``, ``do_empty``),
    which the consumers release before Q's."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    # What lands on q_ready: Q (and dO unless DO_APART), lse and delta.
    Q_BYTES: gl.constexpr = (1 if DO_APART else 2) * q_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes
    b, h_kv, n0, m_lo, m_full, m_end = _bwd_item(seqlen_q, seqlen_k, shift, num_heads_kv, num_n_blocks, CAUSAL,
                                                 BLOCK_M, BLOCK_N)
    mbarrier.expect(kv_ready, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b * seqlen_k + n0, h_kv * HEAD_DIM], kv_ready, k_smem)
    tma.async_copy_global_to_shared(v_desc, [b * seqlen_k + n0, h_kv * HEAD_DIM], kv_ready, v_smem)
    c = 0
    for g in range(kv_group):
        h = h_kv * kv_group + g
        col = h * HEAD_DIM
        row_base = (b * num_heads_kv * kv_group + h) * seqlen_q  # the head's rows of lse and delta
        for j in range(m_lo, m_end):
            s = c % STAGES
            row = b * seqlen_q + j * BLOCK_M
            mbarrier.wait(q_empty.index(s), ((c // STAGES) & 1) ^ 1)  # a fresh slot passes at once
            mbarrier.expect(q_ready.index(s), Q_BYTES)
            tma.async_copy_global_to_shared(q_desc, [row, col], q_ready.index(s), q_ring.index(s))
            tma.async_copy_global_to_shared(lse_desc, [row_base + j * BLOCK_M], q_ready.index(s), lse_ring.index(s))
            tma.async_copy_global_to_shared(delta_desc, [row_base + j * BLOCK_M], q_ready.index(s),
                                            delta_ring.index(s))
            if DO_APART:
                DO_SLOTS: gl.constexpr = do_ring.shape[0]
                sd = c % DO_SLOTS
                mbarrier.wait(do_empty.index(sd), ((c // DO_SLOTS) & 1) ^ 1)
                mbarrier.expect(do_ready.index(sd), do_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(do_desc, [row, col], do_ready.index(sd), do_ring.index(sd))
            else:
                tma.async_copy_global_to_shared(do_desc, [row, col], q_ready.index(s), do_ring.index(s))
            c += 1


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[coord ...] += src (a shared-memory tile) by the copy engine (``cp.reduce.async.bulk
    .tensor``, one thread issues it): what ``tma.async_copy_shared_to_global`` is to a store.
    Triton 3.6's Gluon has the IR op (``ttng.async_tma_reduce``) but no function for it; it
    completes like a TMA store (``tma.store_wait``)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _send_dq(DQ, dq_desc, dq_smem, t, row0, col0, row_stride, rows, cols, dq, DQ_TMA: gl.constexpr):
    """dQ[row0 + i, col0 + j] += dq[i, j] (DQ viewed as (batch * seqlen_q, heads * headdim)) for
    tile t: through shared memory and the copy engine's reduce-add (DQ_TMA: one thread issues it
    and the consumer goes on; two buffers, so it waits only for the reduce issued a tile
    earlier), or by float32 atomic adds from registers (``rows`` = i * row_stride, ``cols`` = j)."""
    if DQ_TMA:
        buf = dq_smem.index(t % 2)
        tma.store_wait(pendings=1)  # this buffer's previous reduce has read it ...
        gl.thread_barrier()  # ... as every thread of the warpgroup sees
        buf.store(dq)
        fence_async_shared()  # the stores, visible to the copy engine
        gl.thread_barrier()
        _tma_reduce_add(dq_desc, [row0, col0], buf)
    else:  # relaxed: only the sum matters
        base = DQ + row0.to(gl.int64) * row_stride + col0
        gl.atomic_add(base + gl.expand_dims(rows, 1) + gl.expand_dims(cols, 0), dq, sem="relaxed")


@gluon.jit
def _attn_bwd_consumer(DK, DV, DQ, dq_desc, dq_smem, q_ring, do_ring, lse_ring, delta_ring, k_smem, v_smem, ds_smem,
                       kv_ready, q_ready, q_empty, ds_ready, ds_free, seqlen_q, seqlen_k, shift, num_heads_kv, kv_group,
                       num_n_blocks, qk_scale, softmax_scale, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                       CAUSAL: gl.constexpr, WHICH: gl.constexpr, DQ_TMA: gl.constexpr):
    """One warpgroup: dK and dV of 64 keys (rows WHICH * 64 of the CTA's block), summed in
    registers over every query tile t of every query head of the group, all transposed so that
    keys are the rows (wgmma's M) and P^T, dS^T stay in registers as the left operands of dV and
    dK:

        S^T = K Q^T,  dP^T = V dO^T            (issued together)
        P^T = exp2(S^T * scale * log2 e - lse * log2 e)
        dV += P^T dO                            (while dS^T is computed)
        dS^T = P^T * (dP^T - delta),  dK += dS^T Q
        dQ[rows, my half of D] += scale * dS K  (dS^T of both consumers through shared memory;
                                                 every key block adds to dQ: ``_send_dq``)

    A tile's dQ goes to memory right after its tile (sending it while the next tile's S^T and
    dP^T ran was 5-10 % slower at D = 128, gluon_bwd_dq_tma_order_h200_2026-11-30_s16d.json)."""
    BLOCK_M: gl.constexpr = q_ring.shape[1]
    BLOCK_N: gl.constexpr = k_smem.shape[0]
    KEYS: gl.constexpr = BLOCK_N // 2
    # dQ = dS K sums over the CTA's 128 keys: both consumers' dS^T meet in shared memory, and
    # each adds half of dQ's columns.
    DQ_COLS: gl.constexpr = HEAD_DIM // 2
    DQ_COL0: gl.constexpr = WHICH * DQ_COLS
    st_layout: gl.constexpr = _acc_layout(BLOCK_M)
    kv_layout: gl.constexpr = _acc_layout(HEAD_DIM)
    dq_layout: gl.constexpr = _acc_layout(DQ_COLS)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    col_st: gl.constexpr = gl.SliceLayout(0, st_layout)  # one value per query row (a column of S^T)
    b, h_kv, n0, m_lo, m_full, m_end = _bwd_item(seqlen_q, seqlen_k, shift, num_heads_kv, num_n_blocks, CAUSAL,
                                                 BLOCK_M, BLOCK_N)
    num_heads = num_heads_kv * kv_group
    per_head = m_end - m_lo
    num_tiles = kv_group * per_head
    k_mine = k_smem.slice(WHICH * KEYS, KEYS, dim=0)  # [KEYS, HEAD_DIM]
    v_mine = v_smem.slice(WHICH * KEYS, KEYS, dim=0)
    k_cols = k_smem.slice(DQ_COL0, DQ_COLS, dim=1)  # [BLOCK_N, DQ_COLS]
    keys = n0 + WHICH * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, st_layout))
    # A dQ tile's elements, relative to its first: [BLOCK_M, DQ_COLS] of the (batch * seqlen_q,
    # heads * headdim) view, this consumer's half of the columns.
    dq_stride = num_heads * HEAD_DIM
    dq_row = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout)) * dq_stride
    dq_col = gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, dq_layout))
    zeros_st = gl.zeros((KEYS, BLOCK_M), gl.float32, st_layout)
    dk = gl.zeros((KEYS, HEAD_DIM), gl.float32, kv_layout)
    dv = gl.zeros((KEYS, HEAD_DIM), gl.float32, kv_layout)
    mbarrier.wait(kv_ready, 0)
    for t in range(num_tiles):
        s = t % STAGES
        q = q_ring.index(s)  # [BLOCK_M, HEAD_DIM]
        do = do_ring.index(s)  # [BLOCK_M, HEAD_DIM]
        h = h_kv * kv_group + t // per_head
        m0 = (m_lo + t % per_head) * BLOCK_M
        mbarrier.wait(q_ready.index(s), (t // STAGES) & 1)
        st = warpgroup_mma(k_mine, q.permute((1, 0)), zeros_st, use_acc=False, is_async=True)  # [KEYS, BLOCK_M]
        dpt = warpgroup_mma(v_mine, do.permute((1, 0)), zeros_st, use_acc=False, is_async=True)  # [KEYS, BLOCK_M]
        lse = lse_ring.index(s).load(col_st) * RCP_LN2  # [BLOCK_M], log2 domain; +inf for rows that see no key
        delta = delta_ring.index(s).load(col_st)  # [BLOCK_M]
        st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse, 0))  # [KEYS, BLOCK_M]
        if CAUSAL:
            rows = m0 + gl.arange(0, BLOCK_M, layout=col_st)
            if m0 < m_full * BLOCK_M:  # the diagonal: key j is visible to row i when j <= i + shift
                pt = gl.where(gl.expand_dims(keys, 1) <= gl.expand_dims(rows + shift, 0), pt, 0.0)
        pt_op = gl.convert_layout(pt.to(q_ring.dtype), op_layout)
        dv = warpgroup_mma(pt_op, do, dv, is_async=True)  # [KEYS, HEAD_DIM]
        dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt,))  # in order: S^T and dP^T are done
        dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(q_ring.dtype)  # [KEYS, BLOCK_M]
        ds_op = gl.convert_layout(dst, op_layout)
        dk = warpgroup_mma(ds_op, q, dk, is_async=True)  # [KEYS, HEAD_DIM]

        # dS^T of both consumers side by side in shared memory, [BLOCK_N, BLOCK_M]: two
        # buffers, so one consumer may write tile t while the other still reads tile t - 1.
        sb = t % 2
        ds = ds_smem.index(sb)
        mbarrier.wait(ds_free.index(sb), ((t // 2) & 1) ^ 1)
        ds.slice(WHICH * KEYS, KEYS, dim=0).store(dst)
        fence_async_shared()  # the stores, visible to the tensor cores' reads
        gl.thread_barrier()  # ... from all 128 threads before one of them arrives
        mbarrier.arrive(ds_ready.index(sb), count=1)
        mbarrier.wait(ds_ready.index(sb), (t // 2) & 1)
        dq = warpgroup_mma(ds.permute((1, 0)), k_cols, gl.zeros((BLOCK_M, DQ_COLS), gl.float32, dq_layout),
                           use_acc=False, is_async=True)  # [BLOCK_M, DQ_COLS]
        dv, dk, dq, pt_op, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq, pt_op, ds_op))
        mbarrier.arrive(ds_free.index(sb), count=1)
        mbarrier.arrive(q_empty.index(s), count=1)
        # The tile's place in the (batch * seqlen_q, heads * headdim) view: its rows, my half of D.
        _send_dq(DQ, dq_desc, dq_smem, t, b * seqlen_q + m0, h * HEAD_DIM + DQ_COL0, dq_stride, dq_row, dq_col,
                 dq * softmax_scale, DQ_TMA)
    if DQ_TMA:
        tma.store_wait(pendings=0)  # the last reduces have read their buffers before the CTA ends
    # Rows n0 + WHICH * 64 of the (batch * seqlen_k, heads_kv * headdim) views of dK and dV.
    keys_o = n0 + WHICH * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, kv_layout))
    offs = (gl.expand_dims((b * seqlen_k + keys_o).to(gl.int64) * (num_heads_kv * HEAD_DIM), 1)
            + gl.expand_dims(h_kv * HEAD_DIM + gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout)), 0))
    gl.store(DK + offs, (dk * softmax_scale).to(DK.dtype.element_ty))
    gl.store(DV + offs, dv.to(DV.dtype.element_ty))


@gluon.jit
def _bwd_buffers(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                 DO_SLOTS: gl.constexpr):
    """The dK / dV kernels' shared memory for what the loader brings: rings of STAGES slots for Q,
    lse and delta and of DO_SLOTS for dO, and the CTA's K and V block."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    q_ring = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_ring = gl.allocate_shared_memory(do_desc.dtype, [DO_SLOTS, BLOCK_M, HEAD_DIM], do_desc.layout)
    lse_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], lse_desc.layout)
    delta_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], delta_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
    return q_ring, do_ring, lse_ring, delta_ring, k_smem, v_smem


@gluon.jit
def _attn_bwd_ws_kernel(q_desc, do_desc, k_desc, v_desc, DK, DV, DQ, dq_desc, lse_desc, delta_desc, seqlen_q, seqlen_k,
                        shift, num_heads_kv, kv_group, num_n_blocks, qk_scale, softmax_scale, HEAD_DIM: gl.constexpr,
                        STAGES: gl.constexpr, CAUSAL: gl.constexpr, DQ_TMA: gl.constexpr):
    """One CTA per (key block of 128, batch, kv head): two consumer warpgroups of 64 keys each
    and a loader warp (FlashAttention-3's backward; dQ summed in float32 by the copy engine's
    reduce-add from shared memory, DQ_TMA, or by atomic adds)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    q_ring, do_ring, lse_ring, delta_ring, k_smem, v_smem = _bwd_buffers(q_desc, do_desc, k_desc, v_desc, lse_desc,
                                                                        delta_desc, HEAD_DIM, STAGES, STAGES)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], q_desc.dtype)
    ds_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    # Each consumer's dQ tiles on their way to the copy engine's reduce: two buffers each.
    DQ_BUFS: gl.constexpr = 2 if DQ_TMA else 1
    dq_smem0 = gl.allocate_shared_memory(gl.float32, [DQ_BUFS] + dq_desc.block_type.shape, dq_desc.layout)
    dq_smem1 = gl.allocate_shared_memory(gl.float32, [DQ_BUFS] + dq_desc.block_type.shape, dq_desc.layout)
    kv_ready = barrier(1)
    q_ready, q_empty = ring_barriers(STAGES, 1, 2)  # both consumers release a slot
    ds_ready, ds_free = ring_barriers(2, 2, 2)  # both consumers write their half, both read it
    gl.warp_specialize([
        (_attn_bwd_consumer, (DK, DV, DQ, dq_desc, dq_smem0, q_ring, do_ring, lse_ring, delta_ring, k_smem, v_smem,
                              ds_smem, kv_ready, q_ready, q_empty, ds_ready, ds_free, seqlen_q, seqlen_k, shift,
                              num_heads_kv, kv_group, num_n_blocks, qk_scale, softmax_scale, HEAD_DIM, STAGES, CAUSAL,
                              0, DQ_TMA)),
        (_attn_bwd_consumer, (DK, DV, DQ, dq_desc, dq_smem1, q_ring, do_ring, lse_ring, delta_ring, k_smem, v_smem,
                              ds_smem, kv_ready, q_ready, q_empty, ds_ready, ds_free, seqlen_q, seqlen_k, shift,
                              num_heads_kv, kv_group, num_n_blocks, qk_scale, softmax_scale, HEAD_DIM, STAGES, CAUSAL,
                              1, DQ_TMA)),
        (_attn_bwd_loader, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_ring, do_ring, lse_ring,
                            delta_ring, k_smem, v_smem, kv_ready, q_ready, q_empty, q_ready, q_empty, seqlen_q,
                            seqlen_k, shift, num_heads_kv, kv_group, num_n_blocks, HEAD_DIM, STAGES, CAUSAL, False)),
    ], [4, 1], [240, 24])


@gluon.jit
def _tile_p_ds(st, dp, lse, delta, qk_scale, rows, keys, shift, diagonal, CAUSAL: gl.constexpr):
    """P = exp2(S * scale * log2 e - lse * log2 e) and dS = P * (dP - delta) for a [rows, keys]
    tile of the D = 256 kernels, once S and then dP (issued in that order) are done. On a tile
    across the causal diagonal (``diagonal``) key j is visible to row i when j <= i + shift."""
    st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))
    p = gl.exp2(st * qk_scale - gl.expand_dims(lse, 1))  # [ROWS, KEYS]
    if CAUSAL:
        if diagonal:
            p = gl.where(gl.expand_dims(keys, 0) <= gl.expand_dims(rows + shift, 1), p, 0.0)
    dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
    return p, p * (dp - gl.expand_dims(delta, 1))


@gluon.jit
def _attn_bwd_dkdv_consumer(DK, DV, q_ring, do_ring, lse_ring, delta_ring, k_smem, v_smem, p_smem, ds_smem, kv_ready,
                            q_ready, q_empty, do_ready, do_empty, pds_ready, pds_free, seqlen_q, seqlen_k, shift,
                            num_heads_kv, kv_group, num_n_blocks, qk_scale, softmax_scale, HEAD_DIM: gl.constexpr,
                            STAGES: gl.constexpr, CAUSAL: gl.constexpr, WHICH: gl.constexpr):
    """One warpgroup of the D = 256 dK / dV kernel (FlashAttention-3's hdim-256 layout). The 64 x
    256 float32 dK and dV of a CTA's 64 keys do not fit one warpgroup's registers (128 a thread
    each), so the two consumers split them by head-dim halves, transposed (head dims are the
    rows, wgmma's M), and P and dS, the right operands, meet in shared memory:

        S = Q K^T, dP = dO V^T                  for my 32 of the 64 keys (m64n32)
        P = exp2(S * scale * log2 e - lse * log2 e),  dS = P * (dP - delta)
        P, dS -> shared memory ([64 rows, 64 keys]: each consumer writes its 32 columns)
        dV^T[my 128 dims] += dO^T P,  dK^T[my 128 dims] += Q^T dS

    dQ is ``_attn_bwd_dq_ws_kernel``'s: summing it here (dS K through the copy engine's reduce-add,
    64 KB of float32 a tile pair, twice D = 128's bytes a FLOP) cost as much as the rest of the
    kernel (gluon_bwd_d256_ablation_h200_2026-11-30_s18c.json)."""
    BLOCK_M: gl.constexpr = q_ring.shape[1]
    BLOCK_N: gl.constexpr = k_smem.shape[0]
    DO_SLOTS: gl.constexpr = do_ring.shape[0]
    KEYS: gl.constexpr = BLOCK_N // 2  # keys of S and dP a consumer computes
    DIMS: gl.constexpr = HEAD_DIM // 2  # head dims of dK and dV a consumer owns
    DIM0: gl.constexpr = WHICH * DIMS
    s_layout: gl.constexpr = _acc_layout(KEYS)
    kvt_layout: gl.constexpr = _acc_layout(BLOCK_N)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)  # one value per query row
    b, h_kv, n0, m_lo, m_full, m_end = _bwd_item(seqlen_q, seqlen_k, shift, num_heads_kv, num_n_blocks, CAUSAL,
                                                 BLOCK_M, BLOCK_N)
    per_head = m_end - m_lo
    num_tiles = kv_group * per_head
    k_mine = k_smem.slice(WHICH * KEYS, KEYS, dim=0)  # [KEYS, HEAD_DIM]
    v_mine = v_smem.slice(WHICH * KEYS, KEYS, dim=0)
    keys = n0 + WHICH * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(0, s_layout))
    zeros_s = gl.zeros((BLOCK_M, KEYS), gl.float32, s_layout)
    dkt = gl.zeros((DIMS, BLOCK_N), gl.float32, kvt_layout)
    dvt = gl.zeros((DIMS, BLOCK_N), gl.float32, kvt_layout)
    mbarrier.wait(kv_ready, 0)
    for t in range(num_tiles):
        s = t % STAGES
        sd = t % DO_SLOTS
        q = q_ring.index(s)  # [BLOCK_M, HEAD_DIM]
        do = do_ring.index(sd)  # [BLOCK_M, HEAD_DIM]
        m0 = (m_lo + t % per_head) * BLOCK_M
        mbarrier.wait(q_ready.index(s), (t // STAGES) & 1)
        st = warpgroup_mma(q, k_mine.permute((1, 0)), zeros_s, use_acc=False, is_async=True)  # [BLOCK_M, KEYS]
        mbarrier.wait(do_ready.index(sd), (t // DO_SLOTS) & 1)
        dp = warpgroup_mma(do, v_mine.permute((1, 0)), zeros_s, use_acc=False, is_async=True)  # [BLOCK_M, KEYS]
        lse = lse_ring.index(s).load(row_s) * RCP_LN2  # [BLOCK_M], log2 domain; +inf for rows that see no key
        delta = delta_ring.index(s).load(row_s)  # [BLOCK_M]
        rows = m0 + gl.arange(0, BLOCK_M, layout=row_s)
        p, ds = _tile_p_ds(st, dp, lse, delta, qk_scale, rows, keys, shift, m0 < m_full * BLOCK_M,
                           CAUSAL)  # [BLOCK_M, KEYS]

        # Both consumers' halves of P and dS in shared memory, [BLOCK_M, BLOCK_N] each, once the
        # last tile's products have read them.
        mbarrier.wait(pds_free, (t & 1) ^ 1)
        p_smem.slice(WHICH * KEYS, KEYS, dim=1).store(p.to(q_ring.dtype))
        ds_smem.slice(WHICH * KEYS, KEYS, dim=1).store(ds.to(q_ring.dtype))
        fence_async_shared()  # the stores, visible to the tensor cores' reads
        gl.thread_barrier()  # ... from all 128 threads before one of them arrives
        mbarrier.arrive(pds_ready, count=1)
        mbarrier.wait(pds_ready, t & 1)
        dvt = warpgroup_mma(do.slice(DIM0, DIMS, dim=1).permute((1, 0)), p_smem, dvt, is_async=True)  # [DIMS, BLOCK_N]
        dkt = warpgroup_mma(q.slice(DIM0, DIMS, dim=1).permute((1, 0)), ds_smem, dkt, is_async=True)
        dvt = warpgroup_mma_wait(num_outstanding=1, deps=(dvt,))
        mbarrier.arrive(do_empty.index(sd), count=1)  # the loader may bring the next dO
        dkt = warpgroup_mma_wait(num_outstanding=0, deps=(dkt,))
        mbarrier.arrive(q_empty.index(s), count=1)
        mbarrier.arrive(pds_free, count=1)
    # dK^T, dV^T: element (d, j) goes to row n0 + j, column h_kv * HEAD_DIM + DIM0 + d of the
    # (batch * seqlen_k, heads_kv * headdim) views: first to a layout where each thread holds 8
    # consecutive head dims, for 16-byte stores (through shared memory; 1.00-1.03 x,
    # gluon_bwd_d256_variants_h200_2026-11-30_s18b.json).
    out_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[16, 2],
                                                warps_per_cta=[1, 4], order=[0, 1])
    dims = DIM0 + gl.arange(0, DIMS, layout=gl.SliceLayout(1, out_layout))
    keys_o = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out_layout))
    offs = (gl.expand_dims((b * seqlen_k + keys_o).to(gl.int64) * (num_heads_kv * HEAD_DIM), 0)
            + gl.expand_dims(h_kv * HEAD_DIM + dims, 1))
    gl.store(DK + offs, gl.convert_layout((dkt * softmax_scale).to(DK.dtype.element_ty), out_layout))
    gl.store(DV + offs, gl.convert_layout(dvt.to(DV.dtype.element_ty), out_layout))


@gluon.jit
def _attn_bwd_dkdv_ws_kernel(q_desc, do_desc, k_desc, v_desc, DK, DV, lse_desc, delta_desc, seqlen_q, seqlen_k, shift,
                             num_heads_kv, kv_group, num_n_blocks, qk_scale, softmax_scale, HEAD_DIM: gl.constexpr,
                             STAGES: gl.constexpr, DO_SLOTS: gl.constexpr, CAUSAL: gl.constexpr):
    """dK and dV at D = 256: one CTA per (64 keys, batch, kv head), two consumer warpgroups
    (``_attn_bwd_dkdv_consumer``) and the loader warp; Q in a ring of STAGES slots, dO in one of
    DO_SLOTS with barriers of its own (released as soon as dV^T is done)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    q_ring, do_ring, lse_ring, delta_ring, k_smem, v_smem = _bwd_buffers(q_desc, do_desc, k_desc, v_desc, lse_desc,
                                                                        delta_desc, HEAD_DIM, STAGES, DO_SLOTS)
    # P and dS, [BLOCK_M, BLOCK_N]: each consumer writes 32 of the 64 columns, a whole 64-byte
    # swizzle atom.
    pds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    p_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, BLOCK_N], pds_layout)
    ds_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, BLOCK_N], pds_layout)
    kv_ready = barrier(1)
    q_ready, q_empty = ring_barriers(STAGES, 1, 2)  # both consumers release a slot
    do_ready, do_empty = ring_barriers(DO_SLOTS, 1, 2)
    pds_ready = barrier(2)  # both consumers have written their halves
    pds_free = barrier(2)  # both consumers' products have read them
    gl.warp_specialize([
        (_attn_bwd_dkdv_consumer, (DK, DV, q_ring, do_ring, lse_ring, delta_ring, k_smem, v_smem, p_smem, ds_smem,
                                   kv_ready, q_ready, q_empty, do_ready, do_empty, pds_ready, pds_free, seqlen_q,
                                   seqlen_k, shift, num_heads_kv, kv_group, num_n_blocks, qk_scale, softmax_scale,
                                   HEAD_DIM, STAGES, CAUSAL, 0)),
        (_attn_bwd_dkdv_consumer, (DK, DV, q_ring, do_ring, lse_ring, delta_ring, k_smem, v_smem, p_smem, ds_smem,
                                   kv_ready, q_ready, q_empty, do_ready, do_empty, pds_ready, pds_free, seqlen_q,
                                   seqlen_k, shift, num_heads_kv, kv_group, num_n_blocks, qk_scale, softmax_scale,
                                   HEAD_DIM, STAGES, CAUSAL, 1)),
        (_attn_bwd_loader, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_ring, do_ring, lse_ring,
                            delta_ring, k_smem, v_smem, kv_ready, q_ready, q_empty, do_ready, do_empty, seqlen_q,
                            seqlen_k, shift, num_heads_kv, kv_group, num_n_blocks, HEAD_DIM, STAGES, CAUSAL, True)),
    ], [4, 1], [240, 24])


@gluon.jit
def _dq_item(seqlen_q, seqlen_k, shift, num_heads, num_m_blocks, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr):
    """This CTA's query block (query blocks run fastest: the CTAs of one head read its K and V from
    L2) and the key blocks its rows see: [0, n_full) by every row, [n_full, n_end) across the
    causal diagonal."""
    pid = gl.program_id(0)
    m0 = (pid % num_m_blocks) * BLOCK_M
    bh = pid // num_m_blocks
    n_end = seqlen_k // BLOCK_N
    n_full = n_end
    if CAUSAL:
        # Row i sees key j when j <= i + shift: the block's last row sees keys up to
        # m0 + BLOCK_M - 1 + shift, its first row up to m0 + shift (clamped at 0 before dividing).
        n_end = gl.minimum((gl.maximum(m0 + BLOCK_M + shift, 0) + BLOCK_N - 1) // BLOCK_N, n_end)
        n_full = gl.minimum(gl.maximum(m0 + shift + 1, 0) // BLOCK_N, n_end)
    return bh // num_heads, bh % num_heads, m0, n_full, n_end


@gluon.jit
def _attn_bwd_dq_loader(q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem, delta_smem,
                        k_ring, v_ring, q_ready, kv_ready, kv_empty, seqlen_q, seqlen_k, shift, num_heads, kv_group,
                        num_m_blocks, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr):
    """One warp: the CTA's Q, dO, lse and delta once, then K and V tiles through a ring."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_ring.shape[0]
    b, h, m0, n_full, n_end = _dq_item(seqlen_q, seqlen_k, shift, num_heads, num_m_blocks, CAUSAL, BLOCK_M, BLOCK_N)
    mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b * seqlen_q + m0, h * HEAD_DIM], q_ready, q_smem)
    tma.async_copy_global_to_shared(do_desc, [b * seqlen_q + m0, h * HEAD_DIM], q_ready, do_smem)
    tma.async_copy_global_to_shared(lse_desc, [(b * num_heads + h) * seqlen_q + m0], q_ready, lse_smem)
    tma.async_copy_global_to_shared(delta_desc, [(b * num_heads + h) * seqlen_q + m0], q_ready, delta_smem)
    kv_col = (h // kv_group) * HEAD_DIM
    for j in range(n_end):
        s = j % STAGES
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)  # a fresh slot passes at once
        mbarrier.expect(kv_ready.index(s), 2 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b * seqlen_k + j * BLOCK_N, kv_col], kv_ready.index(s),
                                        k_ring.index(s))
        tma.async_copy_global_to_shared(v_desc, [b * seqlen_k + j * BLOCK_N, kv_col], kv_ready.index(s),
                                        v_ring.index(s))


@gluon.jit
def _attn_bwd_dq_consumer(DQ, q_smem, do_smem, lse_smem, delta_smem, k_ring, v_ring, ds_smem, q_ready, kv_ready,
                          kv_empty, ds_ready, ds_free, seqlen_q, seqlen_k, shift, num_heads, num_m_blocks, qk_scale,
                          softmax_scale, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, WHICH: gl.constexpr):
    """One warpgroup of the D = 256 dQ kernel: the dK / dV kernel's layout with the roles of
    queries and keys swapped. For each K / V tile, S = Q K^T and dP = dO V^T for my 32 of its 64
    keys, dS = P * (dP - delta) into my 32 columns of a shared [64, 64] buffer, and then
    dQ[:, my 128 head dims] += dS K (64 registers a thread; dQ stays in registers, no atomics)."""
    BLOCK_M: gl.constexpr = q_smem.shape[0]
    BLOCK_N: gl.constexpr = k_ring.shape[1]
    STAGES: gl.constexpr = k_ring.shape[0]
    KEYS: gl.constexpr = BLOCK_N // 2
    DIMS: gl.constexpr = HEAD_DIM // 2
    DIM0: gl.constexpr = WHICH * DIMS
    s_layout: gl.constexpr = _acc_layout(KEYS)
    dq_layout: gl.constexpr = _acc_layout(DIMS)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    b, h, m0, n_full, n_end = _dq_item(seqlen_q, seqlen_k, shift, num_heads, num_m_blocks, CAUSAL, BLOCK_M, BLOCK_N)
    zeros_s = gl.zeros((BLOCK_M, KEYS), gl.float32, s_layout)
    dq = gl.zeros((BLOCK_M, DIMS), gl.float32, dq_layout)
    mbarrier.wait(q_ready, 0)
    lse = lse_smem.load(row_s) * RCP_LN2  # [BLOCK_M], log2 domain; +inf for rows that see no key
    delta = delta_smem.load(row_s)  # [BLOCK_M]
    rows = m0 + gl.arange(0, BLOCK_M, layout=row_s)
    for j in range(n_end):
        s = j % STAGES
        k = k_ring.index(s)  # [BLOCK_N, HEAD_DIM]
        v = v_ring.index(s)
        mbarrier.wait(kv_ready.index(s), (j // STAGES) & 1)
        st = warpgroup_mma(q_smem, k.slice(WHICH * KEYS, KEYS, dim=0).permute((1, 0)), zeros_s, use_acc=False,
                           is_async=True)  # [BLOCK_M, KEYS]
        dp = warpgroup_mma(do_smem, v.slice(WHICH * KEYS, KEYS, dim=0).permute((1, 0)), zeros_s, use_acc=False,
                           is_async=True)
        keys = j * BLOCK_N + WHICH * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(0, s_layout))
        _, ds = _tile_p_ds(st, dp, lse, delta, qk_scale, rows, keys, shift, j >= n_full, CAUSAL)  # [BLOCK_M, KEYS]
        mbarrier.wait(ds_free, (j & 1) ^ 1)
        ds_smem.slice(WHICH * KEYS, KEYS, dim=1).store(ds.to(q_smem.dtype))
        fence_async_shared()  # the stores, visible to the tensor cores' reads
        gl.thread_barrier()  # ... from all 128 threads before one of them arrives
        mbarrier.arrive(ds_ready, count=1)
        mbarrier.wait(ds_ready, j & 1)
        dq = warpgroup_mma(ds_smem, k.slice(DIM0, DIMS, dim=1), dq, is_async=True)  # [BLOCK_M, DIMS]
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        mbarrier.arrive(kv_empty.index(s), count=1)
        mbarrier.arrive(ds_free, count=1)
    # Rows m0.. of the (batch * seqlen_q, heads * headdim) view, my half of the head's columns,
    # each thread holding 8 consecutive head dims (16-byte stores).
    out_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16],
                                                warps_per_cta=[4, 1], order=[1, 0])
    rows_o = b * seqlen_q + m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out_layout))
    cols_o = h * HEAD_DIM + DIM0 + gl.arange(0, DIMS, layout=gl.SliceLayout(0, out_layout))
    offs = gl.expand_dims(rows_o.to(gl.int64) * (num_heads * HEAD_DIM), 1) + gl.expand_dims(cols_o, 0)
    gl.store(DQ + offs, gl.convert_layout((dq * softmax_scale).to(DQ.dtype.element_ty), out_layout))


@gluon.jit
def _attn_bwd_dq_ws_kernel(q_desc, do_desc, k_desc, v_desc, DQ, lse_desc, delta_desc, seqlen_q, seqlen_k, shift,
                           num_heads, kv_group, num_m_blocks, qk_scale, softmax_scale, HEAD_DIM: gl.constexpr,
                           STAGES: gl.constexpr, CAUSAL: gl.constexpr):
    """dQ at D = 256: one CTA per (64 query rows, batch, head), two consumer warpgroups
    (``_attn_bwd_dq_consumer``) and a loader warp; K and V tiles of 64 keys in a ring of STAGES
    slots."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [BLOCK_M, HEAD_DIM], do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], delta_desc.layout)
    k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    ds_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, BLOCK_N], ds_layout)
    q_ready = barrier(1)
    kv_ready, kv_empty = ring_barriers(STAGES, 1, 2)  # both consumers release a slot
    ds_ready = barrier(2)  # both consumers have written their halves
    ds_free = barrier(2)  # both consumers' products have read them
    gl.warp_specialize([
        (_attn_bwd_dq_consumer, (DQ, q_smem, do_smem, lse_smem, delta_smem, k_ring, v_ring, ds_smem, q_ready, kv_ready,
                                 kv_empty, ds_ready, ds_free, seqlen_q, seqlen_k, shift, num_heads, num_m_blocks,
                                 qk_scale, softmax_scale, HEAD_DIM, CAUSAL, 0)),
        (_attn_bwd_dq_consumer, (DQ, q_smem, do_smem, lse_smem, delta_smem, k_ring, v_ring, ds_smem, q_ready, kv_ready,
                                 kv_empty, ds_ready, ds_free, seqlen_q, seqlen_k, shift, num_heads, num_m_blocks,
                                 qk_scale, softmax_scale, HEAD_DIM, CAUSAL, 1)),
        (_attn_bwd_dq_loader, (q_desc, do_desc, k_desc, v_desc, lse_desc, delta_desc, q_smem, do_smem, lse_smem,
                               delta_smem, k_ring, v_ring, q_ready, kv_ready, kv_empty, seqlen_q, seqlen_k, shift,
                               num_heads, kv_group, num_m_blocks, HEAD_DIM, CAUSAL)),
    ], [4, 1], [240, 24])


@functools.lru_cache(maxsize=None)
def _bwd_kv_layout(head_dim: int):
    """K and V in shared memory for the backward: each consumer reads the columns of its half of
    K for dQ, so a swizzled row spans at most half the head dim (64 bytes at D = 64)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=min(128, head_dim), element_bitwidth=16, rank=2)


@functools.lru_cache(maxsize=None)
def _bwd_rows_layout():
    """A tile's 64 lse or delta values (float32) in shared memory, for the copy engine."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


def _vector_descriptor(t: torch.Tensor, block: int):
    """A tensor descriptor of contiguous ``t`` flattened, in blocks of ``block``."""
    return unchecked_descriptor(t, [t.numel()], [1], [block], _bwd_rows_layout())


@functools.lru_cache(maxsize=None)
def _bwd_dq_layout(head_dim: int):
    """A consumer's float32 dQ tile in shared memory, [64, head_dim / 2], for the copy engine's reduce."""
    return nvmma_layout((BWD_BLOCK_M, head_dim // 2), gl.float32)


def bwd_preferred(head_dim: int, causal: bool, seqlen_k: int) -> bool:
    """Whether the public functions send a backward that fits here rather than to the tl
    kernels: at every head dim, with or without the causal mask. Kernel alone on the H200, side
    by side (gluon_bwd_lse_tma_d128_h200_2026-11-30_s17c.json, TFLOP/s at 1k / 4k / 16k tokens,
    D = 128): 408 / 506 / 516 against the tl kernels' 330 / 414 / 400 without a mask, 298 / 451 /
    505 against 255 / 364 / 399 causal; at D = 64 (..._stages_d64_..._s17f.json) 344 / 427 / 442
    against 323 / 365 / 389 and 255 / 380 / 416 against 228 / 327 / 361. Through the public
    functions: 1.07-1.27 x the tl kernels (attention_bwd_h200_2026-11-30_s17d.json); at D = 256
    (the dK / dV and dQ kernels) 1.21-1.45 x (attention_bwd_d256_h200_2026-11-30_s18l.json).
    Calls that ask for determinism take it only where ``bwd_deterministic`` (``_fast_backward_fits``)."""
    return head_dim in HEAD_DIMS


def bwd_deterministic(head_dim: int) -> bool:
    """Whether the backward gives the same bits from run to run at this head dim: at D = 256 the
    dK / dV kernel and then the dQ kernel each sum their tile in one CTA in a fixed order (no
    atomics); at D = 64 / 128 dQ's sums arrive in any order (reduce-adds or atomic adds)."""
    return _wide_backward(head_dim)


def bwd_why_not(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor):
    """None if the Gluon backward takes these tensors, else what it does not take."""
    reason = why_not(q, k, v)
    if reason is not None:
        return reason
    for name, t in (("out", out), ("dout", dout)):
        if t.shape != q.shape or t.dtype != q.dtype:
            return f"{name} must be like q, got {t.dtype} {tuple(t.shape)}"
        row_stride = _row_stride(t)
        if row_stride is None or t.data_ptr() % 16 or (row_stride * t.element_size()) % 16:
            return f"{name} needs unit stride over heads x headdim, sequences back to back, 16-byte alignment"
    return None


_bwd_launcher = CachedLauncher(_attn_bwd_ws_kernel)
_bwd_dkdv_launcher = CachedLauncher(_attn_bwd_dkdv_ws_kernel)
_bwd_dq_launcher = CachedLauncher(_attn_bwd_dq_ws_kernel)
DQ_STAGES = 2  # K / V ring slots of the D = 256 dQ kernel


def launch_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                    delta: torch.Tensor, softmax_scale: float, causal: bool, bottom_right: bool, **variant):
    """(dq, dk, dv) for a call that ``bwd_why_not`` has accepted, given the forward's lse and
    delta = rowsum(dO * O), both (batch, heads, seqlen_q) float32 and contiguous. At D = 64 / 128
    dQ is summed in a float32 buffer (reduce-adds or atomic adds, in any order), so it can differ
    in the last bits from run to run; at D = 256 two kernels run, dK / dV and then dQ, both
    without atomics.
    ``variant`` overrides ``bwd_variant`` (to measure the others)."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    qo_layout = nvmma_layout((BWD_BLOCK_M, head_dim), _GL_DTYPES[q.dtype])
    kv_layout = _bwd_kv_layout(head_dim)
    dk = new_output((batch, seqlen_k, heads_kv, head_dim), dtype=k.dtype, device=k.device)
    dv = new_output((batch, seqlen_k, heads_kv, head_dim), dtype=v.dtype, device=v.device)
    wide = _wide_backward(head_dim)
    block_n = _bwd_block_n(head_dim)
    num_n_blocks = seqlen_k // block_n
    shift = seqlen_k - seqlen_q if bottom_right else 0
    tiles = (_rows_descriptor(q, BWD_BLOCK_M, qo_layout), _rows_descriptor(dout, BWD_BLOCK_M, qo_layout),
             _rows_descriptor(k, block_n, kv_layout), _rows_descriptor(v, block_n, kv_layout))
    rows = (_vector_descriptor(lse, BWD_BLOCK_M), _vector_descriptor(delta, BWD_BLOCK_M), seqlen_q, seqlen_k, shift)
    scales = (softmax_scale * RCP_LN2.value, softmax_scale)
    variant = {**bwd_variant(head_dim, causal), **variant}
    if wide:
        _bwd_dkdv_launcher[(num_n_blocks * batch * heads_kv,)](
            *tiles, dk, dv, *rows, heads_kv, heads // heads_kv, num_n_blocks, *scales,
            HEAD_DIM=head_dim, CAUSAL=causal, num_warps=4, **variant)
        # dQ from the same descriptors: 64 query rows a CTA, K / V in 64-key tiles.
        dq = new_output(q.shape, dtype=q.dtype, device=q.device)
        num_m_blocks = seqlen_q // BWD_BLOCK_M
        _bwd_dq_launcher[(num_m_blocks * batch * heads,)](
            *tiles, dq, *rows, heads, heads // heads_kv, num_m_blocks, *scales,
            HEAD_DIM=head_dim, STAGES=DQ_STAGES, CAUSAL=causal, num_warps=4)
        return dq, dk, dv
    dq_acc = torch.zeros((batch, seqlen_q, heads, head_dim), dtype=torch.float32, device=q.device)
    _bwd_launcher[(num_n_blocks * batch * heads_kv,)](
        *tiles, dk, dv, dq_acc, _rows_descriptor(dq_acc, BWD_BLOCK_M, _bwd_dq_layout(head_dim), head_dim // 2), *rows,
        heads_kv, heads // heads_kv, num_n_blocks, *scales, HEAD_DIM=head_dim, CAUSAL=causal, num_warps=4, **variant,
    )
    return dq_acc.to(q.dtype), dk, dv


def _compile_backward_for_sm90(head_dim: int, dtype: torch.dtype, causal: bool, dq: bool = False, **variant):
    """The backward kernel for sm_90 without a GPU, typed as ``launch_backward`` launches it (``dq``:
    D = 256's dQ kernel)."""
    name = SIGNATURE_NAMES[dtype]

    def desc(rows: int, layout) -> str:
        return f"tensordesc<{name}[{rows}, {head_dim}],{layout!r}>"

    qo = nvmma_layout((BWD_BLOCK_M, head_dim), _GL_DTYPES[dtype])
    kv = _bwd_kv_layout(head_dim)
    wide = _wide_backward(head_dim)
    block_n = _bwd_block_n(head_dim)
    vector = f"tensordesc<fp32[{BWD_BLOCK_M}],{_bwd_rows_layout()!r}>"
    types = {"q_desc": desc(BWD_BLOCK_M, qo), "do_desc": desc(BWD_BLOCK_M, qo), "k_desc": desc(block_n, kv),
             "v_desc": desc(block_n, kv), "lse_desc": vector, "delta_desc": vector, "seqlen_q": "i32",
             "seqlen_k": "i32", "shift": "i32", "kv_group": "i32", "qk_scale": "fp32", "softmax_scale": "fp32"}
    if dq:
        types.update(DQ=f"*{name}", num_heads="i32", num_m_blocks="i32")
        return build_for_sm90(_attn_bwd_dq_ws_kernel, types, dict(HEAD_DIM=head_dim, STAGES=DQ_STAGES, CAUSAL=causal))
    types.update(DK=f"*{name}", DV=f"*{name}", num_heads_kv="i32", num_n_blocks="i32")
    if not wide:
        types.update(DQ="*fp32", dq_desc=f"tensordesc<fp32[{BWD_BLOCK_M}, {head_dim // 2}],"
                                         f"{_bwd_dq_layout(head_dim)!r}>")
    kernel = _attn_bwd_dkdv_ws_kernel if wide else _attn_bwd_ws_kernel
    return build_for_sm90(kernel, types, dict(HEAD_DIM=head_dim, CAUSAL=causal,
                                              **{**bwd_variant(head_dim, causal), **variant}))
