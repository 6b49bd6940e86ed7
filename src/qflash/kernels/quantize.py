"""Symmetric quantization in one Triton pass: absmax, scale, round, saturate, cast.

Each program loads a [BLOCK_M, BLOCK_N] tile once, into registers. Groups that fit
in a tile (rows up to MAX_TILE_N wide, 2-D blocks, several of them per tile) get their
scale from that tile and are quantized from the same registers: one read, one write.
Longer rows and columns are swept twice (absmax, then quantize; the second read
mostly hits L2). A per-tensor scale needs the whole tensor's absmax first: a small
kernel writes one partial maximum per tile and PyTorch reduces those few values.

Rounding and special values follow ``qflash.reference.quantize``. On the GPU the
float8 cast itself rounds to nearest even; Triton's interpreter mis-rounds values
that cross a power of two, so there (ROUND_IN_FP32) the rounding is done in float32
first and the cast becomes exact.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from qflash.reference.quantize import QMAX
from qflash.testing import new_output

MAX_TILE_N = 8192  # rows up to this wide are quantized from one load
TILE_ELEMS = 8192  # elements a program holds at once (about 32 fp32 registers a thread at 8 warps)

# Which groups share a scale (constexpr GROUP).
GROUP_TENSOR = tl.constexpr(0)  # scale given: one for everything
GROUP_TILED = tl.constexpr(1)  # GROUP_M x GROUP_N groups tile each program's tile (rows, columns, blocks)
GROUP_ROW_SWEEP = tl.constexpr(2)  # rows longer than a tile
GROUP_COLUMN_SWEEP = tl.constexpr(3)  # columns longer than a tile
_TL_DTYPES = {torch.int8: tl.int8, torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


@triton.jit
def _load_tile(X, rows, cols, M, N, stride_xm, stride_xn):
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(X + rows[:, None].to(tl.int64) * stride_xm + cols[None, :] * stride_xn, mask=ok, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _abs_or_inf(x):
    # NaN and inf both become +inf, so one max finds the group's absmax and whether it is finite.
    a = tl.abs(x)
    return tl.where(a < float("inf"), a, float("inf"))


@triton.jit
def _scale_of(amax, QMAX: tl.constexpr):
    # Zero group -> scale 1 (values quantize to exactly 0); non-finite group -> NaN.
    scale = tl.where(amax > 0, amax / QMAX, 1.0)
    return tl.where(amax < float("inf"), scale, float("nan"))


@triton.jit
def _round_to_float8_grid(y, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """Round float32 values to the nearest value of a float8 format (ties to even)."""
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
def _quantize_store(Xq, rows, cols, x, scale, M, N, stride_qm, stride_qn,
                    QMAX: tl.constexpr, OUT: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """Store saturate(round(x / scale)) for a float32 tile x."""
    y = x / scale
    # Saturate; comparisons with NaN are false, so NaN passes through unchanged.
    y = tl.where(y > QMAX, QMAX, tl.where(y < -QMAX, -QMAX, y))
    if OUT == tl.int8:  # round half away from zero; NaN (a non-finite group) -> 0
        y = tl.where(y == y, tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(-y + 0.5)), 0.0)
    elif ROUND_IN_FP32:  # NaN (a non-finite group) stays NaN
        if OUT == tl.float8e4nv:  # e4m3: 3 mantissa bits, smallest normal 2^-6
            y = tl.where(y == y, _round_to_float8_grid(y, 3.0, -6.0), y)
        else:  # e5m2: 2 mantissa bits, smallest normal 2^-14
            y = tl.where(y == y, _round_to_float8_grid(y, 2.0, -14.0), y)
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(Xq + rows[:, None].to(tl.int64) * stride_qm + cols[None, :] * stride_qn, y.to(OUT), mask=ok)


@triton.jit
def _quantize_kernel(
    X, Xq, Scale, M, N,
    stride_xm, stride_xn, stride_qm, stride_qn, stride_sm, stride_sn,
    QMAX: tl.constexpr, OUT: tl.constexpr, GROUP: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, GROUP_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    if GROUP == GROUP_TILED:  # one load: the tile holds whole groups, GM x GN each
        x = _load_tile(X, rows, cols, M, N, stride_xm, stride_xn)  # [BLOCK_M, BLOCK_N]
        grouped: tl.constexpr = [BLOCK_M // GROUP_M, GROUP_M, BLOCK_N // GROUP_N, GROUP_N]
        amax = tl.max(tl.max(tl.reshape(_abs_or_inf(x), grouped), axis=3), axis=1)  # [BM // GM, BN // GN]
        scale = _scale_of(amax, QMAX)
        g_rows = pid_m * (BLOCK_M // GROUP_M) + tl.arange(0, BLOCK_M // GROUP_M)
        g_cols = pid_n * (BLOCK_N // GROUP_N) + tl.arange(0, BLOCK_N // GROUP_N)
        tl.store(Scale + g_rows[:, None] * stride_sm + g_cols[None, :] * stride_sn, scale,
                 mask=(g_rows[:, None] * GROUP_M < M) & (g_cols[None, :] * GROUP_N < N))
        scale = tl.reshape(scale, [BLOCK_M // GROUP_M, 1, BLOCK_N // GROUP_N, 1])
        scale = tl.reshape(tl.broadcast_to(scale, grouped), [BLOCK_M, BLOCK_N])  # each element's own scale
        _quantize_store(Xq, rows, cols, x, scale, M, N, stride_qm, stride_qn, QMAX, OUT, ROUND_IN_FP32)
    elif GROUP == GROUP_ROW_SWEEP:  # this program: BLOCK_M whole rows, swept twice
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for n in range(0, N, BLOCK_N):
            x = _load_tile(X, rows, n + offs_n, M, N, stride_xm, stride_xn)
            amax = tl.maximum(amax, tl.max(_abs_or_inf(x), axis=1))
        scale = _scale_of(amax, QMAX)  # [BLOCK_M]
        tl.store(Scale + rows * stride_sm, scale, mask=rows < M)
        for n in range(0, N, BLOCK_N):
            x = _load_tile(X, rows, n + offs_n, M, N, stride_xm, stride_xn)
            _quantize_store(Xq, rows, n + offs_n, x, scale[:, None], M, N, stride_qm, stride_qn,
                            QMAX, OUT, ROUND_IN_FP32)
    elif GROUP == GROUP_COLUMN_SWEEP:  # this program: BLOCK_N whole columns, swept twice
        amax = tl.zeros([BLOCK_N], dtype=tl.float32)
        for m in range(0, M, BLOCK_M):
            x = _load_tile(X, m + offs_m, cols, M, N, stride_xm, stride_xn)
            amax = tl.maximum(amax, tl.max(_abs_or_inf(x), axis=0))
        scale = _scale_of(amax, QMAX)  # [BLOCK_N]
        tl.store(Scale + cols * stride_sn, scale, mask=cols < N)
        for m in range(0, M, BLOCK_M):
            x = _load_tile(X, m + offs_m, cols, M, N, stride_xm, stride_xn)
            _quantize_store(Xq, m + offs_m, cols, x, scale[None, :], M, N, stride_qm, stride_qn,
                            QMAX, OUT, ROUND_IN_FP32)
    else:  # one scale, computed beforehand
        x = _load_tile(X, rows, cols, M, N, stride_xm, stride_xn)
        _quantize_store(Xq, rows, cols, x, tl.load(Scale), M, N, stride_qm, stride_qn, QMAX, OUT, ROUND_IN_FP32)


@triton.jit
def _absmax_partials_kernel(X, Partial, M, N, stride_xm, stride_xn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One max |x| per tile (+inf if the tile holds NaN or inf), for per-tensor scales."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a = _abs_or_inf(_load_tile(X, rows, cols, M, N, stride_xm, stride_xn))
    tl.store(Partial + pid_m * tl.num_programs(1) + pid_n, tl.max(tl.max(a, axis=1), axis=0))


def _tile(m: int, n: int, group_m: int, group_n: int) -> Tuple[int, int]:
    """A tile of about TILE_ELEMS elements made of whole groups (powers of two)."""
    block_n = max(group_n, min(triton.next_power_of_2(n), 512))
    block_m = max(group_m, min(triton.next_power_of_2(m), max(1, TILE_ELEMS // block_n)))
    return block_m, block_n


def _interpreting(x: torch.Tensor) -> bool:
    return x.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def quantize(x: torch.Tensor, dtype: torch.dtype, granularity: str,
             block_size: Optional[Sequence[int]] = None, *,
             round_in_fp32: Optional[bool] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch the quantize kernel on a validated 2-D tensor. Returns (x_q, float32 scale).

    ``round_in_fp32`` forces (or skips) the float32 rounding of float8 values; by default
    it is used only where the cast cannot be trusted (the interpreter).
    """
    m, n = x.shape
    qmax = QMAX[dtype]
    x_q = new_output((m, n), dtype=dtype, device=x.device)
    shapes = {"tensor": (1, 1), "row": (m, 1), "column": (1, n)}
    scale_shape = shapes.get(granularity) or (triton.cdiv(m, block_size[0]), triton.cdiv(n, block_size[1]))
    scale = new_output(scale_shape, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return x_q, scale.reshape(()) if granularity == "tensor" else scale
    if granularity == "row" and n > MAX_TILE_N:
        group, bm, bn, gm, gn = GROUP_ROW_SWEEP, 4, 1024, 1, 1
    elif granularity == "column" and m > MAX_TILE_N:
        group, bm, bn, gm, gn = GROUP_COLUMN_SWEEP, 64, 64, 1, 1
    elif granularity == "tensor":
        bm, bn = _tile(m, n, 1, 1)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        partials = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=x.device)
        _absmax_partials_kernel[grid](x, partials, m, n, x.stride(0), x.stride(1), BLOCK_M=bm, BLOCK_N=bn,
                                      num_warps=8)
        amax = partials.amax()  # +inf when any element is NaN or inf
        scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
        scale = torch.where(amax < float("inf"), scale, torch.full_like(scale, float("nan"))).reshape(1, 1)
        group, gm, gn = GROUP_TENSOR, 1, 1
    else:  # rows, columns and blocks that fit in a tile
        gm, gn = {"row": (1, triton.next_power_of_2(n)), "column": (triton.next_power_of_2(m), 1)}.get(
            granularity) or tuple(block_size)
        bm, bn = _tile(m, n, gm, gn)
        group = GROUP_TILED
    grid = (triton.cdiv(m, bm) if group != GROUP_COLUMN_SWEEP else 1,
            triton.cdiv(n, bn) if group != GROUP_ROW_SWEEP else 1)
    _quantize_kernel[grid](
        x, x_q, scale, m, n, x.stride(0), x.stride(1), x_q.stride(0), x_q.stride(1),
        scale.stride(0), scale.stride(1),
        QMAX=qmax, OUT=_TL_DTYPES[dtype], GROUP=group,
        ROUND_IN_FP32=_interpreting(x) if round_in_fp32 is None else round_in_fp32,
        BLOCK_M=bm, BLOCK_N=bn, GROUP_M=gm, GROUP_N=gn, num_warps=8 if bm * bn >= 4096 else 4,
    )
    return x_q, scale.reshape(()) if granularity == "tensor" else scale
