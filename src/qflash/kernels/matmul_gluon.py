"""Scaled INT8 / FP8 matrix product for Hopper in Gluon: persistent and warp-specialized.

``matmul.scaled_matmul`` (so ``fp8_matmul`` and ``int8_matmul``) sends FP8 products with per-tensor,
per-row or block scales, and INT8 ones with per-tensor or per-row scales, here on Hopper where
``preferred`` says it measured faster than the ``tl`` kernel, which stays the implementation for
everything else (small N or K, the decode-sized products that ``swap_preferred`` leaves out, other
GPUs, the interpreter). This is the schedule
the ``tl`` kernel cannot get from Triton 3.6 on Hopper (its warp-specialized 4-warp tiles
computed wrong results, NOTES "Third round"):

    one CTA per SM takes work items in turn: 128 x 128 or 128 x 256 output tiles (128 x 64 or
    128 x 32 where those would leave SMs idle, 128 x 160 where that makes one round of the SMs
    instead of two, the last 32 columns a second, narrower product; grouped order:
    GROUP_M row blocks share each column block of B while it is in L2), or with split K one
    run of a tile's K steps; in three partitions
      consumer 0 (4 warps)   rows  0-63  \\  acc += A_k B_k^T on the tensor cores (wgmma)
      consumer 1 (4 warps)   rows 64-127 /  K step by K step; then scales, bias and the store
      loader     (1 warp)    A (two 64-row halves) and B tiles of every K step into a ring

    ring slot s:  loader --ready[s]--> consumers --empty[s] (both)--> loader

The ring runs on from one item to the next, so the loads of an item's first K steps overlap the
previous item's epilogue, and C leaves through shared memory and bulk copies (TMA stores) that
run on while the consumer starts its next item (a 256-wide tile's halves through a block each).
Where M <= 64 a tile has 64 rows and one consumer (CONSUMERS = 1), or, 256 wide, two consumers
that split its columns (SPLIT_N: one 64-row part of A a ring slot, each consumer its half of B).
Where 192 x 128 tiles fill the SMs' rounds better than 128 x 256 ones (large M), three consumers
take 64 rows each (CONSUMERS = 3: 160 registers a thread, so no K-step pairs; the third
consumer's partial products keep the tensor cores busy instead).
Decode-sized products (M <= 32) can run transposed (SWAP_AB):
C^T = B A^T, the launcher passing B as the kernel's A, so that B's rows fill wgmma's 64-row side
and A's few rows its narrow one (16 or 32 columns) instead of being padded to 64 rows; the
epilogue writes each block back to C transposed, by plain stores; block scales keep their roles
(A's 1 x 128 scales, one a row of A, run along the tile's columns, and B's 128 x 128 block holds
the tile's 64 rows of B). One CTA streams B at about 40 GB/s, so where B's tiles make one to two
rounds of the SMs two CTAs share each SM (registers capped at 128 a thread, 6 ring slots each;
8 with block scales) and the second round runs beside the first.

C = (A_q * a_scale) @ (B_q * b_scale)^T + bias, with A (M, K) and B (N, K) (``nn.Linear``'s weight
layout), both K-major as wgmma wants 8-bit operands. INT8 accumulates exactly in int32. FP8 (e4m3)
is promoted to float32 every BLOCK_K = 128 products: each K step's product goes to a fresh partial
that is added into the float32 total (Hopper's FP8 accumulation keeps only 14-22 bits of a long sum)
while the other consumer's product keeps the tensor cores busy. A 256-wide tile is two 128-wide
halves that take turns with one partial; a narrower tile takes its K steps in groups (pairs; with
block scales eights, or fours at long K) with two partials, so that its own next product runs while
it adds each partial but a group's last. Scales: per tensor, or per row of A times per row of B (an
output column), applied in the epilogue in the reference's order, with the launch's floating-point
fusion off so that INT8 results are bit-exact (row scales, and a tensor's in tiles up to 64 wide,
loaded at the item's start so that the epilogue need not wait for them: ``loads_scales_early``);
block scales (1 x 128 for A, 128 x 128 for B) multiply each K step's partial (in 128-wide tiles by
fused multiply-adds). The loader brings a K step's block scales into its ring slot with A and B, by 1-D
bulk copies from flat views of the scales (A's column-major, as ``quantize`` writes (1, 128) scales,
64 rows a part; B's in the 16-byte aligned four values that hold the block's value, since a copy
must start aligned), so the consumers wait for nothing but their slot (the scales' global loads had
held up the wgmma issue: 12 % of the samples, s33a; 0.99-1.09 x the loads at M = 1024 and 8192,
s34d). With split K each run's sum goes unscaled to a float32 (int32) buffer, and
``matmul_epilogue.reduce_split_k`` adds the runs in a fixed order and applies the scales and bias;
in the transposed product the last run of a tile to arrive (an atomic count) adds them in the
kernel, also in a fixed order.

In clusters (CLUSTER; an experiment that no dispatch takes yet: ``launch(cluster="A" or "B")``)
two or four CTAs (CTAS) take neighbouring column blocks of the same rows (CLUSTER_SHARES_A) or
row blocks of the same columns (CLUSTER_SHARES_B), and each loader brings its share of the
shared operand's parts of a K step to all of them by multicast copies, so that it is read from
L2 once a cluster, as cuBLAS's clusters do at M = 16 (four CTAs) and 128 (two). A slot is then
free only when every CTA's consumers let it go: each consumer arrives on its own CTA's empty
barrier and on the others'. Triton 3.6's Gluon has neither the multicast copy nor the arrival on
another CTA's barrier, and names no buffer's address, so those are inline PTX (``gluon_common``)
with the buffers' offsets in shared memory found by building the kernel once before
(``build_in_clusters``). The grid is as many clusters as the GPU holds at once
(``gluon_common.resident_clusters``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                            warpgroup_mma_wait)

from qflash.kernels import common
from qflash.kernels.common import (CTA_RESERVED_BYTES, SIGNATURE_NAMES, SM_SHARED_BYTES, CachedLauncher,
                                   aligned_columns, build_for_sm90, cdiv, is_hopper, nvmma_layout, sm_count)
from qflash.kernels.gluon_common import (ClusterLauncher, build_in_clusters, cluster_sync, fence_barrier_init,
                                         let_next_grid_launch, multicast_copy, remote_arrive, ring_barriers,
                                         unchecked_descriptor, wait_for_prior_grids)
from qflash.kernels.matmul_epilogue import (SCALES_BLOCK, SCALES_KIND, SCALES_TENSOR, reduce_split_k,
                                            scale_strides, split_k_counters)
from qflash.testing import new_output

SUB_M = 64  # rows of A a consumer warpgroup owns (wgmma's M per warpgroup)
BLOCK_K = 128  # K step, and the FP8 promotion interval
GROUP_M = 8
# Clusters of CTAS CTAs (CLUSTER): none, or groups of two or four tiles that share A's tile (the
# same rows, neighbouring column blocks) or B's (the same columns, neighbouring row blocks),
# brought to every CTA of the cluster by multicast copies (``multicast_copy``) ...
CLUSTER_OFF = gl.constexpr(0)
CLUSTER_SHARES_A = gl.constexpr(1)
CLUSTER_SHARES_B = gl.constexpr(2)
# ... which name the tensor descriptors by their PTX parameters (a descriptor's 128 bytes, as
# Triton passes it, and then its shape and strides: five parameters for a 2-D one) ...
A_DESC_PARAM = gl.constexpr("_scaled_mm_ws_kernel_param_0")
B_DESC_PARAM = gl.constexpr("_scaled_mm_ws_kernel_param_5")
# ... and these buffers by their offsets in shared memory (the kernel's SMEM_AT)
CLUSTER_BUFFERS = ("a_ring", "b_ring", "ready", "empty")

_GL_DTYPES = {torch.int8: gl.int8, torch.float8_e4m3fn: gl.float8e4nv}
_GL_OUT = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32, torch.int32: gl.int32}


@gluon.jit
def _tile_coords(t, num_m, num_n, GROUP_M: gl.constexpr):
    """Output tile t in grouped order: (row block, column block)."""
    per_group = GROUP_M * num_n
    first_m = (t // per_group) * GROUP_M
    rows_in_group = gl.minimum(num_m - first_m, GROUP_M)
    return first_m + (t % per_group) % rows_in_group, (t % per_group) // rows_in_group


# A B scale's place in a ring slot: eight rows of four float32 values, 128 bytes (a bulk copy's
# shared-memory alignment), of which the copy fills the first row (the aligned four that hold it)
B_SC_ROWS = gl.constexpr(8)


@gluon.constexpr_function
def _a_sc_rows(vec):
    """Rows of ``vec`` float32 values that A's block scales take a ring slot (one a 64-row part):
    128 bytes or more (a bulk copy's shared-memory alignment), of which the copy fills the first.
    One row of 64 values, or in the transposed product (``vec`` the tile's columns) two of 16."""
    return max(1, 32 // vec)


@gluon.jit
def _schedule(num_m, num_n, CLUSTER: gl.constexpr, CTAS: gl.constexpr):
    """This CTA's work items: (first, step, the row and column blocks the items count, rank). In a
    cluster of CTAS the items are groups of CTAS tiles, one for each CTA (its rank, ``_work_item``):
    neighbouring column blocks of the same rows (CLUSTER_SHARES_A) or row blocks of the same
    columns (CLUSTER_SHARES_B). A group's tiles past N or M read zeros and store nothing."""
    pid, programs = gl.program_id(0), gl.num_programs(0)
    if CLUSTER == CLUSTER_SHARES_A:
        return pid // CTAS, programs // CTAS, num_m, gl.cdiv(num_n, CTAS), pid % CTAS
    elif CLUSTER == CLUSTER_SHARES_B:
        return pid // CTAS, programs // CTAS, gl.cdiv(num_m, CTAS), num_n, pid % CTAS
    return pid, programs, num_m, num_n, 0


@gluon.jit
def _work_item(t, items_m, items_n, rank, k_steps, GROUP_M: gl.constexpr, SPLIT_K: gl.constexpr,
               CLUSTER: gl.constexpr, CTAS: gl.constexpr):
    """Work item t of ``_schedule``'s counts: this CTA's output tile (row block, column block; in
    a cluster its rank's tile of the group), which of the SPLIT_K runs of K steps it takes, and
    that run [k_lo, k_hi). The runs of one tile are neighbouring items."""
    pid_m, pid_n = _tile_coords(t // SPLIT_K, items_m, items_n, GROUP_M)
    if CLUSTER == CLUSTER_SHARES_A:
        pid_n = CTAS * pid_n + rank
    elif CLUSTER == CLUSTER_SHARES_B:
        pid_m = CTAS * pid_m + rank
    split = t % SPLIT_K
    k_run = gl.cdiv(k_steps, SPLIT_K)
    return pid_m, pid_n, split, split * k_run, gl.minimum(k_steps, (split + 1) * k_run)


@gluon.jit
def _release(empty, s, CLUSTER: gl.constexpr, CTAS: gl.constexpr, EMPTY_AT: gl.constexpr, go=True):
    """Ring slot s back to the loader (where ``go``): this consumer's arrival on its CTA's empty
    barrier, and in a cluster on the other CTAs' too, whose loaders copy into this slot as well."""
    mbarrier.arrive(empty.index(s), count=1, pred=go)
    if CLUSTER:
        remote_arrive(EMPTY_AT + 8 * s, gl.to_tensor(go).to(gl.int32), CTAS)


@gluon.jit
def _mm_loader(args, GROUP_M: gl.constexpr, STAGES: gl.constexpr, SPLIT_K: gl.constexpr, CONSUMERS: gl.constexpr,
               TAIL_N: gl.constexpr, SCALES: gl.constexpr, SWAP_AB: gl.constexpr, CLUSTER: gl.constexpr,
               CTAS: gl.constexpr, SMEM_AT: gl.constexpr):
    """One warp: the A parts (64 rows a consumer) and the B tile of every K step of every work
    item of this CTA (a tile TAIL_N wider than B's block: its last TAIL_N rows from
    ``b_tail_desc`` into ``b_tail``). A slot holds A and B in the parts the rings are made of: a
    64-row part of A a consumer and B whole, or (SPLIT_N) one part of A and B's block and tail in
    a part a consumer. Edges past M, N or K arrive as zeros (the descriptors' bounds), which add
    nothing. In a cluster of CTAS the CTA of rank r brings the shared operand's parts p with
    p % CTAS == r (A's with CLUSTER_SHARES_A, else B's) to every CTA of its cluster
    (``multicast_copy``: into the ring at byte SMEM_AT[0] or SMEM_AT[1] of each, counted by
    ready[s] at byte SMEM_AT[2]); the others come from the other CTAs (where the parts are fewer
    than the CTAs, some CTAs bring none). ``args``: the kernel's tuple of runtime arguments for
    the loader."""
    (a_desc, b_desc, b_tail_desc, a_ring, b_ring, b_tail, ready, empty, M, N, K, a_sc_desc, b_sc_desc, a_sc_ring,
     b_sc_ring, stride_ask, stride_bsn, stride_bsk) = args
    A_PARTS: gl.constexpr = a_ring.shape[0] // STAGES
    B_PARTS: gl.constexpr = b_ring.shape[0] // STAGES
    SUB: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    LEAD_PART: gl.constexpr = b_desc.block_type.shape[0]
    LEAD: gl.constexpr = B_PARTS * LEAD_PART  # B's block: the tile less its tail
    TAIL_PART: gl.constexpr = TAIL_N // B_PARTS
    BN: gl.constexpr = LEAD + TAIL_N
    B_SC: gl.constexpr = b_sc_ring.shape[0] // (B_SC_ROWS * STAGES)  # B's scale blocks a tile (block scales)
    A_SC_ROWS: gl.constexpr = _a_sc_rows(a_sc_desc.block_type.shape[0])
    STEP_BYTES: gl.constexpr = (A_PARTS * a_desc.block_type.nbytes + B_PARTS * b_desc.block_type.nbytes
                                + (B_PARTS * b_tail_desc.block_type.nbytes if TAIL_N > 0 else 0)
                                + ((A_PARTS * a_sc_desc.block_type.nbytes + B_SC * b_sc_desc.block_type.nbytes)
                                   if SCALES == SCALES_BLOCK else 0))
    num_m = gl.cdiv(M, A_PARTS * SUB)
    num_n = gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    gl.static_assert(CLUSTER != CLUSTER_SHARES_B or TAIL_N == 0, "clusters that share B: no tails")
    EVERY_CTA: gl.constexpr = (1 << CTAS) - 1  # the multicast copies' mask of CTAs
    if CLUSTER:
        cluster_sync()  # every CTA's barriers made before any copies into another
    wait_for_prior_grids()  # launched early (programmatic dependent launch): the inputs may still be in the making
    first, step, items_m, items_n, rank = _schedule(num_m, num_n, CLUSTER, CTAS)
    c = 0  # K steps over all items: the ring's position
    for t in range(first, items_m * items_n * SPLIT_K, step):
        pid_m, pid_n, split, k_lo, k_hi = _work_item(t, items_m, items_n, rank, k_steps, GROUP_M, SPLIT_K, CLUSTER,
                                                     CTAS)
        if SCALES == SCALES_BLOCK:  # where the item's scales start: A's first row, B's 128 x 128 block
            a_first, b_block = _scale_origins(pid_m, pid_n, A_PARTS * SUB, BN, BK, SWAP_AB)
        for kk in range(k_lo, k_hi):
            s = c % STAGES
            # A wait on the previous (parity 1) phase of a fresh barrier passes at once.
            mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), STEP_BYTES)
            if SCALES == SCALES_BLOCK:
                # The step's block scales by the copy engine too, from flat views: A's (column-major)
                # 64 rows a part (in the transposed product the tile's BN columns), and B's in the
                # 16-byte aligned four values that hold the block's (a copy's first element must be
                # 16-byte aligned: else an illegal instruction).
                for part in gl.static_range(A_PARTS):
                    tma.async_copy_global_to_shared(a_sc_desc, [kk * stride_ask + a_first + part * SUB],
                                                    ready.index(s), a_sc_ring.index(A_SC_ROWS * (A_PARTS * s + part)))
                for blk in gl.static_range(B_SC):
                    b_at = (b_block + blk) * stride_bsn + kk * stride_bsk
                    tma.async_copy_global_to_shared(b_sc_desc, [b_at - b_at % 4], ready.index(s),
                                                    b_sc_ring.index(B_SC_ROWS * (B_SC * s + blk)))
            for part in gl.static_range(A_PARTS):
                if CLUSTER == CLUSTER_SHARES_A:
                    if part % CTAS == rank:
                        multicast_copy(A_DESC_PARAM, kk * BK, (pid_m * A_PARTS + part) * SUB,
                                       SMEM_AT[0] + (A_PARTS * s + part) * a_desc.block_type.nbytes,
                                       SMEM_AT[2] + 8 * s, EVERY_CTA)
                else:
                    tma.async_copy_global_to_shared(a_desc, [(pid_m * A_PARTS + part) * SUB, kk * BK],
                                                    ready.index(s), a_ring.index(A_PARTS * s + part))
            for part in gl.static_range(B_PARTS):
                if CLUSTER == CLUSTER_SHARES_B:
                    if part % CTAS == rank:
                        multicast_copy(B_DESC_PARAM, kk * BK, pid_n * BN + part * LEAD_PART,
                                       SMEM_AT[1] + (B_PARTS * s + part) * b_desc.block_type.nbytes,
                                       SMEM_AT[2] + 8 * s, EVERY_CTA)
                else:
                    tma.async_copy_global_to_shared(b_desc, [pid_n * BN + part * LEAD_PART, kk * BK],
                                                    ready.index(s), b_ring.index(B_PARTS * s + part))
            if TAIL_N > 0:
                for part in gl.static_range(B_PARTS):
                    tma.async_copy_global_to_shared(b_tail_desc, [pid_n * BN + LEAD + part * TAIL_PART, kk * BK],
                                                    ready.index(s), b_tail.index(B_PARTS * s + part))
            c += 1
    if CLUSTER:
        # Not gone before the last arrivals from the other CTAs are in: every slot released by all
        # the cluster's consumers (the wait a next fill would make), so nothing still reaches this CTA.
        for j in gl.static_range(STAGES):
            mbarrier.wait(empty.index((c + j) % STAGES), (((c + j) // STAGES) & 1) ^ 1)
    # Every load issued: the next kernel may take the SMs this one leaves. (Let at the start, a long
    # kernel's CTAs that launched early onto the free SMs of a part-empty grid ran 0.79 x at M = 16
    # 70B qkv, two CTAs an SM; s35b.)
    let_next_grid_launch()


@gluon.jit
def _idle(CLUSTER: gl.constexpr):
    """Warps beside the loader's one in the last warpgroup, which do no work (two partitions, of
    two warps and one: a partition's warps are a power of two). Triton would pad the warps to
    whole warpgroups with warps that wait outside every partition; in a cluster these come to the
    cluster barrier (``cluster_sync``), which waits for every thread of the cluster that has not
    exited. (A loader of four warps instead, each running the loop, took issue slots from the
    consumers: pairs 1.46 x the time without clusters at 128 x 6144 x 4096, 1.07 x at 8192^3,
    s68a; ncu's samples, s68b.)"""
    if CLUSTER:
        cluster_sync()


@gluon.jit
def _mm_epilogue(acc, C, c_desc, c_buf, AScale, BScale, Bias, row0, col0, c_row_base, M, N, stride_cm, stride_asm,
                 stride_bsn, SCALES: gl.constexpr, HAS_BIAS: gl.constexpr, TMA_STORE: gl.constexpr,
                 RAW: gl.constexpr, SWAP_AB: gl.constexpr, PENDING: gl.constexpr = 0, EARLY: gl.constexpr = False,
                 a_early=1.0, b_early=1.0):
    """C[row0:, col0:] (acc's block) = acc * scales (+ bias) in float32, in the reference's order,
    cast to C's dtype; with RAW (split K) C is a partial sum's buffer that takes acc as it is,
    from row c_row_base + row0. With TMA_STORE the block goes out through shared memory
    (``c_buf``) and one bulk copy that runs on while the consumer starts its next tile; the copy
    clips rows and columns past C's bounds. PENDING: how many of this consumer's latest copies
    may still be running when ``c_buf`` is written (1 where it takes turns with a second buffer).
    With SWAP_AB the kernel's product is the user's C transposed: the block goes to C[col0:,
    row0:] by plain stores, and the bias runs along rows. With EARLY the scales came in as
    ``a_early`` (per tensor: the two scales' product) and ``b_early``, loaded at the item's start."""
    BM: gl.constexpr = acc.type.shape[0]
    BN: gl.constexpr = acc.type.shape[1]
    rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, acc.type.layout))
    cols = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, acc.type.layout))
    out = acc
    if RAW:
        pass
    elif SCALES == SCALES_BLOCK:  # applied K step by K step
        out = acc.to(gl.float32)
    elif SCALES == SCALES_TENSOR:
        if EARLY:
            out = acc.to(gl.float32) * a_early
        else:
            out = acc.to(gl.float32) * (gl.load(AScale) * gl.load(BScale))
    else:
        if EARLY:
            a_s, b_s = a_early, b_early
        else:
            a_s, b_s = _row_scales(AScale, BScale, rows, cols, M, N, stride_asm, stride_bsn)
        if SWAP_AB:  # the user's A scale first, as the reference multiplies (INT8: the same bits)
            out = acc.to(gl.float32) * gl.expand_dims(b_s, 0) * gl.expand_dims(a_s, 1)
        else:
            out = acc.to(gl.float32) * gl.expand_dims(a_s, 1) * gl.expand_dims(b_s, 0)
    if HAS_BIAS and not RAW:
        if SWAP_AB:  # the user's bias is one a row of B, which is the kernel's A
            out = out + gl.expand_dims(gl.load(Bias + rows, mask=rows < M, other=0.0).to(gl.float32), 1)
        else:
            out = out + gl.expand_dims(gl.load(Bias + cols, mask=cols < N, other=0.0).to(gl.float32), 0)
    if TMA_STORE:
        tma.store_wait(PENDING)  # the copy that last read c_buf is done ...
        gl.thread_barrier()  # ... before any of the 128 threads writes it again
        c_buf.store(out.to(c_desc.dtype))
        fence_async_shared()  # the writes, visible to the copy engine
        gl.thread_barrier()  # ... from all 128 threads before one of them issues the copy
        tma.async_copy_shared_to_global(c_desc, [c_row_base + row0, col0], c_buf)
    else:
        if SWAP_AB:  # element (row, col) is the user's C[col, row]
            ptrs = C + gl.expand_dims(rows, 1) + gl.expand_dims(cols.to(gl.int64) * stride_cm, 0)
        else:
            ptrs = C + gl.expand_dims((c_row_base + rows).to(gl.int64) * stride_cm, 1) + gl.expand_dims(cols, 0)
        ok = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
        gl.store(ptrs, out.to(C.dtype.element_ty), mask=ok)


@gluon.jit
def _row_scales(AScale, BScale, rows, cols, M, N, stride_asm, stride_bsn):
    """The scales of a block's rows of A and of its columns (rows of B)."""
    a_s = gl.load(AScale + rows * stride_asm, mask=rows < M, other=0.0)
    b_s = gl.load(BScale + cols * stride_bsn, mask=cols < N, other=0.0)
    return a_s, b_s


@gluon.jit
def _gather_runs(acc, Sums, Counters, row0, col0, split, tile, split_rows, M, N, SPLIT_K: gl.constexpr):
    """Split K summed inside the kernel (the transposed product): each run stores its float32
    (int32) sum of block (row0, col0) to Sums (SPLIT_K runs of split_rows x N) and counts itself in
    on the block's counter (``tile``: one a consumer's 64-row part of a tile); the run that counts
    last reads the runs back in split order (the same sum whichever run is last), sets the count
    back to zero for the next launch, and returns (True, the total); the others return False."""
    rows = row0 + gl.arange(0, acc.type.shape[0], layout=gl.SliceLayout(1, acc.type.layout))
    cols = col0 + gl.arange(0, acc.type.shape[1], layout=gl.SliceLayout(0, acc.type.layout))
    ok = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
    offs = gl.expand_dims(rows.to(gl.int64) * N, 1) + gl.expand_dims(cols, 0)  # within a run
    run = split_rows.to(gl.int64) * N
    gl.store(Sums + split * run + offs, acc, mask=ok)
    gl.thread_barrier()  # every thread's stores are issued before the count goes up
    # acq_rel: our stores are visible to whoever counts after us, and theirs to us
    arrived = gl.atomic_add(Counters + tile, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT_K - 1
    total = acc
    if last:
        # .cg: from L2, where the other runs' stores are, not from a stale L1 line
        total = gl.load(Sums + offs, mask=ok, other=0, cache_modifier=".cg")
        for s in gl.static_range(1, SPLIT_K):
            total += gl.load(Sums + s * run + offs, mask=ok, other=0, cache_modifier=".cg")
        gl.atomic_xchg(Counters + tile, 0, sem="relaxed", scope="gpu")
    return last, total


@gluon.jit
def _scale_origins(pid_m, pid_n, ROWS: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, SWAP_AB: gl.constexpr):
    """Where the block scales of tile (pid_m, pid_n), ROWS x BN, start: the first of A's (1 x 128)
    rows and the 128 x 128 block of B's that holds the tile's first 128 columns (a 64- or 32-wide
    tile shares its block with the tiles beside it). In the transposed product the kernel's A is
    the user's B and its B the user's A, while the scales keep the user's roles: A's rows are the
    tile's columns, and B's block holds the tile's 64 rows."""
    if SWAP_AB:
        return pid_n * BN, pid_m * ROWS // BK
    return pid_m * ROWS, pid_n * (BN // BK) if BN >= BK else pid_n // (BK // BN)


@gluon.jit
def _slot_scales(a_sc_ring, b_sc_ring, s, a_part, b_sel, b_sel_hi, A_PARTS: gl.constexpr, layout: gl.constexpr):
    """Block scales of the K step in ring slot ``s``, as the loader left them there: A's for the
    consumer's 64 rows (the transposed product: the tile's columns), in ``layout`` (one a row, or
    column, of the consumer's partials), and B's for the tile's first (and a 256-wide tile's
    second) 128 columns, value ``b_sel`` (``b_sel_hi``) of the aligned four that the loader copied
    (its place in B's scales modulo 4)."""
    A_SC_ROWS: gl.constexpr = _a_sc_rows(a_sc_ring.shape[1])
    B_SC: gl.constexpr = b_sc_ring.shape[0] // B_SC_ROWS // (a_sc_ring.shape[0] // (A_PARTS * A_SC_ROWS))  # a slot
    four: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])  # every thread all four
    lane = gl.arange(0, 4, layout=four)
    a_sc = a_sc_ring.index(A_SC_ROWS * (A_PARTS * s + a_part)).load(layout)
    b_sc = gl.sum(gl.where(lane == b_sel, b_sc_ring.index(B_SC_ROWS * B_SC * s).load(four), 0.0), axis=0)
    b_sc_hi = b_sc
    if B_SC == 2:
        b_sc_hi = gl.sum(gl.where(lane == b_sel_hi, b_sc_ring.index(B_SC_ROWS * (B_SC * s + 1)).load(four), 0.0),
                         axis=0)
    return a_sc, b_sc, b_sc_hi


@gluon.jit
def _promote(acc, part, a_sc, b_sc, SCALES: gl.constexpr, FUSED: gl.constexpr, SWAP_AB: gl.constexpr = False):
    """The float32 total plus one K step's partial; with block scales the partial is multiplied
    by its A rows' (SWAP_AB: its columns') and B block's scales first, in one fused multiply-add an
    element with FUSED (a 256-wide tile's halves keep the separate multiply and add: fused, ptxas
    spills them)."""
    if SCALES == SCALES_BLOCK:
        scale = gl.expand_dims(a_sc * b_sc, 0 if SWAP_AB else 1)
        if FUSED:
            return gl.fma(part, scale, acc)
        return acc + part * scale
    return acc + part


@gluon.jit
def _k_group(acc, fresh, c, never, a_ring, b_ring, a_sc_ring, b_sc_ring, ready, empty, a_part, b_part, b_at,
             stride_bsk, A_PARTS: gl.constexpr, B_PARTS: gl.constexpr, STAGES: gl.constexpr, SCALES: gl.constexpr,
             G: gl.constexpr, B_SC_ALIGNED: gl.constexpr, SWAP_AB: gl.constexpr, CLUSTER: gl.constexpr,
             CTAS: gl.constexpr, SMEM_AT: gl.constexpr):
    """G K steps of a 128-wide (or narrower) tile from ring counter ``c``, with two partials: each
    step's product is issued before the previous step's partial is waited for and added, so the
    adds overlap this consumer's own next product, all but the last step's. Steps 2, 3, ... write
    into the registers of the partial two steps back: ``use_acc`` is ``never``, a runtime False,
    so ptxas keeps two register sets (with a constant False it gives every product its own and
    spills), and that partial is pinned after its add (a wait with one product left in
    flight, which is already the case), so the next product cannot be issued before the add.
    Block scales come from each step's slot, read when its product is issued; ``b_at``: where the
    first step's B scale is in B's scales (with B_SC_ALIGNED, a multiple of 4 and the next steps'
    the next values: the value a step takes of its four is known when the kernel is built)."""
    # A's block scales: one a row of the partials, or (SWAP_AB, the user's A rows) one a column
    a_sc_layout: gl.constexpr = gl.SliceLayout(0 if SWAP_AB else 1, fresh.type.layout)
    s = c % STAGES
    mbarrier.wait(ready.index(s), (c // STAGES) & 1)
    prev = warpgroup_mma(a_ring.index(A_PARTS * s + a_part), b_ring.index(B_PARTS * s + b_part).permute((1, 0)),
                         fresh, use_acc=False, is_async=True)
    prev_a, prev_b = 1.0, 1.0  # not used: no scales in the K loop
    if SCALES == SCALES_BLOCK:
        prev_a, prev_b, _ = _slot_scales(a_sc_ring, b_sc_ring, s, a_part, 0 if B_SC_ALIGNED else b_at % 4, 0,
                                         A_PARTS, a_sc_layout)
    prev_s = s
    spare = fresh
    for j in gl.static_range(1, G):
        s = (c + j) % STAGES
        mbarrier.wait(ready.index(s), ((c + j) // STAGES) & 1)
        if j == 1:
            cur = warpgroup_mma(a_ring.index(A_PARTS * s + a_part),
                                b_ring.index(B_PARTS * s + b_part).permute((1, 0)), fresh, use_acc=False,
                                is_async=True)
        else:
            cur = warpgroup_mma(a_ring.index(A_PARTS * s + a_part),
                                b_ring.index(B_PARTS * s + b_part).permute((1, 0)), spare, use_acc=never,
                                is_async=True)
        cur_a, cur_b = prev_a, prev_b
        if SCALES == SCALES_BLOCK:
            b_sel = j % 4 if B_SC_ALIGNED else (b_at + j * stride_bsk) % 4
            cur_a, cur_b, _ = _slot_scales(a_sc_ring, b_sc_ring, s, a_part, b_sel, 0, A_PARTS, a_sc_layout)
        prev = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))
        _release(empty, prev_s, CLUSTER, CTAS, SMEM_AT[3])
        acc = _promote(acc, prev, prev_a, prev_b, SCALES, True, SWAP_AB)
        if j + 1 < G:
            acc, prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc, prev))
            spare = prev
        prev, prev_s, prev_a, prev_b = cur, s, cur_a, cur_b
    prev = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
    _release(empty, prev_s, CLUSTER, CTAS, SMEM_AT[3])
    acc = _promote(acc, prev, prev_a, prev_b, SCALES, True, SWAP_AB)
    return acc, c + G


@gluon.jit
def _mm_consumer(args, which, SCALES: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                 TMA_STORE: gl.constexpr, SPLIT_K: gl.constexpr, CONSUMERS: gl.constexpr, SWAP_AB: gl.constexpr,
                 TAIL_N: gl.constexpr, K_GROUP: gl.constexpr, B_SC_ALIGNED: gl.constexpr,
                 EARLY_SCALES: gl.constexpr = False, CLUSTER: gl.constexpr = 0, CTAS: gl.constexpr = 1,
                 SMEM_AT: gl.constexpr = (0, 0, 0, 0)):
    """One warpgroup (consumer ``which`` of CONSUMERS): 64 rows of every work item of this CTA, K
    step by K step, then the epilogue. A tile is 16, 32, 64, 128 or (FP8 only) 256 columns wide; a
    wide one is two halves of 128, each with its own float32 total. FP8 tiles with tensor or row
    scales can also be B's block and a narrower tail of TAIL_N columns (``b_tail``), two products
    a K step with a total each: 96 = 64 + 32, 160 = 128 + 32, and so on. With SPLIT_N the two
    consumers share the tile's 64 rows and split its columns: each takes half of B's block and
    half of the tail (64 x 160 tiles: columns 0-63 and 128-143 to consumer 0, 64-127 and 144-159
    to consumer 1). With C_BUFS = 2 a 256-wide tile's halves leave through two blocks of shared
    memory, so that the second half need not wait for the first half's copy. With SPLIT_K > 1
    an item's sum goes as it is to rows split * split_rows + row of a partial-sum buffer, which a
    second kernel adds up; in the transposed product, to ``Sums``, where the tile's last run adds
    them up. ``args``: the kernel's tuple of runtime arguments for the consumers (the same for each)."""
    (C, c_desc, c_smem, AScale, BScale, Bias, Sums, Counters, a_ring, b_ring, b_tail, a_sc_ring, b_sc_ring, ready,
     empty, M, N, K, stride_cm, stride_asm, stride_bsn, stride_bsk, split_rows) = args
    if CLUSTER:
        cluster_sync()  # (every warp of the kernel takes part: ``cluster_sync``)
    wait_for_prior_grids()  # the scales, the bias and C: not before the kernel ahead of this one is done
    # The kernel's choices, read off the buffers it made: parts of A and of B's block (and tail) a
    # ring slot, and blocks of C a consumer
    A_PARTS: gl.constexpr = a_ring.shape[0] // STAGES
    B_PARTS: gl.constexpr = b_ring.shape[0] // STAGES
    SPLIT_N: gl.constexpr = B_PARTS > 1
    C_BUFS: gl.constexpr = c_smem.shape[0] // CONSUMERS if TMA_STORE else 1
    if SPLIT_N:  # this consumer's parts of a slot
        a_part = 0
        b_part = which
    else:
        a_part = which
        b_part = 0
    SUB: gl.constexpr = a_ring.shape[1]
    BK: gl.constexpr = a_ring.shape[2]
    LEAD: gl.constexpr = B_PARTS * b_ring.shape[1]  # B's block: the tile less its tail
    BN: gl.constexpr = LEAD + TAIL_N
    WIDE: gl.constexpr = BN == 256 and not SPLIT_N
    HALF: gl.constexpr = LEAD // 2 if WIDE or SPLIT_N else LEAD  # columns of one wgmma
    TAIL: gl.constexpr = TAIL_N // B_PARTS  # columns of this consumer's tail
    IS_INT8: gl.constexpr = a_ring.dtype == gl.int8  # else FP8 e4m3
    gl.static_assert(LEAD == 16 or LEAD == 32 or LEAD == 64 or LEAD == 128 or WIDE or (SPLIT_N and not IS_INT8),
                     "tiles are 16, 32, 64, 128 or 256 wide")
    gl.static_assert(TAIL_N == 0 or (TAIL_N < LEAD and not IS_INT8 and SCALES != SCALES_BLOCK and not TMA_STORE
                                     and not SWAP_AB), "a tail: FP8, tensor or row scales, plain stores")
    gl.static_assert(not SPLIT_N or (CONSUMERS == 2 and HALF >= 16 and (TAIL_N == 0 or TAIL >= 16) and not IS_INT8
                                     and SCALES != SCALES_BLOCK and not SWAP_AB and SPLIT_K == 1),
                     "split columns: two consumers, FP8 with tensor or row scales, parts of 16 columns or more")
    gl.static_assert(C_BUFS == 1 or (WIDE and TMA_STORE), "two blocks of C a consumer: 256-wide tiles, bulk stores")
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HALF, 32])  # 8-bit wgmma: k = 32
    num_m = gl.cdiv(M, A_PARTS * SUB)
    num_n = gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    # EARLY_SCALES: an item's tensor or row scales loaded at its start, so that the loads run under its
    # K steps instead of holding up its epilogue (``loads_scales_early``); tiles of one product up to 128
    # wide, of one or two consumers (three have 160 registers a thread: row scales would spill)
    EARLY: gl.constexpr = (EARLY_SCALES and not WIDE and TAIL_N == 0 and SPLIT_K == 1 and SCALES != SCALES_BLOCK
                           and CONSUMERS < 3)
    first, step, items_m, items_n, rank = _schedule(num_m, num_n, CLUSTER, CTAS)
    c = 0
    for t in range(first, items_m * items_n * SPLIT_K, step):
        pid_m, pid_n, split, k_lo, k_hi = _work_item(t, items_m, items_n, rank, k_steps, GROUP_M, SPLIT_K, CLUSTER,
                                                     CTAS)
        a_early = 1.0  # [SUB] rows' scales (per tensor: the product of the two), or not used
        b_early = 1.0  # [HALF] columns' scales, or not used
        if EARLY:
            if SCALES == SCALES_TENSOR:
                a_early = gl.load(AScale) * gl.load(BScale)
            else:
                early_rows = (pid_m * A_PARTS + a_part) * SUB + gl.arange(0, SUB, layout=gl.SliceLayout(1, acc_layout))
                early_cols = pid_n * BN + b_part * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, acc_layout))
                a_early, b_early = _row_scales(AScale, BScale, early_rows, early_cols, M, N, stride_asm, stride_bsn)
        if IS_INT8:
            acc = gl.zeros((SUB, HALF), dtype=gl.int32, layout=acc_layout)  # exact: |sum| < K * 127^2
            if WIDE:  # columns 128-255
                acc_hi = gl.zeros((SUB, HALF), dtype=gl.int32, layout=acc_layout)
            for kk in range(k_lo, k_hi):
                s = c % STAGES
                mbarrier.wait(ready.index(s), (c // STAGES) & 1)
                a = a_ring.index(A_PARTS * s + a_part)
                b = b_ring.index(B_PARTS * s + b_part)
                # This K step's products in flight: the previous step's are done, so its slot goes back.
                if WIDE:  # each half into its own total
                    acc = warpgroup_mma(a, b.slice(0, HALF).permute((1, 0)), acc, is_async=True)
                    acc_hi = warpgroup_mma(a, b.slice(HALF, HALF).permute((1, 0)), acc_hi, is_async=True)
                    acc, acc_hi = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc_hi))
                else:
                    acc = warpgroup_mma(a, b.permute((1, 0)), acc, is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                _release(empty, (c - 1) % STAGES, CLUSTER, CTAS, SMEM_AT[3], kk > k_lo)
                c += 1
            if WIDE:
                acc, acc_hi = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_hi))
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _release(empty, (c - 1) % STAGES, CLUSTER, CTAS, SMEM_AT[3], k_hi > k_lo)
        else:
            # FP8: each K step's 128-deep product lands in a fresh partial, added into the float32
            # total once the tensor cores are done with it; meanwhile the other consumer's product
            # (and in a narrow tile, this consumer's next one) runs. (Reading a partial before its
            # wait, or carrying one in flight into the next iteration, makes ptxas serialize every
            # wgmma.) A wide tile's halves take turns with one partial: 128 + 64 registers of
            # float32 a thread instead of 256; a narrow tile has 64 + 2 x 64.
            acc = gl.zeros((SUB, HALF), dtype=gl.float32, layout=acc_layout)
            if WIDE:  # columns 128-255
                acc_hi = gl.zeros((SUB, HALF), dtype=gl.float32, layout=acc_layout)
            fresh = gl.zeros((SUB, HALF), dtype=gl.float32, layout=acc_layout)
            if TAIL_N > 0:  # the tail's total and partial
                tail_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                      instr_shape=[16, TAIL, 32])
                acc_t = gl.zeros((SUB, TAIL), dtype=gl.float32, layout=tail_layout)
                fresh_t = gl.zeros((SUB, TAIL), dtype=gl.float32, layout=tail_layout)
            # Block scales: each K step's partial times its scales (A: one a row, or with SWAP_AB a
            # column; B: one a 128 x 128 block) before it joins the total, read from the step's ring
            # slot (``_slot_scales``).
            a_sc_layout: gl.constexpr = gl.SliceLayout(0 if SWAP_AB else 1, acc_layout)
            b_base = _scale_origins(pid_m, pid_n, A_PARTS * SUB, BN, BK, SWAP_AB)[1] * stride_bsn  # the B scales
            k_single = k_lo  # the K steps from here on go one at a time
            if not WIDE and TAIL_N == 0 and CONSUMERS < 3:
                # A 128-wide tile of one or two consumers has registers for a second partial: its K
                # steps go in groups of K_GROUP, then pairs, each partial added while the next
                # step's product runs. (Three consumers have 160 registers a thread, not 232.)
                k_single = k_lo + (k_hi - k_lo) // K_GROUP * K_GROUP
                for kk in range(k_lo, k_single, K_GROUP):
                    acc, c = _k_group(acc, fresh, c, K < 0, a_ring, b_ring, a_sc_ring, b_sc_ring, ready, empty,
                                      a_part, b_part, b_base + kk * stride_bsk, stride_bsk, A_PARTS, B_PARTS, STAGES,
                                      SCALES, K_GROUP, B_SC_ALIGNED, SWAP_AB, CLUSTER, CTAS, SMEM_AT)
                if K_GROUP > 2:  # what is left of them in pairs
                    k_pairs = k_single
                    k_single = k_pairs + (k_hi - k_pairs) // 2 * 2
                    for kk in range(k_pairs, k_single, 2):
                        acc, c = _k_group(acc, fresh, c, K < 0, a_ring, b_ring, a_sc_ring, b_sc_ring, ready, empty,
                                          a_part, b_part, b_base + kk * stride_bsk, stride_bsk, A_PARTS, B_PARTS,
                                          STAGES, SCALES, 2, False, SWAP_AB, CLUSTER, CTAS, SMEM_AT)
            for kk in range(k_single, k_hi):  # a wide or tailed tile's steps, or a narrow tile's odd last one
                s = c % STAGES
                mbarrier.wait(ready.index(s), (c // STAGES) & 1)
                a = a_ring.index(A_PARTS * s + a_part)
                b = b_ring.index(B_PARTS * s + b_part)
                part = warpgroup_mma(a, b.slice(0, HALF).permute((1, 0)), fresh, use_acc=False, is_async=True)
                if TAIL_N > 0:  # in flight beside the block's product
                    part_t = warpgroup_mma(a, b_tail.index(B_PARTS * s + b_part).permute((1, 0)), fresh_t,
                                           use_acc=False, is_async=True)
                a_sc, b_sc, b_sc_hi = 1.0, 1.0, 1.0  # not used: no scales in the K loop
                if SCALES == SCALES_BLOCK:
                    b_at = b_base + kk * stride_bsk
                    a_sc, b_sc, b_sc_hi = _slot_scales(a_sc_ring, b_sc_ring, s, a_part, b_at % 4,
                                                       (b_at + stride_bsn) % 4, A_PARTS, a_sc_layout)
                part = warpgroup_mma_wait(num_outstanding=1 if TAIL_N > 0 else 0, deps=(part,))
                acc = _promote(acc, part, a_sc, b_sc, SCALES, not WIDE, SWAP_AB)
                if TAIL_N > 0:
                    part_t = warpgroup_mma_wait(num_outstanding=0, deps=(part_t,))
                    acc_t = acc_t + part_t
                if WIDE:
                    part = warpgroup_mma(a, b.slice(HALF, HALF).permute((1, 0)), fresh, use_acc=False,
                                         is_async=True)
                    part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
                    acc_hi = _promote(acc_hi, part, a_sc, b_sc_hi, SCALES, False)
                _release(empty, s, CLUSTER, CTAS, SMEM_AT[3])
                c += 1
        row0 = (pid_m * A_PARTS + a_part) * SUB
        col0 = pid_n * BN + b_part * HALF  # this consumer's first column (SPLIT_N: of its part)
        # In a cluster, a group's tiles past M or N (``_schedule``) read zeros and store nothing: with
        # split K a bulk store into the runs' buffer is not clipped at M, and their run counters
        # (the transposed product's) would be another tile's.
        stores = True
        if CLUSTER:
            stores = (pid_m < num_m) & (pid_n < num_n)
        if stores:
            c_buf = c_smem.index(which * C_BUFS)
            c_buf_hi = c_smem.index(which * C_BUFS + C_BUFS - 1)  # a 256-wide tile's second half
            if SWAP_AB and SPLIT_K > 1:  # the runs meet in this kernel: the last of a part's runs writes C
                # (one count for each consumer's 64-row part of the tile: each consumer's runs count apart)
                last, total = _gather_runs(acc, Sums, Counters, row0, pid_n * BN, split,
                                           (pid_m * A_PARTS + a_part) * num_n + pid_n, split_rows, M, N, SPLIT_K)
                if last:
                    _mm_epilogue(total, C, c_desc, c_buf, AScale, BScale, Bias, row0, pid_n * BN, 0, M, N, stride_cm,
                                 stride_asm, stride_bsn, SCALES, HAS_BIAS, TMA_STORE, False, SWAP_AB)
            else:
                RAW: gl.constexpr = SPLIT_K > 1
                _mm_epilogue(acc, C, c_desc, c_buf, AScale, BScale, Bias, row0, col0, split * split_rows, M, N,
                             stride_cm, stride_asm, stride_bsn, SCALES, HAS_BIAS, TMA_STORE, RAW, SWAP_AB, C_BUFS - 1,
                             EARLY, a_early, b_early)
            if WIDE:
                _mm_epilogue(acc_hi, C, c_desc, c_buf_hi, AScale, BScale, Bias, row0, col0 + HALF,
                             split * split_rows, M, N, stride_cm, stride_asm, stride_bsn, SCALES, HAS_BIAS, TMA_STORE,
                             RAW, SWAP_AB, C_BUFS - 1)
            if TAIL_N > 0:
                _mm_epilogue(acc_t, C, c_desc, c_buf, AScale, BScale, Bias, row0,
                             pid_n * BN + LEAD + b_part * TAIL, split * split_rows, M, N, stride_cm, stride_asm,
                             stride_bsn, SCALES, HAS_BIAS, TMA_STORE, RAW, SWAP_AB)
    if TMA_STORE:
        tma.store_wait(0)  # the last copies read c_smem before the CTA's shared memory goes away


@gluon.jit
def _scaled_mm_ws_kernel(a_desc, b_desc, b_tail_desc, C, c_desc, a_sc_desc, b_sc_desc, AScale, BScale, Bias, Sums,
                         Counters, M, N, K,
                         stride_cm, stride_asm, stride_ask, stride_bsn, stride_bsk, split_rows, SCALES: gl.constexpr,
                         HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                         TMA_STORE: gl.constexpr, SPLIT_K: gl.constexpr, CONSUMERS: gl.constexpr,
                         SWAP_AB: gl.constexpr, TAIL_N: gl.constexpr, SPLIT_N: gl.constexpr, C_BUFS: gl.constexpr,
                         K_GROUP: gl.constexpr, B_SC_ALIGNED: gl.constexpr = False,
                         EARLY_SCALES: gl.constexpr = False, CLUSTER: gl.constexpr = 0,
                         CTAS: gl.constexpr = 1, SMEM_AT: gl.constexpr = (0, 0, 0, 0)):
    # CLUSTER: launched in clusters of CTAS CTAs (two or four) that share A's or B's tiles
    # (CLUSTER_SHARES_A / _B, ``_mm_loader``); SMEM_AT: the byte offsets in shared memory of
    # a_ring, b_ring, ready and empty below (``smem_offsets``), which the cluster's copies and
    # arrivals name in PTX. a_desc and b_desc must stay the first two parameters (A_DESC_PARAM,
    # B_DESC_PARAM).
    SUB: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    LEAD_PART: gl.constexpr = b_desc.block_type.shape[0]  # B's block, or with SPLIT_N a consumer's half of it
    A_PARTS: gl.constexpr = 1 if SPLIT_N else CONSUMERS
    B_PARTS: gl.constexpr = CONSUMERS if SPLIT_N else 1
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [A_PARTS * STAGES, SUB, BK], a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [B_PARTS * STAGES, LEAD_PART, BK], b_desc.layout)
    if TAIL_N > 0:  # the tile's last TAIL_N rows of B, beside each slot's block
        b_tail = gl.allocate_shared_memory(b_tail_desc.dtype, [B_PARTS * STAGES, TAIL_N // B_PARTS, BK],
                                           b_tail_desc.layout)
    else:
        b_tail = b_ring  # not used
    if TMA_STORE:  # a 64 x 128 (64 x 64, 64 x 32) block of C for each consumer, or two
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [CONSUMERS * C_BUFS] + c_desc.block_type.shape,
                                           c_desc.layout)
    else:
        c_smem = a_ring  # not used: the blocks of C go out by plain stores
    if SCALES == SCALES_BLOCK:  # each slot's block scales: A's for each 64-row part (SWAP_AB: the tile's
        # columns, a_sc_desc's box), B's for its one or two blocks
        A_SC: gl.constexpr = a_sc_desc.block_type.shape[0]
        a_sc_ring = gl.allocate_shared_memory(gl.float32, [A_PARTS * STAGES * _a_sc_rows(A_SC), A_SC], a_sc_desc.layout)
        B_SC: gl.constexpr = 2 if LEAD_PART + TAIL_N == 256 else 1
        b_sc_ring = gl.allocate_shared_memory(gl.float32, [B_SC * STAGES * B_SC_ROWS, 4], b_sc_desc.layout)
    else:
        a_sc_ring = a_ring  # not used
        b_sc_ring = a_ring
    # Every consumer releases a slot, in a cluster those of every CTA (the other CTAs' loaders
    # copy into it too).
    gl.static_assert((CTAS == 1) == (CLUSTER == CLUSTER_OFF) and (CTAS == 1 or CTAS == 2 or CTAS == 4),
                     "clusters of two or four CTAs")
    ready, empty = ring_barriers(STAGES, 1, CONSUMERS * CTAS)
    if CLUSTER:
        fence_barrier_init()
    # The loader's one warp and three idle ones (``_idle``: 2 + 1) make the last warpgroup. Their
    # registers a thread: 24; in a cluster, where the loader's copies' offsets spill from 24, 32
    # beside three consumers of 160 (128 threads x (3 x 160 + 32) fill the SM's 64 K) and 40
    # beside one or two (160-wide tiles spill from 32), two of which give up 8 of their 240.
    LOADER_REGS: gl.constexpr = (32 if CONSUMERS == 3 else 40) if CLUSTER else 24
    PAIR_REGS: gl.constexpr = 232 if CLUSTER else 240
    # The partitions' runtime arguments, one tuple for every consumer (each learns its index from a
    # tensor beside it) and one for the loader. Constexprs go beside the tuples, not in them: Triton
    # 3.6's Gluon frontend passes a partition's tuple on as runtime values.
    consumer = (C, c_desc, c_smem, AScale, BScale, Bias, Sums, Counters, a_ring, b_ring, b_tail, a_sc_ring, b_sc_ring,
                ready, empty, M, N, K, stride_cm, stride_asm, stride_bsn, stride_bsk, split_rows)
    loader = (a_desc, b_desc, b_tail_desc, a_ring, b_ring, b_tail, ready, empty, M, N, K, a_sc_desc, b_sc_desc,
              a_sc_ring, b_sc_ring, stride_ask, stride_bsn, stride_bsk)
    if CONSUMERS == 3:  # 192-row tiles: three consumers of 160 registers, no K-step pairs
        gl.warp_specialize([
            (_mm_consumer, (consumer, gl.to_tensor(0), SCALES, HAS_BIAS, GROUP_M, STAGES, TMA_STORE, SPLIT_K,
                                   CONSUMERS, SWAP_AB, TAIL_N, K_GROUP, B_SC_ALIGNED, EARLY_SCALES, CLUSTER,
                                   CTAS, SMEM_AT)),
            (_mm_consumer, (consumer, gl.to_tensor(1), SCALES, HAS_BIAS, GROUP_M, STAGES, TMA_STORE, SPLIT_K,
                                   CONSUMERS, SWAP_AB, TAIL_N, K_GROUP, B_SC_ALIGNED, EARLY_SCALES, CLUSTER,
                                   CTAS, SMEM_AT)),
            (_mm_consumer, (consumer, gl.to_tensor(2), SCALES, HAS_BIAS, GROUP_M, STAGES, TMA_STORE, SPLIT_K,
                                   CONSUMERS, SWAP_AB, TAIL_N, K_GROUP, B_SC_ALIGNED, EARLY_SCALES, CLUSTER,
                                   CTAS, SMEM_AT)),
            (_mm_loader, (loader, GROUP_M, STAGES, SPLIT_K, CONSUMERS, TAIL_N, SCALES, SWAP_AB, CLUSTER, CTAS,
                          SMEM_AT)),
            (_idle, (CLUSTER, )),
            (_idle, (CLUSTER, ))],
            [4, 4, 1, 2, 1], [160, 160, LOADER_REGS, LOADER_REGS, LOADER_REGS])
    elif CONSUMERS == 2:
        gl.warp_specialize([
            (_mm_consumer, (consumer, gl.to_tensor(0), SCALES, HAS_BIAS, GROUP_M, STAGES, TMA_STORE, SPLIT_K,
                                   CONSUMERS, SWAP_AB, TAIL_N, K_GROUP, B_SC_ALIGNED, EARLY_SCALES, CLUSTER,
                                   CTAS, SMEM_AT)),
            (_mm_consumer, (consumer, gl.to_tensor(1), SCALES, HAS_BIAS, GROUP_M, STAGES, TMA_STORE, SPLIT_K,
                                   CONSUMERS, SWAP_AB, TAIL_N, K_GROUP, B_SC_ALIGNED, EARLY_SCALES, CLUSTER,
                                   CTAS, SMEM_AT)),
            (_mm_loader, (loader, GROUP_M, STAGES, SPLIT_K, CONSUMERS, TAIL_N, SCALES, SWAP_AB, CLUSTER, CTAS,
                          SMEM_AT)),
            (_idle, (CLUSTER, )),
            (_idle, (CLUSTER, ))],
            [4, 1, 2, 1], [PAIR_REGS, LOADER_REGS, LOADER_REGS, LOADER_REGS])
    else:  # 64-row tiles: one consumer
        gl.warp_specialize([
            (_mm_consumer, (consumer, gl.to_tensor(0), SCALES, HAS_BIAS, GROUP_M, STAGES, TMA_STORE, SPLIT_K,
                                   CONSUMERS, SWAP_AB, TAIL_N, K_GROUP, B_SC_ALIGNED, EARLY_SCALES, CLUSTER,
                                   CTAS, SMEM_AT)),
            (_mm_loader, (loader, GROUP_M, STAGES, SPLIT_K, CONSUMERS, TAIL_N, SCALES, SWAP_AB, CLUSTER, CTAS,
                          SMEM_AT)),
            (_idle, (CLUSTER, )),
            (_idle, (CLUSTER, ))],
            [1, 2, 1], [LOADER_REGS, LOADER_REGS, LOADER_REGS])


BLOCK_N = 128  # output columns a tile: 128 x 128 tiles (wgmma's 8-bit integer products stop short of N = 256)
STAGES = 6  # ring slots of 32 KB (two 64 x 128 A halves, one 128 x 128 B tile): 192 KB of 227


# Ring slots for tiles of each width, with C blocks beside them: two consumers' slots of 20 / 24 / 32
# / 48 KB; one consumer's of 10 / 12 / 16 / 24 / 40 KB (the depths timed at M = 64, s23b). Six slots
# for items of one round and at most 32 K steps (session 53) won only where B stayed in L2: with
# the weights in DRAM these depths won by about 6 % (x cuBLAS per tensor, cold / warm, against six:
# M = 16 8B qkv 1.03 / 0.98 against 0.97 / 1.02, M = 128 8B qkv 0.90 / 0.90 against 0.85 / 0.91,
# 8B o 0.93 / 1.02 against 0.88 / 1.03; matmul_fp8_cold_dispatch_ab_*_h200_2026-12-03_s54d.json)
RING_STAGES = {3: {128: 4}, 2: {16: 10, 32: 10, 64: 8, 128: 5, 256: 3}, 1: {16: 10, 32: 10, 64: 8, 128: 6, 256: 3}}
# Programmatic dependent launch (common.PDL, up to common.PDL_MAX_M rows) where the grid fills this share of the SMs
PDL_MIN_FILL = 0.7
LONG_K = 12288  # from here a split of K beats narrower tiles (s22b: 64-wide tiles won at K = 8192, lost at 14336)
# ... but not 64 x 64 tiles of one consumer in one round on 12 ring slots, with tensor or row scales
# where 128-wide tiles fill under a quarter of the SMs. M = 128 8B down (128 tiles of 112 K steps),
# x cuBLAS per tensor, cold / warm weights, against 128 x 64 tiles with K in two runs, same runs:
# 1.01 / 1.02 against 0.94 / 0.93 (s54b), 1.06 / 1.10 against 0.97 / 0.97 (s54c; eight slots
# 1.00 / 1.00), 1.01 / 1.04 against 0.92 / 0.94 (s54d); per row 1.83 / 1.82 against 1.58 / 1.59 (s54d)
LONG_K_64_STAGES = 12
# K steps a group in tiles of 128 columns or fewer with block scales (``_k_group``): groups of eight
# ran 1.01-1.09 x the pairs at M = 1024 and 8192 (s32b, s32c), up to 1.5 % faster than fours at
# K = 4096 / 8192; from LONG_K fours were ahead at 6 of 8 points (by up to 2 %). Tensor and row
# scales keep the pairs (groups there: 0.97-1.02 x, within the spread).
BLOCK_K_GROUP = {False: 8, True: 4}  # long K?
# Tile order for block scales from LONG_K at M >= 8192: rows of 4 tiles, not GROUP_M. The down
# projections' speed over GROUP_M = 8 in three runs (matmul_fp8_block_group_m_*_s33g.json, _s33h,
# _s33i; the same bits): 8B down 1.054 / 1.027 / 1.051, 70B down 1.012 / 1.008 / 0.997. Not at
# M = 1024 (0.993 / 0.995, s33g), nor at M = 8192 with K under LONG_K (0.976-1.000, s33h).
BLOCK_LONG_K_GROUP_M = 4
BLOCK_LONG_K_GROUP_M_MIN_M = 8192
# A sixth ring slot for two consumers' 128 x 128 tiles with tensor or row scales (6 x 32 KB beside a
# 32 KB block of 16-bit C: 224 KB), where fewer or shorter rounds of tiles leave each CTA's bytes in
# flight to set the pace. Six slots over five, same bits, two runs (matmul_fp8_six_slots_*_s43a.json,
# _s43b): with K split (its float32 sums then by plain stores: no room beside six) 1.01-1.03 per tensor
# and per row (M = 128 70B down, M = 256 8B down); no split, K from SIX_SLOT_MIN_K, per tensor 1.00-1.07
# up to M = 512 (M = 128 70B qkv 1.07; M = 256 70B o, gate_up, down 1.01-1.05; M = 512 70B qkv, 8B down
# 1.00-1.02) but 0.99 at M = 1024 (70B qkv); per row 1.03 at M = 128 (70B qkv), 0.94-1.00 from M = 256.
# With K = 4096 (the 8B shapes but down) 0.96-1.01: five.
SIX_SLOT_MIN_K = 8192
SIX_SLOT_MAX_M = {False: 512, True: 128}  # row scales?


def loads_scales_early(scales: str, block_n: int, consumers: int) -> bool:
    """Whether a work item loads its scales at its start (``EARLY_SCALES``: loads that run under the
    K steps) rather than in its epilogue, which then waits for them: for row scales, and for a
    tensor's two where tiles are at most 64 columns wide (the transposed product's among them); not
    with three consumers, whose 160 registers a thread the row scales overflow (112 bytes of spills,
    built offline; per row at M = 8192 0.98-1.00 x cuBLAS with them, s44c, 1.01-1.06 without, s44d).
    Early over late, same bits, two runs (matmul_fp8_early_scales_*_s44a.json, _s44b): per row
    1.00-1.08 wherever timed (M = 16-1024; 128 x 128 tiles at M = 128-512 with 5 and 6 slots,
    64-wide ones, the transposed product); per tensor 1.00-1.05 on 64-wide tiles at M = 128 / 256
    (8B qkv, 8B o, 70B o) and 0.996-1.02 in the transposed product at M = 16, but 0.96-1.02 on
    128-wide tiles (6 slots at M = 256 / 512: 0.96-0.98)."""
    return consumers < 3 and (scales == "row" or (scales == "tensor" and block_n <= 64))


def c_block_cols(block_n: int, split_n: bool = False) -> int:
    """Columns of a consumer's block of C (64 rows): one wgmma's width, the tile's or half of a
    256-wide one's, or half of the tile's where the consumers split its columns."""
    return block_n // 2 if split_n else min(block_n, 128)


def tail_split(block_n: int) -> tuple:
    """(B's block, tail) of a tile ``block_n`` wide: (block_n, 0) for 16-256 in powers of two; else
    the largest power of two below it and the rest, which must be a narrower power of two (48, 80,
    96, 160, 192: one wgmma each), or ValueError."""
    lead = 1 << (block_n.bit_length() - 1)
    tail = block_n - lead
    if block_n < 16 or block_n > 256 or (tail and (tail & (tail - 1) or tail < 16)):
        raise ValueError(f"block_n must be 16, 32, 64, 128 or 256, or a power of two from 32 to 128 plus a "
                         f"narrower one from 16 (48, 80, 96, 160, 192), got {block_n}")
    return lead, tail


def _wave_fill(tiles: int, sms: int) -> float:
    """How full the SMs are, on average, over the rounds of ``tiles`` equal work items."""
    return tiles / (cdiv(tiles, sms) * sms)


def _fill(m: int, n: int, rows: int, cols: int, sms: int) -> float:
    """The share of the SMs' time over the rounds of ``rows`` x ``cols`` tiles that goes to the
    M x N outputs: the rounds' fill times the tiles' share inside C."""
    tiles = cdiv(m, rows) * cdiv(n, cols)
    return _wave_fill(tiles, sms) * m * n / (tiles * rows * cols)


# Three consumers' 192 x 128 tiles against 128 x 256 ones with the same fill, at M = 4096 / 8192
# (speed over the fills' ratio, two runs each, s27c): per tensor 0.99-1.01, per row 1.00-1.05
# (median 1.02); at M = 2048 / 4096 they tied or lost where the fills alone would take them
# (per row 0.99-1.00, s27c, s27d), so only from M = 8192
THREE_CONSUMER_GAIN = {False: 1.0, True: 1.02}
THREE_CONSUMER_MIN_M = 8192


def tile_config(m: int, n: int, k: int, int8: bool, sms: int = 132, block_scales: bool = False,
                row_scales: bool = False, c_bytes: int = 2) -> tuple:
    """(block_n, stages, tma_store, split_k, consumers) for a product on ``sms`` SMs, as measured on
    the H200 side by side (benchmarks/results/matmul_gluon_tiles_h200_2026-11-29_s9b.json and
    ..._m128_..._s9b.json, FP8). Tiles have 128 rows (two consumers), 192 (three, below), or 64 (one) where M <= 64,
    and the rules below count tiles of either height the same way (M = 64, s23b: 0.91-1.01 x
    cuBLAS at six Llama shapes where the old 64-row tl tiles ran 0.68-1.00 x;
    matmul_fp8_one_consumer_h200_2026-11-30_s23b.json):

    - C through shared memory and bulk copies: +1-19% over plain stores from registers with
      256-wide tiles (8192^3: 1118 -> 1204 TFLOP/s), -1 to +11% with 128-wide ones at M = 128;
    - 128 x 256 tiles (3 slots of 48 KB) wherever they make at least 3/4 of a wave: each B tile
      then serves 128 rows and each A tile 256 columns, and the L2 traffic a product drops by a
      quarter (8192^3, both with bulk stores: 1121 -> 1204 TFLOP/s; both with plain stores, 0.76-0.93
      -> 0.79-1.00x cuBLAS at M = 1024 / 8192, matmul_gluon_tiles_h200_2026-11-29_s9a.json);
    - 192 x 128 tiles of three consumers (4 slots of 40 KB, bulk stores of a 16-bit C: ``c_bytes``)
      instead, from M = 8192, where their rounds are fuller (``_fill``: the rounds and the tiles'
      share inside C; per row even at 2 % less, ``THREE_CONSUMER_GAIN``). Against 128 x 256
      tiles, in turn twice in one run (matmul_fp8_three_consumers_repeat_m8192_h200_2026-12-01_s27c.json),
      at M = 8192 where the rule takes them: per tensor 1.00-1.02 (8192^3, 8B gate_up, 70B o,
      70B down), per row 1.01-1.03 (those and 8B qkv, 70B qkv, 70B gate_up); where it does not,
      0.97-1.00 per tensor and 0.99 per row (8B o and down), and at M = 4096 per row 0.93-1.00.
      The dispatch against 128 x 256 tiles, once each (..._dispatch_m2048_m8192_..._s27d.json):
      per tensor 0.99-1.02, per row 1.01-1.04 (x cuBLAS per row 1.005-1.049 against 0.989-1.034);
    - 128 x 128 tiles (5 slots; 6 where K is long and M small, or K split: ``SIX_SLOT_MIN_K``)
      below that, where wide tiles leave SMs idle (M = 128: 128-wide
      tiles 1.5-1.8x faster at N = 4096-10240), and where their rounds of work fill the SMs
      better by more than a tenth (M = 1024, N = 6144: 192 wide tiles fill two rounds to 0.73,
      384 narrow ones three to 0.97; with K steps in pairs, 0.91 -> 1.03x cuBLAS per tensor,
      ..._paired_steps_h200_2026-11-30_s19b.json);
    - where 128-wide tiles fill less than half of the SMs (M = 128 or 256, N <= 8192): with K
      under LONG_K, tiles of 64 or 32 columns, halved until they fill half of the SMs, and no split
      of K, whose float32 sums cost a round trip through L2 (s21d, s21e); per tensor against
      128-wide tiles with K split, x cuBLAS (matmul_fp8_narrow_tiles_h200_2026-11-30_s22b.json):
      M = 128 8B qkv 0.69 -> 0.88 (64 wide), 8B o 0.69 -> 0.89 (32 wide), 70B o 0.82 -> 0.95;
      M = 256 8B o 0.75 -> 0.96. Where K is long, the sums weigh less than the narrow tiles' extra
      reads of A: 64-wide tiles only where 128-wide ones fill under a quarter of the SMs (with
      tensor or row scales 64 x 64 tiles, one round, K whole: ``LONG_K_64_STAGES``), else
      128-wide ones with K split (M = 128 70B down: 0.98 either way, block scales 0.98 against
      0.90; M = 256 8B down 0.98 against 0.97-0.98, block scales 0.90 against 0.80);
    - 64 x 64 tiles (one consumer) where 128 x 32 ones would run: as many tiles, each reading 128
      rows of A and B instead of 160 (M = 128 8B o: 0.90 -> 1.02 x cuBLAS, s23c); 64-row tiles
      halve their width to fill half of the SMs whatever K (M = 64 8B down, 32 wide: 0.92 against
      0.88 with 64-wide tiles in two runs; 70B down, 64 wide: 0.98 against 0.97, s23c);
    - split K into ``sms // tiles`` runs when the tiles still fill less than half of the SMs
      (M = 128 8B down: 64-wide tiles in two runs, 0.88 -> 0.95 x cuBLAS; 128-wide tiles in
      ..._split_k_h200_2026-11-29_s9d.json, 307 -> 378 TFLOP/s and 369 -> 576 against no
      split; it lost where the tiles fill half or more);
    - 128 x 160 tiles (a 128-wide block and a 32-wide tail, plain stores) where 128-wide ones make
      a second round of a few tiles and 160-wide ones one round: M = 256 70B qkv, 160 tiles
      (0.61 of two rounds) against 128, 0.79 -> 0.93 x cuBLAS per tensor
      (matmul_fp8_tailed_tiles_m256_h200_2026-12-01_s25b.json). A tail costs its K steps' pairs and
      the bulk stores: where the fill gains less, tails lost (M = 256 8B gate_up, 360 tiles 160 wide
      at 0.91 full against 224 256-wide ones at 0.85: 0.86 against 0.99; M = 128 8B qkv, 128 tiles
      64 x 96 in one round against 96 of 128 x 64 at 0.73: 0.75 against 0.86). The dispatch
      against 128 x 128 tiles in one run, per tensor (..._tailed_dispatch_..._s25c.json):
      M = 256 70B qkv 0.93 against 0.79, M = 384 8B qkv 0.81 against 0.72, M = 640 8B o 0.81
      against 0.67 and 8B down 0.89 against 0.73 (per row 1.05-1.13 against 0.97-1.02).

    Block scales take no 256-wide tiles: in narrower ones the K steps go in pairs (now groups of
    eight or four, ``BLOCK_K_GROUP``) and the scales by fused multiply-adds (1.03-1.24x the
    256-wide tiles at M = 1024 / 8192, ..._fma_h200_2026-11-30_s19c.json). INT8 takes these tiles
    where it can run them, else 128 x 128 ones (``_int8_tiles``)."""
    if int8:
        return _int8_tiles(tile_config(m, n, k, False, sms, row_scales=row_scales, c_bytes=c_bytes), m)
    consumers = 1 if m <= SUB_M else 2
    stages = RING_STAGES[consumers]
    wide = cdiv(m, consumers * SUB_M) * cdiv(n, 256)
    if not block_scales and wide * 4 >= sms * 3 and _wave_fill(wide, sms) + 0.1 >= _wave_fill(2 * wide, sms):
        three = _fill(m, n, 3 * SUB_M, 128, sms) * THREE_CONSUMER_GAIN[row_scales]
        # 192 x 128 tiles, C (16-bit, 16-byte aligned rows) by bulk stores beside 4 slots
        if (m >= THREE_CONSUMER_MIN_M and c_bytes == 2 and n % 8 == 0
                and three > _fill(m, n, 2 * SUB_M, 256, sms)):
            return 128, RING_STAGES[3][128], True, 1, 3
        return 256, stages[256], True, 1, consumers
    block_n = 128
    tiles = cdiv(m, consumers * SUB_M) * cdiv(n, block_n)
    if consumers == 2 and not block_scales and tiles > sms and cdiv(m, 2 * SUB_M) * cdiv(n, 160) <= sms:
        return 160, _tail_stages(160, 2), False, 1, 2  # a second round of a few 128-wide tiles: one of 160
    if 2 * tiles < sms:  # under half the SMs: narrower tiles, or K split
        if k < LONG_K or consumers == 1:  # a 64-row tile's extra reads of A are half as many
            while 2 * tiles < sms and block_n > 32:
                block_n, tiles = block_n // 2, 2 * tiles
        elif 4 * tiles < sms and block_scales:
            block_n, tiles = 64, 2 * tiles
        elif 4 * tiles < sms:  # one round of 64 x 64 tiles on deep rings, K whole
            return 64, LONG_K_64_STAGES, True, 1, 1
    if block_n == 32 and consumers == 2:  # as many 64 x 64 tiles, a fifth less to read
        block_n, consumers, stages = 64, 1, RING_STAGES[1]
        tiles = cdiv(m, SUB_M) * cdiv(n, block_n)
    split_k = max(1, sms // tiles) if 2 * tiles < sms else 1
    if (consumers == 2 and block_n == 128 and not block_scales and k >= SIX_SLOT_MIN_K
            and (split_k > 1 or (c_bytes == 2 and m <= SIX_SLOT_MAX_M[row_scales]))):
        return block_n, 6, split_k == 1, split_k, consumers  # a sixth slot (float32 sums by plain stores)
    return block_n, stages[block_n], True, split_k, consumers


def _int8_takes(config: tuple) -> bool:
    """Whether an INT8 product can run FP8's tile (``tile_config``): up to 128 wide on one or two
    consumers, or 256 wide on two. 192-row, tailed and split-column tiles are FP8's only (the INT8
    branch has no third consumer and no tail, and one consumer's 256-wide tile is FP8's with split
    columns, ``split_columns``)."""
    return config[4] < 3 and not tail_split(config[0])[1] and not split_columns(config)


# INT8's 128 x 256 tiles (FP8's) from this M; below it, 128 x 128 ones with 5 slots and bulk stores.
# x ``torch._int_mm`` per row, same run, weights cold, three rounds, 256 wide against 128 wide
# (matmul_int8_wide_tiles_m128_m512_h200_2026-12-04_s63f.json; the same bits): M = 128 8B gate_up
# 1.46 against 1.52, 70B gate_up 1.93 against 1.96; M = 256 8B gate_up 1.67 against 1.74; M = 512
# 70B o 1.53 against 1.55, 70B gate_up and down within 0.01 (M = 1024 / 8192: 1.01-1.08 x the
# 128-wide ones, s62e). In the same run one tile timed twice (M = 512 8B gate_up, 128 wide either
# way) gave 1.65 and 1.61: the gaps at M = 128 / 256 are within twice that. At M = 96 / 384, where
# FP8 takes 256-wide tiles (..._m96_m384_h200_2026-12-04_s64a.json): M = 384 8B gate_up 1.82 against
# 1.87, 70B qkv 1.53 / 1.55, 70B gate_up 1.76 / 1.79; M = 96 8B gate_up 1.47 / 1.45, 70B gate_up
# 1.24 / 1.21 (the 256-wide tile's gains there within the spread above).
INT8_WIDE_MIN_M = 512


def _int8_tiles(config: tuple, m: int) -> tuple:
    """FP8's tile for an INT8 product of ``m`` rows where INT8 takes it (``_int8_takes``), its
    128 x 256 tiles from INT8_WIDE_MIN_M; in place of three consumers' 192 x 128 tiles the
    128 x 256 ones FP8 would take without them, and else two consumers' 128 x 128 tiles with 5
    slots and bulk stores, FP8's own 128-wide tile. That tile against session 7's INT8 tile (6
    slots, plain stores), x ``torch._int_mm``, weights cold, three rounds
    (matmul_int8_gluon_tiles_*_s62a.json): M = 8192 1.48-1.53 against 1.31-1.42, M = 1024 1.46-1.99
    against 1.29-1.71; at M = 128 / 256 where FP8 takes 256-wide or tailed tiles, 1.53-2.00 against
    1.44-1.93. The 128 x 256 tiles against it where FP8 takes those or 192 x 128 ones, same
    bits, each ratio the median of three rounds' (matmul_int8_wide_tiles_ab_h200_2026-12-04_s62e.json):
    M = 8192 1.02-1.08, M = 1024 1.01-1.08."""
    if _int8_takes(config) and (config[0] < 256 or m >= INT8_WIDE_MIN_M):
        return config
    if config[4] == 3:
        return 256, RING_STAGES[2][256], True, 1, 2
    return BLOCK_N, RING_STAGES[2][BLOCK_N], True, 1, 2


def split_columns(config: tuple) -> bool:
    """Whether ``tile_config``'s tile runs as 64 rows whose columns two consumers split (each a
    64 x 128 product a K step, 4 ring slots, bulk stores) instead of one consumer's two halves
    in turn: for its 64 x 256 tiles (M <= 64, gate / up projections), where the second consumer's
    products run while the first adds its partials. x cuBLAS at M = 64, same run
    (matmul_fp8_split_n_m64_h200_2026-12-01_s26c.json): 8B gate_up 1.04 against 1.02 per tensor,
    1.34 against 1.30 per row; 70B gate_up 1.02 against 0.99, 1.36 against 1.28 (s26b: 1.03
    against 1.02 and 0.97 per tensor). Narrower tiles split so lost (s26b: 64 x 96 / 128 / 160 at
    M = 128, 0.55-0.98 against 0.87-1.01)."""
    block_n, _, _, _, consumers = config
    return block_n == 256 and consumers == 1


def swap_config(m: int, n: int, k: int, sms: int = 132) -> tuple:
    """(block_n, stages, tma_store, split_k, consumers) for the transposed product C^T = B A^T of a
    decode-sized M (the user's M x N x K): A's M rows, padded to 16 / 32 / 64, are the tile's
    width; 64 rows of B a tile, one consumer; 10 ring slots of 10 / 12 KB (6 to 16 timed at
    M = 8 / 16 / 32: 10 within 0.04 of the best everywhere, s23b), 8 of 16 KB for 64-wide tiles;
    K in ``_swap_runs`` runs (at least one)."""
    block_n = max(16, 1 << max(0, m - 1).bit_length())
    return block_n, RING_STAGES[1][block_n], False, max(1, _swap_runs(m, cdiv(n, SUB_M), k, sms)), 1


# Ring slots a CTA where two share an SM, by tile width: 80 / 96 / 96 / 96 KB of 16- / 32- / 64- /
# 128-wide slots, with room beside the wider ones for a 64-row block of C
TWO_CTA_STAGES = {16: 8, 32: 8, 64: 6, 128: 4}
# (block scales: 3 of 128 wide, since each slot's scales, 384 bytes, would leave no room for C)
TWO_CTA_BLOCK_STAGES = {**TWO_CTA_STAGES, 128: 3}
# (the transposed product's 16- and 32-wide tiles with tensor or row scales: six, s53f, s54b)
SWAP_TWO_CTA_STAGES = {**TWO_CTA_STAGES, 16: 6, 32: 6}
# ... and registers a thread: two CTAs of 256 threads (the consumer warpgroup, the loader's warp
# padded to four) in the SM's 64 K. Uncapped, the launch asks 256 a thread (one CTA an SM); capped,
# the loader still gives up all but 24 and the consumers take 232 (setmaxnreg), with no spills in
# the 16- and 32-wide transposed product.
TWO_CTA_MAXNREG = 128


def _launch_options(ctas_per_sm: int) -> dict:
    """The compile options that go with ``ctas_per_sm``: the register cap where two CTAs share an SM."""
    return {"maxnreg": TWO_CTA_MAXNREG} if ctas_per_sm == 2 else {}


def swap_ctas_per_sm(tiles: int, sms: int) -> int:
    """CTAs an SM for the transposed product on ``tiles`` 64-row tiles of B: 2 where the tiles make
    more than one round of the SMs but at most two. One CTA streams B at about 40 GB/s whatever
    its ring depth (6 to 22 slots at M = 16, s23b), so a second round of a few tiles on one CTA
    an SM runs as long as the first; two CTAs on those SMs run both rounds at once. 70B qkv (160
    tiles), x cuBLAS per tensor, two CTAs of 8 slots against one of 10 (and the tl kernel), same
    run (matmul_fp8_swap_two_ctas_h200_2026-12-01_s24e.json): M = 1 1.02 against 0.87 (1.00),
    M = 8 0.97 against 0.86 (0.95), M = 16 1.00 against 0.86 (0.94), M = 32 0.93 against 0.84
    (0.90). With more tiles it did not gain (8B gate_up, 448: 0.94-0.98 against 0.91-0.95, the
    tl kernel 0.97-0.99), nor with as many tiles as SMs or fewer (within 0.02, but 8B down at
    M = 1 / 8, K = 14336: 1.01 / 0.99 against 1.08 / 1.06)."""
    return 2 if sms < tiles <= 2 * sms else 1


# Where the transposed product's tiles fill under half the SMs, K of up to this many steps stays
# whole instead of going in runs on the idle SMs: with the weights in DRAM (cold, as in a model),
# the runs' meeting through L2 costs more than the SMs gain. x cuBLAS per tensor, cold / warm
# weights, K whole against two runs, 8B o (64 tiles of 32 K steps), same runs:
# M = 16 0.92 / 0.83 against 0.88 / 0.90 (s54b), 0.92 / 0.83 against 0.87 / 0.88 (s54c); M = 32
# 0.92 / 0.84 against 0.83 / 0.81 (s54c). At 8B down (112 steps) the runs still won (M = 16 cold
# 1.10 against 1.07).
SWAP_WHOLE_K_STEPS = 32


def _swap_runs(m: int, tiles: int, k: int, sms: int) -> int:
    """Runs of K for the transposed product of ``m`` rows on ``tiles`` 64-row tiles of B, as
    measured against the tl kernel (s23b-s23f, s24e): 1 where the tiles make one round of two
    CTAs an SM (``swap_ctas_per_sm``), fill several rounds of the SMs at least 90 %, or one round
    at least 70 % from M = 8 (with fewer rows a tile is mostly the copy engine's zero fill, and
    one round does not hide it); from M = 16, 2-4 runs of at least 8 K steps where one round is
    under half full and that many runs fill it at least 90 %, but K whole where it is at most
    SWAP_WHOLE_K_STEPS steps; 0 elsewhere (the tl kernel's turn)."""
    if swap_ctas_per_sm(tiles, sms) == 2:
        return 1  # one round of two CTAs an SM
    fill = _wave_fill(tiles, sms)
    if tiles > sms:
        return 1 if fill >= 0.9 else 0
    if m < 8:
        return 0
    if fill >= 0.7:
        return 1
    runs = min(4, sms // tiles)
    if m >= 16 and runs >= 2 and cdiv(k, BLOCK_K) >= 8 * runs and _wave_fill(tiles * runs, sms) >= 0.9:
        return 1 if cdiv(k, BLOCK_K) <= SWAP_WHOLE_K_STEPS else runs
    return 0


# The smallest N and K the kernel takes from M = 33 (shapes of smaller models: Llama-3.2-1B / 3B,
# Qwen2.5-7B's K = 3584), where the tl kernel ran 0.26-0.80 x cuBLAS per tensor at M = 128 (s56c)
MIN_NK = 2048


def preferred(m: int, n: int, k: int, int8: bool) -> bool:
    """Whether ``scaled_matmul`` takes this kernel for a product it fits: FP8 (tensor, row and block
    scales) from M = 33 with N and K from MIN_NK. It measured 1.22-1.71x the tl kernel with tensor
    and row scales from M = 128 at N and K from 4096 (graphs,
    benchmarks/results/matmul_fp8_h200_2026-11-29_s9c.json, and ..._split_k_..._s9d.json at
    M = 128), 1.02-2.60x with block scales (..._fp8_block_..._s9e.json), and with 64-row tiles at
    M = 64 (s23b); M = 65-127 runs M = 128's tiles, with fewer rows to read. At N or K of 2048-3584
    (twelve (N, K) of Llama-3.2-1B / 3B and Qwen2.5-7B, weights cold, x cuBLAS in three rounds,
    ``matmul_fp8_small_models_m128_h200_2026-12-03_s56c.json``, ``..._m1024_...``): per tensor
    0.69-1.09 against the tl kernel's 0.26-0.80 at M = 128, 0.83-1.11 against 0.58-0.75 at
    M = 1024; per row 1.00-2.01 against 0.53-0.79 and 0.98-1.12 against 0.69-0.78. This dispatch
    against the tl kernel, same runs, tensor, row and block scales
    (``matmul_fp8_small_models_dispatch_ab_m{64,128,1024,8192}_h200_2026-12-03_s56d.json``):
    1.20-3.62x from M = 128, 0.86-1.74x at M = 64 (the one loss: N = K = 2048 per tensor). Not M <= 32
    (the transposed product, ``swap_preferred``, or the tl kernel).

    INT8 (row scales) likewise, in FP8's tiles where it takes them (``_int8_tiles``), but at M <= 64
    not where FP8 takes one consumer's 256-wide tile (gate / up projections: 0.89 / 1.14 x ``torch._int_mm``
    on two consumers' 128 x 128 tiles against the tl kernel's 1.08 / 1.41). x ``torch._int_mm``,
    weights cold, three rounds, the Llama shapes, against the tl kernel that took every INT8 product
    until then (matmul_int8_gluon_tiles_m64_m8192_h200_2026-12-04_s62a.json): M = 64 1.11-1.62
    against 0.69-1.44, M = 128 1.34-1.93 against 0.49-1.96 (256-wide FP8 tiles: 1.57 / 2.00 with
    bulk stores against 1.46 / 1.96), M = 256 1.50-2.20 against 0.83-1.56; M = 1024 / 8192 on
    128 x 128 tiles with bulk stores 1.46-1.99 against 1.26-1.80 (128 x 256 ones, ``_int8_tiles``,
    then 1.01-1.08 faster again)."""
    if m <= 32 or n < MIN_NK or k < MIN_NK:
        return False
    return not int8 or m > SUB_M or _int8_takes(tile_config(m, n, k, False, row_scales=True))


def swap_preferred(m: int, n: int, k: int, int8: bool, sms: int = 132, block_scales: bool = False) -> bool:
    """Whether ``scaled_matmul`` takes the transposed product (``swap_ab``) for a decode-sized FP8
    product: M <= 32 with N and K from 4096 where ``_swap_runs`` finds work for it, and with block
    scales also where B's 64-row tiles make one or two rounds of the SMs (in one run of K where
    ``_swap_runs`` finds none: M < 8). With block scales, x our per-tensor product, against the tl
    kernel's transposed product (``matmul_fp8_decode_block_gluon_h200_2026-12-02_s37b.json``):
    M = 16 0.97-1.01 against 0.83-0.95 where this rule takes it, 8B gate_up (448 tiles) left to the
    tl kernel, 0.97 against 0.99; M = 32 0.96-0.99 against 0.72-0.95 (8B gate_up, the tl kernel's,
    0.93 against 0.94); M = 1 8B qkv 0.93 against 0.83, 70B o 0.97 against 0.95, 70B down 0.99
    against 0.92, 8B o 0.82 against 0.80, 8B down 0.91 against 0.92, 70B qkv 0.98 against 1.00
    (8B down in two runs of K 0.95, not taken).
    With tensor or row scales, against the tl kernel's transposed product in the same run, x
    cuBLAS per tensor:
    - no split (benchmarks/results/matmul_fp8_decode_dispatch_h200_2026-11-30_s23d.json, M = 8 /
      16 / 32): 8B qkv (96 tiles) 0.87 / 0.95 / 0.95 against 0.84 / 0.81 / 0.73, 70B gate_up
      (896) 1.02 / 1.01 / 1.00 against 0.92 / 0.93 / 0.97, 70B o and down (128) 0.96-1.07
      against 0.93-1.04; at M = 1 only 70B gate_up (1.01 against 0.90);
    - K in two runs summed in the kernel (``matmul_fp8_decode_split*_h200_2026-12-01_s23f.json``,
      M = 16 / 32): 8B o (64 tiles) 0.91 / 0.85 against 0.87 / 0.80, 8B down 1.10 / 0.92 against
      1.10 / 0.90;
    - two CTAs an SM (``swap_ctas_per_sm``, s24e, M = 1 / 8 / 16 / 32): 70B qkv (160 tiles) 1.02
      / 0.97 / 1.00 / 0.93 against 1.00 / 0.95 / 0.94 / 0.90.
    The tl kernel stays ahead at 8B gate_up (448 tiles, four rounds 85 % full: 0.76 in two runs
    against 0.98, s23f) and at M = 1 where one round runs (8B o 0.83 in two runs against 1.02).

    INT8 (row scales) by the same rule, against the tl kernel that took every INT8 product until
    then, weights cold, three rounds (matmul_int8_gluon_tiles_m16_m32_h200_2026-12-04_s62a.json):
    M = 16, x the tl kernel (``torch._int_mm`` refuses M <= 16), 1.02-1.20 where the rule takes it
    but 8B down, 0.99 (8B gate_up, left out: 0.96); M = 32, x ``torch._int_mm``, 1.11-1.64 against
    0.95-1.60 (8B gate_up, left out: 1.04 against 1.08). At M = 1 / 8 (the dispatch against the tl
    kernel, ``matmul_int8_dispatch_ab_h200_2026-12-04_s62b.json``) 1.02-1.16 where it takes them."""
    if m > 32 or n < 4096 or k < 4096:
        return False
    tiles = cdiv(n, SUB_M)
    return _swap_runs(m, tiles, k, sms) > 0 or (block_scales and tiles <= 2 * sms)


def why_not(a_q: torch.Tensor, b_q: torch.Tensor, scales: str) -> Optional[str]:
    """None if this kernel takes the product, else what it does not take (a short reason)."""
    if not is_hopper(a_q.device):
        return f"the Gluon matmul runs on Hopper (compute capability 9.x), got a tensor on {a_q.device}"
    if a_q.dtype not in _GL_DTYPES or b_q.dtype != a_q.dtype:
        return f"a_q and b_q must both be int8 or float8_e4m3fn, got {a_q.dtype}, {b_q.dtype}"
    if scales not in ("tensor", "row", "block"):
        return f"scales must be 'tensor', 'row' or 'block' here, got {scales!r}"
    if scales == "block" and a_q.dtype == torch.int8:
        return "block scales are FP8's: int8 takes 'tensor' or 'row' scales"
    if a_q.dim() != 2 or b_q.dim() != 2 or a_q.shape[1] != b_q.shape[1] or 0 in (*a_q.shape, b_q.shape[0]):
        return f"a_q (M, K) and b_q (N, K) must share a positive K, got {tuple(a_q.shape)}, {tuple(b_q.shape)}"
    for name, t in (("a_q", a_q), ("b_q", b_q)):
        if t.stride(1) != 1 or t.stride(0) % 16 or t.data_ptr() % 16:
            return f"{name} needs unit column stride and a 16-byte aligned base and row stride"
    return None


def scaled_matmul_gluon(a_q: torch.Tensor, b_q: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                        bias: Optional[torch.Tensor], out_dtype: torch.dtype, scales: str) -> torch.Tensor:
    """C (M, N) in ``out_dtype`` = (A_q * a_scale) @ (B_q * b_scale)^T + bias. Scale shapes as in
    ``matmul.scaled_matmul``: () or (1,) per tensor; (M, 1) and (N, 1) per row; (M, ceil(K/128))
    and (ceil(N/128), ceil(K/128)) for block scales. Raises ValueError for what ``why_not`` names."""
    reason = why_not(a_q, b_q, scales)
    if reason is not None:
        raise ValueError(reason)
    return launch(a_q, b_q, a_scale, b_scale, bias, out_dtype, scales)


SMEM_BYTES = SM_SHARED_BYTES - CTA_RESERVED_BYTES - 1024  # the most a CTA has (227 KB), less the ring's barriers


def _slot_bytes(block_n: int, consumers: int = 2, split_n: bool = False) -> int:
    """A ring slot: a 64-row part of A a consumer (one for both where they split the columns) and a
    B tile, a byte an element."""
    return ((1 if split_n else consumers) * SUB_M + block_n) * BLOCK_K


def _scale_bytes(block_n: int, consumers: int, swap_ab: bool = False) -> int:
    """A ring slot's block scales (float32): a 64-row part of A's a consumer (the transposed
    product: the tile's block_n columns), and B's for the tile's one (two where 256 wide) blocks,
    four values each in 128 bytes (``_mm_loader``)."""
    a_part = block_n if swap_ab else SUB_M
    a_bytes = (1 if swap_ab else consumers) * _a_sc_rows(a_part) * a_part * 4
    return a_bytes + (2 if block_n == 256 else 1) * B_SC_ROWS * 4 * 4


def _tail_stages(block_n: int, consumers: int) -> int:
    """Ring slots for a tile with a tail: no block of C in shared memory beside them, up to 8."""
    return min(8, SMEM_BYTES // _slot_bytes(block_n, consumers))


def _split_n_stages(block_n: int) -> int:
    """Ring slots for a 64-row tile whose columns the two consumers split, up to 8: beside them the
    consumers' bfloat16 blocks of C where the tile has no tail."""
    c_blocks = 0 if tail_split(block_n)[1] else 2 * SUB_M * c_block_cols(block_n, True) * 2
    return min(8, (SMEM_BYTES - c_blocks) // _slot_bytes(block_n, 2, True))


class _Plan(NamedTuple):
    """What a launch needs that follows from the shapes and options alone (made once per key)."""
    block_n: int
    split_k: int
    consumers: int
    m_pad: int  # a split's rows in the partial sums: no tile crosses into the next split
    grid: tuple
    partial_dtype: Optional[torch.dtype]  # the split-K partial sums' dtype (None: no split)
    constexprs: dict
    options: dict  # launch options: a register cap where two CTAs share an SM, programmatic dependent launch
    ctas_per_sm: int


@functools.lru_cache(maxsize=1024)
def _plan(m: int, n: int, k: int, int8: bool, out_dtype: torch.dtype, scales: str, has_bias: bool,
          block_n: Optional[int], stages: Optional[int], tma_store: Optional[bool], split_k: Optional[int],
          group_m: Optional[int], sms: int, consumers: Optional[int], swap_ab: bool,
          ctas_per_sm: Optional[int] = None, split_n: Optional[bool] = None, c_bufs: Optional[int] = None,
          k_group: Optional[int] = None, early: Optional[bool] = None) -> _Plan:
    """The launch of a kernel product of ``m`` x ``n`` (with ``swap_ab`` the user's C transposed;
    with ``split_n`` 64-row tiles whose columns two consumers split: by default where
    ``tile_config`` gives one consumer a 64 x 256 tile, ``split_columns``)."""
    if split_n and (int8 or scales == "block" or swap_ab or (ctas_per_sm or 1) != 1 or (split_k or 1) != 1):
        raise ValueError("split_n takes FP8 with tensor or row scales, one CTA an SM, no swap_ab and no K split")
    if swap_ab:
        config = swap_config(n, m, k, sms)
        if ctas_per_sm is None:
            ctas_per_sm = swap_ctas_per_sm(cdiv(m, SUB_M), sms)
    else:
        config = tile_config(m, n, k, int8, sms, block_scales=scales == "block", row_scales=scales == "row",
                             c_bytes=out_dtype.itemsize)
    if split_n is None:  # tile_config's own tile, as it is
        split_n = (block_n is None and consumers is None and not swap_ab and (split_k or 1) == 1
                   and (ctas_per_sm or 1) == 1 and split_columns(config))
    ctas_per_sm = ctas_per_sm or 1
    if consumers is None:  # a tile width of the caller's own: 64-row tiles where M <= 64, as tile_config's
        consumers = config[4] if block_n is None or swap_ab else 1 if m <= SUB_M else 2
    own_width = block_n is not None
    if not own_width and consumers != config[4] and 3 in (consumers, config[4]):
        # 128-wide tiles of the caller's three consumers where tile_config's have two or one, or
        # the other way round: the ring depth of the caller's
        block_n, own_width = 128, True
    block_n = block_n or config[0]
    if ctas_per_sm == 2 and (consumers != 1 or block_n not in TWO_CTA_STAGES):
        raise ValueError(f"two CTAs an SM take one-consumer tiles up to 128 wide (16, 32, 64 or 128), got "
                         f"{consumers} consumers and block_n={block_n}")
    tail = tail_split(block_n)[1]
    if split_n:
        lead = block_n - tail
        if lead < 32 or 0 < tail < 32:
            raise ValueError(f"split_n gives each consumer half of B's block and of the tail, 16 columns or more: "
                             f"block_n={block_n} is {lead} + {tail}")
        consumers, split_k = 2, 1
    if stages is None:  # the ring for two CTAs an SM, or for the caller's tile width, if any
        if split_n:
            stages = _split_n_stages(block_n)
        elif tail:
            stages = _tail_stages(block_n, consumers)
        else:
            two_cta = (TWO_CTA_BLOCK_STAGES if scales == "block" else SWAP_TWO_CTA_STAGES if swap_ab
                       else TWO_CTA_STAGES)
            stages = (two_cta[block_n] if ctas_per_sm == 2 else RING_STAGES[consumers][block_n] if own_width
                      else config[1])
    if tma_store is None:  # tile_config's choice, or for FP8 tiles of the caller's width bulk stores
        tma_store = config[2] if not own_width or swap_ab else not int8
    tma_store = tma_store and not tail  # a tail's block goes by plain stores
    k_steps = cdiv(k, BLOCK_K)
    split_k = min(split_k or config[3], k_steps)
    split_k = cdiv(k_steps, cdiv(k_steps, split_k))  # every run of K steps non-empty
    slot_bytes = _slot_bytes(block_n, consumers, split_n)
    if scales == "block":
        slot_bytes += _scale_bytes(block_n, consumers, swap_ab)
    ring_bytes = stages * slot_bytes
    if ring_bytes > SMEM_BYTES // ctas_per_sm:
        raise ValueError(f"stages={stages} of {block_n}-wide tiles do not fit in shared memory")
    # With split K the kernel writes float32 (int32) partial sums, split after split, and a second
    # kernel adds them in a fixed order and applies the scales and bias.
    partial_dtype = None if split_k == 1 else torch.int32 if int8 else torch.float32
    c_size = (partial_dtype or out_dtype).itemsize
    # Bulk stores need 16-byte aligned rows of C (a fresh tensor: its base is) and room next to the ring.
    c_blocks = consumers * SUB_M * c_block_cols(block_n, split_n) * c_size  # one block of C for each consumer
    tma_store = tma_store and (n * c_size) % 16 == 0 and ring_bytes + c_blocks <= SMEM_BYTES // ctas_per_sm
    if c_bufs not in (None, 1, 2) or (c_bufs == 2 and (block_n != 256 or split_n)):
        raise ValueError(f"c_bufs=2 (two blocks of C a consumer) takes two consumers' 256-wide tiles, got "
                         f"c_bufs={c_bufs}, block_n={block_n}, split_n={split_n}")
    if c_bufs is None:  # two for a 256-wide tile's halves (M = 8192: +0.2-1.8 %, s26d)
        c_bufs = 2 if block_n == 256 and not split_n else 1
    # ... with bulk stores, where the second block fits too (as the first, else one)
    c_bufs = c_bufs if tma_store and ring_bytes + c_bufs * c_blocks <= SMEM_BYTES else 1
    long_k_block = scales == "block" and k >= LONG_K
    if k_group is None:
        k_group = BLOCK_K_GROUP[long_k_block] if scales == "block" else 2
    if group_m is None:
        group_m = BLOCK_LONG_K_GROUP_M if long_k_block and m >= BLOCK_LONG_K_GROUP_M_MIN_M else GROUP_M
    tile_rows = SUB_M if split_n else consumers * SUB_M
    items = cdiv(m, tile_rows) * cdiv(n, block_n) * split_k
    constexprs = dict(SCALES=SCALES_KIND[scales], HAS_BIAS=has_bias, GROUP_M=group_m, STAGES=stages,
                      TMA_STORE=tma_store, SPLIT_K=split_k, CONSUMERS=consumers, SWAP_AB=swap_ab, TAIL_N=tail,
                      SPLIT_N=split_n, C_BUFS=c_bufs, K_GROUP=k_group,
                      EARLY_SCALES=loads_scales_early(scales, block_n, consumers) if early is None else early)
    grid = min(items, ctas_per_sm * sms)
    reduce_kernel = partial_dtype is not None and not swap_ab
    options = dict(_launch_options(ctas_per_sm),
                   launch_pdl=launches_early(n if swap_ab else m, grid, sms, reduce_kernel, ctas_per_sm))
    return _Plan(block_n, split_k, consumers, cdiv(m, tile_rows) * tile_rows, (grid,), partial_dtype, constexprs,
                 options, ctas_per_sm)


def launches_early(m: int, grid: int, sms: int, reduce_kernel: bool, ctas_per_sm: int = 1) -> bool:
    """Whether a product of ``m`` rows of A on ``grid`` CTAs (``ctas_per_sm`` an SM) is, where
    ``common.PDL`` opts in (``launch``), a programmatic dependent launch: it may start while the
    kernel ahead of it in the stream still runs, sets up its rings and waits
    (``wait_for_prior_grids``) before it touches memory; each CTA lets the next kernel launch once
    it has issued its last load. That hides a microsecond or so a product, which counts where
    products are short and the kernel ahead lets them launch early (a product of ours,
    ``quantize``'s one-pass kernel): up to ``common.PDL_MAX_M`` rows, one CTA an SM on PDL_MIN_FILL of the SMs
    or more, and no second kernel adding split-K runs. x cuBLAS per tensor, back to back from CUDA
    graphs, without / with (matmul_fp8_pdl_probe_chains_m16_m128_h200_2026-12-02_s35d.json): M = 16
    8B qkv 0.94 -> 1.12, 8B o 0.92 -> 1.07, 8B down 1.18 -> 1.27, 70B o 0.98 -> 1.06; M = 128 8B qkv
    0.90 -> 0.99, 8B o 1.04 -> 1.15, 70B o 0.95 -> 1.05; the rest within 0.02. After a per-row
    quantize launched early too, as a layer runs them: 0.97-1.19 x the pair without (s35c); after a
    kernel that does not let it start early, 0.26-2.5 us slower a pair (s35a). Not taken: two CTAs
    an SM (M = 16 70B qkv 1.00 -> 0.81, s35c), 80 CTAs of a long product (M = 128 70B qkv 0.88 ->
    0.84, s35b), beside split-K's second kernel (-0.01 to -0.02), and from M = 1024 (even or up to
    2 % slower, ..._pdl_trigger_m1024_m8192_..._s35b.json)."""
    return m <= common.PDL_MAX_M and grid >= PDL_MIN_FILL * sms and not reduce_kernel and ctas_per_sm == 1


def _desc(t: torch.Tensor, rows: int, dtype, cols: int = BLOCK_K):
    """A host tensor descriptor of ``t`` in blocks of ``rows`` x ``cols`` (A and B: K steps of 128;
    C: a consumer's 64 x 128, 64 x 64 or 64 x 32): ``why_not`` checked A and B, and C and the split-K sums
    are fresh tensors with 16-byte aligned rows."""
    return unchecked_descriptor(t, t.shape, t.stride(), [rows, cols], nvmma_layout((rows, cols), dtype))


@functools.cache
def _scale_layout():
    """The shared layout of the flat scale views' boxes: one row of float32, no swizzle."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


def _flat_scale_desc(t: torch.Tensor, block: int):
    """A 1-D descriptor over the storage a scale tensor spans, in boxes of ``block`` values."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    flat = torch.as_strided(t, (extent,), (1,))
    return unchecked_descriptor(flat, [extent], [1], [block], _scale_layout())


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it where it does not start 16-byte aligned (a bulk copy's source must)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _scales_for_copies(a_scale: torch.Tensor) -> torch.Tensor:
    """A's block scales as the kernel's bulk copies take them, a K step's 64 rows at a time:
    column-major, each K step's column starting 16-byte aligned (a copy of them where not)."""
    m, k_blocks = a_scale.shape
    if a_scale.stride(0) == 1 and (a_scale.stride(1) % 4 == 0 or k_blocks == 1) and a_scale.data_ptr() % 16 == 0:
        return a_scale
    columns = aligned_columns((m, k_blocks), a_scale.device)
    columns.copy_(a_scale)
    return columns


_launcher = CachedLauncher(_scaled_mm_ws_kernel)
# The same kernel in clusters of two or four CTAs that share A's or B's tiles (``launch(cluster=...)``):
# its copies and arrivals name these buffers' offsets.
_cluster_launcher = ClusterLauncher(_scaled_mm_ws_kernel, CLUSTER_BUFFERS, persistent=True)


def launch(a_q: torch.Tensor, b_q: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
           bias: Optional[torch.Tensor], out_dtype: torch.dtype, scales: str, block_n: Optional[int] = None,
           stages: Optional[int] = None, tma_store: Optional[bool] = None, split_k: Optional[int] = None,
           group_m: Optional[int] = None, consumers: Optional[int] = None, swap_ab: bool = False,
           ctas_per_sm: Optional[int] = None, split_n: Optional[bool] = None,
           c_bufs: Optional[int] = None, k_group: Optional[int] = None, pdl: Optional[bool] = None,
           early_scales: Optional[bool] = None, cluster: Optional[str] = None, cluster_size: int = 2) -> torch.Tensor:
    """``scaled_matmul_gluon`` for a product that ``why_not`` has already accepted. ``block_n`` (16,
    32, 64, 128 or 256, and for FP8 with tensor or row scales a width with a tail, ``tail_split``),
    ``stages``, ``tma_store`` and ``split_k`` override ``tile_config``, ``group_m`` the tile order
    (by default GROUP_M, or BLOCK_LONG_K_GROUP_M for block scales at long K and large M),
    ``ctas_per_sm`` (1 or 2 CTAs an SM; 2 for one-consumer tiles up to 128 wide, each ring in half
    the shared memory) ``swap_ctas_per_sm``; ``split_n`` makes tiles of 64 rows whose columns two
    consumers split (FP8, tensor or row scales; by default ``split_columns`` where the tile is
    ``tile_config``'s own); ``consumers`` (1, 2 or 3) the tile's 64-row parts (3: 192 x 128 tiles,
    FP8, no K split); ``c_bufs`` (1 or 2, by default 2 where they fit) blocks of C in shared memory
    each consumer of a 256-wide tile has, one a half; ``k_group`` (2, 4 or 8; by default 8 for block
    scales, 4 from K = LONG_K, and 2 for the rest) the K steps a group of a tile up to 128 wide
    (``_k_group``); ``early_scales`` whether a work item loads its tensor or row scales at its start
    (by default ``loads_scales_early``'s choice); ``pdl`` whether the launch is programmatic
    dependent (by default ``launches_early``'s choice where ``common.PDL`` is True, else not);
    ``cluster`` ("A" or "B"; an experiment that no dispatch takes) launches CTAs in clusters of
    ``cluster_size`` (2 or 4) whose tiles share the user's A (the activations: the same rows of C,
    neighbouring column blocks) or B (the weights: the same columns, neighbouring row blocks),
    brought to every CTA of the cluster by multicast copies, each CTA copying its share; one CTA
    an SM unless ``ctas_per_sm=2``. C (or
    with split K, the partial sums) goes out through shared memory and bulk copies where its rows are
    16-byte aligned, the ring leaves room and the tile has no tail. Eager calls of short kernels are
    bound by the host: what follows from the shapes is made once (``_plan``), and the kernel launches
    without Triton's argument binding (``CachedLauncher``)."""
    m, k = a_q.shape
    n = b_q.shape[0]
    if block_n is not None and tail_split(block_n)[1] and (a_q.dtype == torch.int8 or scales == "block" or swap_ab):
        raise ValueError(f"block_n={block_n} (a tile with a tail) takes FP8 with tensor or row scales, not swap_ab")
    if consumers not in (None, 1, 2, 3):
        raise ValueError(f"consumers must be 1, 2 or 3, got {consumers}")
    if consumers == 3 and (block_n not in (None, 128) or a_q.dtype == torch.int8 or swap_ab or split_n
                           or (split_k or 1) != 1 or (ctas_per_sm or 1) != 1):
        raise ValueError(f"consumers=3 (192 x 128 tiles) takes FP8, block_n=128, one CTA an SM, no split_n, "
                         f"swap_ab or K split, got block_n={block_n}, {a_q.dtype}, swap_ab={swap_ab}, "
                         f"split_n={split_n}, split_k={split_k}, ctas_per_sm={ctas_per_sm}")
    if ctas_per_sm not in (None, 1, 2):
        raise ValueError(f"ctas_per_sm must be 1 or 2, got {ctas_per_sm}")
    if k_group not in (None, 2, 4, 8):
        raise ValueError(f"k_group must be 2, 4 or 8, got {k_group}")
    if swap_ab and tma_store:
        raise ValueError("the transposed product (swap_ab) writes C by plain stores: tma_store must be False")
    if cluster not in (None, "A", "B"):
        raise ValueError(f"cluster must be None, 'A' or 'B' (the operand a cluster's CTAs share), got {cluster!r}")
    if cluster and cluster_size not in (2, 4):
        raise ValueError(f"cluster_size must be 2 or 4, got {cluster_size}")
    if swap_ab and m > SUB_M:
        raise ValueError(f"the transposed product (swap_ab) takes decode-sized products, A of up to {SUB_M} rows "
                         f"(its tile's width), got {m}")
    c = new_output((m, n), dtype=out_dtype, device=a_q.device)
    if swap_ab:  # the kernel computes C^T = B A^T: B's rows on wgmma's 64-row side, A's few rows on its narrow one
        a_q, b_q, m, n = b_q, a_q, n, m
        if scales != "block":  # block scales keep the user's roles (``_scale_origins``)
            a_scale, b_scale = b_scale, a_scale
    plan = _plan(m, n, k, a_q.dtype == torch.int8, out_dtype, scales, bias is not None, block_n, stages, tma_store,
                 split_k, group_m, sm_count(a_q.device), consumers, swap_ab,
                 1 if cluster and ctas_per_sm is None else ctas_per_sm, split_n,
                 c_bufs, k_group, early_scales)
    partial = None if plan.partial_dtype is None else torch.empty((plan.split_k * plan.m_pad, n), device=a_q.device,
                                                                  dtype=plan.partial_dtype)
    # Split K: the runs' sums go to ``partial``, which a second kernel adds up, or in the transposed
    # product to ``sums``, where each tile's last run adds them up in the kernel.
    target = c if partial is None or swap_ab else partial
    sums = counters = c  # not read without that split
    if partial is not None and swap_ab:
        parts = cdiv(m, plan.consumers * SUB_M) * plan.consumers * cdiv(n, plan.block_n)  # 64-row parts of tiles
        sums, counters = partial, split_k_counters(a_q.device, parts)
    qdtype = _GL_DTYPES[a_q.dtype]
    a_desc = _desc(a_q, SUB_M, qdtype)
    # Without the bulk store the kernel ignores c_desc; A's descriptor stands in for it.
    c_desc = (_desc(target, SUB_M, _GL_OUT[target.dtype], c_block_cols(plan.block_n, plan.constexprs["SPLIT_N"]))
              if plan.constexprs["TMA_STORE"] else a_desc)
    tail = plan.constexprs["TAIL_N"]  # B's tile in one block, or a block and a narrower tail
    parts = 2 if plan.constexprs["SPLIT_N"] else 1  # B in a part a consumer where they split the columns
    b_desc = _desc(b_q, (plan.block_n - tail) // parts, qdtype)
    a_sc_desc = b_sc_desc = a_desc  # not read without block scales
    constexprs = plan.constexprs
    if scales == "block":
        a_scale, b_scale = _scales_for_copies(a_scale), _aligned(b_scale)
        # A's a K step at a time, 64 rows of the tile (the transposed product: its columns, the user's A rows)
        a_sc_desc = _flat_scale_desc(a_scale, plan.block_n if swap_ab else SUB_M)
        b_sc_desc = _flat_scale_desc(b_scale, 4)
        # B's scales along K in rows of a multiple of 4, and each run of K steps and each group
        # starting at a multiple of 4: a group's steps take values 0, 1, 2, 3, ... of their fours
        k_run = cdiv(cdiv(k, BLOCK_K), plan.split_k)
        b_sc_aligned = (b_scale.stride(1) == 1 and b_scale.stride(0) % 4 == 0
                        and (plan.split_k == 1 or k_run % 4 == 0))
        if not b_sc_aligned and k_group is None and constexprs["K_GROUP"] > 4:
            # picked at run time, each step's B scale costs registers: groups of eight would spill
            constexprs = {**constexprs, "K_GROUP": 4}
        # (groups of two, the caller's choice, start at every other step: picked at run time too)
        b_sc_aligned = b_sc_aligned and constexprs["K_GROUP"] % 4 == 0
    else:
        b_sc_aligned = False
    grid, launcher = plan.grid, _launcher
    if cluster:
        # The kernel's operands: with swap_ab its B is the user's A.
        mode = CLUSTER_SHARES_A if (cluster == "A") != swap_ab else CLUSTER_SHARES_B
        if mode == CLUSTER_SHARES_B and tail:
            raise ValueError(f"cluster={cluster!r}: clusters that share B's tiles take no tiles with a tail, got "
                             f"{plan.block_n} wide")
        rows = SUB_M if plan.constexprs["SPLIT_N"] else plan.consumers * SUB_M
        row_blocks, col_blocks = cdiv(m, rows), cdiv(n, plan.block_n)
        if mode == CLUSTER_SHARES_A:  # a cluster's work item: cluster_size column blocks, or row blocks
            groups = row_blocks * cdiv(col_blocks, cluster_size) * plan.split_k
        else:
            groups = cdiv(row_blocks, cluster_size) * col_blocks * plan.split_k
        # as many clusters as the GPU holds at once (known after the first call: until then SMs / size)
        fits = _cluster_launcher.resident.get((a_q.device.index, cluster_size, plan.ctas_per_sm),
                                              plan.ctas_per_sm * sm_count(a_q.device) // cluster_size)
        grid, launcher = (min(groups, fits),), _cluster_launcher
        constexprs = {**constexprs, "CLUSTER": mode.value, "CTAS": cluster_size}
    launcher[grid](
        a_desc, b_desc, _desc(b_q, tail // parts, qdtype) if tail else b_desc, target, c_desc, a_sc_desc, b_sc_desc,
        a_scale, b_scale,
        c if bias is None else bias, sums, counters, m, n, k, target.stride(0), *scale_strides(a_scale),
        *scale_strides(b_scale), plan.m_pad,
        **constexprs, B_SC_ALIGNED=b_sc_aligned, num_warps=4,
        **{**plan.options, "launch_pdl": (common.PDL and plan.options["launch_pdl"]) if pdl is None else pdl},
        # No multiply-add fusion in the epilogue: the float32 rounding steps are the reference's.
        # (Block scales in 128-wide tiles ask for their fused multiply-add explicitly, ``_promote``.)
        enable_fp_fusion=False,
    )
    if partial is not None and not swap_ab:  # rounding as in the kernel's own epilogue: no multiply-add fusion
        reduce_split_k(target, c, a_scale, b_scale, bias, plan.m_pad * n, plan.constexprs["SCALES"], exact=True)
    return c


def compile_for_sm90(int8: bool = False, scales: str = "row", has_bias: bool = True,
                     out_dtype: torch.dtype = torch.bfloat16, block_n: int = BLOCK_N, stages: int = STAGES,
                     tma_store: bool = False, split_k: int = 1, consumers: int = 2, swap_ab: bool = False,
                     ctas_per_sm: int = 1, split_n: bool = False, c_bufs: int = 1, k_group: int = 2,
                     b_sc_aligned: bool = True, early_scales: bool = False, cluster: int = CLUSTER_OFF.value,
                     cluster_size: int = 2):
    """Build the kernel for sm_90 without a GPU (what the CPU test checks): the compiled kernel.
    ``cluster``: CLUSTER_OFF, CLUSTER_SHARES_A or CLUSTER_SHARES_B (0, 1, 2), in clusters of
    ``cluster_size`` CTAs."""
    qdtype = torch.int8 if int8 else torch.float8_e4m3fn
    gdt = _GL_DTYPES[qdtype]
    name = SIGNATURE_NAMES[qdtype]
    sums = "*i32" if int8 else "*fp32"
    # split K: C takes the partial sums, except in the transposed product (they go to Sums)
    target = (torch.int32 if int8 else torch.float32) if split_k > 1 and not swap_ab else out_dtype
    out = SIGNATURE_NAMES[target]

    flat = _scale_layout()

    def desc(rows: int, dtype=gdt, type_name=name, cols=BLOCK_K) -> str:
        return f"tensordesc<{type_name}[{rows}, {cols}],{nvmma_layout((rows, cols), dtype)!r}>"

    lead, tail = tail_split(block_n)
    parts = 2 if split_n else 1  # B's block and tail in a part a consumer
    types = {"a_desc": desc(SUB_M), "b_desc": desc(lead // parts), "b_tail_desc": desc(tail // parts or lead // parts),
             "C": f"*{out}", "Sums": sums, "Counters": "*i32",
             "c_desc": (desc(SUB_M, _GL_OUT[target], out, c_block_cols(block_n, split_n)) if tma_store
                        else desc(SUB_M)),
             "AScale": "*fp32",
             "a_sc_desc": (f"tensordesc<fp32[{block_n if swap_ab else SUB_M}],{flat!r}>" if scales == "block"
                           else desc(SUB_M)),
             "b_sc_desc": (f"tensordesc<fp32[4],{flat!r}>" if scales == "block" else desc(SUB_M)),
             "BScale": "*fp32", "Bias": f"*{out}", "M": "i32", "N": "i32", "K": "i32", "stride_cm": "i32",
             "stride_asm": "i32", "stride_ask": "i32", "stride_bsn": "i32", "stride_bsk": "i32", "split_rows": "i32"}
    constants = dict(SCALES=SCALES_KIND[scales], HAS_BIAS=has_bias,
                     GROUP_M=GROUP_M, STAGES=stages, TMA_STORE=tma_store, SPLIT_K=split_k, CONSUMERS=consumers,
                     SWAP_AB=swap_ab, TAIL_N=tail, SPLIT_N=split_n, C_BUFS=c_bufs, K_GROUP=k_group,
                     B_SC_ALIGNED=b_sc_aligned, EARLY_SCALES=early_scales, CLUSTER=cluster,
                     CTAS=cluster_size if cluster else 1)

    def build(smem_at=(0, 0, 0, 0)):
        return build_for_sm90(_scaled_mm_ws_kernel, types, {**constants, "SMEM_AT": smem_at}, enable_fp_fusion=False,
                              **_launch_options(ctas_per_sm))

    return build_in_clusters(build, CLUSTER_BUFFERS) if cluster else build()
