"""FlashAttention backward: gradients against float64 references (flash-attn's rule, factor 3).

Runs the real Triton kernels in the interpreter on a CPU (fp16, fp32, fp64) and the
``gpu``-marked sweep on the H200 (fp16, bf16).
"""

import dataclasses

import pytest
import torch

import qflash
from qflash.kernels import attention as attention_kernels
from qflash.reference import attention_ref, attention_varlen_ref, sdpa_ref
from qflash.testing import (FINITE_POISON, GRADIENT_FACTOR, assert_flash_rule, assert_written, attention_sinks,
                            poisoned)

from conftest import DEVICE, one_graph, ptxas_report, sm90_build

gpu = pytest.mark.gpu


def _leaves(*shapes, dtype, device=DEVICE, scale=1.0):
    return [(torch.randn(s, device=device) * scale).to(dtype).requires_grad_() for s in shapes]


def _grads(fn, inputs, dout):
    out = fn(*inputs)
    return torch.autograd.grad(out, inputs, dout)


def check_grads(fn, ref_fn, inputs, *, out_shape_from=0, names=("q", "k", "v", "attn_mask"), floors=None):
    """Kernel grads vs fp64 reference grads, with PyTorch's same-precision grads as the yardstick.
    ``floors``: input name -> a function of the reference gradient giving that gradient's floor."""
    dtype = inputs[0].dtype
    with torch.no_grad():
        out = fn(*inputs)
    dout = torch.randn(out.shape, device=out.device).to(dtype)
    with poisoned():
        got = _grads(fn, inputs, dout)
    for g in got:
        assert_written(g, "gradient")
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    ref = _grads(lambda *a: ref_fn(*a, upcast=True), ref_inputs, dout.double())
    pt_inputs = [t.detach().clone().requires_grad_() for t in inputs]
    pt = _grads(lambda *a: ref_fn(*a, upcast=False), pt_inputs, dout)
    for name, g, r, p, t in zip(names, got, ref, pt, inputs):
        assert g.shape == r.shape and g.dtype == t.dtype
        # In float64, PyTorch's "same precision" gradients are the reference itself (error 0), so
        # the bound is the rounding of sums as long as the longest axis: 64 sqrt(n) steps of max |ref|
        # (1e-13 relative; a real bug, such as an lse rounded to float32, is off by 1e-8).
        longest = max(max(t.shape) for t in inputs)
        floor = (64 * torch.finfo(dtype).eps * longest ** 0.5 * float(r.abs().max())
                 if dtype == torch.float64 else None)
        if floors and name in floors:
            floor = floors[name](r)
        assert_flash_rule(g, r, p, factor=GRADIENT_FACTOR, floor=floor, what=f"d{name}")


def check_flash_grads(b, sq, sk, h, hkv, d, dtype=torch.float16, scale=1.0, **kw):
    inputs = _leaves((b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d), dtype=dtype, scale=scale)
    check_grads(lambda q, k, v: qflash.flash_attn_func(q, k, v, **kw),
                lambda q, k, v, upcast: attention_ref(q, k, v, upcast=upcast, reorder_ops=not upcast, **kw)[0],
                inputs)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,d", [(1, 1, 32), (113, 203, 80), (239, 1, 64), (128, 217, 128), (799, 3, 32),
                                     (64, 128, 64), (63, 63, 40)])
def test_shapes(sq, sk, d, causal):
    check_flash_grads(1, sq, sk, 2, 1, d, causal=causal)


@pytest.mark.parametrize("hkv", [6, 2, 1])
def test_gqa_sums_over_the_group(hkv):
    check_flash_grads(2, 37, 51, 6, hkv, 32, causal=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dtypes(dtype):
    check_flash_grads(2, 45, 70, 2, 2, 32, dtype=dtype, causal=True)


@pytest.mark.parametrize("window", [(0, 0), (7, 3), (20, -1), (-1, 5)])
@pytest.mark.parametrize("sq,sk", [(50, 50), (33, 90), (90, 33)])
def test_sliding_window(window, sq, sk):
    check_flash_grads(1, sq, sk, 2, 2, 32, window_size=window)


def test_softcap_and_alibi():
    check_flash_grads(1, 40, 57, 2, 2, 32, scale=3.0, softcap=4.0, causal=True)
    check_flash_grads(2, 30, 45, 4, 2, 32, alibi_slopes=torch.rand(2, 4, device=DEVICE) * 0.5)


def test_large_logits_and_empty_rows_stay_finite():
    # Rows 0..39 of a 60 x 20 bottom-right causal mask see no key: gradients 0 there, never NaN.
    check_flash_grads(1, 60, 20, 2, 2, 32, causal=True, scale=7.0)


def check_varlen_grads(cu_q, cu_k, max_q, max_k, inputs):
    """check_grads of causal flash_attn_varlen_func against attention_varlen_ref."""
    check_grads(
        lambda q, k, v: qflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True),
        lambda q, k, v, upcast: attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, upcast=upcast,
                                                     reorder_ops=not upcast)[0],
        inputs,
    )


def test_varlen():
    lens_q, lens_k = [1, 63, 0, 40, 17], [5, 63, 9, 11, 30]
    cu_q = torch.tensor([0, 1, 64, 64, 104, 121], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 5, 68, 77, 88, 118], dtype=torch.int32, device=DEVICE)
    inputs = _leaves((sum(lens_q), 4, 32), (sum(lens_k), 2, 32), (sum(lens_k), 2, 32), dtype=torch.float16)
    check_varlen_grads(cu_q, cu_k, 63, 63, inputs)


def test_varlen_padding_rows_get_zero_gradients():
    """Query rows after the last sequence (9) and key rows after the last one (4), the padding of
    fixed-size buffers: no part in any output, so gradients 0 there, never what the (poisoned)
    buffers held."""
    cu_q = torch.tensor([0, 1, 64, 104], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 5, 68, 79], dtype=torch.int32, device=DEVICE)
    inputs = _leaves((113, 4, 32), (83, 2, 32), (83, 2, 32), dtype=torch.float16)
    check_varlen_grads(cu_q, cu_k, 63, 63, inputs)


@gpu
def test_gpu_varlen_padding_bf16():
    """The padding fill compiled on the H200: 5000 query rows and 3000 key rows after the last
    sequences (each fill program takes several steps), bf16, D = 128, grouped heads."""
    cu_q = torch.tensor([0, 1, 700, 3700], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 2000, 2700, 5700], dtype=torch.int32, device="cuda")
    inputs = _leaves((8700, 8, 128), (8700, 2, 128), (8700, 2, 128), dtype=torch.bfloat16, device="cuda")
    check_varlen_grads(cu_q, cu_k, 3000, 3000, inputs)
    with poisoned():
        out, lse, _ = qflash.flash_attn_varlen_func(*inputs, cu_q, cu_k, 3000, 3000, causal=True,
                                                    return_attn_probs=True)
    assert torch.equal(out[3700:], torch.zeros_like(out[3700:])) and torch.isposinf(lse[:, 3700:]).all()


def _varlen_grads(cu_q, cu_k, max_q, max_k, inputs, dout):
    with poisoned(FINITE_POISON):
        out = qflash.flash_attn_varlen_func(*inputs, cu_q, cu_k, max_q, max_k, causal=True)
        return torch.autograd.grad(out, inputs, dout)


def test_varlen_bad_cu_seqlens_and_short_max_seqlen_give_nan_gradients():
    """The backward's side of test_attention's bad-contents tests: a sequence past the packed
    rows gets NaN gradients and the others the gradients of good contents; a max_seqlen_k under
    the longest sequence would leave keys to no dK/dV program, and that sequence's dK and dV come
    out NaN (dQ, whose grid max_seqlen_q sizes, stays right)."""
    cu = torch.tensor([0, 5, 305, 312], dtype=torch.int32, device=DEVICE)  # 5, 300 and 7 rows
    inputs = _leaves((312, 2, 32), (312, 2, 32), (312, 2, 32), dtype=torch.float16)
    dout = torch.randn(312, 2, 32, device=DEVICE).to(torch.float16)
    want = _varlen_grads(cu, cu, 300, 300, inputs, dout)

    past = torch.tensor([0, 5, 305, 320], dtype=torch.int32, device=DEVICE)  # the last ends past the rows
    for got, w in zip(_varlen_grads(past, past, 300, 300, inputs, dout), want):
        assert got[305:].isnan().all() and torch.equal(got[:305], w[:305])

    got_dq, got_dk, got_dv = _varlen_grads(cu, cu, 300, 1, inputs, dout)
    assert attention_kernels.default_bwd_configs(32, torch.float16, inputs[0].device)[1].block_n < 300
    left = torch.zeros(312, dtype=torch.bool)
    left[5:305] = True  # the second sequence, longer than the grid of one key block
    assert torch.equal(got_dq, want[0])
    for got, w in ((got_dk, want[1]), (got_dv, want[2])):
        assert got[left].isnan().all() and torch.equal(got[~left], w[~left])


@pytest.mark.parametrize("mask", ["causal", "bool", "float"])
def test_sdpa(mask):
    inputs = _leaves((2, 3, 29, 32), (2, 3, 45, 32), (2, 3, 45, 32), dtype=torch.float16)
    kw = {"is_causal": True} if mask == "causal" else {}
    if mask == "bool":
        kw["attn_mask"] = torch.rand(29, 45, device=DEVICE) > 0.3
    elif mask == "float":
        kw["attn_mask"] = torch.randn(2, 1, 29, 45, device=DEVICE).half()

    def ref(q, k, v, upcast):
        kw_ref = dict(kw)
        if mask == "float":
            kw_ref["attn_mask"] = kw["attn_mask"].to(q.dtype)
        return sdpa_ref(q, k, v, upcast=upcast, **kw_ref)

    check_grads(lambda q, k, v: qflash.sdpa(q, k, v, **kw), ref, inputs)


@pytest.mark.parametrize("mask_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("mask_shape,hkv", [((2, 1, 29, 45), 3), ((29, 45), 1), ((2, 3, 29, 45), 3)])
def test_sdpa_float_mask_gets_its_gradient(mask_shape, hkv, mask_dtype):
    """A float attn_mask that requires grad (a learned bias) gets dL/dscores, summed over the
    dimensions it was broadcast along (batch, heads); GQA; ragged lengths; a float32 mask beside
    float16 queries gets a float32 gradient."""
    q, k, v = _leaves((2, 3, 29, 32), (2, hkv, 45, 32), (2, hkv, 45, 32), dtype=torch.float16)
    mask = (torch.randn(mask_shape, device=DEVICE) * 2).to(mask_dtype).requires_grad_()
    check_grads(lambda q, k, v, m: qflash.sdpa(q, k, v, attn_mask=m, enable_gqa=True),
                lambda q, k, v, m, upcast: sdpa_ref(q, k, v, attn_mask=m, enable_gqa=True, upcast=upcast),
                [q, k, v, mask])


def test_sdpa_mask_gradient_under_torch_compile():
    """The custom op's backward returns the mask's gradient under torch.compile(fullgraph=True)
    too, and none when the mask needs none."""
    q, k, v = _leaves((2, 3, 17, 16), (2, 3, 17, 16), (2, 3, 17, 16), dtype=torch.float32)
    mask = torch.randn(17, 17, device=DEVICE).requires_grad_()

    def loss(q, k, v, m):
        return qflash.sdpa(q, k, v, attn_mask=m).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    expected = torch.autograd.grad(loss(q, k, v, mask), (q, k, v, mask))
    for a, b in zip(torch.autograd.grad(compiled(q, k, v, mask), (q, k, v, mask)), expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(torch.autograd.grad(compiled(q, k, v, mask.detach()), (q, k, v))) == 3


def test_sdpa_mask_gradient_float64_with_softcap_and_fully_masked_rows():
    """float64, tight: the mask's gradient is taken before soft-capping's chain rule; rows whose
    keys are all masked (-inf) get zero gradients, not NaN."""
    q, k, v = _leaves((1, 2, 21, 16), (1, 2, 19, 16), (1, 2, 19, 16), dtype=torch.float64, scale=2.0)
    mask = torch.randn(1, 2, 21, 19, device=DEVICE, dtype=torch.float64)
    mask[0, 1, 4] = float("-inf")
    mask.requires_grad_()
    check_grads(lambda q, k, v, m: qflash.sdpa(q, k, v, attn_mask=m, softcap=3.0),
                lambda q, k, v, m, upcast: sdpa_ref(q, k, v, attn_mask=m, softcap=3.0, upcast=upcast),
                [q, k, v, mask])
    (g,) = torch.autograd.grad(qflash.sdpa(q, k, v, attn_mask=mask, softcap=3.0).sum(), (mask,))
    assert g.isfinite().all() and torch.equal(g[0, 1, 4], torch.zeros_like(g[0, 1, 4]))


def test_packed_qkv_gets_the_same_gradients():
    qkv = torch.randn(2, 33, 3, 4, 32, device=DEVICE).half().requires_grad_()
    dout = torch.randn(2, 33, 4, 32, device=DEVICE).half()
    (g_packed,) = torch.autograd.grad(qflash.flash_attn_qkvpacked_func(qkv, causal=True), qkv, dout)
    q, k, v = (qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3))
    grads = torch.autograd.grad(qflash.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
    torch.testing.assert_close(g_packed, torch.stack(grads, dim=2), rtol=0, atol=0)


def test_deterministic_run_to_run():
    q, k, v = _leaves((2, 70, 4, 32), (2, 90, 2, 32), (2, 90, 2, 32), dtype=torch.float16)
    dout = torch.randn(2, 70, 4, 32, device=DEVICE).half()
    first = _grads(lambda *a: qflash.flash_attn_func(*a, causal=True, deterministic=True), (q, k, v), dout)
    second = _grads(lambda *a: qflash.flash_attn_func(*a, causal=True, deterministic=True), (q, k, v), dout)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_gradcheck_float64():
    q, k, v = _leaves((1, 5, 2, 4), (1, 6, 1, 4), (1, 6, 1, 4), dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda *a: qflash.flash_attn_func(*a, causal=True), (q, k, v))
    slopes = torch.rand(2, device=DEVICE)
    q, k, v = _leaves((1, 4, 2, 4), (1, 3, 2, 4), (1, 3, 2, 4), dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda *a: qflash.flash_attn_func(*a, softcap=2.0, alibi_slopes=slopes, window_size=(2, 1)), (q, k, v))


def test_torch_compile_forward_and_backward():
    q, k, v = _leaves((1, 24, 2, 32), (1, 40, 1, 32), (1, 40, 1, 32), dtype=torch.float16)
    dout = torch.randn(1, 24, 2, 32, device=DEVICE).half()

    def step(a, b, c):
        return qflash.flash_attn_func(a, b, c, causal=True) * 2

    compiled = one_graph(step)
    expected = _grads(step, (q, k, v), dout)
    for a, b in zip(_grads(compiled, (q, k, v), dout), expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_dout_and_mask_gradient():
    q, k, v = _leaves((1, 8, 2, 32), (1, 8, 2, 32), (1, 8, 2, 32), dtype=torch.float16)
    out = qflash.flash_attn_func(q, k, v)
    with pytest.raises(RuntimeError, match="shape"):
        out.backward(torch.randn(1, 8, 2, 16, device=DEVICE).half())
    # A dout of another float dtype is cast to the output's by autograd, as for any PyTorch op.
    dout64 = torch.randn(1, 8, 2, 32, device=DEVICE, dtype=torch.float64)
    (g64,) = torch.autograd.grad(qflash.flash_attn_func(q, k, v), (q,), dout64)
    (g16,) = torch.autograd.grad(qflash.flash_attn_func(q, k, v), (q,), dout64.half())
    assert torch.equal(g64, g16)


@pytest.mark.parametrize("which", ["dq", "dkdv", "both"])
def test_descriptor_loads(which, monkeypatch):
    """Streamed tiles through tensor descriptors (Hopper's copy engine; the interpreter runs them
    too): ragged lengths, a head dim that is not a power of two, GQA, windows and varlen."""
    import qflash.kernels.attention as kernels

    base = kernels.default_bwd_configs

    def configs(*args, **kwargs):
        dq_cfg, dkdv_cfg = base(*args, **kwargs)
        return (dataclasses.replace(dq_cfg, use_tma=which in ("dq", "both")),
                dataclasses.replace(dkdv_cfg, use_tma=which in ("dkdv", "both")))

    monkeypatch.setattr(kernels, "default_bwd_configs", configs)
    check_flash_grads(2, 113, 203, 4, 2, 40, causal=True)
    check_flash_grads(1, 70, 33, 2, 1, 64, window_size=(9, 2))
    lens_q, lens_k = [1, 37, 0, 20], [5, 29, 9, 20]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
                  for n in (lens_q, lens_k))
    inputs = _leaves((sum(lens_q), 2, 32), (sum(lens_k), 1, 32), (sum(lens_k), 1, 32), dtype=torch.float16)
    check_varlen_grads(cu_q, cu_k, 37, 29, inputs)


@pytest.mark.parametrize("d,causal", [(64, True), (128, True), (64, False)])
def test_dkdv_builds_for_sm90_with_asynchronous_wgmma(d, causal):
    """Built offline as the H200's default launch would be: no wgmma serialized by ptxas (C7515).
    With its masked diagonal loop first, the causal dK/dV kernel had them all serialized and took
    20-27 % longer (benchmarks/NOTES.md, fourteenth round)."""
    kernel = sm90_build("qflash.kernels.attention", d, torch.bfloat16, causal=causal)
    assert "wgmma.mma_async" in kernel["ptx"]
    assert "serialized" not in ptxas_report(kernel["ptx"])


@pytest.mark.parametrize("kernel", ["fwd", "dq", "dkdv"])
@pytest.mark.parametrize("d", [64, 128])
def test_varlen_builds_for_sm90_with_asynchronous_wgmma(kernel, d):
    """The packed-sequence builds (causal, as the H200's default launch would be), with their
    checks of cu_seqlens on a branch of its own: no wgmma serialized by ptxas (C7515). Where the
    checks sit moved the D = 128 builds' spills and time (benchmarks/NOTES.md, fortieth round)."""
    built = sm90_build("qflash.kernels.attention", d, torch.bfloat16, causal=True, kernel=kernel, varlen=True)
    assert "wgmma.mma_async" in built["ptx"]
    assert "serialized" not in ptxas_report(built["ptx"])


@pytest.mark.parametrize("causal", [False, True])
def test_d256_dq_tiles_fit_and_keep_asynchronous_wgmma(causal):
    """D = 256's dQ tiles (128 rows, 32 keys, two stages) built for sm_90 as the H200 launches them:
    inside the 227 KB of shared memory a block may have, and no wgmma serialized by ptxas."""
    kernel = sm90_build("qflash.kernels.attention", 256, torch.bfloat16, causal=causal, kernel="dq")
    assert kernel["shared"] <= 227 * 1024
    assert "wgmma.mma_async" in kernel["ptx"]
    assert "serialized" not in ptxas_report(kernel["ptx"])


# ----------------------------------------------------------------------------------------------
# GPU (H200)
# ----------------------------------------------------------------------------------------------
# The CPU default visits dK/dV's interior before its masked edges (edges_last), as the H200's
# does; these tiles visit the masked edges first.
CPU_BWD_TILES = [((16, 64, 4, 1), (64, 16, 4, 1)), ((64, 16, 4, 1), (16, 64, 4, 1)), ((32, 32, 4, 1), (32, 32, 4, 1))]


def _gpu_bwd_tiles():
    """The H200 search grid, gpu-marked: `pytest -m gpu` on the H200 runs every candidate (a list
    shorter than the other pairs its first entry with the rest)."""
    from itertools import zip_longest

    from qflash.bench.attention import BWD_TILE_GRID

    return [pytest.param(d, (dq or grid["dq"][0], dkdv or grid["dkdv"][0]), marks=gpu)
            for d, grid in BWD_TILE_GRID.items() for dq, dkdv in zip_longest(grid["dq"], grid["dkdv"])]


@pytest.mark.parametrize("d,tiles", [(40, t) for t in CPU_BWD_TILES] + _gpu_bwd_tiles(), ids=str)
@pytest.mark.parametrize("window", [(-1, 0), (9, 2), (-1, -1)])
def test_every_tile_shape_splits_masked_blocks_right(d, tiles, window, monkeypatch):
    """Tiles with block_m != block_n move the masked / unmasked boundaries; gradients must not."""
    import qflash.kernels.attention as kernels

    configs = tuple(kernels.AttnBwdConfig(*t) for t in tiles)
    monkeypatch.setattr(kernels, "default_bwd_configs", lambda *args: configs)
    sq, sk = (113, 203) if DEVICE == "cpu" else (1023, 1500)
    check_flash_grads(2, sq, sk, 2, 1, d, window_size=window)
    check_flash_grads(1, sk, sq, 2, 2, d, window_size=window)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 80, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (113, 203), (239, 1), (1023, 1023), (4224, 4224)])
def test_gpu_sweep(dtype, d, causal, sq, sk):
    check_flash_grads(2, sq, sk, 4, 2, d, dtype=dtype, causal=causal)


@gpu
@pytest.mark.parametrize("dtype,mask_dtype", [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                                              (torch.float64, torch.float64), (torch.bfloat16, torch.float32)])
def test_gpu_sdpa_mask_gradient(dtype, mask_dtype):
    """A learned float mask's gradient on the GPU, broadcast over batch and heads, ragged lengths,
    GQA (float64: also the boolean-mask change's neighbour, an additive mask in float64; a
    float32 mask beside bfloat16 queries, as PyTorch takes)."""
    q, k, v = _leaves((2, 8, 1000, 64), (2, 2, 1100, 64), (2, 2, 1100, 64), dtype=dtype)
    mask = (torch.randn(1000, 1100, device="cuda") * 2).to(mask_dtype).requires_grad_()
    check_grads(lambda q, k, v, m: qflash.sdpa(q, k, v, attn_mask=m, enable_gqa=True),
                lambda q, k, v, m, upcast: sdpa_ref(q, k, v, attn_mask=m, enable_gqa=True, upcast=upcast),
                [q, k, v, mask])


@gpu
def test_gpu_deterministic_and_mask_at_64_past_128():
    # seqlen % 128 == 64 with a mask: where cuDNN has returned NaN gradients.
    inputs = _leaves((2, 8, 1088, 128), (2, 8, 1088, 128), (2, 8, 1088, 128), dtype=torch.bfloat16)
    mask = torch.rand(1088, 1088, device="cuda") > 0.1
    check_grads(lambda q, k, v: qflash.sdpa(q, k, v, attn_mask=mask),
                lambda q, k, v, upcast: sdpa_ref(q, k, v, attn_mask=mask, upcast=upcast), inputs)
    dout = torch.randn(2, 8, 1088, 128, device="cuda").bfloat16()
    runs = [_grads(lambda *a: qflash.sdpa(*a, attn_mask=mask), inputs, dout) for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# Dropout: the mask is drawn in the kernel and regenerated in the backward pass.
# ----------------------------------------------------------------------------------------------
def _seed_for(torch_seed: int) -> int:
    """The dropout seed qflash draws after torch.manual_seed(torch_seed)."""
    torch.manual_seed(torch_seed)
    return int(torch.randint(0, 2**31 - 1, ()))


@pytest.mark.parametrize("causal,hkv", [(False, 2), (True, 1)])
def test_dropout_forward_and_gradients_match_the_same_mask(causal, hkv):
    from qflash.kernels.attention import dropout_keep_mask

    p = 0.3
    b, sq, sk, h, d = 2, 45, 70, 4, 32
    inputs = _leaves((b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d), dtype=torch.float16)
    mask = dropout_keep_mask(b, h, sq, sk, dropout_p=p, dropout_seed=_seed_for(7), device=DEVICE)
    keep_rate = mask.float().mean().item()
    sigma = (p * (1 - p) / mask.numel()) ** 0.5
    assert abs(keep_rate - (1 - p)) < 4 * sigma, keep_rate

    def fn(q, k, v):
        torch.manual_seed(7)  # the same seed, hence the same mask, on every call
        return qflash.flash_attn_func(q, k, v, dropout_p=p, causal=causal)

    check_grads(fn, lambda q, k, v, upcast: attention_ref(q, k, v, causal=causal, dropout_p=p, dropout_mask=mask,
                                                          upcast=upcast, reorder_ops=not upcast)[0], inputs)


def test_dropout_mask_has_independent_neighbours():
    """One Philox call serves eight neighbouring keys (16 bits each): every pair of keys 1-8 apart,
    of rows 1 apart, and the last keys of a row beside the first of the next (a row of 70 keys ends
    inside a counter's eight) must be kept together as often as independent draws are, (1 - p)^2."""
    from qflash.kernels.attention import dropout_keep_mask

    p, sq, sk = 0.5, 96, 70
    mask = dropout_keep_mask(2, 3, sq, sk, dropout_p=p, dropout_seed=_seed_for(11), device=DEVICE).float().cpu()
    pairs = {f"keys {lag} apart": (mask[..., :-lag], mask[..., lag:]) for lag in range(1, 9)}
    pairs["rows 1 apart"] = (mask[..., :-1, :], mask[..., 1:, :])
    pairs["a row's end, the next row's start"] = (mask[..., :-1, -2:], mask[..., 1:, :2])
    for what, (a, b) in pairs.items():
        both = (a * b).mean().item()
        sigma = ((1 - p) ** 2 * (1 - (1 - p) ** 2) / a.numel()) ** 0.5
        assert abs(both - (1 - p) ** 2) < 5 * sigma, (what, both)
    assert abs(mask.mean().item() - (1 - p)) < 5 * (p * (1 - p) / mask.numel()) ** 0.5


def test_dropout_varlen_single_sequence_equals_dense_and_seeds_differ():
    q, k, v = (t.detach() for t in _leaves((1, 40, 2, 32), (1, 50, 2, 32), (1, 50, 2, 32), dtype=torch.float16))
    torch.manual_seed(3)
    dense = qflash.flash_attn_func(q, k, v, dropout_p=0.5)
    torch.manual_seed(3)
    cu_q = torch.tensor([0, 40], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 50], dtype=torch.int32, device=DEVICE)
    packed = qflash.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 40, 50, dropout_p=0.5)
    torch.testing.assert_close(packed, dense[0], rtol=0, atol=0)
    torch.manual_seed(4)
    assert not torch.equal(qflash.flash_attn_func(q, k, v, dropout_p=0.5), dense)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_dropout_gradients(dtype):
    from qflash.kernels.attention import dropout_keep_mask

    b, s, h, d, p = 2, 1000, 8, 128, 0.1
    inputs = _leaves((b, s, h, d), (b, s, h, d), (b, s, h, d), dtype=dtype)
    mask = dropout_keep_mask(b, h, s, s, dropout_p=p, dropout_seed=_seed_for(11), device="cuda")

    def fn(q, k, v):
        torch.manual_seed(11)
        return qflash.flash_attn_func(q, k, v, dropout_p=p, causal=True)

    check_grads(fn, lambda q, k, v, upcast: attention_ref(q, k, v, causal=True, dropout_p=p, dropout_mask=mask,
                                                          upcast=upcast, reorder_ops=not upcast)[0], inputs)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_wide_dtypes(dtype, d):
    check_flash_grads(1, 300, 517, 4, 2, d, dtype=dtype, causal=True)


@gpu
def test_gpu_gradcheck_float64():
    q, k, v = _leaves((1, 9, 2, 8), (1, 11, 1, 8), (1, 11, 1, 8), dtype=torch.float64, device="cuda")
    assert torch.autograd.gradcheck(lambda *a: qflash.flash_attn_func(*a, causal=True, softcap=3.0), (q, k, v))


# ----------------------------------------------------------------------------------------------
# Attention sinks (gpt-oss): their gradient, and q, k, v's through a softmax that holds them.
# ----------------------------------------------------------------------------------------------
def _sinks_leaf(heads: int, dtype=torch.float32):
    return attention_sinks(heads, dtype=dtype, device=DEVICE).requires_grad_()


SINK_NAMES = ("q", "k", "v", "sinks")


def _sinks_floor(inputs, ref_fn):
    """The sinks' gradient is a sum of p_sink = exp(sink - lse) over a head's rows, and the kernels
    keep lse in float32 (as flash-attn's): each p_sink is then off by up to a few float32 steps of
    |lse| (relative), which PyTorch's own float32 softmax is not. Floor: 4 such steps of the
    largest |lse| times the largest |dsinks| (float64 inputs keep lse in float64: no floor)."""
    if inputs[0].dtype == torch.float64:
        return None
    with torch.no_grad():
        lse = ref_fn(*(t.detach().double() for t in inputs), upcast=True)[1]
    step = 4 * torch.finfo(torch.float32).eps * float(lse[lse.isfinite()].abs().max())
    return {"sinks": lambda ref: step * float(ref.abs().max())}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("sq,sk,kw", [(45, 70, {"causal": True}), (70, 45, {"causal": True}),
                                      (33, 90, {"window_size": (7, 3)}), (40, 57, {"softcap": 4.0}), (1, 63, {})])
def test_sinks_gradients(dtype, sq, sk, kw):
    """dq, dk, dv and dsinks against float64 by the rule (factor 3): causal with Sq > Sk (rows that
    see no key hold the sink alone), windows, soft-capping, one query row; GQA, head dim 40."""
    inputs = _leaves((2, sq, 4, 40), (2, sk, 2, 40), (2, sk, 2, 40), dtype=dtype) + [_sinks_leaf(4)]

    def ref(q, k, v, s, upcast):
        return attention_ref(q, k, v, sinks=s, upcast=upcast, reorder_ops=not upcast, **kw)

    check_grads(lambda q, k, v, s: qflash.flash_attn_func(q, k, v, sinks=s, **kw),
                lambda *a, upcast: ref(*a, upcast)[0], inputs, names=SINK_NAMES, floors=_sinks_floor(inputs, ref))


def test_sinks_gradients_varlen_and_sdpa():
    """Packed sequences (an empty one among them; three packed rows after the last sequence, which
    the sinks' gradient must leave out) and sdpa with a boolean mask, sinks in float16."""
    cu_q = torch.tensor([0, 1, 64, 64, 104, 121], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 5, 68, 77, 88, 118], dtype=torch.int32, device=DEVICE)
    inputs = _leaves((121, 4, 32), (118, 2, 32), (118, 2, 32), dtype=torch.float16) + [_sinks_leaf(4, torch.float16)]
    check_grads(lambda q, k, v, s: qflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 63, 63, causal=True, sinks=s),
                lambda q, k, v, s, upcast: attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, sinks=s,
                                                                upcast=upcast, reorder_ops=not upcast)[0],
                inputs, names=SINK_NAMES)
    q, k, v, s = inputs
    extra = torch.randn(3, 4, 32, device=DEVICE).to(q.dtype)
    with poisoned():  # the rows after the last sequence: never written
        out = qflash.flash_attn_varlen_func(torch.cat([q, extra]), k, v, cu_q, cu_k, 63, 63, causal=True, sinks=s)
    dout = torch.randn(121, 4, 32, device=DEVICE).to(q.dtype)
    got = torch.autograd.grad(out[:121], s, dout)[0]
    want = torch.autograd.grad(qflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 63, 63, causal=True, sinks=s),
                               s, dout)[0]
    assert torch.equal(got, want)

    mask = torch.rand(2, 1, 30, 41, device=DEVICE) > 0.3
    inputs = _leaves((2, 4, 30, 32), (2, 2, 41, 32), (2, 2, 41, 32), dtype=torch.float16) + [_sinks_leaf(4)]
    check_grads(lambda q, k, v, s: qflash.sdpa(q, k, v, attn_mask=mask, enable_gqa=True, sinks=s),
                lambda q, k, v, s, upcast: sdpa_ref(q, k, v, attn_mask=mask, enable_gqa=True, sinks=s, upcast=upcast),
                inputs, names=SINK_NAMES)


def test_sinks_gradient_of_a_bad_sequence_is_nan():
    """A sequence the delta pass finds bad (it ends past the packed rows) makes the sinks' gradient,
    which sums every sequence's rows, NaN, as it makes that sequence's dq, dk and dv."""
    q, k, v = _leaves((312, 2, 32), (312, 2, 32), (312, 2, 32), dtype=torch.float16)
    sinks = _sinks_leaf(2)
    dout = torch.randn(312, 2, 32, device=DEVICE).to(torch.float16)
    for ends, bad in ((312, False), (320, True)):
        cu = torch.tensor([0, 5, 305, ends], dtype=torch.int32, device=DEVICE)
        with poisoned(FINITE_POISON):
            out = qflash.flash_attn_varlen_func(q, k, v, cu, cu, 300, 300, causal=True, sinks=sinks)
            dsinks = torch.autograd.grad(out, sinks, dout)[0]
        assert dsinks.isnan().all() if bad else dsinks.isfinite().all()


def test_sinks_gradient_under_torch_compile():
    """The custom ops take the sinks whole under torch.compile(fullgraph=True): one graph, the same
    gradients as eager, none for sinks that need none."""
    q, k, v, s = _leaves((1, 24, 4, 32), (1, 40, 2, 32), (1, 40, 2, 32), dtype=torch.float16) + [_sinks_leaf(4)]
    dout = torch.randn(1, 24, 4, 32, device=DEVICE).half()

    def step(a, b, c, d):
        return qflash.flash_attn_func(a, b, c, causal=True, sinks=d) * 2

    compiled = one_graph(step)
    expected = _grads(step, (q, k, v, s), dout)
    for a, b in zip(_grads(compiled, (q, k, v, s), dout), expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(torch.autograd.grad(compiled(q, k, v, s.detach()), (q, k, v), dout)) == 3


def test_sinks_with_dropout_match_the_same_mask():
    """Dropout beside sinks: the sink takes its share of each row's softmax before the drop, as in
    transformers' gpt-oss (its value is zero, so dropping it would change nothing)."""
    from qflash.kernels.attention import dropout_keep_mask

    p, b, sq, sk, h = 0.3, 2, 45, 70, 4
    inputs = _leaves((b, sq, h, 32), (b, sk, 2, 32), (b, sk, 2, 32), dtype=torch.float16) + [_sinks_leaf(h)]
    mask = dropout_keep_mask(b, h, sq, sk, dropout_p=p, dropout_seed=_seed_for(7), device=DEVICE)

    def fn(q, k, v, s):
        torch.manual_seed(7)  # the same mask on every call
        return qflash.flash_attn_func(q, k, v, dropout_p=p, causal=True, sinks=s)

    check_grads(fn, lambda q, k, v, s, upcast: attention_ref(q, k, v, causal=True, dropout_p=p, dropout_mask=mask,
                                                             sinks=s, upcast=upcast, reorder_ops=not upcast)[0],
                inputs, names=SINK_NAMES)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d,causal,sq,sk", [(64, True, 1024, 1024), (128, False, 512, 768), (64, False, 256, 256),
                                            (128, True, 384, 1024), (80, True, 333, 517)])
def test_gpu_sinks_gradients(dtype, d, causal, sq, sk):
    """On the H200: the Gluon forward and backward (lengths multiple of 128, D = 64 / 128) and the tl
    kernels (D = 80, ragged) with sinks; gpt-oss's grouping (8 query heads a key/value head)."""
    inputs = _leaves((2, sq, 16, d), (2, sk, 2, d), (2, sk, 2, d), dtype=dtype) + [_sinks_leaf(16)]

    def ref(q, k, v, s, upcast):
        return attention_ref(q, k, v, causal=causal, sinks=s, upcast=upcast, reorder_ops=not upcast)

    check_grads(lambda q, k, v, s: qflash.flash_attn_func(q, k, v, causal=causal, sinks=s),
                lambda *a, upcast: ref(*a, upcast)[0], inputs, names=SINK_NAMES, floors=_sinks_floor(inputs, ref))
