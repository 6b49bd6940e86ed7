"""Symmetric quantization in one Triton pass: absmax, scale, round, saturate, cast.

Each program loads a [BLOCK_M, BLOCK_N] tile once, into registers. Groups that fit
in a tile (rows up to MAX_TILE_N wide, 2-D blocks, several of them per tile) get their
scale from that tile and are quantized from the same registers: one read, one write.
Longer rows, and columns, are swept twice (absmax, then quantize; the second read
mostly hits L2). A per-tensor scale needs the whole tensor's absmax before the first
value is quantized. From 2 to about 34 MB of input, one cooperative launch
(``_tensor_kernel``) finds it and quantizes: one program an SM holds up to 128 KB of the
input in its registers (17 MB on the H200) across a grid barrier, and streams the rest
twice, the second time mostly from L2 (from 24 to 32 MB 0.73-0.76 of a same-size copy's
bandwidth for float8, 0.67-0.69 for int8, against the sweep's 0.55-0.63). Smaller and
larger tensors: a sweep by a few programs per SM, each adding its maximum to one value by
an atomic max, then the quantize pass, which takes the tiles in reverse order, so that it
starts on those the sweep read last (two reads of the input: about 0.6 of the copy
bandwidth at most, once the tensor is larger than L2). A static per-tensor scale, given by
the caller, needs neither: one read.

Rounding and special values follow ``qflash.reference.quantize``, bit for bit: each
group gets scale = absmax / QMAX and inv = QMAX / absmax (IEEE divisions, one of each
per group; 2^-126 and 2^126 where absmax / QMAX would be a subnormal), each element
x_q = saturate(round(x * inv)): a multiply, not a division, per element. On the GPU the
casts are the hardware's round-to-nearest-even conversions
(int8 through one saturating ``cvt`` per value, in inline PTX); Triton's interpreter
converts differently and runs no PTX, so there (EMULATE_CASTS) the values are first
rounded in float32: int8 by adding and subtracting 1.5 * 2^23, float8 to the format's
grid by integer arithmetic.
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from qflash.kernels import common
from qflash.kernels.common import CachedLauncher, aligned_columns, cdiv, next_power_of_2, sm_count
from qflash.reference.quantize import QMAX, SCALE_MIN, scale_shape
from qflash.testing import new_output

MAX_TILE_N = 8192  # rows up to this wide are quantized from one load
# Elements a program holds at once, and its warps, on the one-load paths: the best of 9 sizes on
# the H200 (benchmarks/results/quantize_tiles_*): 0.95x copy bandwidth for fp8 rows, 0.87x for
# 1 x 128 blocks (16384 x 8192), against 0.91x / 0.86x for 8192 elements and 8 warps.
TILE_ELEMS = 4096
TILE_WARPS = 4
# The per-tensor absmax pass: this many 8-warp programs an SM, each sweeping every programs-th tile.
ABSMAX_PROGRAMS_PER_SM = 8
# A dynamic per-tensor scale in one cooperative launch (_tensor_kernel): one program an SM, of
# TENSOR_WARPS warps, holds up to TENSOR_HOLD_BYTES of the input in its registers between the two
# phases (half of an SM's registers: 64 a thread) and streams the rest in TENSOR_BLOCK tiles; it
# takes tensors from 16 KB an SM up to twice what the programs hold (2.2-34.6 MB of 16-bit values
# on the H200).
TENSOR_HOLD_BYTES = 128 * 1024
TENSOR_BLOCK = 8192
TENSOR_WARPS = 16

# Which groups share a scale (constexpr GROUP).
GROUP_TENSOR = tl.constexpr(0)  # one scale, from a tensor-wide absmax computed beforehand
GROUP_TILED = tl.constexpr(1)  # GROUP_M x GROUP_N groups tile each program's tile (rows, blocks)
GROUP_ROW_SWEEP = tl.constexpr(2)  # rows longer than a tile
GROUP_COLUMN_SWEEP = tl.constexpr(3)  # columns (strided: always swept)
SIGN_BIT = tl.constexpr(-(2**31))  # float32's sign bit, as an int32
ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: float32's spacing is 1 from 2^23 to 2^24
FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)  # the largest finite float32
MIN_SCALE = tl.constexpr(SCALE_MIN)  # 2^-126, float32's smallest normal: the least scale ...
MAX_INV = tl.constexpr(1 / SCALE_MIN)  # ... and its inverse 2^126, the largest
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
    """(scale, 1 / scale) of groups with this absmax: amax / QMAX and QMAX / amax.

    Zero group -> 1 and 1 (values quantize to exactly 0); a group of values so small that
    amax / QMAX is a subnormal -> MIN_SCALE and MAX_INV (QMAX / amax would overflow to inf,
    making every value +-QMAX and zeros NaN); non-finite group -> NaN. Both divisions are
    IEEE-rounded (div_rn; the plain "/" is approximate on the GPU), and there is one of each
    per group: the elements are multiplied by the inverse.
    """
    qmax = tl.full(amax.shape, QMAX, tl.float32)
    finite = amax < float("inf")
    scale = tl.math.div_rn(amax, qmax)
    normal = scale >= MIN_SCALE  # (not for an all-zero group: scale 1)
    inv = tl.where(normal, tl.math.div_rn(qmax, tl.where(normal, amax, 1.0)), tl.where(amax > 0, MAX_INV, 1.0))
    scale = tl.where(normal, scale, tl.where(amax > 0, MIN_SCALE, 1.0))
    return tl.where(finite, scale, float("nan")), tl.where(finite, inv, float("nan"))


@triton.jit
def _round_half_even(y):
    """Round to the nearest integer, ties to even (as torch.round), for |y| < 2^22: after
    adding 1.5 * 2^23 no fraction bits are left, and float32 addition rounds ties to even;
    subtracting it again is exact. Two adds, where floor-based rounding takes eight."""
    return (y + ROUND_MAGIC) - ROUND_MAGIC


@triton.jit
def _to_int8_rne(y):
    """float32 -> int8 in one conversion instruction per value: round to nearest even,
    saturate to [-128, 127], NaN -> 0; four values packed into one register."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 a, b, c, d;
        cvt.rni.sat.s8.f32 a, $1;
        cvt.rni.sat.s8.f32 b, $2;
        cvt.rni.sat.s8.f32 c, $3;
        cvt.rni.sat.s8.f32 d, $4;
        prmt.b32 a, a, b, 0x3340;
        prmt.b32 c, c, d, 0x3340;
        prmt.b32 $0, a, c, 0x5410;
        }""",
        "=r,r,r,r,r", [y], dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def _round_to_float8(y, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """Round float32 values within the format's range to the nearest float8 value, ties
    to even, still in float32 (so that any later cast is exact).

    Normal values keep MANT_BITS of float32's 23 mantissa bits (integer rounding of the
    bit pattern; a carry moves into the exponent as it should). Below 2^MIN_EXP the
    format's step is fixed, 2^(MIN_EXP - MANT_BITS), so there it is a rounding to an
    integer multiple of that step, with y's sign bit put back (so -tiny gives -0).
    """
    DROP: tl.constexpr = 23 - MANT_BITS
    bits = y.to(tl.int32, bitcast=True)
    rounded = bits + ((bits >> DROP) & 1) + ((1 << (DROP - 1)) - 1)
    normal = (rounded & -(1 << DROP)).to(tl.float32, bitcast=True)
    t = tl.abs(y) * (2.0 ** (MANT_BITS - MIN_EXP))  # exact: a power of two
    r = tl.floor(t + 0.5)  # t < 2^MANT_BITS here, so the sum is exact
    r = tl.where(((r - t) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) == 1.0), r - 1.0, r)  # ties to even
    small_bits = (r * (2.0 ** (MIN_EXP - MANT_BITS))).to(tl.int32, bitcast=True) | (bits & SIGN_BIT)
    out = tl.where(tl.abs(y) < 2.0 ** MIN_EXP, small_bits.to(tl.float32, bitcast=True), normal)
    return tl.where(y == y, out, y)  # NaN stays NaN


@triton.jit
def _quantized(x, inv, QMAX: tl.constexpr, OUT: tl.constexpr, EMULATE_CASTS: tl.constexpr,
               OWN_ABSMAX: tl.constexpr = True):
    """saturate(round(x * inv)) in OUT, for float32 values x: inv = QMAX / absmax of their group
    (OWN_ABSMAX), or the reciprocal of a static scale, which any value may exceed.

    With the group's own absmax no clamp is needed: |x * inv| <= QMAX * (1 + 2^-23) rounds to
    QMAX at most, and a non-finite group (inv = NaN) gives NaN, then 0 (int8) or NaN (float8).
    A static scale needs it (int8's conversion saturates at -128, not -127, and float8's is a
    saturating one only from sm_90 on): one ``min.NaN.xorsign.abs`` a value, which keeps NaN."""
    y = x * inv
    if not OWN_ABSMAX:
        y = tl.clamp(y, -QMAX, QMAX, propagate_nan=tl.PropagateNan.ALL)
    if OUT == tl.int8 and not EMULATE_CASTS:
        q = _to_int8_rne(y)
    elif OUT == tl.int8:
        q = _round_half_even(tl.where(y == y, y, 0.0)).to(tl.int8)  # NaN -> 0
    elif EMULATE_CASTS:  # e4m3: 3 mantissa bits, smallest normal 2^-6; e5m2: 2 and 2^-14
        r = _round_to_float8(y, 3, -6) if OUT == tl.float8e4nv else _round_to_float8(y, 2, -14)
        # The interpreter casts NaN to a finite value: put the formats' NaN back, 0x7F with
        # the sign bit of the float32 NaN (as PyTorch's conversion keeps it).
        nan = tl.where(r.to(tl.int32, bitcast=True) < 0, -1, 127).to(tl.int8).to(OUT, bitcast=True)
        q = tl.where(r == r, r.to(OUT), nan)
    else:
        q = y.to(OUT, fp_downcast_rounding="rtne")
    return q


@triton.jit
def _quantize_store(Xq, rows, cols, x, inv, M, N, stride_qm, stride_qn, QMAX: tl.constexpr, OUT: tl.constexpr,
                    EMULATE_CASTS: tl.constexpr, OWN_ABSMAX: tl.constexpr = True):
    """Store the quantized [rows, cols] tile of the float32 values x (see ``_quantized``)."""
    q = _quantized(x, inv, QMAX, OUT, EMULATE_CASTS, OWN_ABSMAX)
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(Xq + rows[:, None].to(tl.int64) * stride_qm + cols[None, :] * stride_qn, q, mask=ok)


@triton.jit
def _quantize_kernel(
    X, Xq, Scale, Amax, M, N,
    stride_xm, stride_xn, stride_qm, stride_qn, stride_sm, stride_sn,
    QMAX: tl.constexpr, OUT: tl.constexpr, GROUP: tl.constexpr, EMULATE_CASTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, GROUP_N: tl.constexpr,
    STATIC_SCALE: tl.constexpr = False, REVERSED: tl.constexpr = False, PDL: tl.constexpr = False,
):
    if PDL:  # launched early (common.PDL): x may still be in the making; the next kernel may start
        gdc_wait()  # (and waits for this one before it reads x_q)
        gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if REVERSED:  # last tile first: those the absmax pass read last are still in L2
        pid_m = tl.num_programs(0) - 1 - pid_m
        pid_n = tl.num_programs(1) - 1 - pid_n
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    if GROUP == GROUP_TILED:  # one load: the tile holds whole groups of GROUP_M x GROUP_N
        GROUPS_M: tl.constexpr = BLOCK_M // GROUP_M
        GROUPS_N: tl.constexpr = BLOCK_N // GROUP_N
        x = _load_tile(X, rows, cols, M, N, stride_xm, stride_xn)  # [BLOCK_M, BLOCK_N]
        a = _abs_or_inf(x)
        if GROUPS_N == 1:
            amax = tl.max(a, axis=1)[:, None]  # [BLOCK_M, 1]
        else:
            amax = tl.max(tl.reshape(a, [BLOCK_M, GROUPS_N, GROUP_N]), axis=2)  # [BLOCK_M, GROUPS_N]
        if GROUP_M > 1:  # then over the rows of each group
            amax = tl.max(tl.reshape(amax, [GROUPS_M, GROUP_M, GROUPS_N]), axis=1)  # [GROUPS_M, GROUPS_N]
        scale, inv = _scale_of(amax, QMAX)
        g_rows = pid_m * GROUPS_M + tl.arange(0, GROUPS_M)
        g_cols = pid_n * GROUPS_N + tl.arange(0, GROUPS_N)
        tl.store(Scale + g_rows[:, None] * stride_sm + g_cols[None, :] * stride_sn, scale,
                 mask=(g_rows[:, None] * GROUP_M < M) & (g_cols[None, :] * GROUP_N < N))
        # Back to one factor per element: repeat over the rows, then the columns, of each group.
        if GROUP_M > 1:
            inv = tl.reshape(tl.broadcast_to(inv[:, None, :], [GROUPS_M, GROUP_M, GROUPS_N]), [BLOCK_M, GROUPS_N])
        if GROUPS_N > 1:
            inv = tl.reshape(tl.broadcast_to(inv[:, :, None], [BLOCK_M, GROUPS_N, GROUP_N]), [BLOCK_M, BLOCK_N])
        _quantize_store(Xq, rows, cols, x, inv, M, N, stride_qm, stride_qn, QMAX, OUT, EMULATE_CASTS)
    elif GROUP == GROUP_ROW_SWEEP:  # this program: BLOCK_M whole rows, swept twice
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for n in range(0, N, BLOCK_N):
            x = _load_tile(X, rows, n + offs_n, M, N, stride_xm, stride_xn)
            amax = tl.maximum(amax, tl.max(_abs_or_inf(x), axis=1))
        scale, inv = _scale_of(amax, QMAX)  # [BLOCK_M]
        tl.store(Scale + rows * stride_sm, scale, mask=rows < M)
        for n in range(0, N, BLOCK_N):
            x = _load_tile(X, rows, n + offs_n, M, N, stride_xm, stride_xn)
            _quantize_store(Xq, rows, n + offs_n, x, inv[:, None], M, N, stride_qm, stride_qn, QMAX, OUT,
                            EMULATE_CASTS)
    elif GROUP == GROUP_COLUMN_SWEEP:  # this program: BLOCK_N whole columns, swept twice
        amax = tl.zeros([BLOCK_N], dtype=tl.float32)
        for m in range(0, M, BLOCK_M):
            x = _load_tile(X, m + offs_m, cols, M, N, stride_xm, stride_xn)
            amax = tl.maximum(amax, tl.max(_abs_or_inf(x), axis=0))
        scale, inv = _scale_of(amax, QMAX)  # [BLOCK_N]
        tl.store(Scale + cols * stride_sn, scale, mask=cols < N)
        for m in range(0, M, BLOCK_M):
            x = _load_tile(X, m + offs_m, cols, M, N, stride_xm, stride_xn)
            _quantize_store(Xq, m + offs_m, cols, x, inv[None, :], M, N, stride_qm, stride_qn, QMAX, OUT,
                            EMULATE_CASTS)
    else:  # one scale for the tensor
        if STATIC_SCALE:  # the caller's (Amax points at it): one pass, no absmax
            scale = tl.load(Amax)
            # A scale that is not positive, finite and normal (its inverse could overflow; checked
            # here: checking it on the host would sync) gives NaN values, as a non-finite group
            # does: 0 (int8) or NaN (float8).
            valid = (scale >= MIN_SCALE) & (scale <= FLOAT32_MAX)  # False for NaN too
            inv = tl.where(valid, tl.math.div_rn(tl.full([], 1.0, tl.float32), scale), float("nan"))
        else:  # from the absmax of the whole tensor (found beforehand)
            scale, inv = _scale_of(tl.load(Amax), QMAX)
        if (pid_m == 0) & (pid_n == 0):
            tl.store(Scale, scale)
        x = _load_tile(X, rows, cols, M, N, stride_xm, stride_xn)
        _quantize_store(Xq, rows, cols, x, inv, M, N, stride_qm, stride_qn, QMAX, OUT, EMULATE_CASTS,
                        not STATIC_SCALE)


@triton.jit
def _absmax_kernel(X, Amax, M, N, stride_xm, stride_xn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Amax (zeroed) = max |X| (+inf if X holds NaN or inf). Each program sweeps the tiles pid,
    pid + programs, ... in the quantize kernel's launch order (row blocks first) and adds its
    maximum with one atomic, so the tiles read last are the tensor's last ones."""
    num_m = tl.cdiv(M, BLOCK_M)
    amax = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(tl.program_id(0), num_m * tl.cdiv(N, BLOCK_N), tl.num_programs(0)):
        rows = (t % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (t // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
        amax = tl.maximum(amax, _abs_or_inf(_load_tile(X, rows, cols, M, N, stride_xm, stride_xn)))
    tl.atomic_max(Amax, tl.max(tl.max(amax, axis=1), axis=0), sem="relaxed")  # all >= 0: float order is int order


@triton.jit
def _abs_bits(x, EMULATE_CASTS: tl.constexpr):
    """|x| as an integer, the bits of x's own format with the sign cleared: for values >= 0 integer
    order is float order, and every NaN lies above inf. No conversion to float32 (that the compiler
    could keep for the quantize phase), and 16-bit values two at a time, as they lie in a register
    (an "and" of int16 values takes a register each: 30 more a thread for the held values).
    The interpreter runs no PTX: there the int16 "and"."""
    if x.dtype.primitive_bitwidth == 32:
        bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    elif EMULATE_CASTS:
        bits = x.to(tl.int16, bitcast=True) & 0x7FFF
    else:
        bits = tl.inline_asm_elementwise("and.b32 $0, $1, 0x7FFF7FFF;", "=r,r", [x], dtype=tl.int16, is_pure=True,
                                         pack=2)
    return bits


@triton.jit
def _float_of_abs_bits(bits, like):
    """The float32 value of an |x| in like's format given by its bits (int32; see ``_abs_bits``), any NaN
    as +inf (``_abs_or_inf``)."""
    if like.dtype.primitive_bitwidth == 32:
        a = bits.to(tl.float32, bitcast=True)
    else:
        a = bits.to(tl.int16).to(like.dtype, bitcast=True).to(tl.float32)
    return _abs_or_inf(a)


@triton.jit
def _flat_load(X, offs, numel, MASKED: tl.constexpr):
    if MASKED:
        x = tl.load(X + offs, mask=offs < numel, other=0.0)
    else:
        x = tl.load(X + offs)
    return x


@triton.jit
def _flat_quantize_store(Xq, offs, x, inv, numel, QMAX: tl.constexpr, OUT: tl.constexpr,
                         EMULATE_CASTS: tl.constexpr, MASKED: tl.constexpr):
    q = _quantized(x.to(tl.float32), inv, QMAX, OUT, EMULATE_CASTS)
    if MASKED:
        tl.store(Xq + offs, q, mask=offs < numel)
    else:
        tl.store(Xq + offs, q)


@triton.jit
def _tensor_kernel(
    X, Xq, Scale, Amax, Arrived, numel,
    QMAX: tl.constexpr, OUT: tl.constexpr, EMULATE_CASTS: tl.constexpr,
    HOLD: tl.constexpr, BLOCK: tl.constexpr, FIND_ABSMAX: tl.constexpr, QUANTIZE: tl.constexpr,
    HELD_MASKED: tl.constexpr,
):
    """Quantize with one scale from the whole tensor's absmax, reading the input once where it fits
    in the programs' registers.

    The (contiguous) tensor, flat: program p holds elements [p * HOLD, (p + 1) * HOLD) in its
    registers from start to end; the rest, past programs * HOLD, is streamed in BLOCK-element
    tiles p, p + programs, ... Phase one: the absmax of what it holds and streams, added to Amax
    (zeroed) by an atomic max. Then every program waits at a grid barrier (Arrived, zeroed, counts
    the programs that are done: the launch is cooperative, so all of them are resident) and, in
    phase two, quantizes its held elements from the registers and streams its tiles again, last
    first (those it read last may still be in L2). Triton's interpreter runs one program after
    another, where a barrier never opens: there the phases are two launches (FIND_ABSMAX, then
    QUANTIZE), each loading the held elements.

    The held elements are four quarters, four tensors: one tensor would be converted to float32
    as a whole before the first of its values is quantized, twice the registers it is held in.
    They are masked only for a tensor smaller than one program's HOLD (HELD_MASKED: the
    interpreter's small tests; on the GPU such tensors take the sweep).
    """
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    QUARTER: tl.constexpr = HOLD // 4
    first = pid.to(tl.int64) * HOLD + tl.arange(0, QUARTER)  # [QUARTER]
    held = (_flat_load(X, first, numel, HELD_MASKED),
            _flat_load(X, first + QUARTER, numel, HELD_MASKED),
            _flat_load(X, first + 2 * QUARTER, numel, HELD_MASKED),
            _flat_load(X, first + 3 * QUARTER, numel, HELD_MASKED))
    rest = progs.to(tl.int64) * HOLD  # the streamed part's first element
    tiles = tl.cdiv(tl.maximum(numel - rest, 0), BLOCK)
    mine = tl.maximum(tl.cdiv(tiles - pid, progs), 0)  # this program's tiles: pid, pid + progs, ...
    if FIND_ABSMAX:
        WIDE: tl.constexpr = X.dtype.element_ty.primitive_bitwidth == 32
        bits = tl.zeros([BLOCK], dtype=tl.int32 if WIDE else tl.int16)  # [BLOCK], streamed tiles': reduced at the end
        for i in range(mine):
            offs = rest + (pid + i * progs).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            x = _flat_load(X, offs, numel, True)
            bits = tl.maximum(bits, _abs_bits(x, EMULATE_CASTS))
        top = tl.max(bits, axis=0)
        for q in tl.static_range(4):
            top = tl.maximum(top, tl.max(_abs_bits(held[q], EMULATE_CASTS), axis=0))
        tl.atomic_max(Amax, _float_of_abs_bits(top, held[0]), sem="release")
    if FIND_ABSMAX and QUANTIZE:  # the grid barrier: wait until every program has added its maximum
        arrived = tl.atomic_add(Arrived, 1, sem="acq_rel") + 1
        while arrived < progs:
            arrived = tl.atomic_add(Arrived, 0, sem="acquire")
    if QUANTIZE:
        scale, inv = _scale_of(tl.atomic_max(Amax, 0.0, sem="acquire"), QMAX)  # (reads the total)
        if pid == 0:
            tl.store(Scale, scale)
        for q in tl.static_range(4):
            _flat_quantize_store(Xq, first + q * QUARTER, held[q], inv, numel, QMAX, OUT, EMULATE_CASTS, HELD_MASKED)
        for i in range(mine):
            offs = rest + (pid + (mine - 1 - i) * progs).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            x = _flat_load(X, offs, numel, True)
            _flat_quantize_store(Xq, offs, x, inv, numel, QMAX, OUT, EMULATE_CASTS, True)


_quantize_launcher = CachedLauncher(_quantize_kernel)
_absmax_launcher = CachedLauncher(_absmax_kernel)
_tensor_launcher = CachedLauncher(_tensor_kernel)


def _tile(m: int, n: int, group_m: int, group_n: int, elems: int, warps: int) -> Tuple[int, int]:
    """A tile of about ``elems`` elements made of whole groups (powers of two), and at least four
    per thread: the int8 conversion packs four values a register (small tensors get masked rows)."""
    block_n = max(group_n, min(next_power_of_2(n), 512, max(1, elems // group_m)))
    block_m = max(group_m, min(next_power_of_2(m), max(1, elems // block_n)))
    while block_m * block_n < 4 * 32 * warps:
        block_m *= 2
    return block_m, block_n


class _Plan(NamedTuple):
    """What a launch needs that follows from the shapes and options alone (made once per key)."""
    grid: Tuple[int, int]
    absmax_programs: int  # programs of the per-tensor absmax sweep; 0: no sweep
    constexprs: dict  # the quantize kernel's, less QMAX, OUT and EMULATE_CASTS (or _tensor_kernel's)
    one_launch: bool = False  # a dynamic per-tensor scale by _tensor_kernel (grid: its programs)


def _tensor_plan(numel: int, element_size: int, sms: int, hold_bytes: int, block: int) -> Optional[_Plan]:
    """_tensor_kernel's launch: one program an SM, each holding a power of two of elements, at least
    four values a thread in each quarter, and at most ``hold_bytes``; what the programs do not hold
    (a part of a program's, or more) is streamed. The held parts are whole, unmasked (masks cost
    registers). None, for the sweep, where the tensor is
    - smaller than a smallest part for every SM: the sweep's two plain launches take less time than
      one cooperative launch there (4.4-4.7 against 5.1 us at 16-128 x 4096, s28e);
    - more than twice what the programs hold: streaming more than it holds, one program an SM, is
      slower than the sweep's eight (0.51-0.59 of a copy against 0.58-0.61 from 48 MB on, s28b).
    In the interpreter every size takes it, 4 programs of 1024 with 1024-element tiles, so that
    small tests hold and stream, and a tensor smaller than one part is masked (HELD_MASKED)."""
    if not sms:
        hold, block, programs = 1024, 1024, min(4, numel // 1024)
    else:
        least = 4 * 4 * 32 * TENSOR_WARPS  # four values a thread in each quarter
        most = max(hold_bytes // element_size, least)
        if not sms * least <= numel <= 2 * sms * most:
            return None
        hold = min(most, next_power_of_2(cdiv(numel, sms)))
        programs = min(sms, numel // hold)
    constexprs = dict(HOLD=hold, BLOCK=block, HELD_MASKED=programs == 0)
    return _Plan((max(programs, 1), 1), 0, constexprs, one_launch=True)


@functools.lru_cache(maxsize=1024)
def _plan(m: int, n: int, granularity: str, block_size: Optional[Tuple[int, int]], static: bool, tile_elems: int,
          num_warps: Optional[int], sms: int, element_size: int = 2, one_launch: bool = True,
          hold_bytes: int = TENSOR_HOLD_BYTES, stream_block: int = TENSOR_BLOCK) -> _Plan:
    if granularity == "tensor" and not static and one_launch:  # (contiguous x only)
        tensor_plan = _tensor_plan(m * n, element_size, sms, hold_bytes, stream_block)
        if tensor_plan is not None:  # (None: too large)
            return tensor_plan
    programs = 0
    if granularity == "row" and n > MAX_TILE_N:
        group, bm, bn, gm, gn = GROUP_ROW_SWEEP, 4, 1024, 1, 1
    elif granularity == "column":  # weights, quantized offline: a strided sweep is fine
        group, bm, bn, gm, gn = GROUP_COLUMN_SWEEP, 64, 64, 1, 1
    elif granularity == "tensor":
        group, gm, gn = GROUP_TENSOR, 1, 1
        bm, bn = _tile(m, n, 1, 1, tile_elems, num_warps or TILE_WARPS)
        if not static:  # the absmax first, swept by a few programs per SM into one value
            programs = min(cdiv(m, bm) * cdiv(n, bn), ABSMAX_PROGRAMS_PER_SM * sms if sms else 4)  # 4: interpreter
    else:  # rows and blocks that fit in a tile
        gm, gn = (1, next_power_of_2(n)) if granularity == "row" else block_size
        bm, bn = _tile(m, n, gm, gn, tile_elems, num_warps or TILE_WARPS)
        group = GROUP_TILED
    warps = TILE_WARPS if group in (GROUP_TILED, GROUP_TENSOR) else 8  # sweeps: 4096-element tiles
    grid = (cdiv(m, bm) if group != GROUP_COLUMN_SWEEP else 1,
            cdiv(n, bn) if group != GROUP_ROW_SWEEP else 1)
    constexprs = dict(GROUP=group, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=gm, GROUP_N=gn, STATIC_SCALE=static,
                      REVERSED=programs > 0, num_warps=num_warps or warps)
    return _Plan(grid, programs, constexprs)


def new_outputs(m: int, n: int, dtype: torch.dtype, granularity: str, block_size: Optional[Sequence[int]],
                device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x_q, scale) as ``quantize`` allocates them, unwritten (poisoned in tests): x_q (m, n); the
    scale (1, 1) per tensor (returned as ()), (m, 1), (1, n) or one a block, (1, bn) blocks
    column-major (``aligned_columns``: how the FP8 matmul reads them). torch.compile's fake
    quantize (``ops.quantize``) takes its shapes and strides from here too."""
    x_q = new_output((m, n), dtype=dtype, device=device)
    shape = scale_shape(m, n, granularity, block_size) or (1, 1)  # the kernels write a 2-D scale
    if granularity == "block" and block_size[0] == 1:  # activations' (1, bn) blocks
        return x_q, aligned_columns(shape, device, new_output)
    return x_q, new_output(shape, dtype=torch.float32, device=device)


def quantize(x: torch.Tensor, dtype: torch.dtype, granularity: str, block_size: Optional[Sequence[int]] = None,
             *, static_scale: Optional[torch.Tensor] = None, tile_elems: int = TILE_ELEMS,
             num_warps: Optional[int] = None, one_launch: bool = True, hold_bytes: int = TENSOR_HOLD_BYTES,
             stream_block: int = TENSOR_BLOCK) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch the quantize kernel on a validated 2-D tensor. Returns (x_q, float32 scale).

    ``static_scale``: a validated one-element float32 tensor, the per-tensor scale (granularity
    "tensor" only): one pass instead of an absmax pass and a quantize pass. ``tile_elems`` and
    ``num_warps`` size the programs of the one-load paths (the benchmark's tile search varies
    them; the defaults suit the H200). A dynamic per-tensor scale on a contiguous x takes one
    cooperative launch of ``_tensor_kernel`` where the tensor is from 16 KB an SM to twice what it holds,
    ``hold_bytes`` of the input a program (the rest streamed in ``stream_block``-element tiles);
    otherwise (or ``one_launch=False``, as the benchmark compares) the absmax sweep, then the
    quantize pass over 2-D tiles. What follows from the
    shapes is made once (``_plan``): eager calls on activations are bound by the host's time.
    """
    m, n = x.shape
    cuda = x.is_cuda
    one_launch = one_launch and x.is_contiguous() and x.device not in _NOT_COOPERATIVE
    plan = _plan(m, n, granularity, None if block_size is None else tuple(block_size), static_scale is not None,
                 tile_elems, num_warps, sm_count(x.device) if cuda else 0, x.element_size(), one_launch, hold_bytes,
                 stream_block)
    x_q, scale = new_outputs(m, n, dtype, granularity, block_size, x.device)
    if m == 0 or n == 0:  # no values: the static scale, or the scale of an all-zero group (1) in every group
        if static_scale is not None:
            scale.copy_(static_scale.reshape(1, 1))
        else:
            scale.fill_(1.0)
        return x_q, scale.reshape(()) if granularity == "tensor" else scale
    if plan.one_launch:
        if _quantize_tensor(x, x_q, scale, plan, dtype):
            return x_q, scale.reshape(())
        return quantize(x, dtype, granularity, static_scale=static_scale, tile_elems=tile_elems,
                        num_warps=num_warps, one_launch=False)
    per_tensor = static_scale if static_scale is not None else scale  # (read only by GROUP_TENSOR)
    early = common.launches_early_on(x.device)  # programmatic dependent launch (opt in, Hopper)
    if plan.absmax_programs:
        per_tensor = torch.zeros((), dtype=torch.float32, device=x.device)
        _absmax_launcher[(plan.absmax_programs,)](x, per_tensor, m, n, x.stride(0), x.stride(1),
                                                  BLOCK_M=plan.constexprs["BLOCK_M"],
                                                  BLOCK_N=plan.constexprs["BLOCK_N"], num_warps=8)
    _quantize_launcher[plan.grid](
        x, x_q, scale, per_tensor, m, n,
        x.stride(0), x.stride(1), x_q.stride(0), x_q.stride(1), scale.stride(0), scale.stride(1),
        QMAX=QMAX[dtype], OUT=_TL_DTYPES[dtype], EMULATE_CASTS=not cuda, **plan.constexprs,
        PDL=early, launch_pdl=early,
    )
    return x_q, scale.reshape(()) if granularity == "tensor" else scale


_NOT_COOPERATIVE = set()  # devices where a cooperative launch of _tensor_kernel failed: they take the sweep


def _quantize_tensor(x: torch.Tensor, x_q: torch.Tensor, scale: torch.Tensor, plan: _Plan, dtype: torch.dtype) -> bool:
    """Launch _tensor_kernel on a contiguous x: cooperatively on the GPU, as two launches in
    Triton's interpreter. False if the GPU refused the cooperative launch: its programs could not
    all be resident at once (fewer SMs than the device reports, as under MPS), where a plain
    launch would wait at the barrier for ever. That device takes the sweep from then on."""
    m, n = x.shape
    zeroed = torch.zeros(2, dtype=torch.int32, device=x.device)  # Amax (float32 bits), then Arrived
    args = (x, x_q, scale, zeroed.view(torch.float32), zeroed[1:], m * n)
    constants = dict(QMAX=QMAX[dtype], OUT=_TL_DTYPES[dtype], **plan.constexprs)
    if x.is_cuda:
        try:
            _tensor_launcher[plan.grid](*args, EMULATE_CASTS=False, FIND_ABSMAX=True, QUANTIZE=True,
                                        num_warps=TENSOR_WARPS, launch_cooperative_grid=True, **constants)
        except RuntimeError as error:
            if "cooperative" not in str(error):
                raise
            warnings.warn(f"quantize: the GPU refused a cooperative launch of {plan.grid[0]} programs ({error}); "
                          f"a per-tensor scale on {x.device} takes two launches from now on", RuntimeWarning)
            _NOT_COOPERATIVE.add(x.device)
            return False
    else:
        for phase in ("FIND_ABSMAX", "QUANTIZE"):
            _tensor_launcher[plan.grid](*args, EMULATE_CASTS=True, FIND_ABSMAX=phase == "FIND_ABSMAX",
                                        QUANTIZE=phase == "QUANTIZE", num_warps=TENSOR_WARPS, **constants)
    return True


def compile_for_sm90(x_dtype: torch.dtype = torch.bfloat16, dtype: torch.dtype = torch.float8_e4m3fn,
                     shape: Tuple[int, int] = (4096, 4096), granularity: str = "tensor", pdl: bool = True):
    """Build for sm_90 without a GPU (what the CPU tests read), specialized as the H200's launch
    (132 SMs) on a contiguous (M, N) ``x_dtype`` tensor would be: ``_tensor_kernel`` for a dynamic
    per-tensor scale, or for ``granularity`` "row" the one-pass ``_quantize_kernel`` (``pdl``: as a
    programmatic dependent launch, ``common.PDL``), and for "static" that kernel with a static
    per-tensor scale."""
    from qflash.kernels.common import SIGNATURE_NAMES, build_tl_for_sm90

    m, n = shape
    if granularity in ("row", "static"):
        static = granularity == "static"
        plan = _plan(m, n, "tensor" if static else "row", None, static, TILE_ELEMS, None, 132,
                     torch.empty((), dtype=x_dtype).element_size(), False, TENSOR_HOLD_BYTES, TENSOR_BLOCK)
        args = dict(X=f"*{SIGNATURE_NAMES[x_dtype]}", Xq=f"*{SIGNATURE_NAMES[dtype]}", Scale="*fp32", Amax="*fp32",
                    M=m, N=n, stride_xm=n, stride_xn=1, stride_qm=n, stride_qn=1, stride_sm=1, stride_sn=1)
        constants = {**plan.constexprs, "QMAX": QMAX[dtype], "OUT": _TL_DTYPES[dtype], "EMULATE_CASTS": False,
                     "PDL": pdl}
        return build_tl_for_sm90(_quantize_kernel, args, constants, num_warps=constants.pop("num_warps"))
    plan = _tensor_plan(m * n, torch.empty((), dtype=x_dtype).element_size(), 132, TENSOR_HOLD_BYTES, TENSOR_BLOCK)
    args = dict(X=f"*{SIGNATURE_NAMES[x_dtype]}", Xq=f"*{SIGNATURE_NAMES[dtype]}", Scale="*fp32", Amax="*fp32",
                Arrived="*i32", numel=m * n)
    constants = dict(QMAX=QMAX[dtype], OUT=_TL_DTYPES[dtype], EMULATE_CASTS=False, FIND_ABSMAX=True, QUANTIZE=True,
                     **plan.constexprs)
    return build_tl_for_sm90(_tensor_kernel, args, constants, num_warps=TENSOR_WARPS)
