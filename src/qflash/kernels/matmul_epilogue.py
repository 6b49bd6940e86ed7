"""The end of a scaled INT8 / FP8 product, shared by the tl kernel (``matmul.py``) and the Gluon
kernel (``matmul_gluon.py``): scales and bias in the reference's order, and the arrival counts
with which both kernels' split-K runs find the last of a tile's runs (which adds them all up).

The reference's order: C = acc * a_scale * b_scale + bias, each step rounded in float32 (with
multiply-add fusion off, INT8 results are then bit-exact); block scales were applied to each K
block's partial already, so only the bias is left.
"""

from __future__ import annotations

from typing import Dict

import torch
import triton
import triton.language as tl


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


_COUNTERS: Dict[tuple, torch.Tensor] = {}


def split_k_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 arrival counts, one a tile, for split-K launches on the current stream. Each
    launch leaves them at zero again (its last run resets its tile's count), so they are made once
    per device and stream: launches in one stream run one after another, while two streams would
    race on shared counts. (A CUDA graph captured on a stream keeps that stream's counts; graphs
    whose capture streams shared a handle must not be replayed at the same time.)"""
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < tiles:
        counters = _COUNTERS[key] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
    return counters
