"""Quantize kernel: bit-exact against the pure-PyTorch reference, with the edge cases spelled out."""

import math
import re

import pytest
import torch

import qflash
from qflash.reference.quantize import QMAX, SCALE_MIN, dequantize_ref, quantize_ref
from qflash.testing import assert_written, poisoned, same_bits, sqnr_db, with_outlier_channels

from conftest import DEVICE, FAKE_CHECKS, one_graph, ptxas_report, sm90_build

QDTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
GROUPS = [("tensor", None), ("row", None), ("column", None), ("block", (32, 64)), ("block", (1, 128))]


@pytest.mark.parametrize("granularity,block", GROUPS)
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 100), (70, 300), (129, 33)])
def test_matches_reference_bitwise(shape, qdtype, granularity, block):
    x = torch.randn(shape, device=DEVICE) * 3
    with poisoned():
        x_q, scale = qflash.quantize(x, qdtype, granularity, block)
    ref_q, ref_scale = quantize_ref(x, qdtype, granularity, block)
    assert x_q.dtype == qdtype and scale.dtype == torch.float32 and scale.shape == ref_scale.shape
    assert_written(scale, "scale")
    assert same_bits(x_q, ref_q)
    assert torch.equal(scale, ref_scale)


@pytest.mark.parametrize("granularity,block", GROUPS + [("block", (128, 128))])
@pytest.mark.parametrize("shape", [(0, 64), (4, 0), (0, 0)])
def test_empty_input_gets_the_all_zero_scale(shape, granularity, block):
    """x with no rows or no columns (an empty batch): every group has no values and gets the
    scale of an all-zero group, 1, as the reference does; a static scale comes back as given.
    Nothing is left unwritten."""
    x = torch.randn(shape, device=DEVICE)
    for qdtype in (torch.int8, torch.float8_e4m3fn):
        with poisoned():
            x_q, scale = qflash.quantize(x, qdtype, granularity, block)
        ref_q, ref_scale = quantize_ref(x, qdtype, granularity, block)
        assert x_q.shape == shape and x_q.dtype == qdtype and scale.shape == ref_scale.shape
        assert torch.equal(scale, ref_scale) and bool((scale == 1).all())
    if granularity == "tensor":
        static = torch.tensor(0.25, device=DEVICE)
        with poisoned():
            assert float(qflash.quantize(x, torch.int8, "tensor", scale=static)[1]) == 0.25


@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_rounding_ties_and_subnormals(qdtype):
    """Every float8 value, every midpoint between neighbours (ties go to even) and the
    float32 numbers just beside each midpoint, with scale exactly 1 (absmax = QMAX)."""
    grid = torch.arange(256, dtype=torch.uint8).view(qdtype).float()
    grid = grid[grid.isfinite()].unique()  # sorted, one zero
    mids = (grid[1:] + grid[:-1]) / 2
    beside = torch.cat([torch.nextafter(mids, grid[1:]), torch.nextafter(mids, grid[:-1])])
    x = torch.cat([grid, mids, beside, torch.tensor([QMAX[qdtype]])]).reshape(1, -1).to(DEVICE)
    x_q, scale = qflash.quantize(x, qdtype, "row")
    assert float(scale) == 1.0
    expected = x.cpu().to(qdtype).float()
    assert torch.equal(x_q.cpu().float(), expected)  # values: the interpreter's cast drops the sign of -0
    if DEVICE == "cuda":
        assert torch.equal(x_q.cpu().view(torch.uint8), x.cpu().to(qdtype).view(torch.uint8))


def test_int8_rounds_half_to_even():
    """Scale 1 (absmax 127): ties go to the even neighbour, as torch.round, and 0.49999997
    (whose + 0.5 rounds to 1.0 in float32) stays 0."""
    below_half = 0.5 - 2.0**-25
    vals = [127.0, below_half, 0.5, 1.5, 2.5, -0.5, -below_half, -2.5, -3.5, 126.49999, 126.5, 3.0000002]
    want = [127, 0, 0, 2, 2, 0, 0, -2, -4, 126, 126, 3]
    x = torch.tensor([vals], device=DEVICE)
    x_q, scale = qflash.quantize(x, torch.int8, "row")
    assert float(scale) == 1.0 and x_q.tolist() == [want]
    assert quantize_ref(x, torch.int8, "row")[0].tolist() == [want]


@pytest.mark.parametrize("granularity", ["row", "column"])
@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
def test_long_rows_and_columns_are_swept(granularity, qdtype, monkeypatch):
    """Groups longer than a tile take the two-pass sweep; NaN and zero groups included."""
    import qflash.kernels.quantize as kernels

    monkeypatch.setattr(kernels, "MAX_TILE_N", 64)
    x = torch.randn(150, 1100, device=DEVICE) * 4
    x[3] = 0.0
    x[:, 5] = 0.0
    x[7, 900] = math.nan
    x = x if granularity == "row" else x.T.contiguous()
    x_q, scale = qflash.quantize(x, qdtype, granularity)
    ref_q, ref_scale = quantize_ref(x, qdtype, granularity)
    assert torch.equal(scale.nan_to_num(-1.0), ref_scale.nan_to_num(-1.0))
    finite = (scale == scale).expand_as(x)  # groups without NaN
    # Values, not bits: the interpreter's float8 cast also drops the sign of -0.
    assert torch.equal(x_q[finite].float(), ref_q[finite].float())
    if qdtype == torch.int8:
        assert bool((x_q[~finite] == 0).all())
    elif DEVICE == "cuda":  # the interpreter's float8 cast turns NaN into 384; the GPU's keeps NaN
        assert bool(x_q[~finite].float().isnan().all())


@pytest.mark.parametrize("one_launch", [True, False])
@pytest.mark.parametrize("where", ["first", "held last", "middle", "last"])
def test_per_tensor_absmax_found_in_any_tile(where, one_launch):
    """A dynamic per-tensor scale, both ways. One launch (here as its two phases, the interpreter
    running no barrier): 4 programs each hold 1024 elements of the 27007 and stream the rest in
    1024-element tiles, then quantize them last first. The sweep: a few programs, each over every
    few 2 x 256 tiles (57), then the quantize pass in reverse. The largest value (and a NaN)
    counts from any part: held by the first or the last program, streamed, in the last tile."""
    from qflash.kernels.quantize import quantize as launch

    x = torch.randn(113, 239, device=DEVICE)
    row, col = {"first": (0, 0), "held last": (17, 30), "middle": (57, 120), "last": (112, 238)}[where]
    x[row, col] = -40.0
    for qdtype in (torch.int8, torch.float8_e4m3fn):
        with poisoned():
            x_q, scale = launch(x, qdtype, "tensor", tile_elems=256, one_launch=one_launch)
        ref_q, ref_scale = quantize_ref(x, qdtype, "tensor")
        assert torch.equal(scale, ref_scale) and scale.item() == pytest.approx(40.0 / QMAX[qdtype], rel=1e-6)
        assert same_bits(x_q, ref_q)
    x[row, col] = math.nan
    assert math.isnan(launch(x, torch.int8, "tensor", tile_elems=256, one_launch=one_launch)[1].item())


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "every other column"])
def test_per_tensor_input_dtypes_and_layouts(x_dtype, layout):
    """Per tensor, each input dtype read in its own format (one launch: the absmax from its bits);
    strided inputs take the sweep over 2-D tiles. Ragged sizes."""
    for m, n in ((1, 1), (3, 100), (63, 113)):
        base = torch.randn(m, n if layout != "every other column" else 2 * n, device=DEVICE) * 7
        x = {"contiguous": base, "transposed": torch.randn(n, m, device=DEVICE).t() * 7,
             "every other column": base[:, ::2]}[layout].to(x_dtype)
        assert x.shape == (m, n)
        for qdtype in (torch.int8, torch.float8_e5m2):
            with poisoned():
                x_q, scale = qflash.quantize(x, qdtype, "tensor")
            ref_q, ref_scale = quantize_ref(x, qdtype, "tensor")
            assert torch.equal(scale, ref_scale) and same_bits(x_q, ref_q), (m, n, qdtype)


def test_per_tensor_one_launch_plan():
    """One program an SM, each holding a power of two of elements (at least 8192: four values a
    thread in each quarter, at most 128 KB: 64 K bfloat16, 32 K float32), whole, unmasked; what
    they do not hold is streamed. Tensors under 8192 values an SM, or more than twice what all
    parts hold, take the sweep."""
    from qflash.kernels.quantize import TENSOR_BLOCK, TENSOR_HOLD_BYTES, _tensor_plan

    def plan(numel, size=2):
        p = _tensor_plan(numel, size, 132, TENSOR_HOLD_BYTES, TENSOR_BLOCK)
        return p and (p.grid[0], p.constexprs["HOLD"], p.constexprs["HELD_MASKED"])

    assert plan(4096 * 4096) == (132, 65536, False)  # 8.7 M of 16.8 M held, the rest streamed
    assert plan(2048 * 4096, 4) == (132, 32768, False)
    assert plan(1024 * 4096) == (128, 32768, False)  # held whole
    assert plan(2048 * 4095) == (127, 65536, False)  # 63488 streamed
    assert plan(1100 * 1000) == (67, 16384, False)  # 2252 streamed
    assert plan(132 * 8192) == (132, 8192, False) and plan(132 * 8192 - 1) is None  # smaller: the sweep
    assert plan(1) is None and plan(128 * 4096) is None
    assert plan(2 * 132 * 65536) and plan(2 * 132 * 65536 + 1) is None  # more than it holds to stream: the sweep
    assert plan(2 * 132 * 32768, 4) and plan(2 * 132 * 32768 + 1, 4) is None
    for numel in (132 * 8192, 1_100_000, 3 * 10**6 + 1, 10**7, 2 * 132 * 65536 - 1):
        programs, hold, masked = plan(numel)
        assert hold & (hold - 1) == 0 and programs <= 132 and not masked
        assert programs * hold <= numel < programs * hold + max(hold, programs * hold)  # streams less than it holds


@pytest.mark.parametrize("x_dtype,qdtype", [(torch.bfloat16, torch.float8_e4m3fn), (torch.bfloat16, torch.int8),
                                            (torch.float32, torch.int8), (torch.float16, torch.float8_e5m2)])
def test_per_tensor_one_launch_build(x_dtype, qdtype):
    """Built offline as the H200's launch on the largest tensor it takes would be (4096 x 4096 of
    16-bit values, 2048 x 4096 of float32: half held, half streamed): 512 threads an SM within 128
    registers each, with the held part in them and nothing spilled; the grid barrier's atomics
    (arrive with release, spin on an acquiring load); float8 values go straight to sm_90's
    saturating conversion."""
    shape = (2048, 4096) if x_dtype == torch.float32 else (4096, 4096)
    kernel = sm90_build("qflash.kernels.quantize", x_dtype, qdtype, shape)
    report = ptxas_report(kernel["ptx"])
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    assert registers <= 128 and "0 bytes spill stores" in report, report
    assert "atom.global.gpu.acq_rel.add" in kernel["ptx"] and "ld.global.gpu.acquire" in kernel["ptx"]
    if qdtype != torch.int8:  # no clamp before the saturating conversion (it took 2 selp a value: 288 here)
        assert "cvt.rn.satfinite.e" in kernel["ptx"] and kernel["ptx"].count("selp") < 32


@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
def test_static_scale_build(qdtype):
    """The static per-tensor pass built offline for sm_90: one pass (no atomics), nothing spilled,
    and the check of the scale compiled in (the NaN it gives a scale that is not positive and
    finite: the interpreter runs the check as Python, this is the compiler's)."""
    ptx = sm90_build("qflash.kernels.quantize", torch.bfloat16, qdtype, (128, 4096), "static", pdl=False)["ptx"]
    assert "atom." not in ptx and "0f7FC00000" in ptx
    assert "0 bytes spill stores" in ptxas_report(ptx)


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_saturation_zero_groups_and_nonfinite(qdtype):
    qmax = QMAX[qdtype]
    x = torch.randn(4, 64, device=DEVICE)
    x[1] = 0.0  # an all-zero row: scale 1, values exactly 0
    x[2, 5] = math.inf  # a non-finite row: scale NaN
    x[3, 7] = math.nan
    x_q, scale = qflash.quantize(x.half(), qdtype, "row")
    assert scale[1].item() == 1.0 and bool((x_q[1].float() == 0).all())
    assert math.isnan(scale[2].item()) and math.isnan(scale[3].item())
    if qdtype == torch.int8:  # the values of a non-finite group: 0 (int8) or NaN (float8)
        assert bool((x_q[2:4] == 0).all())
    else:
        assert bool(x_q[2:4].float().isnan().all())
    assert math.isfinite(scale[0].item())
    assert float(x_q[0].float().abs().max()) == qmax  # the row's absmax lands exactly on QMAX
    # A scale smaller than the data needs (a block whose max is one huge value) still saturates.
    y = torch.full((16, 16), 1000.0, device=DEVICE)
    y_q, _ = qflash.quantize(y, qdtype, "tensor")
    assert torch.isfinite(y_q.float()).all() and float(y_q.float().max()) == qmax


def _tiny_case(qdtype, device):
    """Rows of random values scaled so that each row's absmax is ``absmax`` (the first value of
    the row, the rest smaller, some exact zeros): from float32 subnormals to just above the least
    normal scale's reach (QMAX * 2^-126), and one ordinary row."""
    qmax = QMAX[qdtype]
    absmax = [1e-42, 1e-40, qmax * 2.0**-130, qmax * 2.0**-128, 1e-38, qmax * 2.0**-126 * 0.99,
              qmax * 2.0**-126, qmax * 2.0**-126 * 1.5, 1.0]
    x = torch.rand(len(absmax), 130, dtype=torch.float64) * 2 - 1
    x[:, 0] = 1.0
    x[:, 5::7] = 0.0
    return (x * torch.tensor(absmax, dtype=torch.float64)[:, None]).float().to(device), absmax


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # (the interpreter's 1 / amax, not taken)
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_tiny_groups_keep_a_normal_scale(qdtype):
    """A group of values so small that absmax / QMAX is a float32 subnormal gets the least normal
    scale, 2^-126, whose inverse is finite. (QMAX / absmax used to overflow to inf from about
    QMAX * 2^-128 down: every value became +-QMAX and zeros NaN in float8.)"""
    x, absmax = _tiny_case(qdtype, DEVICE)
    qmax = QMAX[qdtype]
    # (float16 holds nothing this small; bfloat16 on the GPU only: Triton 3.6's interpreter converts
    # bfloat16 subnormals to float32 wrongly, 2.85e-39 to 1.10e-38, where the GPU's cvt is exact)
    for inp in (x, x.bfloat16()) if DEVICE == "cuda" else (x,):
        amax = inp.float().abs().amax(dim=1)
        for granularity, block in (("row", None), ("column", None), ("block", (1, 64)), ("tensor", None)):
            with poisoned():
                x_q, scale = qflash.quantize(inp if granularity != "column" else inp.T, qdtype, granularity, block)
            ref_q, ref_scale = quantize_ref(inp if granularity != "column" else inp.T, qdtype, granularity, block)
            assert same_bits(x_q, ref_q) and torch.equal(scale, ref_scale), granularity
            assert not x_q.float().isnan().any() and bool((scale >= SCALE_MIN).all()), granularity
        x_q, scale = qflash.quantize(inp, qdtype, "row")
        small = (amax > 0) & (amax < qmax * SCALE_MIN)  # (bfloat16 rounds 1e-42 to 0: scale 1)
        if inp.dtype == torch.float32:
            assert small.tolist() == [a < qmax * 2.0**-126 for a in absmax]
        assert bool((scale[small] == SCALE_MIN).all()) and bool((scale[amax == 0] == 1).all())
        above = amax >= qmax * SCALE_MIN  # the rule there, unchanged (IEEE: a tensor divides on the GPU too)
        assert torch.equal(scale[above, 0], amax[above] / torch.full_like(amax[above], qmax))
        assert bool((x_q.float()[inp.float() == 0] == 0).all())  # zeros stay zeros, never NaN
        error = (dequantize_ref(x_q, scale) - inp.float()).abs()  # (under 2^-126 in the tiny rows)
        assert bool((error <= 2.0**-3 * inp.float().abs() + scale / 2).all())


def _static_case(device):
    """Values that a static scale leaves in range, saturates on both sides (int8 must give -127,
    never -128), exact ties of the rounding, and non-finite ones."""
    x = torch.randn(37, 300, device=device) * 2
    x[0, :6] = torch.tensor([1e6, -1e6, math.inf, -math.inf, math.nan, -0.0])
    x[1, :4] = torch.tensor([0.25, 0.75, -0.25, -127.75]) * 0.02  # ties at scale 0.01 / 0.02
    return x


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("static", [0.01, 0.02, 0.3])
def test_static_scale_matches_reference_bitwise(qdtype, static):
    x = _static_case(DEVICE)
    s = torch.tensor(static, device=DEVICE)
    before = s.clone()
    for inp in (x, x.half(), x.bfloat16()[:, ::3]):  # dtypes and a strided view
        with poisoned():
            x_q, scale = qflash.quantize(inp, qdtype, "tensor", scale=s)
        ref_q, ref_scale = quantize_ref(inp, qdtype, "tensor", scale=s)
        assert scale.shape == () and scale.dtype == torch.float32 and float(scale) == float(ref_scale)
        assert same_bits(x_q, ref_q)
    if qdtype == torch.int8:
        assert int(x_q.min()) == -127 and int(x_q.max()) == 127
    assert torch.equal(s, before)  # the caller's scale is not touched


# (1e-40: a float32 subnormal, whose inverse overflows)
BAD_STATIC_SCALES = [0.0, -0.0, -0.01, math.inf, -math.inf, math.nan, 1e-40, 2.0**-127]


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the interpreter's 1 / 0, not taken
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # and its 1 / 1e-40
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_static_scale_not_positive_and_finite_shows(qdtype):
    """Without debug checks (a host sync), a scale that is not positive and finite must not give
    plausible values (a negative one used to flip every sign): every value is 0 (int8) or NaN
    (float8), as for a non-finite group, and the given scale comes back."""
    x = _static_case(DEVICE)
    for bad in BAD_STATIC_SCALES:
        s = torch.tensor(bad, device=DEVICE)
        with poisoned():
            x_q, scale = qflash.quantize(x, qdtype, "tensor", scale=s)
        ref_q, _ = quantize_ref(x, qdtype, "tensor", scale=s)
        assert same_bits(x_q, ref_q), bad
        assert (x_q == 0).all() if qdtype == torch.int8 else x_q.float().isnan().all(), bad
        assert torch.equal(scale.view(torch.int32), s.view(torch.int32)), bad  # NaN too


def test_static_scale_bad_inputs():
    x = torch.randn(8, 8, device=DEVICE)
    one = torch.tensor(0.1, device=DEVICE)
    cases = [
        (lambda: qflash.quantize(x, torch.int8, "row", scale=one), ValueError, "per tensor"),
        (lambda: qflash.quantize(x, torch.int8, "tensor", scale=0.1), TypeError, "one-element"),
        (lambda: qflash.quantize(x, torch.int8, "tensor", scale=torch.ones(2, device=DEVICE)), TypeError,
         "one-element"),
        (lambda: qflash.quantize(x, torch.int8, "tensor", scale=torch.ones(1, dtype=torch.int32, device=DEVICE)),
         TypeError, "floating-point"),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()
    qflash.set_debug(True)
    try:
        for bad in (0.0, -1.0, math.inf, math.nan, 1e-40):
            with pytest.raises(ValueError, match="positive and finite"):
                qflash.quantize(x, torch.int8, "tensor", scale=torch.tensor(bad, device=DEVICE))
    finally:
        qflash.set_debug(False)


def test_dequantize_round_trip_and_sqnr():
    x = torch.randn(64, 256, device=DEVICE)
    for qdtype, floor_db in ((torch.int8, 35.0), (torch.float8_e4m3fn, 28.0)):
        x_q, scale = qflash.quantize(x, qdtype, "row")
        back = qflash.dequantize(x_q, scale, "row")
        torch.testing.assert_close(back, dequantize_ref(x_q, scale, "row"), rtol=0, atol=0)
        assert sqnr_db(back, x) > floor_db
    x_q, scale = qflash.quantize(x, torch.float8_e4m3fn, "block", (1, 128))
    assert qflash.dequantize(x_q, scale, "block", (1, 128)).shape == x.shape


@pytest.mark.parametrize("m", [1, 63, 113, 128])
def test_row_block_scales_column_major(m):
    """(1, bn) block scales come column-major, each column 16-byte aligned (strides (1, M rounded
    up to 4)), the layout the FP8 matmul's bulk copies read; the values are the reference's."""
    x = torch.randn(m, 384, device=DEVICE)
    x_q, scale = qflash.quantize(x, torch.float8_e4m3fn, "block", (1, 128))
    assert scale.shape == (m, 3) and scale.stride() == (1, -(-m // 4) * 4)
    assert scale.data_ptr() % 16 == 0
    want_q, want_scale = quantize_ref(x, torch.float8_e4m3fn, "block", (1, 128))
    assert torch.equal(scale, want_scale) and same_bits(x_q, want_q)


def test_outliers_collapse_per_tensor_but_not_per_row():
    x = with_outlier_channels(torch.randn(128, 256), num=4, scale=100.0, seed=0).T.contiguous().to(DEVICE)
    # channels as rows: a few rows 100x larger
    db = {g: sqnr_db(qflash.dequantize(*qflash.quantize(x, torch.int8, g), g), x) for g in ("tensor", "row")}
    assert db["row"] > db["tensor"] + 15, db


def test_bad_inputs():
    x = torch.randn(8, 8, device=DEVICE)
    cases = [
        (lambda: qflash.quantize(x[0]), ValueError, "x must have 2 dimensions"),
        (lambda: qflash.quantize(x.double()), TypeError, "float16, bfloat16 or float32"),
        (lambda: qflash.quantize(x, torch.int16), TypeError, "dtype must be"),
        (lambda: qflash.quantize(x, granularity="channel"), ValueError, "granularity must be one of"),
        (lambda: qflash.quantize(x, granularity="block"), ValueError, "block_size is required"),
        (lambda: qflash.quantize(x, granularity="row", block_size=(1, 128)), ValueError, "block_size is required"),
        (lambda: qflash.quantize(x, granularity="block", block_size=(3, 128)), ValueError, "powers of two"),
        (lambda: qflash.dequantize(*qflash.quantize(x), granularity="column"), ValueError, "does not fit"),
        (lambda: qflash.dequantize(*qflash.quantize(x), granularity="block"), ValueError, "block_size is required"),
        (lambda: qflash.dequantize(*qflash.quantize(x), "row", (1, 128)), ValueError, "block_size is required"),
        (lambda: qflash.dequantize(qflash.quantize(x)[0], 0.5, "tensor"), TypeError, "scale must be a torch.Tensor"),
        (lambda: qflash.dequantize(*qflash.quantize(x), dtype=torch.int8), TypeError, "dtype must be a floating-point"),
        (lambda: qflash.dequantize(qflash.quantize(x)[0], torch.ones((), device="meta"), "tensor"), ValueError,
         "scale is on meta"),
        (lambda: qflash.quantize(x, granularity="block", block_size="ab"), ValueError,
         "block_size must be a pair of ints \\(rows, cols\\), got 'ab'"),
        (lambda: qflash.quantize(x, granularity="block", block_size=(1, 2, 4)), ValueError, "got \\(1, 2, 4\\)"),
        (lambda: qflash.quantize(x, granularity="tensor", scale=torch.ones((), device="meta")), ValueError,
         "scale is on meta, expected x's device"),
        (lambda: qflash.dequantize(*qflash.quantize(x), granularity="rows"), ValueError, "granularity must be one of"),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()


def test_one_pass_kernel_launched_early_build():
    """As a programmatic dependent launch (``common.PDL``), the one-pass kernel built for sm_90
    waits for the kernel ahead before it reads x and lets the next kernel launch; otherwise (and
    in the interpreter) neither."""
    for pdl in (False, True):
        ptx = sm90_build("qflash.kernels.quantize", shape=(128, 4096), granularity="row", pdl=pdl)["ptx"]
        assert ptx.count("griddepcontrol.wait;") == ptx.count("griddepcontrol.launch_dependents;") == int(pdl)


@pytest.mark.gpu
@pytest.mark.parametrize("granularity,block", GROUPS)
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_gpu_matches_reference_bitwise(qdtype, granularity, block):
    x = (torch.randn(4097, 1500, device="cuda") * 5).bfloat16()
    x_q, scale = qflash.quantize(x, qdtype, granularity, block)
    ref_q, ref_scale = quantize_ref(x, qdtype, granularity, block)
    assert torch.equal(scale, ref_scale), f"{int((scale != ref_scale).sum())} scales differ"
    bad = (x_q.view(torch.uint8) != ref_q.view(torch.uint8)).nonzero()
    assert len(bad) == 0, (len(bad), x[tuple(bad[:4].T)], x_q[tuple(bad[:4].T)], ref_q[tuple(bad[:4].T)])


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_gpu_static_scale_matches_reference_bitwise(qdtype):
    """The one-pass static path through the GPU's conversions, with saturation on both sides."""
    x = _static_case("cuda")
    big = (torch.randn(4097, 1500, device="cuda") * 5).bfloat16()
    cases = [(x, 0.01), (x.bfloat16(), 0.02), (big, 0.03), (big[:, ::2], 0.5)]
    for inp, s in cases + [(big, bad) for bad in BAD_STATIC_SCALES]:  # the bad ones: all 0 or NaN
        s = torch.tensor(s, device="cuda")
        x_q, scale = qflash.quantize(inp, qdtype, "tensor", scale=s)
        ref_q, ref_scale = quantize_ref(inp, qdtype, "tensor", scale=s)
        assert torch.equal(scale.view(torch.int32), ref_scale.view(torch.int32))  # NaN too
        bad = (x_q.view(torch.uint8) != ref_q.view(torch.uint8)).nonzero()
        assert len(bad) == 0, (len(bad), inp[tuple(bad[:4].T)], x_q[tuple(bad[:4].T)], ref_q[tuple(bad[:4].T)])


@pytest.mark.gpu
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_gpu_ties_saturation_and_special_values(qdtype):
    """The cases above through the GPU's conversions (int8: the inline-PTX cvt), which the
    interpreter cannot run."""
    if qdtype == torch.int8:
        test_int8_rounds_half_to_even()
    test_saturation_zero_groups_and_nonfinite(qdtype)
    test_tiny_groups_keep_a_normal_scale(qdtype)


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_gpu_per_tensor_one_launch(x_dtype):
    """The cooperative launch, bit for bit against the reference and the two-launch sweep: a
    tensor held whole (1024 x 4096), one held with a ragged streamed rest (1100 x 1000: 67 parts
    of 16 K and 2252 values), the largest it takes (4096 x 4097 of bfloat16, 2048 x 4097 of
    float32: 132 programs hold 64 K / 32 K values each, about half), and around it the sweep's
    (1 x 1, 63 x 113, twice the largest), with the absmax in the first element, in the last
    program's held part, in the middle and in the last element; a NaN there gives a NaN scale."""
    from qflash.kernels.quantize import TENSOR_BLOCK, TENSOR_HOLD_BYTES, _tensor_plan, quantize as launch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    largest = 4096 if x_dtype == torch.bfloat16 else 2048
    one_launch = {(1100, 1000), (1024, 4096), (largest, 4097)}
    for shape in ((1, 1), (63, 113), (1100, 1000), (1024, 4096), (largest, 4097), (2 * largest, 4097)):
        x = (torch.randn(shape, device="cuda") * 3).to(x_dtype)
        numel = x.numel()
        plan = _tensor_plan(numel, x.element_size(), sms, TENSOR_HOLD_BYTES, TENSOR_BLOCK)
        assert (plan is not None) == (shape in one_launch), shape
        last_held = (plan.grid[0] - 1) * plan.constexprs["HOLD"] + 5 if plan else 0
        for pos in sorted({0, min(last_held, numel - 1), numel // 2 + 7 if numel > 1 else 0, numel - 1}):
            y = x.clone()
            y.view(-1)[pos] = -40.0
            for qdtype in (torch.int8, torch.float8_e4m3fn):
                with poisoned():
                    x_q, scale = launch(y, qdtype, "tensor")
                ref_q, ref_scale = quantize_ref(y, qdtype, "tensor")
                sweep_q, sweep_scale = launch(y, qdtype, "tensor", one_launch=False)
                assert torch.equal(scale, ref_scale) and scale.item() == pytest.approx(40.0 / QMAX[qdtype], rel=1e-6)
                assert same_bits(x_q, ref_q) and same_bits(x_q, sweep_q), (shape, pos)
                assert torch.equal(scale, sweep_scale), (shape, pos)
            y.view(-1)[pos] = math.nan
            assert math.isnan(launch(y, torch.int8, "tensor")[1].item()), (shape, pos)


@pytest.mark.gpu
def test_gpu_per_tensor_one_launch_in_cuda_graph():
    """Captured in a CUDA graph (the cooperative launch and the zeroing of its counters) and replayed
    on new values, whose scale differs each time."""
    x = torch.empty(4096, 4097, device="cuda", dtype=torch.bfloat16)
    x.normal_()
    qflash.quantize(x, torch.float8_e4m3fn, "tensor")  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x_q, scale = qflash.quantize(x, torch.float8_e4m3fn, "tensor")
    for spread in (1.0, 300.0, 0.01):
        x.normal_().mul_(spread)
        graph.replay()
        ref_q, ref_scale = quantize_ref(x, torch.float8_e4m3fn, "tensor")
        assert torch.equal(scale, ref_scale) and same_bits(x_q, ref_q), spread


_REFUSED_COOPERATIVE = """
import warnings, torch, qflash
from qflash.kernels import quantize as kernels
from qflash.reference.quantize import quantize_ref
real = kernels.sm_count
kernels.sm_count = lambda device: 4 * real(device)  # 512 programs of one an SM: more than can be resident
x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    x_q, scale = qflash.quantize(x, torch.float8_e4m3fn, "tensor")
assert any("cooperative" in str(w.message) for w in caught), [str(w.message) for w in caught]
assert x.device in kernels._NOT_COOPERATIVE
ref_q, ref_scale = quantize_ref(x, torch.float8_e4m3fn, "tensor")
assert torch.equal(scale, ref_scale) and torch.equal(x_q.view(torch.uint8), ref_q.view(torch.uint8))
print("fell back")
"""


@pytest.mark.gpu
def test_gpu_per_tensor_refused_cooperative_launch_falls_back():
    """Where the programs cannot all be resident (here the SM count reported 4 x too large, as
    under MPS), the GPU refuses the cooperative launch rather than let them wait at the barrier
    for ever; quantize warns and takes the sweep, with the reference's bits. In a subprocess with
    a time limit, so that a hang fails the test instead of the suite."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _REFUSED_COOPERATIVE], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "fell back" in run.stdout, run.stderr[-3000:]


_COMPILE_CASES = [("tensor", None), ("row", None), ("column", None), ("block", (1, 128)), ("block", (128, 128))]


@pytest.mark.parametrize("granularity,block", _COMPILE_CASES)
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_under_torch_compile(granularity, block, dtype):
    """Under torch.compile (one graph) quantize is the custom op qflash::quantize: the same bits,
    shapes and strides as the eager call (it used to fail inside dynamo, tracing the launcher);
    its fake implementation agrees with the kernel's outputs (opcheck: shapes, strides, dtypes,
    also with dynamic shapes). A ragged 33 x 200 input."""
    import qflash.ops.quantize  # noqa: F401  (registers the op)

    x = torch.randn(33, 200, device=DEVICE)
    step = lambda t: qflash.quantize(t, dtype, granularity, block)  # noqa: E731
    got, want = one_graph(step)(x), step(x)
    for g, w in zip(got, want):
        assert same_bits(g, w) and g.stride() == w.stride() and g.dtype == w.dtype
    torch.library.opcheck(torch.ops.qflash.quantize.default, (x, dtype, granularity, block and list(block), None),
                          test_utils=FAKE_CHECKS)
