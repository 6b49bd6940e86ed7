"""The Gluon forward kernel (Hopper, warp-specialized): it builds for sm_90 on any machine, says
which calls it does not take, and on the H200 meets the flash-attn rule against float64, with
and without the causal mask, for GQA, seqlen_q != seqlen_k and sliced (packed) inputs; the
public functions send it the calls it takes. The Gluon backward: the same, with gradients within
3x PyTorch's error (the tests send every call it fits there, whatever the dispatch prefers), and
``deterministic`` keeps calls off it at D = 64 / 128, where its dQ sums arrive in any order, but
not at D = 256, where it gives the same bits run after run."""

import functools
import itertools
import math
import re

import pytest
import torch

import qflash
from qflash.reference import attention_ref, sdpa_ref
from qflash.testing import assert_flash_rule, assert_written, poisoned

from conftest import DEVICE, ptxas_report, sm90_build

gluon = pytest.importorskip("qflash.kernels.attention_gluon")


@pytest.mark.parametrize("d,dtype,causal,seqlen_k", [(128, torch.bfloat16, False, 0), (128, torch.bfloat16, True, 0),
                                                     (64, torch.float16, False, 0), (64, torch.float16, True, 4096),
                                                     (64, torch.bfloat16, True, 1024), (256, torch.bfloat16, True, 0),
                                                     (256, torch.bfloat16, False, 4096)])
def test_builds_for_sm90(d, dtype, causal, seqlen_k):
    """Compiled offline (no GPU needed): a producer warp and two (three) consumer warpgroups whose
    registers are rebalanced (setmaxnreg), products on wgmma, tiles through TMA, and an
    occupancy of one CTA in the H200's 227 KB of shared memory (D = 64 causal: 128-key tiles,
    and 64-key ones up to 1k keys)."""
    kernel = sm90_build("qflash.kernels.attention_gluon", d, dtype, causal=causal, seqlen_k=seqlen_k)
    ptx = kernel["ptx"]
    assert "wgmma.mma_async" in ptx and "setmaxnreg" in ptx and "cp.async.bulk.tensor" in ptx
    assert kernel["shared"] <= 227 * 1024
    assert "serialized" not in ptxas_report(ptx)  # S and P V stay asynchronous
    # the output leaves by bulk copies from shared memory (D = 256 in two 64 x 128 halves, up to 1k keys)
    assert ("cp.async.bulk.tensor.2d.global.shared" in ptx) == (d <= 128 or seqlen_k <= 1024)


@pytest.mark.parametrize("d,causal", [(64, True), (128, False), (256, True)])
def test_builds_for_sm90_with_sinks(d, causal):
    """With attention sinks (one load a work item, the running max and sum starting from it): the
    same asynchronous products as without, and no spills at D = 64 / 128; at D = 256, whose three
    consumers spill 12 bytes without sinks, 8 more with them."""
    plain, with_sinks = (sm90_build("qflash.kernels.attention_gluon", d, torch.bfloat16, causal=causal, sinks=s)
                         for s in (False, True))

    def spilled(kernel):
        report = ptxas_report(kernel["ptx"])
        assert "serialized" not in report
        return int(re.search(r"(\d+) bytes spill stores", report).group(1))

    assert spilled(with_sinks) <= (0 if d <= 128 else spilled(plain) + 8)
    assert with_sinks["ptx"].count("wgmma.mma_async") == plain["ptx"].count("wgmma.mma_async")
    assert with_sinks["shared"] <= 227 * 1024


def _qkv(b=1, sq=128, sk=None, h=2, hkv=None, d=64, dtype=torch.float16, device=DEVICE):
    q = torch.randn(b, sq, h, d, device=device).to(dtype)
    k, v = (torch.randn(b, sk or sq, hkv or h, d, device=device).to(dtype) for _ in range(2))
    return q, k, v


def test_names_what_it_does_not_take():
    cases = [
        (_qkv(dtype=torch.float32), "float16 or bfloat16"),
        (_qkv(d=80), "head dim"),
        (_qkv(d=96), "head dim"),
        (_qkv(sq=200), "seqlen_q must be a positive multiple of 128"),
        (_qkv(sk=100), "seqlen_k must be a positive multiple of 128"),
        (_qkv(h=3, hkv=2), "multiple of heads_kv"),
        (tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in _qkv()), "q needs unit stride"),
    ]
    if DEVICE == "cpu":
        cases = [(_qkv(), "Hopper")]
    for args, match in cases:
        assert match in gluon.why_not(*args)
        with pytest.raises(ValueError, match=match):
            gluon.attention_forward_gluon(*args, softmax_scale=0.125)


def _reference(q, k, v, causal, bottom_right, dtype):
    """fp64 reference (out, lse or None) and PyTorch's own result in the input precision."""
    if bottom_right or not causal:
        ref, ref_lse = attention_ref(q.double(), k.double(), v.double(), causal=causal)
        pt, _ = attention_ref(q, k, v, causal=causal, upcast=False, reorder_ops=True)
        return ref, ref_lse, pt
    gqa = q.shape[2] != k.shape[2]
    t = [x.transpose(1, 2) for x in (q, k, v)]
    ref = sdpa_ref(*[x.double() for x in t], is_causal=True, enable_gqa=gqa).transpose(1, 2)
    pt = sdpa_ref(*t, is_causal=True, enable_gqa=gqa, upcast=False).transpose(1, 2)
    return ref, None, pt


GPU_CASES = [  # (batch, seqlen_q, seqlen_k, heads, heads_kv, headdim, causal, bottom_right)
    (2, 128, 128, 3, 3, 128, False, True),
    (1, 1024, 1024, 4, 4, 64, False, True),
    (2, 4224, 4224, 2, 2, 128, False, True),
    (2, 1024, 1024, 4, 4, 128, True, True),
    (1, 4224, 4224, 2, 2, 64, True, True),
    (2, 384, 1152, 6, 2, 128, True, True),  # Sq < Sk: the last queries see every key
    (2, 1152, 384, 6, 1, 64, True, True),  # Sq > Sk: the first queries see no key
    (1, 512, 384, 4, 4, 64, True, True),  # D = 64: a 192-row item whose first 128 rows see no key
    (1, 1152, 384, 4, 2, 128, True, False),  # top-left: the last queries see every key
    (1, 256, 640, 4, 4, 64, True, False),
    (3, 256, 512, 8, 2, 64, False, True),
    (2, 1408, 1408, 2, 2, 64, False, True),  # D = 64, 192-row items: the last one's rows 64-191 are past the end
    (2, 1024, 1024, 4, 4, 256, False, True),  # D = 256: 64-key tiles, one Q buffer
    (1, 640, 640, 4, 2, 256, True, True),
    (1, 384, 896, 2, 1, 256, True, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,sq,sk,h,hkv,d,causal,bottom_right", GPU_CASES)
def test_gpu_matches_reference(b, sq, sk, h, hkv, d, causal, bottom_right, dtype):
    q, k, v = _qkv(b, sq, sk, h, hkv, d, dtype, "cuda")
    with poisoned():
        out, lse = gluon.attention_forward_gluon(q, k, v, softmax_scale=1 / math.sqrt(d), causal=causal,
                                                 bottom_right=bottom_right)
    assert_written(out, "out")
    ref, ref_lse, pt = _reference(q, k, v, causal, bottom_right, dtype)
    assert_flash_rule(out, ref, pt)
    if ref_lse is not None:
        seen = torch.isfinite(ref_lse)  # rows that see no key: lse = +inf in both
        assert torch.equal(seen.cpu(), torch.isfinite(lse).cpu())
        err = (lse.double() - ref_lse)[seen].abs().max().item()
        assert err <= 1e-4 * max(1.0, ref_lse[seen].abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal,seqlen", [(64, False, 1408), (64, True, 1024), (64, False, 512), (128, True, 768),
                                             (128, False, 640), (256, True, 640), (256, False, 512)])
def test_gpu_output_paths_agree(d, causal, seqlen):
    """The output through shared memory and bulk copies is bit for bit the one plain stores write
    (the same registers, two ways out), every row of every batch written."""
    q, k, v = _qkv(2, seqlen, seqlen, 3, 3, d, torch.bfloat16, "cuda")
    results = []
    for tma_store in (True, False):
        with poisoned():
            out, lse = gluon.launch(q, k, v, d ** -0.5, causal, True, tma_store=tma_store)
        assert_written(out, "out")
        results.append((out, lse))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    ref, _, pt = _reference(q, k, v, causal, True, q.dtype)
    assert_flash_rule(results[0][0], ref, pt)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_deterministic_calls_reach_only_the_fixed_order_backward(d, monkeypatch):
    """The dispatch, without a GPU (a Hopper call that fits stood in for): the Gluon backward
    takes calls that ask for the same bits each run (``deterministic=True`` or
    ``torch.use_deterministic_algorithms``) only at D = 256, and every call that does not ask."""
    from qflash.kernels import attention as tl_attention

    monkeypatch.setattr(tl_attention, "_plain", lambda q, opts: True)
    monkeypatch.setattr(gluon, "bwd_why_not", lambda *args: None)
    q, k, v = _qkv(1, 128, 128, 2, 2, d, torch.float16, "cpu")
    out, dout = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(1, 2, 128, dtype=torch.float32)
    scale = 1 / math.sqrt(d)
    fits = functools.partial(tl_attention._fast_backward_fits, dout, q, k, v, out, lse)
    assert fits(tl_attention.AttnOptions(scale, window_right=0))
    assert fits(tl_attention.AttnOptions(scale, window_right=0, deterministic=True)) == (d == 256)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert fits(tl_attention.AttnOptions(scale, window_right=0)) == (d == 256)
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.gpu
def test_gpu_backward_deterministic_at_256_takes_the_gluon_kernels(monkeypatch):
    """At D = 256 deterministic=True and torch.use_deterministic_algorithms keep the Gluon
    backward (dK / dV, then dQ, no atomics): the same bits run after run and with the default
    call, within the rule against float64, GQA and causal."""
    from test_attention_backward import _grads, _leaves, check_grads

    calls = _spy_backward(monkeypatch)
    inputs = _leaves((2, 512, 4, 256), (2, 512, 2, 256), (2, 512, 2, 256), dtype=torch.bfloat16)
    check_grads(lambda q, k, v: qflash.flash_attn_func(q, k, v, causal=True, deterministic=True),
                lambda q, k, v, upcast: attention_ref(q, k, v, causal=True, upcast=upcast,
                                                      reorder_ops=not upcast)[0], inputs)
    assert calls
    q, k, v = (t.requires_grad_() for t in _qkv(2, 512, 512, 4, 2, 256, torch.bfloat16, "cuda"))
    dout = torch.randn_like(q)
    calls.clear()
    runs = [_grads(lambda *a: qflash.flash_attn_func(*a, causal=True, deterministic=True), (q, k, v), dout)
            for _ in range(3)]
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        runs.append(_grads(lambda *a: qflash.flash_attn_func(*a, causal=True), (q, k, v), dout))
    finally:
        torch.use_deterministic_algorithms(False)
    runs.append(_grads(lambda *a: qflash.flash_attn_func(*a, causal=True), (q, k, v), dout))
    assert len(calls) == 5
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("heads_per_group", [1, 3, 4, 10])
def test_gpu_causal_work_orders(d, heads_per_group):
    """Every causal order computes the same result: groups of 1, 3 (the last group holds one
    head of 10), 4 and all 10 heads, over 9 CTAs' worth of items or more."""
    q, k, v = _qkv(2, 768, 768, 5, 5, d, torch.bfloat16, "cuda")
    with poisoned():
        out, lse = gluon.launch(q, k, v, d ** -0.5, True, True, heads_per_group=heads_per_group)
    assert_written(out, "out")
    ref, ref_lse, pt = _reference(q, k, v, True, True, q.dtype)
    assert_flash_rule(out, ref, pt)
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-4 * ref_lse.abs().max().item()


@pytest.mark.gpu
def test_gpu_packed_qkv_without_copies():
    """q, k, v sliced from one (B, S, 3, H, D) tensor: strided views the descriptors read directly."""
    qkv = torch.randn(2, 512, 3, 4, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    assert gluon.why_not(q, k, v) is None
    out, _ = gluon.attention_forward_gluon(q, k, v, softmax_scale=128 ** -0.5, causal=True)
    ref, _, pt = _reference(q, k, v, True, True, q.dtype)
    assert_flash_rule(out, ref, pt)


@pytest.mark.gpu
def test_gpu_public_functions_use_it(monkeypatch):
    """flash_attn_func and sdpa take the Gluon kernel where it fits (same bits as calling it), and
    the tl kernel with QFLASH_GLUON=0 (its error is within the rule too)."""
    q, k, v = _qkv(2, 512, 512, 4, 2, 128, torch.bfloat16, "cuda")
    fast, _ = gluon.attention_forward_gluon(q, k, v, softmax_scale=128 ** -0.5, causal=True)
    assert torch.equal(qflash.flash_attn_func(q, k, v, causal=True), fast)
    sd = qflash.sdpa(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True, enable_gqa=True)
    assert torch.equal(sd.transpose(1, 2), fast)
    monkeypatch.setenv("QFLASH_GLUON", "0")
    portable = qflash.flash_attn_func(q, k, v, causal=True)
    assert not torch.equal(portable, fast)
    ref, _, pt = _reference(q, k, v, True, True, q.dtype)
    assert_flash_rule(portable, ref, pt)



@pytest.mark.gpu
@pytest.mark.parametrize("d,causal", [(64, False), (64, True), (256, False), (256, True)])
def test_gpu_public_dispatch_by_head_dim(d, causal):
    """D = 64 (three consumers without a mask, two with a causal one) and D = 256 take the Gluon
    kernel too: the public result is its result, bit for bit, and meets the rule."""
    q, k, v = _qkv(2, 512, 512, 4, 2, d, torch.bfloat16, "cuda")
    fast, _ = gluon.attention_forward_gluon(q, k, v, softmax_scale=d ** -0.5, causal=causal)
    public = qflash.flash_attn_func(q, k, v, causal=causal)
    assert torch.equal(public, fast)
    ref, _, pt = _reference(q, k, v, causal, True, q.dtype)
    assert_flash_rule(public, ref, pt)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_gradients_from_its_forward(causal, d):
    """The backward recomputes P from the lse this kernel saved: gradients meet the rule (3x)."""
    from test_attention_backward import check_flash_grads

    check_flash_grads(2, 384, 640, 4, 2, d, dtype=torch.bfloat16, causal=causal)


@pytest.mark.parametrize("num_bh,m_blocks,programs,block_m,block_n,seqlen_k,shift", [
    (512, 4, 132, 128, 128, 512, 0),  # 512 tokens: a few heads a round is as even as all heads
    (16, 128, 132, 128, 128, 16384, 0),  # 16k tokens: one group of all heads
    (10, 3, 7, 192, 128, 512, 0),
    (3, 9, 132, 128, 64, 1536, 384),  # fewer items than CTAs
])
def test_causal_heads_per_group_is_even(num_bh, m_blocks, programs, block_m, block_n, seqlen_k, shift):
    """The chosen group size divides the work as evenly (within a few %) as groups of 1-16 or all
    heads, recomputed here item by item as the kernel's _work_item maps them."""
    chosen = gluon.causal_heads_per_group(num_bh, m_blocks, programs, block_m, block_n, seqlen_k, shift)
    assert 1 <= chosen <= num_bh

    def busiest(group):
        load = [0] * programs
        seen = set()
        n = num_bh * m_blocks
        for r in range(-(-n // programs)):
            for c in range(programs):
                w = r * programs + (c if r % 2 == 0 else programs - 1 - c)
                if w >= n:
                    continue
                first = (w // (group * m_blocks)) * group
                heads = min(group, num_bh - first)
                bh, m_block = first + (w % (group * m_blocks)) % heads, m_blocks - 1 - (w % (group * m_blocks)) // heads
                seen.add((bh, m_block))
                visible = max(m_block * block_m + block_m + shift, 0)
                load[c] += min(-(-visible // block_n), seqlen_k // block_n) + 1
        assert len(seen) == n  # every item exactly once
        return max(load)

    best = min(busiest(g) for g in set(range(1, min(num_bh, 16) + 1)) | {num_bh})
    assert busiest(chosen) <= 1.05 * best


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d,dtype,causal", [(128, torch.bfloat16, False), (128, torch.bfloat16, True),
                                            (64, torch.float16, False), (64, torch.float16, True),
                                            (256, torch.bfloat16, False), (256, torch.float16, True)])
def test_backward_builds_for_sm90(d, dtype, causal):
    """Compiled offline: a loader warp and two consumer warpgroups (setmaxnreg), the products on
    wgmma, Q / dO / lse / delta through TMA, dQ by the copy engine's reduce-add (no atomic adds;
    at D = 256 no dQ: its own kernel's), one CTA in shared memory, and no wgmma that ptxas had
    to serialize."""
    kernel = sm90_build("qflash.kernels.attention_gluon", d, dtype, causal=causal, backward=True)
    ptx = kernel["ptx"]
    assert "wgmma.mma_async" in ptx and "setmaxnreg" in ptx and "cp.async.bulk.tensor.2d" in ptx
    assert "cp.async.bulk.tensor.1d" in ptx  # lse and delta
    assert ("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add" in ptx) == (d != 256)
    assert "relaxed.add.f32" not in ptx and "ld.global" not in ptx
    assert kernel["shared"] <= 227 * 1024
    assert "serialized" not in ptxas_report(ptx)


@pytest.mark.parametrize("dtype,causal", [(torch.bfloat16, False), (torch.float16, True)])
def test_backward_dq_kernel_builds_for_sm90(dtype, causal):
    """D = 256's dQ kernel, compiled offline: wgmma, Q / dO / K / V / lse / delta through TMA, no
    atomic adds or reduces (each query block sums its own dQ), one CTA in shared memory, and
    nothing that ptxas serialized or spilled."""
    kernel = sm90_build("qflash.kernels.attention_gluon", 256, dtype, causal=causal, dq=True)
    ptx = kernel["ptx"]
    assert "wgmma.mma_async" in ptx and "setmaxnreg" in ptx and "cp.async.bulk.tensor.2d" in ptx
    assert "cp.async.bulk.tensor.1d" in ptx  # lse and delta
    assert "cp.reduce" not in ptx and "atom.global" not in ptx and "red.global" not in ptx and "ld.global" not in ptx
    assert kernel["shared"] <= 227 * 1024
    report = ptxas_report(ptx)
    assert "serialized" not in report and "0 bytes spill stores" in report


def test_backward_names_what_it_does_not_take():
    q, k, v = _qkv(d=64)
    if DEVICE == "cpu":
        assert "Hopper" in gluon.bwd_why_not(q, k, v, q, q)
        return
    assert gluon.bwd_why_not(*_qkv(d=256), *_qkv(d=256)[:2]) is None
    assert "dout must be like q" in gluon.bwd_why_not(q, k, v, q, q[:, :, :1])
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert "dout needs unit stride" in gluon.bwd_why_not(q, k, v, q, strided)


BWD_CASES = [  # (batch, seqlen_q, seqlen_k, heads, heads_kv, headdim, causal, bottom_right)
    (2, 128, 128, 3, 3, 128, False, True),
    (1, 1024, 1024, 4, 4, 64, False, True),
    (2, 1152, 1152, 2, 2, 128, True, True),
    (1, 1024, 1024, 4, 4, 64, True, True),
    (2, 384, 1152, 6, 2, 128, True, True),  # Sq < Sk: key blocks past the diagonal of every row
    (2, 1152, 384, 6, 1, 64, True, True),  # Sq > Sk: the first queries see no key (lse = +inf)
    (1, 1152, 384, 4, 2, 128, True, False),  # top-left: the last key blocks see no query
    (3, 256, 512, 8, 2, 64, False, True),
    (2, 1408, 1408, 2, 2, 64, False, True),  # D = 64, 192-row items: the last one's rows 64-191 are past the end
    (1, 512, 512, 3, 3, 256, False, True),  # D = 256: 64-key CTAs, dK / dV split by head-dim halves
    (2, 1152, 1152, 2, 2, 256, True, True),
    (2, 384, 1152, 4, 2, 256, True, True),
    (1, 1152, 384, 4, 1, 256, True, False),
]


def _spy_backward(monkeypatch, force=True):
    """Counts the Gluon backward's launches; with ``force`` every call it fits goes there
    (whatever the dispatch prefers by measured speed)."""
    if force:
        monkeypatch.setattr(gluon, "bwd_preferred", lambda head_dim, causal, seqlen_k: True)
    calls = []
    real = gluon.launch_backward

    def spy(*args, **kwargs):
        calls.append(args[1].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(gluon, "launch_backward", spy)
    return calls


# How dQ is summed: at D = 64 / 128 by atomic adds or the copy engine's reduce-add; at D = 256 the
# dK / dV kernel is followed by the dQ kernel, neither with atomics.
DQ_SCHEDULES = {"dq_atomics": dict(DQ_TMA=False), "dq_tma_reduce": dict(DQ_TMA=True), "dq_kernel": {}}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,sq,sk,h,hkv,d,causal,bottom_right,schedule", [
    pytest.param(*case, name, id=f"{'-'.join(map(str, case))}-{name}") for case in BWD_CASES
    for name in (("dq_kernel",) if case[5] == 256 else ("dq_atomics", "dq_tma_reduce"))])
def test_gpu_backward_matches_reference(b, sq, sk, h, hkv, d, causal, bottom_right, schedule, dtype, monkeypatch):
    """Gradients through the public functions, which take the Gluon backward here: within 3x
    PyTorch's same-precision error against float64 (flash-attn's rule), every element written;
    dQ summed by atomic adds or by the copy engine's reduce (D = 64 / 128), or by its own kernel
    (D = 256)."""
    from test_attention_backward import check_grads, _leaves

    calls = _spy_backward(monkeypatch)
    variant = gluon.bwd_variant
    monkeypatch.setattr(gluon, "bwd_variant",
                        lambda head_dim, causal: {**variant(head_dim, causal), **DQ_SCHEDULES[schedule]})
    inputs = _leaves((b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d), dtype=dtype)
    if bottom_right:
        check_grads(lambda q, k, v: qflash.flash_attn_func(q, k, v, causal=causal),
                    lambda q, k, v, upcast: attention_ref(q, k, v, causal=causal, upcast=upcast,
                                                          reorder_ops=not upcast)[0], inputs)
    else:  # sdpa's top-left mask, on (B, H, S, D) views of (B, S, H, D) tensors
        def to_bhsd(*t):
            return [x.transpose(1, 2) for x in t]

        check_grads(lambda q, k, v: qflash.sdpa(*to_bhsd(q, k, v), is_causal=True, enable_gqa=True).transpose(1, 2),
                    lambda q, k, v, upcast: sdpa_ref(*to_bhsd(q, k, v), is_causal=True, enable_gqa=True,
                                                     upcast=upcast).transpose(1, 2), inputs)
    assert calls, "the Gluon backward did not run"


@pytest.mark.gpu
def test_gpu_backward_deterministic_takes_the_tl_kernels(monkeypatch):
    """deterministic=True (and torch.use_deterministic_algorithms) keep the backward off the
    atomic-dQ Gluon kernel: bitwise-identical gradients, within the rule as well; the Gluon
    gradients agree with them to the rule's precision."""
    from test_attention_backward import _grads, _leaves, check_grads

    calls = _spy_backward(monkeypatch)
    inputs = _leaves((2, 1024, 4, 128), (2, 1024, 2, 128), (2, 1024, 2, 128), dtype=torch.bfloat16)
    check_grads(lambda q, k, v: qflash.flash_attn_func(q, k, v, causal=True, deterministic=True),
                lambda q, k, v, upcast: attention_ref(q, k, v, causal=True, upcast=upcast,
                                                      reorder_ops=not upcast)[0], inputs)
    assert not calls
    q, k, v = (t.requires_grad_() for t in _qkv(2, 1024, 1024, 4, 2, 128, torch.bfloat16, "cuda"))
    dout = torch.randn_like(q)
    runs = [_grads(lambda *a: qflash.flash_attn_func(*a, causal=True, deterministic=True), (q, k, v), dout)
            for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs)) and not calls
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        again = _grads(lambda *a: qflash.flash_attn_func(*a, causal=True), (q, k, v), dout)
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(runs[0], again)) and not calls
    fast = _grads(lambda *a: qflash.flash_attn_func(*a, causal=True), (q, k, v), dout)
    assert len(calls) == 1
    for a, b in zip(runs[0], fast):
        assert (a.float() - b.float()).abs().max().item() <= 0.05 * b.float().abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", [256, 2048])
def test_gpu_backward_dispatch_follows_the_measurements(d, causal, seqlen, monkeypatch):
    """The public backward takes the Gluon kernel exactly where ``bwd_preferred`` says."""
    from test_attention_backward import _grads

    calls = _spy_backward(monkeypatch, force=False)
    q, k, v = (t.requires_grad_() for t in _qkv(1, seqlen, seqlen, 2, 2, d, torch.bfloat16, "cuda"))
    _grads(lambda *a: qflash.flash_attn_func(*a, causal=causal), (q, k, v), torch.randn_like(q))
    assert bool(calls) == gluon.bwd_preferred(d, causal, seqlen)


def test_backward_dispatch_table():
    """Where the measurements send the public backward: every head dim it has, with or without the mask."""
    for d, causal, seqlen in itertools.product((64, 128, 256), (False, True), (256, 1024, 16384)):
        assert gluon.bwd_preferred(d, causal, seqlen)


@pytest.mark.gpu
def test_gpu_backward_packed_qkv(monkeypatch):
    """qkv sliced from one (B, S, 3, H, D) tensor, as flash_attn_qkvpacked_func takes it: the
    descriptors read the strided views, and the gradient reaches the packed tensor."""
    from test_attention_backward import check_grads, _leaves

    calls = _spy_backward(monkeypatch)
    (qkv,) = _leaves((2, 512, 3, 4, 128), dtype=torch.bfloat16)
    check_grads(lambda t: qflash.flash_attn_qkvpacked_func(t, causal=True),
                lambda t, upcast: attention_ref(*t.unbind(2), causal=True, upcast=upcast,
                                                reorder_ops=not upcast)[0], [qkv])
    assert calls
