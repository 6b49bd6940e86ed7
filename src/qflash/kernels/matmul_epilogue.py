"""The end of a scaled INT8 / FP8 product, shared by the tl kernel (``matmul.py``) and the Gluon
kernel (``matmul_gluon.py``): scales and bias in the reference's order, the Gluon kernel's
fixed-order sum of split-K partial products, and the arrival counts of the kernels that add
their runs themselves (the tl kernel, and the Gluon kernel's transposed product).

The reference's order: C = acc * a_scale * b_scale + bias, each step rounded in float32 (with
multiply-add fusion off, INT8 results are then bit-exact); block scales were applied to each K
block's partial already, so only the bias is left.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import triton
import triton.language as tl

from qflash.kernels.common import CachedLauncher, cdiv, stream_handle

# How scales are laid out (constexpr SCALES, the same in the tl and the Gluon kernels).
SCALES_TENSOR = tl.constexpr(0)
SCALES_ROW = tl.constexpr(1)  # A per row, B per output column (row of B)
SCALES_BLOCK = tl.constexpr(2)  # A per (row, 128-wide K block), B per (128 x 128) block
SCALES_KIND = {"tensor": SCALES_TENSOR.value, "row": SCALES_ROW.value, "block": SCALES_BLOCK.value}


def scale_strides(t: torch.Tensor) -> tuple:
    """(row, column) strides of a scale tensor as the kernels read it: one value of any shape (per
    tensor: every row and K block reads it), (M,) or (M, 1) per row, 2-D per block."""
    if t.numel() == 1:
        return 0, 0
    return t.stride() if t.dim() == 2 else (t.stride(0), 0)


@triton.jit
def scaled_epilogue(acc, C, AScale, BScale, Bias, rows, cols, M, N, stride_cm, stride_cn, stride_asm, stride_bsn,
                    SCALES: tl.constexpr, HAS_BIAS: tl.constexpr):
    """C[rows, cols] = acc * scales + bias, cast to C's dtype (block scales were applied per K step)."""
    out = acc.to(tl.float32)
    if SCALES == SCALES_TENSOR:
        out = out * (tl.load(AScale) * tl.load(BScale))
    elif SCALES == SCALES_ROW:
        a_s = tl.load(AScale + rows * stride_asm, mask=rows < M, other=0.0)
        b_s = tl.load(BScale + cols * stride_bsn, mask=cols < N, other=0.0)
        out = out * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        out += tl.load(Bias + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = C + rows[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, out.to(C.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _split_k_reduce_kernel(
    Partial, C, AScale, BScale, Bias, M, N, stride_ps, stride_cm, stride_cn, stride_asm, stride_bsn,
    SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Sum the SPLIT_K partial products in a fixed order (int32 exactly), then the epilogue.
    Partial holds SPLIT_K row-major M x N sums, ``stride_ps`` elements apart."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    p_ptrs = Partial + rows[:, None].to(tl.int64) * N + cols[None, :]
    acc = tl.load(p_ptrs, mask=ok, other=0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(p_ptrs + s * stride_ps, mask=ok, other=0)
    scaled_epilogue(acc, C, AScale, BScale, Bias, rows, cols, M, N, stride_cm, stride_cn, stride_asm, stride_bsn,
                    SCALES, HAS_BIAS)


_reduce_launcher = CachedLauncher(_split_k_reduce_kernel)


def reduce_split_k(partial: torch.Tensor, c: torch.Tensor, a_s: torch.Tensor, b_s: torch.Tensor,
                   bias: Optional[torch.Tensor], split_stride: int, scales_kind: int, exact: bool) -> None:
    """c (M, N) = the sum of ``partial``'s split-K sums (``split_stride`` elements apart, in a fixed
    order), then scales (laid out as ``scale_strides`` reads them) and bias. ``exact`` (INT8): no
    multiply-add fusion, so the float32 steps round as the reference's do."""
    m, n = c.shape
    split_k = partial.numel() // split_stride if split_stride else 1
    bm, bn = 32, 128
    _reduce_launcher[(cdiv(m, bm), cdiv(n, bn))](
        partial, c, a_s, b_s, bias if bias is not None else c, m, n, split_stride, c.stride(0), c.stride(1),
        scale_strides(a_s)[0], scale_strides(b_s)[0],
        SCALES=scales_kind, HAS_BIAS=bias is not None, SPLIT_K=split_k, BLOCK_M=bm, BLOCK_N=bn,
        num_warps=4, enable_fp_fusion=not exact,
    )


_COUNTERS: Dict[tuple, torch.Tensor] = {}


def split_k_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 arrival counts, one a tile, for split-K launches on the current stream. Each
    launch leaves them at zero again (its last run resets its tile's count), so they are made once
    per device and stream: launches in one stream run one after another, while two streams would
    race on shared counts. (A CUDA graph captured on a stream keeps that stream's counts; graphs
    whose capture streams shared a handle must not be replayed at the same time.)"""
    key = (device, stream_handle(device) if device.type == "cuda" else 0)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < tiles:
        counters = _COUNTERS[key] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
    return counters
