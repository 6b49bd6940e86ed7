"""Scaled INT8 / FP8 matmul kernels: INT8 bit-exact, FP8 within float32 rounding of the
product of the dequantized inputs. Quantization error is reported apart from kernel error."""

from functools import partial

import pytest
import torch

import qflash
from qflash.bench.matmul import MATMUL_TILE_GRID, cublas_fp8
from qflash.kernels.matmul import MatmulConfig, scaled_matmul
from qflash.reference.matmul import fp8_matmul_ref, int8_matmul_ref
from qflash.testing import assert_flash_rule, assert_written, poisoned, rel_l2_err, rounding_floor, sqnr_db

from conftest import DEVICE, FAKE_CHECKS, check_chain_eager_and_replayed, one_graph

SHAPES = [(1, 1, 1), (70, 90, 300), (33, 129, 64), (128, 16, 257)]  # (M, N, K), ragged on purpose


def _operands(m, n, k):
    return torch.randn(m, k, device=DEVICE), torch.randn(n, k, device=DEVICE), torch.randn(n, device=DEVICE)


@pytest.mark.parametrize("scales", ["tensor", "row", "mixed"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int8_bit_exact(m, n, k, out_dtype, scales):
    a, b, bias = _operands(m, n, k)
    a_q, a_s = qflash.quantize(a, torch.int8, "tensor" if scales == "tensor" else "row")
    b_q, b_s = qflash.quantize(b, torch.int8, "row" if scales == "row" else "tensor")
    with poisoned():
        c = qflash.int8_matmul(a_q, b_q, a_s, b_s, bias=bias, out_dtype=out_dtype)
    assert c.shape == (m, n) and c.dtype == out_dtype
    assert_written(c)
    assert torch.equal(c, int8_matmul_ref(a_q, b_q, a_s, b_s, bias, out_dtype))


def test_scales_of_every_accepted_shape_go_through_as_they_are():
    """One-element scales of any shape ((), (1,), (1, 1)) and per-row (M,) / (M, 1), float32 or
    not, next to each other: INT8 bit-exact. Float32 scales reach the kernel without a copy."""
    from qflash.ops.matmul import _scale

    m, n, k = 33, 40, 96
    a, b, bias = _operands(m, n, k)
    a_q, a_s = qflash.quantize(a, torch.int8, "row")
    b_q, b_s = qflash.quantize(b, torch.int8, "row")
    one = torch.full((1, 1), 0.01, device=DEVICE)
    for a_scale, b_scale in [(one, b_s.reshape(n)), (a_s.reshape(m, 1), one.reshape(1)), (one.reshape(()), one),
                             (a_s.reshape(m).half(), b_s.reshape(n, 1))]:
        c = qflash.int8_matmul(a_q, b_q, a_scale, b_scale, bias=bias, out_dtype=torch.float32)
        assert torch.equal(c, int8_matmul_ref(a_q, b_q, a_scale.float(), b_scale.float(), bias, torch.float32))
    assert _scale("a_scale", a_s, m, a_s.device) is a_s


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_bias_of_any_floating_dtype_and_strides(dtype):
    """The kernels read the bias as one contiguous row: a strided one (every other value of a
    longer tensor, or a column of a matrix) gives the same bits as its contiguous copy (INT8
    against the reference; FP8 against the same call), and is left as it was."""
    m, n, k = 33, 40, 96
    a, b, _ = _operands(m, n, k)
    a_q, a_s = qflash.quantize(a, torch.int8, "row")
    b_q, b_s = qflash.quantize(b, torch.int8, "row")
    f_a, f_as = qflash.quantize(a, torch.float8_e4m3fn, "row")
    f_b, f_bs = qflash.quantize(b, torch.float8_e4m3fn, "row")
    strided = (torch.randn(2 * n, device=DEVICE, dtype=dtype)[::2], torch.randn(n, 3, device=DEVICE, dtype=dtype)[:, 1])
    for bias in strided:
        kept = bias.clone()
        with poisoned():
            c = qflash.int8_matmul(a_q, b_q, a_s, b_s, bias=bias, out_dtype=torch.float32)
        assert torch.equal(c, int8_matmul_ref(a_q, b_q, a_s, b_s, bias.contiguous(), torch.float32))
        c = qflash.fp8_matmul(f_a, f_b, f_as, f_bs, bias=bias, out_dtype=torch.float32)
        assert torch.equal(c, qflash.fp8_matmul(f_a, f_b, f_as, f_bs, bias=bias.contiguous(), out_dtype=torch.float32))
        assert torch.equal(bias, kept) and bias.stride() != (1,)


@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("scales", ["tensor", "row", "block"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_fp8_within_fp32_rounding(m, n, k, scales, qdtype):
    a, b, bias = _operands(m, n, k)
    blocks = {"tensor": (None, None), "row": (None, None), "block": ((1, 128), (128, 128))}[scales]
    a_q, a_s = qflash.quantize(a, qdtype, "block" if scales == "block" else scales, blocks[0])
    b_q, b_s = qflash.quantize(b, qdtype, "block" if scales == "block" else scales, blocks[1])
    with poisoned():
        c = qflash.fp8_matmul(a_q, b_q, a_s, b_s, bias=bias, out_dtype=torch.float32)
    assert_written(c)
    ref = fp8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.float64)
    # float32 accumulation over K terms: error ~ sqrt(K) * 2^-24 relative; allow a wide margin.
    assert rel_l2_err(c, ref) < 1e-5 * max(1.0, k ** 0.5)


CPU_TILES = [MatmulConfig(32, 32, 32, 4, 1, use_tma=True), MatmulConfig(16, 64, 128, 4, 1, group_m=2, use_tma=True),
             MatmulConfig(64, 16, 128, 4, 1, group_m=1), MatmulConfig(32, 32, 32, 4, 1, split_k=3),
             MatmulConfig(16, 64, 128, 4, 1, split_k=2, use_tma=True), MatmulConfig(32, 32, 32, 4, 1, warp_specialize=True),
             MatmulConfig(32, 32, 32, 4, 1, promote_in_dot=True), MatmulConfig(16, 64, 128, 4, 1, swap_ab=True),
             MatmulConfig(16, 32, 128, 4, 1, split_k=3, swap_ab=True, use_tma=True)]


# The H200's search grid is gpu-marked: `pytest -m gpu` on the H200 runs every candidate.
GPU_TILES = [pytest.param(MatmulConfig(*t), marks=pytest.mark.gpu) for t in MATMUL_TILE_GRID]


@pytest.mark.parametrize("cfg", CPU_TILES + GPU_TILES, ids=str)
@pytest.mark.parametrize("m,n,k", [(70, 90, 256), (33, 129, 272), (129, 256, 384)])
def test_every_tile_path_is_exact(m, n, k, cfg):
    """Descriptor and pointer loads, any tile shape, split-K, warp specialization: INT8 stays
    bit-exact, FP8 per-row and block-scaled FP8 (where the tile fits the 128-wide scale
    blocks) within fp32 rounding."""
    a, b, bias = _operands(m, n, k)
    a_q, a_s = qflash.quantize(a, torch.int8, "row")
    b_q, b_s = qflash.quantize(b, torch.int8, "row")
    if cfg.warp_specialize or cfg.promote_in_dot:  # refused for INT8 (FP8-only options)
        with pytest.raises(ValueError, match="warp_specialize|promote_in_dot"):
            scaled_matmul(a_q, b_q, a_s, b_s, bias, torch.float32, "row", config=cfg)
    else:
        with poisoned():
            c = scaled_matmul(a_q, b_q, a_s, b_s, bias, torch.float32, "row", config=cfg)
        assert_written(c)
        assert torch.equal(c, int8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.float32))
    a_q, a_s = qflash.quantize(a, torch.float8_e4m3fn, "row")
    b_q, b_s = qflash.quantize(b, torch.float8_e4m3fn, "row")
    if cfg.warp_specialize and cfg.num_warps < 8:  # refused for FP8 too (rows left unwritten)
        with pytest.raises(ValueError, match="warp_specialize"):
            scaled_matmul(a_q, b_q, a_s, b_s, bias, torch.float32, "row", config=cfg)
        return
    with poisoned():
        c = scaled_matmul(a_q, b_q, a_s, b_s, bias, torch.float32, "row", config=cfg)
    assert_written(c)
    assert rel_l2_err(c, fp8_matmul_ref(a_q, b_q, a_s, b_s, bias, torch.float64)) < 1e-5 * k ** 0.5
    if cfg.block_k == 128 and 128 % cfg.block_n == 0:
        a_q, a_s = qflash.quantize(a, torch.float8_e4m3fn, "block", (1, 128))
        b_q, b_s = qflash.quantize(b, torch.float8_e4m3fn, "block", (128, 128))
        if cfg.promote_in_dot:  # block scales multiply each K block's sum: no room for it
            with pytest.raises(ValueError, match="promote_in_dot"):
                scaled_matmul(a_q, b_q, a_s, b_s, None, torch.float32, "block", config=cfg)
            return
        with poisoned():
            c = scaled_matmul(a_q, b_q, a_s, b_s, None, torch.float32, "block", config=cfg)
        assert rel_l2_err(c, fp8_matmul_ref(a_q, b_q, a_s, b_s, None, torch.float64)) < 1e-5 * k ** 0.5


def test_quantization_error_is_reported_apart_from_kernel_error():
    """On Gaussian inputs: per-row INT8 reaches the 30 dB bar; block FP8 DeepGEMM-style diff < 1e-3."""
    a, b, _ = _operands(64, 256, 512)
    exact = (a.double() @ b.double().T)
    a_q, a_s = qflash.quantize(a, torch.int8, "row")
    b_q, b_s = qflash.quantize(b, torch.int8, "row")
    c8 = qflash.int8_matmul(a_q, b_q, a_s, b_s, out_dtype=torch.float32)
    kernel_err = rel_l2_err(c8, int8_matmul_ref(a_q, b_q, a_s, b_s, None, torch.float32))
    assert kernel_err == 0.0 and sqnr_db(c8, exact) > 30.0
    a_q, a_s = qflash.quantize(a, torch.float8_e4m3fn, "block", (1, 128))
    b_q, b_s = qflash.quantize(b, torch.float8_e4m3fn, "block", (128, 128))
    cf = qflash.fp8_matmul(a_q, b_q, a_s, b_s, out_dtype=torch.float32).double()
    diff = 1 - 2 * (cf * exact).sum() / ((cf * cf).sum() + (exact * exact).sum())  # DeepGEMM's calc_diff
    assert float(diff) < 1e-3


def test_bad_inputs():
    a_q = torch.zeros(8, 32, dtype=torch.int8, device=DEVICE) + 1
    b_q = torch.zeros(4, 32, dtype=torch.int8, device=DEVICE) + 1
    one = torch.ones((), device=DEVICE)
    f8 = a_q.float().to(torch.float8_e4m3fn)
    cases = [
        (lambda: qflash.int8_matmul(a_q.float(), b_q, one, one), TypeError, "a_q must be torch.int8"),
        (lambda: qflash.int8_matmul(a_q, b_q[:, :16], one, one), ValueError, "disagree on K"),
        (lambda: qflash.int8_matmul(a_q, b_q, torch.ones(3, device=DEVICE), one), ValueError, "a_scale must have"),
        (lambda: qflash.int8_matmul(a_q, b_q, one, one, bias=torch.ones(5, device=DEVICE)), ValueError, "bias"),
        (lambda: qflash.int8_matmul(a_q, b_q, one, one, bias=torch.ones(4, device=DEVICE, dtype=torch.int32)),
         TypeError, "bias must be a floating-point tensor, got torch.int32"),
        (lambda: qflash.int8_matmul(a_q, b_q, one, one, out_dtype=torch.int32), TypeError, "out_dtype"),
        (lambda: qflash.int8_matmul(a_q[0], b_q, one, one), ValueError, "a_q must have 2 dimensions"),
        (lambda: qflash.fp8_matmul(f8, b_q, one, one), TypeError, "b_q must be torch.float8_e4m3fn"),
        (lambda: qflash.fp8_matmul(f8, b_q.float().to(torch.float8_e5m2), one, one), TypeError, "must match"),
        (lambda: qflash.fp8_matmul(a_q, b_q, one, one), TypeError, "float8"),
        (lambda: qflash.fp8_matmul(f8.repeat(1, 5), torch.ones(256, 160, device=DEVICE).to(torch.float8_e4m3fn),
                                   torch.ones(8, 3, device=DEVICE), torch.ones(2, 2, device=DEVICE)),
         ValueError, "a_scale must be"),
        # A's scales are block scales (K in two blocks): the error names B's, which are not
        (lambda: qflash.fp8_matmul(f8.repeat(1, 5), torch.ones(256, 160, device=DEVICE).to(torch.float8_e4m3fn),
                                   torch.ones(8, 2, device=DEVICE), torch.ones(2, 1, device=DEVICE)),
         ValueError, r"b_scale must be \(ceil\(N/128\), ceil\(K/128\)\) = \(2, 2\), got \(2, 1\)"),
        (lambda: qflash.fp8_matmul(f8.repeat(1, 5), torch.ones(256, 160, device=DEVICE).to(torch.float8_e4m3fn),
                                   torch.ones(8, 2, device=DEVICE), torch.ones(2, 2, device=DEVICE, dtype=torch.int32)),
         TypeError, "b_scale must be a floating-point tensor, got torch.int32"),
        (lambda: qflash.int8_matmul(a_q, b_q.to("meta"), one, one), ValueError, "b_q is on meta but a_q is on"),
        (lambda: qflash.int8_matmul(a_q, b_q, one, one, bias=torch.ones(4, device="meta")), ValueError,
         "bias is on meta, expected"),
        (lambda: qflash.int8_matmul(a_q, b_q, one, one.to("meta")), ValueError, "b_scale is on meta, expected"),
        # K past what int32 sums hold whatever the values (131071 * 128^2 < 2^31 <= 131072 * 128^2)
        (lambda: qflash.int8_matmul(*(torch.ones(2, 131072, dtype=torch.int8, device=DEVICE),) * 2, one, one),
         ValueError, "K = 131072 is over 131071"),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()


@pytest.mark.parametrize("n,k", [(1, 256), (1, 384), (129, 128), (2, 128)])
def test_fp8_block_scales_of_one_block_row_or_column(n, k):
    """Block scales whose shape could read as per-row ones: B of one row (its scales (1, K / 128),
    once refused as per-row ones of the wrong shape), one 128-wide K block (the per-row reading is
    the same product), and (ceil(N / 128), 1) scales of B (blocks, as N differs). Close: float32
    rounding over K, or on a GPU a K block's sum inside the tensor cores (about 14 bits: 1.5e-4 at
    K = 128 on the H200, s38e); scales read the wrong way would be off by 1e-2 or more."""
    a, b, _ = _operands(3, n, k)
    a_q, a_s = qflash.quantize(a, torch.float8_e4m3fn, "block", (1, 128))
    b_q, b_s = qflash.quantize(b, torch.float8_e4m3fn, "block", (128, 128))
    with poisoned():
        c = qflash.fp8_matmul(a_q, b_q, a_s, b_s, out_dtype=torch.float32)
    assert_written(c)
    assert rel_l2_err(c, fp8_matmul_ref(a_q, b_q, a_s, b_s, None, torch.float64)) < max(1e-5 * k ** 0.5, 2 ** -12)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(16, 4096, 4096), (1024, 6144, 4096), (8192, 8192, 1024)])
def test_gpu_int8_bit_exact_bf16_and_fp8_block(m, n, k):
    a, b, bias = (t.cuda() for t in (torch.randn(m, k), torch.randn(n, k), torch.randn(n)))
    a_q, a_s = qflash.quantize(a.bfloat16(), torch.int8, "row")
    b_q, b_s = qflash.quantize(b.bfloat16(), torch.int8, "row")
    c = qflash.int8_matmul(a_q, b_q, a_s, b_s, bias=bias)  # bf16 out: the GPU's conversion rounds to nearest even
    ref = int8_matmul_ref(a_q.cpu(), b_q.cpu(), a_s.cpu(), b_s.cpu(), bias.cpu(), torch.bfloat16)
    differ = c.cpu() != ref
    assert not differ.any(), f"{int(differ.sum())} of {c.numel()} differ, e.g. {c.cpu()[differ][:4]} vs {ref[differ][:4]}"
    a_q, a_s = qflash.quantize(a, torch.float8_e4m3fn, "block", (1, 128))
    b_q, b_s = qflash.quantize(b, torch.float8_e4m3fn, "block", (128, 128))
    c = qflash.fp8_matmul(a_q, b_q, a_s, b_s, out_dtype=torch.float32)
    err = rel_l2_err(c, fp8_matmul_ref(a_q, b_q, a_s, b_s, None, torch.float64))
    assert err < 1e-5 * k ** 0.5, f"fp8 block: rel err {err}, scales finite: {bool(a_s.isfinite().all())}"


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(96, 1024, 2048), (8, 4096, 4096), (128, 4096, 4096), (1024, 4096, 8192)])
@pytest.mark.parametrize("scales", ["tensor", "row"])
def test_gpu_fp8_as_accurate_as_cublas(m, n, k, scales):
    """The accuracy rule against cuBLAS in the same precision: inside a 128-wide K block Hopper's
    tensor cores keep about 14 bits of an FP8 sum, for both. Error against the float64 product
    of the dequantized inputs <= 2 x ``torch._scaled_mm``'s (float32 sums between its blocks,
    no fast accumulation) + float32 rounding; row scales with bfloat16 out (cuBLAS's only one)."""
    a, b = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
    a_q, a_s = qflash.quantize(a, torch.float8_e4m3fn, scales)
    b_q, b_s = qflash.quantize(b, torch.float8_e4m3fn, scales)
    out_dtype = torch.float32 if scales == "tensor" else torch.bfloat16
    c = qflash.fp8_matmul(a_q, b_q, a_s, b_s, out_dtype=out_dtype)
    cublas = cublas_fp8(a_q, b_q, a_s, b_s, out_dtype)()
    ref = fp8_matmul_ref(a_q, b_q, a_s, b_s, None, torch.float64)
    assert_flash_rule(c, ref, cublas, floor=rounding_floor(ref, out_dtype), what=f"fp8 {scales}")


@pytest.mark.parametrize("int8", [True, False])
def test_split_k_reduce_with_padded_runs(int8):
    """The split-K sum as the Gluon kernel leaves it: runs ``split_stride`` elements apart with
    padding rows between them (which must not leak in), added in a fixed order, then row scales
    and bias; INT8 exactly, as the reference rounds."""
    from qflash.kernels.matmul_epilogue import SCALES_ROW, reduce_split_k

    m, n, m_pad, split = 5, 24, 8, 3
    g = torch.Generator().manual_seed(0)
    if int8:
        partial = torch.randint(-2**20, 2**20, (split * m_pad, n), generator=g, dtype=torch.int32)
    else:
        partial = torch.randn(split * m_pad, n, generator=g)
    for s in range(split):  # padding rows: garbage that must not reach C
        partial[s * m_pad + m:(s + 1) * m_pad] = 10**6
    partial = partial.to(DEVICE)
    a_s, b_s = torch.rand(m, 1, device=DEVICE) + 0.5, torch.rand(n, 1, device=DEVICE) + 0.5
    bias = torch.randn(n, device=DEVICE)
    with poisoned():
        c = torch.full((m, n), float("nan"), device=DEVICE)
        reduce_split_k(partial, c, a_s, b_s, bias, m_pad * n, SCALES_ROW.value, exact=int8)
    runs = partial.view(split, m_pad, n)[:, :m]
    total = runs[0] + runs[1] + runs[2]
    expect = (total.float() * a_s * b_s.T + bias) if int8 else (total * a_s * b_s.T + bias)
    if int8:
        assert torch.equal(c, expect)
    else:
        assert rel_l2_err(c, expect) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("use_tma", [False, True])
@pytest.mark.parametrize("m", [1, 16, 63])
def test_gpu_decode_split_k_counts_reset(m, use_tma):
    """Decode-sized M takes K split into runs that the last run of each tile adds up (INT8: the
    transposed product; FP8 from 33 rows: 64-row tiles): exact INT8 results launch after launch
    with fresh inputs (the arrival counts go back to zero), on the default stream and on another
    one, and FP8 within float32 rounding; with pointer loads and with tensor descriptors (the
    public functions take the default; on Hopper their FP8 product at M = 63 is the Gluon kernel's)."""
    from dataclasses import replace

    from qflash.kernels.matmul import default_config
    from qflash.kernels.matmul_epilogue import _COUNTERS

    n, k = 4096, 4096
    cfg = default_config(m, n, k, "row", True, torch.device("cuda"))
    assert cfg.swap_ab and cfg.split_k > 1, cfg
    if cfg.use_tma != use_tma:
        cfg = replace(cfg, use_tma=use_tma)
        int8_mm = partial(scaled_matmul, out_dtype=torch.float32, scales="row", config=cfg)
        fp8_mm = partial(scaled_matmul, out_dtype=torch.float32, scales="tensor", config=cfg)
    else:
        int8_mm = partial(qflash.int8_matmul, out_dtype=torch.float32)
        fp8_mm = partial(qflash.fp8_matmul, out_dtype=torch.float32)
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side, side):
        with torch.cuda.stream(stream):
            a, b, bias = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda"), torch.randn(n, device="cuda")
            a_q, a_s = qflash.quantize(a, torch.int8, "row")
            b_q, b_s = qflash.quantize(b, torch.int8, "row")
            with poisoned():
                c = int8_mm(a_q, b_q, a_s.reshape(m, 1), b_s.reshape(n, 1), bias=bias)
            cpu = [t.cpu() for t in (a_q, b_q, a_s, b_s, bias)]
            assert torch.equal(c.cpu(), int8_matmul_ref(*cpu, torch.float32))
            a_q, a_s = qflash.quantize(a, torch.float8_e4m3fn, "tensor")
            b_q, b_s = qflash.quantize(b, torch.float8_e4m3fn, "tensor")
            with poisoned():
                c = fp8_mm(a_q, b_q, a_s, b_s, bias=bias)
            cpu = [t.cpu() for t in (a_q, b_q, a_s, b_s, bias)]
            assert rel_l2_err(c.cpu(), fp8_matmul_ref(*cpu, torch.float64)) < 1e-5 * k ** 0.5
        stream.synchronize()
    assert all(int(t.count_nonzero()) == 0 for t in _COUNTERS.values())


def test_small_m_default_tiles(monkeypatch):
    """The H200's table for few rows of FP8: the transposed product up to 32 rows, 64-row tiles
    with K in two runs up to 64 (128-wide without a split where the tiles make two waves); INT8
    keeps the transposed product up to 64 rows."""
    from qflash.kernels import matmul as mm

    monkeypatch.setattr(mm, "has_tma", lambda device: True)
    monkeypatch.setattr(mm, "sm_count", lambda device: 132)
    cfg = lambda m, n: mm.default_config.__wrapped__(m, n, 4096, "tensor", False, torch.device("cuda"))  # noqa: E731
    assert cfg(16, 4096).swap_ab and cfg(32, 4096).swap_ab and cfg(16, 4096).split_k > 1
    assert not cfg(33, 4096).swap_ab and (cfg(64, 4096).block_m, cfg(64, 4096).split_k) == (64, 2)
    assert (cfg(64, 28672).block_n, cfg(64, 28672).split_k) == (128, 1)
    assert mm.default_config.__wrapped__(64, 4096, 4096, "row", True, torch.device("cuda")).swap_ab


def test_small_m_block_scales_tiles(monkeypatch):
    """Decode-sized block-scaled products take tensor descriptors and 4 ring slots, or 3 where only
    that keeps every program resident at once: 448 programs of 16 x 128 (70B gate_up) fit 4 an SM
    with 3 slots (54 KB), one round, and 3 an SM with 4 (72 KB), two rounds; 32-row ones take two
    rounds either way (3 or 2 an SM), and 224 programs (8B gate_up) one round either way."""
    from qflash.kernels import matmul as mm

    monkeypatch.setattr(mm, "has_tma", lambda device: True)
    monkeypatch.setattr(mm, "sm_count", lambda device: 132)

    def cfg(m, n, k):
        return mm.default_config.__wrapped__(m, n, k, "block", False, torch.device("cuda"))

    assert all(cfg(m, 8192, 8192).use_tma and cfg(m, 8192, 8192).num_stages == 4 for m in (1, 16, 32))
    assert (cfg(16, 57344, 8192).block_n, cfg(16, 57344, 8192).num_stages) == (128, 3)
    assert (cfg(32, 57344, 8192).block_n, cfg(32, 57344, 8192).num_stages) == (128, 4)
    assert (cfg(16, 28672, 4096).block_n, cfg(16, 28672, 4096).num_stages) == (128, 4)
    assert not mm.default_config.__wrapped__(16, 8192, 8192, "tensor", False, torch.device("cuda")).use_tma


@pytest.mark.gpu
def test_gpu_decode_split_k_in_a_cuda_graph():
    """The split-K counts are made (and zeroed) during capture when the graph's stream has none yet;
    replays with new inputs stay exact."""
    m, n, k = 16, 4096, 4096
    a, b = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
    a_q, a_s = qflash.quantize(a, torch.int8, "row")
    b_q, b_s = qflash.quantize(b, torch.int8, "row")
    qflash.int8_matmul(a_q, b_q, a_s, b_s, out_dtype=torch.float32)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c = qflash.int8_matmul(a_q, b_q, a_s, b_s, out_dtype=torch.float32)
    for _ in range(2):
        fresh_q, fresh_s = qflash.quantize(torch.randn(m, k, device="cuda"), torch.int8, "row")
        a_q.copy_(fresh_q)
        a_s.copy_(fresh_s)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(c.cpu(), int8_matmul_ref(a_q.cpu(), b_q.cpu(), a_s.cpu(), b_s.cpu(), None, torch.float32))


@pytest.mark.parametrize("scales", ["tensor", "block"])
def test_decode_kernel_launched_early_build(scales):
    """As a programmatic dependent launch (``common.PDL``) the kernel built for sm_90 waits for the
    kernel ahead once and lets the next one launch once; otherwise it does neither. (Built, not
    interpreted: the interpreter lets through what the compiler refuses, such as a global that is
    not a constexpr.)"""
    from conftest import sm90_build

    for pdl in (False, True):
        ptx = sm90_build("qflash.kernels.matmul", pdl=pdl, scales=scales)["ptx"]
        assert ptx.count("griddepcontrol.wait;") == ptx.count("griddepcontrol.launch_dependents;") == int(pdl)


@pytest.mark.parametrize("switch,m,hopper,want", [(False, 16, True, False), (True, 16, True, True),
                                                  (True, 128, True, True), (True, 129, True, False),
                                                  (True, 16, False, False)])
def test_launch_asks_for_early_launch_where_opted_in(monkeypatch, switch, m, hopper, want):
    """The kernel is a programmatic dependent launch where ``common.PDL`` opts in, on Hopper, for
    products of up to ``common.PDL_MAX_M`` rows; the kernel launch is recorded here, not run."""
    from qflash.kernels import common, matmul as mm

    seen = {}

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.update(kwargs)

    monkeypatch.setattr(mm, "_launcher", Recorder())
    monkeypatch.setattr(common, "has_tma", lambda device: hopper)
    monkeypatch.setattr(common, "PDL", switch)
    a_q, b_q, one = torch.zeros(m, 256, dtype=torch.int8), torch.zeros(64, 256, dtype=torch.int8), torch.ones(())
    scaled_matmul(a_q, b_q, one, one, None, torch.float32, "tensor", config=MatmulConfig(32, 32, 128, 4, 1))
    assert seen["launch_pdl"] is want and seen["PDL"] is want


@pytest.mark.gpu
def test_gpu_chained_launches_wait_for_the_kernel_ahead(monkeypatch):
    """Programmatic dependent launch (``common.PDL``) of the decode-sized products, back to back,
    each reading what the one before wrote: a long Gluon product of 16 rows on 16 CTAs (most SMs
    free; it lets the next kernel launch once its last load is issued, while it still computes)
    whose C (bfloat16) is this kernel's INT8 A (K in runs: the arrival counts), a (1, 128)
    quantize of that C, and this kernel's block-scaled FP8 product of what it wrote. Each starts
    while the one ahead still runs and must wait for it before it loads: C of the first starts
    poisoned, so a load that came too early reads NaN bytes. Eagerly (where the host's launches
    leave the kernels apart) and replayed from a CUDA graph on fresh inputs (where they overlap);
    bit for bit against the references (the FP8 product: the same launch without PDL)."""
    from qflash.kernels import common, matmul as mm, matmul_gluon
    from qflash.reference.quantize import quantize_ref

    monkeypatch.setattr(common, "PDL", True)
    m, n, k, n2 = 16, 2048, 8192, 384
    a_q, a_s = qflash.quantize(torch.randn(m, k, device="cuda"), torch.int8, "tensor")
    b_q, b_s = qflash.quantize(torch.randn(n, k, device="cuda"), torch.int8, "tensor")
    b2, _ = qflash.quantize(torch.randn(n2, 2 * n, device="cuda"), torch.int8, "tensor")
    b3, b3_s = qflash.quantize(torch.randn(n2, n, device="cuda"), torch.float8_e4m3fn, "block", (128, 128))
    one = torch.ones((), device="cuda")
    assert mm.default_config(m, n2, 2 * n, "tensor", True, a_q.device).split_k > 1  # the second's K in runs

    def chain():
        with poisoned():
            c1 = matmul_gluon.launch(a_q, b_q, a_s, b_s, None, torch.bfloat16, "tensor", block_n=128, pdl=True)
        c2 = scaled_matmul(c1.view(torch.int8), b2, one, one, None, torch.float32, "tensor")
        x_q, x_s = qflash.quantize(c1, torch.float8_e4m3fn, "block", (1, 128))
        c3 = scaled_matmul(x_q, b3, x_s, b3_s, None, torch.float32, "block")
        return c1, c2, x_q, x_s, c3

    def check(c1, c2, x_q, x_s, c3):
        assert_written(c1)
        assert torch.equal(c1, int8_matmul_ref(a_q, b_q, a_s, b_s, None, torch.bfloat16))
        assert torch.equal(c2, int8_matmul_ref(c1.view(torch.int8), b2, one, one, None, torch.float32))
        want_q, want_s = quantize_ref(c1, torch.float8_e4m3fn, "block", (1, 128))
        assert torch.equal(x_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(x_s, want_s)
        with common.early_launch(False):
            assert torch.equal(c3, scaled_matmul(want_q, b3, want_s, b3_s, None, torch.float32, "block"))

    def refresh():
        fresh_q, fresh_s = qflash.quantize(torch.randn(m, k, device="cuda"), torch.int8, "tensor")
        a_q.copy_(fresh_q)
        a_s.copy_(fresh_s)

    check_chain_eager_and_replayed(chain, check, refresh)


@pytest.mark.parametrize("kind", ["int8 row", "fp8 tensor", "fp8 block"])
def test_under_torch_compile(kind):
    """Under torch.compile (one graph) the products are the custom op qflash::scaled_matmul: the
    same bits as the eager call (it used to fail inside dynamo); the fake output agrees with the
    kernel's (opcheck, also with dynamic shapes). Ragged 33 x 70 x 200, with a bias."""
    import qflash.ops.matmul  # noqa: F401  (registers the op)

    dtype, granularity = kind.split()
    qdtype = torch.int8 if dtype == "int8" else torch.float8_e4m3fn
    a, b = torch.randn(33, 200, device=DEVICE), torch.randn(70, 200, device=DEVICE)
    a_q, a_s = qflash.quantize(a, qdtype, granularity, (1, 128) if granularity == "block" else None)
    b_q, b_s = qflash.quantize(b, qdtype, granularity, (128, 128) if granularity == "block" else None)
    bias = torch.randn(70, device=DEVICE)
    op = qflash.int8_matmul if dtype == "int8" else qflash.fp8_matmul
    step = lambda *t: op(*t, bias=bias)  # noqa: E731
    got = one_graph(step)(a_q, b_q, a_s, b_s)
    assert torch.equal(got, step(a_q, b_q, a_s, b_s))
    torch.library.opcheck(torch.ops.qflash.scaled_matmul.default,
                          (a_q, b_q, a_s.float(), b_s.float(), bias, torch.bfloat16, granularity),
                          test_utils=FAKE_CHECKS)
