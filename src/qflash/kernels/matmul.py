"""Scaled INT8 and FP8 matrix products: C = (A_q * a_scale) @ (B_q * b_scale).T + bias.

A is (M, K) row-major activations, B is (N, K) in ``nn.Linear`` weight layout. INT8
products accumulate exactly in int32 and the scales are applied once, in the
epilogue. FP8 products are accumulated in float32 one K block (QBLOCK = 128) at a
time and added to the float32 total ("promotion"): Hopper's FP8 tensor cores keep
only about 14-22 bits of a long sum, and with block scales each K block has its own
scale anyway.

Scale layouts (float32): tensor () or (1,); row (M, 1) for A and (N, 1) for B; block
(M, K/128) for A (1 x 128 groups) and (N/128, K/128) for B (128 x 128 groups).

Decode-sized products (M <= 64: one token a sequence, a few sequences) only stream B. There the
kernel computes the product transposed, C^T = B A^T (``swap_ab``): B's rows take the tensor cores'
64-row side and A's few rows the narrow side (16 columns and up) instead of being padded to 64
rows, and K is split into runs so that every SM streams part of B. Each run stores its float32
(int32) sum; the last run of a tile to arrive, counted by an atomic, adds the runs in a fixed order
and writes C (no second kernel; the same result whichever run arrives last).

On Hopper, FP8 products from M = 33 (tensor, row or block scales) and INT8 ones (tensor or row
scales) go to the warp-specialized Gluon kernel in ``matmul_gluon.py`` (``matmul_gluon.preferred``),
and those of M <= 32 to its transposed product where B's tiles fill the SMs
(``matmul_gluon.swap_preferred``; with block scales also where they make one or two rounds);
``QFLASH_GLUON=0`` keeps them here. Scales and
bias live in ``matmul_epilogue.py``, which both kernels share (with the Gluon kernel's split-K
sum and the split-K arrival counts).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from triton.tools.tensor_descriptor import TensorDescriptor

from qflash.kernels import common
from qflash.kernels.common import (CTA_RESERVED_BYTES, SM_SHARED_BYTES, CachedLauncher, cdiv, gluon_enabled, has_tma,
                                   sm_count, tma_compatible)
from qflash.kernels.matmul_epilogue import SCALES_BLOCK, SCALES_KIND, scale_strides, scaled_epilogue, split_k_counters
from qflash.testing import new_output

QBLOCK = 128  # the K (and B's N) extent of one FP8 block scale

@triton.jit
def _scaled_matmul_kernel(
    A, B, C, AScale, BScale, Bias, Partial, Counters,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bsn, stride_bsk,
    SCALES: tl.constexpr, IS_INT8: tl.constexpr, HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, SPLIT_K: tl.constexpr, PROMOTE_IN_DOT: tl.constexpr, SWAP_AB: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """C = (A * a_scale) @ (B * b_scale)^T + bias. A and B are pointers, or with USE_TMA host tensor
    descriptors in [BLOCK_M, BLOCK_K] / [BLOCK_N, BLOCK_K] blocks. With SPLIT_K > 1, Partial
    (SPLIT_K, M, N) takes each run's sum and Counters (zeroed, one a tile) their arrivals. With PDL
    (a programmatic dependent launch, ``common.PDL``) the program waits for the kernel ahead before
    it touches memory, and lets the next one launch once its K loop is done."""
    if PDL:  # launched early: A, B and the scales may still be in the making
        gdc_wait()
    # Grouped launch order: GROUP_M row blocks share each column block of B while it is in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_rows
    pid_n = (pid % (GROUP_M * num_n)) // group_rows

    # Split-K: program_id(1) takes one of SPLIT_K equal runs of whole K blocks, so that a
    # small M x N still fills the machine; the last run of a tile to finish adds them up (below).
    pid_k = tl.program_id(1)
    k_run = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = pid_k * k_run
    k_hi = tl.minimum(K, k_lo + k_run)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)
    if not USE_TMA:
        a_ptrs = A + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
        b_ptrs = B + cols[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk  # [BLOCK_K, BLOCK_N]
    # SWAP_AB (decode-sized M): the product is computed transposed, C^T = B A^T, so that B's rows
    # fill the tensor cores' 64-row side and A's few rows the narrow one (down to 16 columns)
    # instead of being padded to 64 rows. The accumulator is transposed back once, at the end.
    ACC_SHAPE: tl.constexpr = [BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N]
    acc = tl.zeros(ACC_SHAPE, dtype=tl.int32 if IS_INT8 else tl.float32)  # INT8 exact: |sum| < K * 127^2
    if SCALES == SCALES_BLOCK:  # the first K step's scales; each step then loads the next one's
        a_s_next, b_s_next = _block_scales(AScale, BScale, rows, M, pid_n, k_lo // BLOCK_K, K, stride_asm, stride_ask,
                                           stride_bsn, stride_bsk, BLOCK_N, BLOCK_K)
    # Warp specialization: producer warps issue the loads while consumer warps multiply.
    for k in tl.range(k_lo, k_hi, BLOCK_K, warp_specialize=WARP_SPECIALIZE):
        if USE_TMA:  # A and B are descriptors: the copy engine fetches whole tiles, zero-filling past the edges
            a = A.load([pid_m * BLOCK_M, k])  # [BLOCK_M, BLOCK_K]
            b = B.load([pid_n * BLOCK_N, k]).T  # [BLOCK_K, BLOCK_N]
        else:
            a_ok = (rows[:, None] < M) & (k + offs_k[None, :] < K)
            b_ok = (cols[None, :] < N) & (k + offs_k[:, None] < K)
            zero = 0 if IS_INT8 else 0.0  # masked-off K must add nothing
            a = tl.load(a_ptrs + k * stride_ak, mask=a_ok, other=zero)
            b = tl.load(b_ptrs + k * stride_bk, mask=b_ok, other=zero)
        if IS_INT8:
            acc = _dot(a, b, acc, tl.int32, None, SWAP_AB)
        elif PROMOTE_IN_DOT:  # the same promotion, every BLOCK_K products, left to the compiler
            acc = _dot(a, b, acc, tl.float32, BLOCK_K, SWAP_AB)
        else:
            part = _dot(a, b, None, tl.float32, None, SWAP_AB)  # one K block, promoted to the fp32 total below
            if SCALES == SCALES_BLOCK:
                # Loaded a step ahead: the compiler does not pipeline these loads. With pointer loads
                # of A and B, waiting on them each step had cost up to 29 % (decode sizes, M = 16 / 32:
                # 0.94-1.41 x as fast now; with tensor descriptors 0.98-1.05 x; same bits;
                # matmul_fp8_decode_block_scales_ahead_h200_2026-12-02_s36g.json against ..._not_ahead_...)
                a_s, b_s = a_s_next, b_s_next  # [BLOCK_M], scalar
                a_s_next, b_s_next = _block_scales(AScale, BScale, rows, M, pid_n, k // BLOCK_K + 1, K, stride_asm,
                                                   stride_ask, stride_bsn, stride_bsk, BLOCK_N, BLOCK_K)
                if SWAP_AB:
                    part = part * (a_s[None, :] * b_s)
                else:
                    part = part * (a_s[:, None] * b_s)
            acc += part
    # Every load of A and B issued: the next kernel may take the SMs this one leaves. (Let at the
    # program's start, back-to-back decode products lost up to 25 %, s36c.)
    if PDL:
        gdc_launch_dependents()
    if SWAP_AB:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]

    if SPLIT_K == 1:
        scaled_epilogue(acc, C, AScale, BScale, Bias, rows, cols, M, N, stride_cm, stride_cn, stride_asm,
                        stride_bsn, SCALES, HAS_BIAS)
    else:
        # Partial is (SPLIT_K, M, N), contiguous, in the accumulator's type. Each run stores its sum
        # and counts itself in; the run that counts last adds the SPLIT_K sums in split order (the
        # same order, so the same float32 result, whichever run is last), applies the epilogue and
        # sets the count back to zero for the next launch. No second kernel.
        ok = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(_run_ptrs(Partial, pid_k, rows, cols, M, N), acc, mask=ok)
        tl.debug_barrier()  # every thread's stores are issued before the count goes up
        counter = Counters + pid_m * num_n + pid_n
        # acq_rel: the stores above are visible to whoever counts after, and theirs to us
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            # .cg: from L2, where the other runs' stores are, not from a stale L1 line
            total = tl.load(_run_ptrs(Partial, 0, rows, cols, M, N), mask=ok, other=0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(_run_ptrs(Partial, s, rows, cols, M, N), mask=ok, other=0, cache_modifier=".cg")
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
            scaled_epilogue(total, C, AScale, BScale, Bias, rows, cols, M, N, stride_cm, stride_cn, stride_asm,
                            stride_bsn, SCALES, HAS_BIAS)


@triton.jit
def _block_scales(AScale, BScale, rows, M, pid_n, kb, K, stride_asm, stride_ask, stride_bsn, stride_bsk,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """K step ``kb``'s block scales (BLOCK_K == QBLOCK, a scale block's extent in K and in B's N: one
    scale column a step): A's for ``rows`` ([BLOCK_M]) and B's for this column block (a scalar);
    zeros past K's last step."""
    inside = kb < tl.cdiv(K, BLOCK_K)
    a_s = tl.load(AScale + rows * stride_asm + kb * stride_ask, mask=(rows < M) & inside, other=0.0)
    b_s = tl.load(BScale + (pid_n * BLOCK_N // BLOCK_K) * stride_bsn + kb * stride_bsk, mask=inside, other=0.0)
    return a_s, b_s


@triton.jit
def _run_ptrs(Partial, run, rows, cols, M, N):
    """Where split-K run ``run`` keeps its sum of C[rows, cols]: Partial is (SPLIT_K, M, N),
    contiguous (64-bit offsets: SPLIT_K * M * N can pass 2^31)."""
    return Partial + (run * M + rows[:, None]).to(tl.int64) * N + cols[None, :]  # [BLOCK_M, BLOCK_N]


@triton.jit
def _dot(a, b, acc, out_dtype: tl.constexpr, max_imprecise: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc + a @ b, with a [BLOCK_M, BLOCK_K] and b [BLOCK_K, BLOCK_N]; with SWAP_AB the transposed
    product acc + b^T @ a^T ([BLOCK_N, BLOCK_M])."""
    if SWAP_AB:
        out = tl.dot(tl.trans(b), tl.trans(a), acc, out_dtype=out_dtype, max_num_imprecise_acc=max_imprecise)
    else:
        out = tl.dot(a, b, acc, out_dtype=out_dtype, max_num_imprecise_acc=max_imprecise)
    return out


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    use_tma: bool = False  # tensor descriptors (Hopper's copy engine) when strides allow
    warp_specialize: bool = False
    split_k: int = 1  # K cut into this many runs, summed by the last run of each tile (small M x N)
    # FP8 tensor/row scales: promote through tl.dot's max_num_imprecise_acc (the compiler adds each
    # K block's partial sum into the float32 total, without waiting for the next block's products)
    # instead of the explicit `acc += part`; the H200 tile tests check it is exact to float32.
    promote_in_dot: bool = False
    # Decode-sized M: compute C^T = B A^T, B's block_n rows on the tensor cores' 64-row side and A's
    # block_m (16 or more) rows on the narrow side.
    swap_ab: bool = False


@functools.lru_cache(maxsize=1024)
def default_config(m: int, n: int, k: int, scales: str, int8: bool, device: torch.device) -> MatmulConfig:
    """Tiles searched on the H200 (benchmarks/results/matmul_tiles_*); small ones for the interpreter.
    (Cached: eager calls of decode-sized products are bound by the host.)"""
    if device.type != "cuda":
        return MatmulConfig(32, 32, QBLOCK if scales == "block" else 32, 4, 1)
    hopper = has_tma(device)
    if 32 < m <= 64 and hopper and not int8:
        # FP8: 64 rows fill the tensor cores' M side without the transposed product: 64-wide B tiles and
        # K in two runs, or 128-wide ones and no split where the tiles make two waves. Graph-timed
        # searches at five (64, N, K) shapes: 0.73-1.01 x torch._scaled_mm, where the transposed
        # 64 x 64 tiles below ran 0.51-0.80 x (matmul_tiles_small_m_..._s16a, matmul_tiles_m64_..._s16b);
        # the public path 0.74-1.01 x (matmul_fp8_m64_h200_2026-11-30_s16e.json). INT8: not searched.
        if cdiv(n, 64) > 2 * sm_count(device):
            return MatmulConfig(64, 128, 128, 4, 4, split_k=1)
        return MatmulConfig(64, 64, 128, 4, 6, split_k=2)
    if m <= 64 and hopper:
        # Decode-sized M reads B once and does little else: the transposed product on 64 rows of B
        # a tile (128 where that already makes two tiles a SM), K split so that about two runs a SM
        # stream B, each of at least 8 K steps; pointer loads (tensor descriptors timed within 7 %).
        # Tile searches: matmul_tiles_small_m_*_h200_2026-11-30_s11{a,b,e}.json; the public FP8
        # path went from 0.58-0.80x torch._scaled_mm (per tensor, CUDA graphs) with the tiles
        # below to 0.84-1.11x (matmul_fp8_small_m_h200_2026-11-30_s11c.json).
        sms = sm_count(device)
        block_m = max(16, triton.next_power_of_2(m))
        block_n = 128 if cdiv(n, 64) > 2 * sms else 64
        split_k = max(1, min(cdiv(k, QBLOCK) // 8, round(2 * sms / cdiv(n, block_n))))
        if scales == "block":
            # Block scales: A and B by tensor descriptors, 4 ring slots, or 3 where that keeps all the
            # programs resident in one round and 4 would not. x our per-tensor product, the eight Llama
            # shapes, against these tiles with pointer loads and 6 / 4 slots, from graphs, same bits
            # (matmul_fp8_decode_block_dispatch_h200_2026-12-02_s36e.json; the search: ..._tiles_..._s36d):
            # M = 16 0.84-0.99 (0.56-0.87), M = 32 0.72-0.99 (0.53-0.92), M = 1 0.81-0.99 (0.82-0.96;
            # 8B qkv and o, 7-8 us, lost 0.07-0.08)
            tiles = cdiv(n, block_n) * split_k
            slot = (block_m + block_n) * QBLOCK
            rounds = {s: cdiv(tiles, sms * (SM_SHARED_BYTES // (s * slot + CTA_RESERVED_BYTES))) for s in (3, 4)}
            return MatmulConfig(block_m, block_n, 128, 4, 3 if rounds[3] < rounds[4] else 4, split_k=split_k,
                                swap_ab=True, use_tma=True)
        return MatmulConfig(block_m, block_n, 128, 4, 6 if block_n == 64 else 4, split_k=split_k, swap_ab=True)
    if m <= 64:  # decode-sized M: narrow tiles give more programs to stream B with
        return MatmulConfig(64, 32, 128, 4, 4)
    if int8 or m <= 128:
        # INT8 keeps one accumulator for the whole K loop; with M <= 128 there is one row of tiles,
        # where FP8 ran 419 TFLOP/s this way and 176 warp-specialized (128 x 28672 x 4096).
        return MatmulConfig(128, 128, 128, 8, 3)
    # FP8, every kind of scale: two warpgroups on 128 x 128 tiles fed by tensor descriptors. (The
    # warp-specialized 4-warp tiles timed 1.05-1.15x faster but computed wrong results: below.
    # 128 x 256 tiles with promote_in_dot timed 1028 TFLOP/s at 8192^3 in the tile search, but
    # 926 as the default in the full benchmark, against 912 for these: not worth the switch.)
    return MatmulConfig(128, 128, 128, 8, 4, use_tma=hopper)


def config_problem(cfg: MatmulConfig, scales: str, int8: bool) -> Optional[str]:
    """Why ``cfg`` cannot run this kind of product (None if it can); the launcher raises it."""
    if scales == "block" and (cfg.block_k != QBLOCK or QBLOCK % cfg.block_n):
        return f"block scales need block_k == {QBLOCK} and block_n dividing {QBLOCK}"
    if cfg.promote_in_dot and (int8 or scales == "block"):
        return "promote_in_dot is for FP8 with tensor or row scales"
    if cfg.warp_specialize and (int8 or cfg.num_warps < 8):
        # Measured on the H200 with Triton 3.6: warp-specialized tiles of 4 warps leave rows 64-127
        # of tiles unwritten (INT8 and FP8), so they are refused; 8-warp FP8 tiles pass the tests.
        return "warp_specialize needs FP8 and num_warps >= 8 (Triton 3.6 computes the others wrong)"
    return None


_launcher = CachedLauncher(_scaled_matmul_kernel)


def scaled_matmul(a_q: torch.Tensor, b_q: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                  bias: Optional[torch.Tensor], out_dtype: torch.dtype, scales: str,
                  config: Optional[MatmulConfig] = None) -> torch.Tensor:
    """Launch on validated inputs. ``scales`` is "tensor", "row" or "block"."""
    m, k = a_q.shape
    n = b_q.shape[0]
    is_int8 = a_q.dtype == torch.int8
    if config is None and a_q.is_cuda and gluon_enabled():
        from qflash.kernels import matmul_gluon

        if matmul_gluon.preferred(m, n, k, is_int8) and matmul_gluon.why_not(a_q, b_q, scales) is None:
            return matmul_gluon.launch(a_q, b_q, a_scale, b_scale, bias, out_dtype, scales)
        if (matmul_gluon.swap_preferred(m, n, k, is_int8, sm_count(a_q.device), block_scales=scales == "block")
                and matmul_gluon.why_not(a_q, b_q, scales) is None):
            return matmul_gluon.launch(a_q, b_q, a_scale, b_scale, bias, out_dtype, scales, swap_ab=True)
    c = new_output((m, n), dtype=out_dtype, device=a_q.device)
    if m == 0 or n == 0:
        return c
    cfg = config or default_config(m, n, k, scales, is_int8, a_q.device)
    problem = config_problem(cfg, scales, is_int8)
    if problem:
        raise ValueError(f"{problem}, got {cfg}")
    use_tma = cfg.use_tma and tma_compatible(a_q, b_q)
    # Descriptors made on the host: made in the kernel they cost each program a global write and a
    # fence before its first load (at M = 16, 4096^2, 16 x 64 tiles ran 8.2 us with them against
    # 5.6-6.0 with pointer loads, matmul_tiles_small_m_h200_2026-11-30_s11a/b.json).
    a_arg = TensorDescriptor.from_tensor(a_q, [cfg.block_m, cfg.block_k]) if use_tma else a_q
    b_arg = TensorDescriptor.from_tensor(b_q, [cfg.block_n, cfg.block_k]) if use_tma else b_q
    split_k = max(1, min(cfg.split_k, cdiv(k, cfg.block_k)))
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    if split_k > 1:
        partial = torch.empty((split_k, m, n), dtype=torch.int32 if is_int8 else torch.float32, device=a_q.device)
        counters = split_k_counters(a_q.device, tiles)
    else:
        partial = counters = c  # not read
    early = m <= common.PDL_MAX_M and common.launches_early_on(a_q.device)  # programmatic dependent launch
    _launcher[(tiles, split_k)](
        a_arg, b_arg, c, a_scale, b_scale, bias if bias is not None else c, partial, counters,
        m, n, k,
        a_q.stride(0), a_q.stride(1), b_q.stride(0), b_q.stride(1), c.stride(0), c.stride(1),
        *scale_strides(a_scale), *scale_strides(b_scale),
        SCALES=SCALES_KIND[scales], IS_INT8=is_int8, HAS_BIAS=bias is not None, USE_TMA=use_tma,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        WARP_SPECIALIZE=cfg.warp_specialize, SPLIT_K=split_k, PROMOTE_IN_DOT=cfg.promote_in_dot, SWAP_AB=cfg.swap_ab,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, PDL=early, launch_pdl=early,
        # INT8: no multiply-add fusion in the epilogue, so that the float32 rounding steps are
        # exactly the reference's (int32 * a_scale * b_scale + bias, each rounded).
        enable_fp_fusion=not is_int8,
    )
    return c


def compile_for_sm90(m: int = 16, n: int = 4096, k: int = 4096, pdl: bool = True, scales: str = "tensor"):
    """Build the decode product for sm_90 without a GPU (what the CPU tests read): FP8, ``scales``
    "tensor" (pointer loads, 6 ring slots) or "block" (tensor descriptors, 4 slots, A's scales
    column-major as ``quantize`` writes them), 16 x 64 tiles of the transposed product with K in
    four runs, as a programmatic dependent launch or not (``pdl``, ``common.PDL``)."""
    from qflash.kernels.common import build_tl_for_sm90

    block = scales == "block"
    cfg = MatmulConfig(16, 64, QBLOCK, 4, 4 if block else 6, split_k=4, swap_ab=True, use_tma=block)
    operand = "tensordesc<fp8e4nv[{}, 128]>" if block else "*fp8e4nv"
    k_blocks = cdiv(k, QBLOCK)
    args = dict(A=operand.format(cfg.block_m), B=operand.format(cfg.block_n), C="*bf16", AScale="*fp32",
                BScale="*fp32", Bias="*bf16", Partial="*fp32", Counters="*i32", M=m, N=n, K=k, stride_am=k, stride_ak=1,
                stride_bn=k, stride_bk=1, stride_cm=n, stride_cn=1, stride_asm=1 if block else 0,
                stride_ask=m if block else 0, stride_bsn=k_blocks if block else 0, stride_bsk=1 if block else 0)
    constants = dict(SCALES=SCALES_KIND[scales], IS_INT8=False, HAS_BIAS=False, USE_TMA=block,
                     BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                     WARP_SPECIALIZE=False, SPLIT_K=cfg.split_k, PROMOTE_IN_DOT=False, SWAP_AB=True, PDL=pdl)
    return build_tl_for_sm90(_scaled_matmul_kernel, args, constants, num_warps=cfg.num_warps,
                             num_stages=cfg.num_stages)
