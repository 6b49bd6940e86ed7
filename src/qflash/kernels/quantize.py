"""Symmetric quantization in one Triton pass per group: absmax, scale, round, saturate, cast.

A program owns whole groups: BLOCK_M rows (row scales, columns swept in chunks),
BLOCK_N columns (column scales, rows swept), or a stack of 2-D blocks (block scales;
16 rows of 1 x 128 activation blocks share a program). It
reads its groups twice (absmax, then quantize), the second time from L2. Per-tensor
scales need a reduction over the whole tensor first; that one is done by PyTorch
(``amax``) before a single quantizing pass.

Rounding and special values follow ``qflash.reference.quantize``.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from qflash.reference.quantize import QMAX
from qflash.testing import new_output

# Which groups share a scale (constexpr GROUP).
GROUP_TENSOR = tl.constexpr(0)  # scale given: one for everything
GROUP_ROW = tl.constexpr(1)
GROUP_COLUMN = tl.constexpr(2)
GROUP_BLOCK = tl.constexpr(3)
_GROUPS = {"tensor": 0, "row": 1, "column": 2, "block": 3}
_TL_DTYPES = {torch.int8: tl.int8, torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


@triton.jit
def _load_abs(X, rows, cols, M, N, stride_xm, stride_xn):
    """|x| of a tile (non-finite entries as 0) and a 0/1 flag tile marking NaN and inf."""
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(X + rows[:, None].to(tl.int64) * stride_xm + cols[None, :] * stride_xn, mask=ok, other=0.0)
    a = tl.abs(x.to(tl.float32))
    finite = a < float("inf")  # False for inf and for NaN
    return tl.where(finite, a, 0.0), tl.where(finite, 0.0, 1.0)


@triton.jit
def _scale_of(amax, bad, QMAX: tl.constexpr):
    # Zero group -> scale 1 (values quantize to exactly 0); non-finite group -> NaN.
    scale = tl.where(amax > 0, amax / QMAX, 1.0)
    return tl.where(bad > 0, float("nan"), scale)


@triton.jit
def _round_to_float8_grid(y, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """Round float32 values to the nearest value of a float8 format (ties to even).

    Done here in float32, so that the final cast is exact whatever the conversion
    instruction (Triton's interpreter mis-rounds values that cross a power of two).
    """
    a = tl.abs(y)
    e = tl.floor(tl.math.log2(tl.maximum(a, 1e-30)))  # 0 lands in the subnormal range below
    e = tl.where(a >= tl.math.exp2(e + 1.0), e + 1.0, e)  # log2 of powers of two can be 1 ulp off
    e = tl.where(a < tl.math.exp2(e), e - 1.0, e)
    e = tl.maximum(e, MIN_EXP)  # subnormals share the smallest exponent's spacing
    step = tl.math.exp2(e - MANT_BITS)
    t = a / step
    r = tl.floor(t + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    r = tl.where(((r - t) == 0.5) & odd, r - 1.0, r)
    return tl.where(y < 0, -r * step, r * step)


@triton.jit
def _quantize_store(X, Xq, rows, cols, scale, M, N, stride_xm, stride_xn, stride_qm, stride_qn,
                    QMAX: tl.constexpr, OUT: tl.constexpr):
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    r64 = rows[:, None].to(tl.int64)
    x = tl.load(X + r64 * stride_xm + cols[None, :] * stride_xn, mask=ok, other=0.0).to(tl.float32)
    y = x / scale
    # Saturate; comparisons with NaN are false, so NaN passes through unchanged.
    y = tl.where(y > QMAX, QMAX, tl.where(y < -QMAX, -QMAX, y))
    if OUT == tl.int8:  # round half away from zero; NaN (a non-finite group) -> 0
        y = tl.where(y == y, tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(-y + 0.5)), 0.0)
    elif OUT == tl.float8e4nv:  # e4m3: 3 mantissa bits, smallest normal 2^-6
        y = _round_to_float8_grid(y, 3.0, -6.0)
    else:  # e5m2: 2 mantissa bits, smallest normal 2^-14
        y = _round_to_float8_grid(y, 2.0, -14.0)
    tl.store(Xq + r64 * stride_qm + cols[None, :] * stride_qn, y.to(OUT), mask=ok)


@triton.jit
def _quantize_kernel(
    X, Xq, Scale, M, N,
    stride_xm, stride_xn, stride_qm, stride_qn, stride_sm, stride_sn,
    QMAX: tl.constexpr, OUT: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_ROWS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    if GROUP == GROUP_ROW:  # this program: BLOCK_M whole rows
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        bad = tl.zeros([BLOCK_M], dtype=tl.float32)
        for n in range(0, N, BLOCK_N):
            a, nf = _load_abs(X, rows, n + offs_n, M, N, stride_xm, stride_xn)
            amax = tl.maximum(amax, tl.max(a, axis=1))
            bad = tl.maximum(bad, tl.max(nf, axis=1))
        scale = _scale_of(amax, bad, QMAX)  # [BLOCK_M]
        tl.store(Scale + rows * stride_sm, scale, mask=rows < M)
        for n in range(0, N, BLOCK_N):
            _quantize_store(X, Xq, rows, n + offs_n, scale[:, None], M, N, stride_xm, stride_xn, stride_qm,
                            stride_qn, QMAX, OUT)
    elif GROUP == GROUP_COLUMN:  # this program: BLOCK_N whole columns
        amax = tl.zeros([BLOCK_N], dtype=tl.float32)
        bad = tl.zeros([BLOCK_N], dtype=tl.float32)
        for m in range(0, M, BLOCK_M):
            a, nf = _load_abs(X, m + offs_m, cols, M, N, stride_xm, stride_xn)
            amax = tl.maximum(amax, tl.max(a, axis=0))
            bad = tl.maximum(bad, tl.max(nf, axis=0))
        scale = _scale_of(amax, bad, QMAX)  # [BLOCK_N]
        tl.store(Scale + cols * stride_sn, scale, mask=cols < N)
        for m in range(0, M, BLOCK_M):
            _quantize_store(X, Xq, m + offs_m, cols, scale[None, :], M, N, stride_xm, stride_xn, stride_qm,
                            stride_qn, QMAX, OUT)
    elif GROUP == GROUP_BLOCK:  # this program: BLOCK_M // GROUP_ROWS blocks of GROUP_ROWS x BLOCK_N, stacked
        a, nf = _load_abs(X, rows, cols, M, N, stride_xm, stride_xn)
        # [BLOCK_M, BLOCK_N] -> [blocks, GROUP_ROWS, BLOCK_N]: one scale per block. Thin blocks
        # (1 x 128 for activations) thus share a program instead of getting one each.
        amax = tl.max(tl.max(tl.reshape(a, [BLOCK_M // GROUP_ROWS, GROUP_ROWS, BLOCK_N]), axis=2), axis=1)
        bad = tl.max(tl.max(tl.reshape(nf, [BLOCK_M // GROUP_ROWS, GROUP_ROWS, BLOCK_N]), axis=2), axis=1)
        scale = _scale_of(amax, bad, QMAX)  # [BLOCK_M // GROUP_ROWS]
        blocks = pid_m * (BLOCK_M // GROUP_ROWS) + tl.arange(0, BLOCK_M // GROUP_ROWS)
        tl.store(Scale + blocks * stride_sm + pid_n * stride_sn, scale, mask=blocks * GROUP_ROWS < M)
        row_scale = tl.reshape(tl.broadcast_to(scale[:, None], [BLOCK_M // GROUP_ROWS, GROUP_ROWS]), [BLOCK_M])
        _quantize_store(X, Xq, rows, cols, row_scale[:, None], M, N, stride_xm, stride_xn, stride_qm, stride_qn,
                        QMAX, OUT)
    else:  # one scale, computed beforehand
        _quantize_store(X, Xq, rows, cols, tl.load(Scale), M, N, stride_xm, stride_xn, stride_qm, stride_qn,
                        QMAX, OUT)


def quantize(x: torch.Tensor, dtype: torch.dtype, granularity: str,
             block_size: Optional[Sequence[int]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch the quantize kernel on a validated 2-D tensor. Returns (x_q, float32 scale)."""
    m, n = x.shape
    qmax = QMAX[dtype]
    x_q = new_output((m, n), dtype=dtype, device=x.device)
    group = _GROUPS[granularity]
    if granularity == "tensor":
        amax = x.abs().amax().float()  # NaN and inf propagate into amax
        scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
        scale = torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))
        bm, bn = 64, 64
        strides = (0, 0)
        group_rows = bm
    elif granularity == "row":
        scale = new_output((m, 1), dtype=torch.float32, device=x.device)
        bm, bn = 16, 128
        strides = (scale.stride(0), 0)
        group_rows = bm
    elif granularity == "column":
        scale = new_output((1, n), dtype=torch.float32, device=x.device)
        bm, bn = 128, 16
        strides = (0, scale.stride(1))
        group_rows = bm
    else:
        group_rows, bn = block_size
        scale = new_output((triton.cdiv(m, group_rows), triton.cdiv(n, bn)), dtype=torch.float32, device=x.device)
        strides = tuple(scale.stride())
        bm = max(group_rows, 16)  # thin blocks: 16 rows of them per program
    grid = (triton.cdiv(m, bm) if granularity != "column" else 1, triton.cdiv(n, bn) if granularity != "row" else 1)
    if m == 0 or n == 0:
        return x_q, scale
    _quantize_kernel[grid](
        x, x_q, scale, m, n, x.stride(0), x.stride(1), x_q.stride(0), x_q.stride(1), *strides,
        QMAX=qmax, OUT=_TL_DTYPES[dtype], GROUP=group, BLOCK_M=bm, BLOCK_N=bn, GROUP_ROWS=group_rows,
    )
    return x_q, scale
