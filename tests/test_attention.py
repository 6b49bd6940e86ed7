"""FlashAttention forward against the float64 reference, with flash-attn's accuracy rule.

On a CPU-only machine these run the real Triton kernel in Triton's interpreter
(small shapes); tests marked ``gpu`` run on the H200. bf16 is GPU-only: the
interpreter's bf16 dot returns wrong values without an error.
"""

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

import qflash
from qflash.kernels import attention as attention_kernels
from qflash.reference import attention_kvcache_ref, attention_ref, attention_varlen_ref, sdpa_ref
from qflash.testing import (FINITE_POISON, assert_flash_rule, assert_written, attention_sinks, paged_cache,
                            poisoned, rel_l2_err)

from conftest import DEVICE, HAS_CUDA, ptxas_report, sm90_build

CPU_DTYPES = [torch.float16, torch.float32]
gpu = pytest.mark.gpu


def _qkv(b, sq, sk, h, hkv, d, dtype=torch.float16, device=DEVICE, scale=1.0):
    q = torch.randn(b, sq, h, d, device=device) * scale
    k = torch.randn(b, sk, hkv, d, device=device) * scale
    v = torch.randn(b, sk, hkv, d, device=device)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _f64(*ts):
    return tuple(t.to(torch.float64) if t is not None and t.is_floating_point() else t for t in ts)


def check_flash(q, k, v, **kw):
    """Run flash_attn_func on poisoned outputs and hold it to the flash-attn rule."""
    with poisoned():
        out, lse, _ = qflash.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert_written(out, "out")
    assert_written(lse, "lse")
    ref, ref_lse = attention_ref(*_f64(q, k, v), **kw)
    pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kw)
    assert_flash_rule(out, ref, pt)
    # lse is float32 in the kernel: compare against float64 directly.
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse.cpu()), ~finite.cpu()), "rows with no key must have lse = +inf"
    if finite.any():
        err = (lse.double() - ref_lse)[finite].abs().max().item()
        assert err <= 1e-4 * max(1.0, ref_lse[finite].abs().max().item()), f"lse err {err}"
    return out, lse


# ----------------------------------------------------------------------------------------------
# Shapes: ragged lengths, Sq != Sk, head dims that are not powers of two.
# ----------------------------------------------------------------------------------------------
SHAPES = [  # (seqlen_q, seqlen_k, headdim)
    (1, 1, 32),
    (113, 203, 80),
    (239, 1, 64),
    (128, 217, 128),
    (799, 3, 32),
    (64, 128, 64),
    (63, 63, 40),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,d", SHAPES)
def test_shapes(sq, sk, d, causal):
    q, k, v = _qkv(1, sq, sk, 2, 1, d)
    check_flash(q, k, v, causal=causal)


@pytest.mark.parametrize("hkv", [6, 2, 1])
def test_gqa_mqa(hkv):
    q, k, v = _qkv(2, 37, 51, 6, hkv, 32)
    check_flash(q, k, v, causal=True)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_dtypes(dtype):
    q, k, v = _qkv(2, 45, 70, 2, 2, 32, dtype=dtype)
    check_flash(q, k, v, causal=True)


@pytest.mark.parametrize("window", [(0, 0), (7, 3), (20, -1), (-1, 5), (16, 16)])
@pytest.mark.parametrize("sq,sk", [(50, 50), (33, 90), (90, 33)])
def test_sliding_window(window, sq, sk):
    q, k, v = _qkv(1, sq, sk, 2, 2, 32)
    check_flash(q, k, v, window_size=window)


@pytest.mark.parametrize("causal,window_left", [(True, 256), (False, 256)])
def test_window_forward_builds_for_sm90_with_asynchronous_wgmma(causal, window_left):
    """The tl forward with a left window edge (the Gluon forward takes no windows), built offline
    for sm_90 as the default D = 64 launch would be: ptxas must not serialize its wgmma (C7515),
    which it did while the left edge's loop came before the interior."""
    kernel = sm90_build("qflash.kernels.attention", 64, torch.bfloat16, causal=causal, kernel="fwd",
                        window_left=window_left)
    assert "wgmma.mma_async" in kernel["ptx"]
    assert "serialized" not in ptxas_report(kernel["ptx"])


# What one Hopper SM (sm_90: H100, H200) holds for its programs.
SM90_REGISTERS_AN_SM = 65536
SM90_SHARED_AN_SM = 228 * 1024


@pytest.mark.parametrize("share_keys", [128, 2048])
@pytest.mark.parametrize("call", ["func", "rows", "kvcache", "varlen"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_decode_forward_fits_two_programs_an_sm(call, d, share_keys):
    """A decode step's forward built for sm_90 as each public call launches it on the H200
    (``launch_builds``: flash_attn_func; flash_attn_with_kvcache on a cache row with a left pad, or
    on pages; flash_attn_varlen_func on pages; keys split, heads packed), with the tiles of short
    and of long key shares: two programs fit an SM, in registers and in shared memory, as
    decoding's share counts assume (DECODE_PROGRAMS_PER_SM), and ptxas does not spill. Known: the
    paged D = 256 tiles cap registers at 128 and may spill up to 8 bytes there; without the cap the
    varlen launch held 184 registers (one program an SM) and ran 1.6-1.8 x the time of the
    with_kvcache one (s48e). The paged D = 256 build spilled 40 bytes while its page lookups divided
    in 64 bits. The paged D = 64 tiles of one-block shares (64-key blocks, 2 stages) spill 8 bytes
    at 72 registers through flash_attn_with_kvcache, and were the fastest there all the same (s50a-c)."""
    kernel = sm90_build("launch_builds", call, d, share_keys=share_keys)
    report = ptxas_report(kernel["ptx"])
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spilled = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    programs = attention_kernels.DECODE_PROGRAMS_PER_SM
    assert programs * registers * 32 * kernel["num_warps"] <= SM90_REGISTERS_AN_SM, report[-600:]
    assert programs * (kernel["shared"] + 1024) <= SM90_SHARED_AN_SM  # (1 KB a program is the system's)
    known = d == 256 and call in ("kvcache", "varlen") or (d, call, share_keys) == (64, "kvcache", 128)
    assert spilled <= (8 if known else 0), report[-600:]


def test_causal_with_window():
    q, k, v = _qkv(1, 70, 70, 2, 1, 32)
    check_flash(q, k, v, causal=True, window_size=(9, 99))  # causal overrides the right side


@pytest.mark.parametrize("causal", [False, True])
def test_softcap(causal):
    q, k, v = _qkv(1, 40, 57, 2, 2, 32, scale=3.0)
    check_flash(q, k, v, causal=causal, softcap=4.0)


@pytest.mark.parametrize("slopes_shape", ["heads", "batch_heads"])
def test_alibi(slopes_shape):
    q, k, v = _qkv(2, 30, 45, 4, 2, 32)
    shape = (4,) if slopes_shape == "heads" else (2, 4)
    slopes = torch.rand(shape, device=DEVICE) * 0.5
    check_flash(q, k, v, causal=True, alibi_slopes=slopes)
    check_flash(q, k, v, causal=False, alibi_slopes=slopes, softcap=5.0)


# ----------------------------------------------------------------------------------------------
# Attention sinks (gpt-oss): a score a query head beside the keys, with a value of zero.
# ----------------------------------------------------------------------------------------------
def _sinks(heads, dtype=torch.float32):
    return attention_sinks(heads, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("sq,sk,d,kw", [
    (113, 203, 80, {"causal": True}), (239, 1, 64, {}), (63, 63, 40, {"window_size": (5, 2)}),
    (1, 239, 32, {"softcap": 3.0}), (77, 9, 32, {"causal": True}), (64, 128, 64, {"alibi_slopes": "yes"}),
    (30, 45, 32, {"window_size": (0, 0), "causal": False}),
])
def test_sinks_match_the_reference(sq, sk, d, kw):
    """Output and lse against the float64 reference by the rule (rows that see no key, causal with
    Sq > Sk, hold the sink alone: 0 and lse = the sink), the sinks left as they were, and the
    sinks mattered (the call without them is far off)."""
    kw = dict(kw)
    if kw.get("alibi_slopes") == "yes":
        kw["alibi_slopes"] = torch.rand(4, device=DEVICE)
    q, k, v = _qkv(2, sq, sk, 4, 2, d)
    sinks = _sinks(4)
    before = sinks.clone()
    out, lse = check_flash(q, k, v, sinks=sinks, **kw)
    assert torch.equal(sinks, before) and lse.isfinite().all()
    assert rel_l2_err(out, qflash.flash_attn_func(q, k, v, **kw)) > 1e-3


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("sinks_dtype", [torch.float16, torch.float32, torch.float64])
def test_sinks_in_any_precision(dtype, sinks_dtype):
    """The kernel reads the sinks as they come (bfloat16 weights of a model, float32 ones); -inf
    is no sink at all."""
    q, k, v = _qkv(1, 40, 57, 4, 4, 32, dtype=dtype)
    check_flash(q, k, v, causal=True, sinks=_sinks(4, sinks_dtype))
    none = torch.full((4,), float("-inf"), device=DEVICE, dtype=sinks_dtype)
    torch.testing.assert_close(qflash.flash_attn_func(q, k, v, causal=True, sinks=none),
                               qflash.flash_attn_func(q, k, v, causal=True), rtol=0, atol=0)


@pytest.mark.parametrize("num_splits", [1, 3, 40])
@pytest.mark.parametrize("sq,sk,kw", [(1, 239, {}), (1, 1023, {"causal": True}), (8, 200, {"window_size": (50, 0)}),
                                      (3, 2, {"causal": True})])
def test_sinks_with_split_keys_and_grouped_heads(monkeypatch, num_splits, sq, sk, kw):
    """Decoding: the sink goes into one key share only (40: most shares empty, the sink's among
    them where it falls on an empty one), with the grouped heads of a key/value head in one row
    block, each row its own head's sink."""
    _split_keys(monkeypatch, num_splits)
    q, k, v = _qkv(2, sq, sk, 8, 2, 24)
    check_flash(q, k, v, sinks=_sinks(8), **kw)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("paged", [False, True])
def test_sinks_with_a_kv_cache(monkeypatch, num_splits, paged):
    """flash_attn_with_kvcache with sinks: ragged caches (an empty one: the sink alone), new keys,
    grouped heads; the paged cache in pages of 16."""
    _split_keys(monkeypatch, num_splits)
    q, k_cache, v_cache, k, v = _kvcache(new=2, sq=2)
    lens = torch.tensor([0, 1, 63, 113], dtype=torch.int32, device=DEVICE)
    sinks = _sinks(8)
    if not paged:
        _check_kvcache(q, k_cache, v_cache, k, v, lens, causal=True, sinks=sinks)
        return
    k_pages, v_pages, table = paged_cache(k_cache, v_cache, 16, spare_pages=2)
    with poisoned():
        out, lse = qflash.flash_attn_with_kvcache(q, k_pages, v_pages, k, v, cache_seqlens=lens, block_table=table,
                                                  causal=True, sinks=sinks, return_softmax_lse=True)
    ref, ref_lse, _, _ = attention_kvcache_ref(*_f64(q, k_cache, v_cache, k, v), lens, causal=True,
                                               sinks=sinks.double())
    pt, _, _, _ = attention_kvcache_ref(q, k_cache, v_cache, k, v, lens, causal=True, sinks=sinks, upcast=False,
                                        reorder_ops=True)
    assert_flash_rule(out, ref, pt)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-4)


def test_sinks_varlen_and_sdpa():
    """Packed sequences (an empty one, a one-key one; keys packed and in pages of 16) and sdpa (a
    boolean mask with fully masked rows: the sink alone; leading dims; one head of (seqlen,
    headdim))."""
    lens_q, lens_k = [1, 63, 0, 40, 17], [5, 63, 9, 11, 30]
    q, k, v, cu_q, cu_k = _varlen(lens_q, lens_k)
    _check_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, sinks=_sinks(4))
    _check_varlen_paged([1, 3, 0, 5], [70, 1, 9, 130], 16, 144, causal=True, sinks=_sinks(4))
    query = torch.randn(2, 4, 30, 32, device=DEVICE).half()
    key, value = torch.randn(2, 2, 41, 32, device=DEVICE).half(), torch.randn(2, 2, 41, 32, device=DEVICE).half()
    mask = torch.rand(2, 1, 30, 41, device=DEVICE) > 0.3
    mask[:, :, 3] = False
    sinks = _sinks(4)
    out = _check_sdpa(query, key, value, attn_mask=mask, enable_gqa=True, sinks=sinks)
    assert out[:, :, 3].abs().max() == 0
    _check_sdpa(query.unsqueeze(0), key.repeat(1, 2, 1, 1).unsqueeze(0), value.repeat(1, 2, 1, 1).unsqueeze(0),
                is_causal=True, sinks=sinks)
    _check_sdpa(query[0, 0], key[0, 0], value[0, 0], sinks=sinks[:1])


def test_large_logits_and_custom_scale():
    # Scores of magnitude ~50: exp() overflows unless the running max does its job.
    q, k, v = _qkv(1, 64, 96, 2, 2, 64, scale=7.0)
    check_flash(q, k, v, softmax_scale=0.2)


def test_noncontiguous_inputs_are_not_copied():
    # q, k, v as strided views of one packed buffer, plus a (B, H, S, D) transposed layout.
    qkv = torch.randn(2, 41, 3, 4, 32, device=DEVICE).half()
    q, k, v = qkv.unbind(dim=2)
    assert not q.is_contiguous()
    check_flash(q, k, v, causal=True)
    out_packed = qflash.flash_attn_qkvpacked_func(qkv, causal=True)
    torch.testing.assert_close(out_packed, qflash.flash_attn_func(q, k, v, causal=True), rtol=0, atol=0)
    kv = torch.stack([k, v], dim=2)
    torch.testing.assert_close(qflash.flash_attn_kvpacked_func(q, kv, causal=True), out_packed, rtol=0, atol=0)
    qt = torch.randn(2, 4, 41, 32, device=DEVICE).half().transpose(1, 2)  # heads-major storage
    check_flash(qt, k, v)


def test_inputs_not_modified():
    q, k, v = _qkv(1, 20, 30, 2, 2, 32)
    copies = [t.clone() for t in (q, k, v)]
    qflash.flash_attn_func(q, k, v, causal=True)
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t, c)


# ----------------------------------------------------------------------------------------------
# Variable-length sequences.
# ----------------------------------------------------------------------------------------------
def _varlen(lens_q, lens_k, h=4, hkv=2, d=32, dtype=torch.float16, padding=(0, 0)):
    """Packed sequences, and ``padding`` (query rows, key rows) after the last one."""
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(lens_q) + padding[0], h, d, device=DEVICE).to(dtype)
    k = torch.randn(sum(lens_k) + padding[1], hkv, d, device=DEVICE).to(dtype)
    v = torch.randn(sum(lens_k) + padding[1], hkv, d, device=DEVICE).to(dtype)
    return q, k, v, cu_q, cu_k


def _check_varlen(q, k, v, cu_q, cu_k, max_q, max_k, block_table=None, packed_kv=None, **kw):
    """flash_attn_varlen_func (block_table None, as flash-attn's callers pass it, or a paged k / v
    whose keys ``packed_kv`` holds packed) against the float64 reference by the rule, and its
    lse; returns (out, lse)."""
    with poisoned():
        out, lse, _ = qflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                    return_attn_probs=True, block_table=block_table, **kw)
    assert_written(out)
    assert_written(lse)
    k, v = packed_kv or (k, v)
    ref, ref_lse = attention_varlen_ref(*_f64(q, k, v), cu_q, cu_k, **kw)
    pt, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=False, reorder_ops=True, **kw)
    assert_flash_rule(out, ref, pt)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=1e-4, atol=1e-4)
    return out, lse


@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window_size": (5, 2)}, {"softcap": 3.0}])
def test_varlen(kw):
    lens_q, lens_k = [1, 63, 0, 40, 17], [5, 63, 9, 11, 30]
    q, k, v, cu_q, cu_k = _varlen(lens_q, lens_k)
    _, lse = _check_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
    assert lse.shape == (4, sum(lens_q))


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("paged", [False, True])
def test_varlen_padding_after_the_last_sequence(monkeypatch, num_splits, paged):
    """Packed rows after the last sequence (cu_seqlens[-1] < total: padding, as fixed-size
    buffers leave) come out as rows that see no key: out 0 and lse +inf, never what the buffer
    held; split and not, packed keys and paged; a sequence of five rows and no key beside them."""
    _split_keys(monkeypatch, num_splits)
    lens_q, lens_k = [3, 5, 70], [9, 0, 65]
    q, k, v, cu_q, cu_k = _varlen(lens_q, lens_k, padding=(75, 6))
    if not paged:
        out, lse = _check_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), sinks=_sinks(4))
    else:
        rows = [torch.randn(3, 70, *t.shape[1:], device=DEVICE).to(t.dtype) for t in (k, v)]
        for b, n in enumerate(lens_k):
            for r, t in zip(rows, (k, v)):
                r[b, :n] = t[int(cu_k[b]): int(cu_k[b]) + n]
        k_pages, v_pages, table = paged_cache(*rows, 16, spare_pages=1)
        out, lse = _check_varlen(q, k_pages, v_pages, cu_q, cu_k, max(lens_q), max(lens_k), block_table=table,
                                 packed_kv=(k, v), causal=True)
    assert torch.equal(out[78:], torch.zeros_like(out[78:])) and torch.isposinf(lse[:, 78:]).all()


def test_varlen_padding_starts_after_every_sequence():
    """Bad contents whose last entry is not the furthest ([0, 50, 30]: the second sequence ends
    before it starts): padding starts after the furthest entry, so the first sequence's rows keep
    its output and rows 50-59 are padding."""
    q, k, v, _, _ = _varlen([50, 10], [50, 10])
    cu = torch.tensor([0, 50, 30], dtype=torch.int32, device=DEVICE)
    with poisoned(FINITE_POISON):
        out, lse, _ = qflash.flash_attn_varlen_func(q, k, v, cu, cu, 50, 50, causal=True, return_attn_probs=True)
    ref, _ = attention_ref(*_f64(q[None, :50], k[None, :50], v[None, :50]), causal=True)
    pt, _ = attention_ref(q[None, :50], k[None, :50], v[None, :50], causal=True, upcast=False, reorder_ops=True)
    assert_flash_rule(out[None, :50], ref, pt)
    assert torch.equal(out[50:], torch.zeros_like(out[50:])) and torch.isposinf(lse[:, 50:]).all()


def test_varlen_alibi_per_sequence_and_packed():
    lens = [12, 31, 7]
    q, k, v, cu, _ = _varlen(lens, lens, h=2, hkv=2)
    slopes = torch.rand(3, 2, device=DEVICE)
    out = qflash.flash_attn_varlen_func(q, k, v, cu, cu, 31, 31, causal=True, alibi_slopes=slopes)
    ref, _ = attention_varlen_ref(*_f64(q, k, v), cu, cu, causal=True, alibi_slopes=slopes)
    pt, _ = attention_varlen_ref(q, k, v, cu, cu, causal=True, alibi_slopes=slopes, upcast=False, reorder_ops=True)
    assert_flash_rule(out, ref, pt)
    qkv = torch.stack([q, k, v], dim=1)
    packed = qflash.flash_attn_varlen_qkvpacked_func(qkv, cu, 31, causal=True, alibi_slopes=slopes)
    torch.testing.assert_close(packed, out, rtol=0, atol=0)
    kvp = qflash.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), cu, cu, 31, 31, causal=True,
                                                 alibi_slopes=slopes)
    torch.testing.assert_close(kvp, out, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# sdpa: PyTorch semantics.
# ----------------------------------------------------------------------------------------------
def _check_sdpa(query, key, value, **kw):
    with poisoned():
        out = qflash.sdpa(query, key, value, **kw)
    assert out.shape == query.shape
    assert_written(out)
    kw64 = dict(kw)
    if kw.get("attn_mask") is not None and kw["attn_mask"].is_floating_point():
        kw64["attn_mask"] = kw["attn_mask"].double()
    ref = sdpa_ref(*_f64(query, key, value), **kw64)
    pt = sdpa_ref(query, key, value, upcast=False, **kw)
    assert_flash_rule(out, ref, pt)
    return out


@pytest.mark.parametrize("sq,sk", [(37, 37), (20, 53), (53, 20)])
def test_sdpa_causal_top_left(sq, sk):
    q = torch.randn(2, 3, sq, 32, device=DEVICE).half()
    k, v = torch.randn(2, 3, sk, 32, device=DEVICE).half(), torch.randn(2, 3, sk, 32, device=DEVICE).half()
    _check_sdpa(q, k, v, is_causal=True)


@pytest.mark.parametrize("mask_shape", [(2, 3, 29, 45), (29, 45), (2, 1, 1, 45)])
@pytest.mark.parametrize("kind", ["bool", "float", "float32"])
def test_sdpa_masks(kind, mask_shape):
    """Boolean and additive masks; an additive one may be float32 whatever the query's dtype
    (PyTorch's rule)."""
    q = torch.randn(2, 3, 29, 32, device=DEVICE).half()
    k, v = torch.randn(2, 3, 45, 32, device=DEVICE).half(), torch.randn(2, 3, 45, 32, device=DEVICE).half()
    if kind == "bool":
        mask = torch.rand(mask_shape, device=DEVICE) > 0.4
    else:
        mask = torch.randn(mask_shape, device=DEVICE) * 2
        mask = mask if kind == "float32" else mask.half()
    before = mask.clone()
    _check_sdpa(q, k, v, attn_mask=mask)
    assert torch.equal(mask, before) and mask.dtype == before.dtype  # the caller's mask is left as it was


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_softcap_with_and_without_mask(causal):
    """qflash's extension of SDPA: Gemma 2's soft-capped scores, before the masks."""
    q = torch.randn(2, 3, 29, 40, device=DEVICE).half() * 3
    k, v = torch.randn(2, 3, 29, 40, device=DEVICE).half() * 3, torch.randn(2, 3, 29, 40, device=DEVICE).half()
    mask = None if causal else torch.rand(2, 1, 29, 29, device=DEVICE) > 0.3
    _check_sdpa(q, k, v, attn_mask=mask, is_causal=causal, softcap=5.0)
    with pytest.raises(ValueError, match="softcap"):
        qflash.sdpa(q, k, v, softcap=-1.0)


def test_sdpa_float64_boolean_mask_is_the_additive_one():
    """float64 boolean masks go to the kernel as 0 / -inf added to the scores (Triton 3.6 cannot
    build the boolean-mask kernel in float64 for sm_90): the same result, bit for bit."""
    q, k, v = (torch.randn(2, 3, 21, 24, device=DEVICE, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(2, 1, 21, 21, device=DEVICE) > 0.3
    mask[0, 0, 5] = False  # a row that sees no key
    additive = torch.zeros(mask.shape, dtype=torch.float64, device=DEVICE).masked_fill(~mask, float("-inf"))
    with poisoned():
        out = qflash.sdpa(q, k, v, attn_mask=mask)
    assert_written(out)
    assert rel_l2_err(out, sdpa_ref(q, k, v, attn_mask=mask)) < 1e-12
    assert torch.equal(out, qflash.sdpa(q, k, v, attn_mask=additive))
    assert mask.dtype == torch.bool  # the caller's mask is left as it was


@gpu
def test_gpu_sdpa_float64_boolean_mask():
    """float64 with a boolean mask on the GPU (Triton 3.6 cannot build the boolean-mask kernel in
    float64 for sm_90; qflash.sdpa sends the mask as 0 / -inf added)."""
    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.float64) for _ in range(3))
    mask = torch.rand(2, 1, 300, 300, device="cuda") > 0.3
    with poisoned():
        out = qflash.sdpa(q, k, v, attn_mask=mask)
    assert_written(out)
    assert rel_l2_err(out, sdpa_ref(q, k, v, attn_mask=mask)) < 1e-12


def test_sdpa_fully_masked_rows_give_zero():
    q = torch.randn(1, 2, 8, 16, device=DEVICE).half()
    k, v = torch.randn(1, 2, 12, 16, device=DEVICE).half(), torch.randn(1, 2, 12, 16, device=DEVICE).half()
    mask = torch.rand(8, 12, device=DEVICE) > 0.5
    mask[3] = False
    out = _check_sdpa(q, k, v, attn_mask=mask)
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
    # as PyTorch's own since 2.5 (its "safe softmax"; NaN before)
    torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(torch_out[:, :, 3], out[:, :, 3])


def test_sdpa_gqa_and_3d():
    q = torch.randn(2, 6, 19, 32, device=DEVICE).half()
    k, v = torch.randn(2, 2, 23, 32, device=DEVICE).half(), torch.randn(2, 2, 23, 32, device=DEVICE).half()
    _check_sdpa(q, k, v, enable_gqa=True, scale=0.3)
    out3 = qflash.sdpa(q[0], k[0], v[0], enable_gqa=True, scale=0.3)
    torch.testing.assert_close(out3, qflash.sdpa(q, k, v, enable_gqa=True, scale=0.3)[0], rtol=0, atol=0)


def test_sdpa_takes_any_leading_dims_as_pytorch():
    """PyTorch's (batch, ..., heads, seqlen, headdim): 5-D inputs with GQA and a mask that
    broadcasts over a leading dim give the 4-D call's bits on the flattened inputs, PyTorch's
    result in float64, and the mask its gradient in its own shape (5-D used to be refused)."""
    q = torch.randn(2, 3, 4, 9, 16, device=DEVICE, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 3, 2, 11, 16, device=DEVICE, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.randn(3, 1, 9, 11, device=DEVICE, dtype=torch.float64, requires_grad=True)
    with poisoned():
        out = qflash.sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    assert out.shape == (2, 3, 4, 9, 16)
    assert_written(out)
    flat = qflash.sdpa(q.reshape(6, 4, 9, 16), k.reshape(6, 2, 11, 16), v.reshape(6, 2, 11, 16),
                       attn_mask=mask.expand(2, 3, 4, 9, 11).reshape(6, 4, 9, 11), enable_gqa=True)
    assert torch.equal(out, flat.reshape(out.shape))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert rel_l2_err(out, ref) < 1e-12
    grads = torch.autograd.grad(out.sum(), (q, k, v, mask))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v, mask))
    for g, r in zip(grads, ref_grads):
        assert g.shape == r.shape and rel_l2_err(g, r) < 1e-12
    with pytest.raises(ValueError, match="key must have query's leading dims"):
        qflash.sdpa(q, k[:1], v[:1], enable_gqa=True)


def test_sdpa_takes_two_dims_as_pytorch():
    """(seqlen, headdim) alone, one head (PyTorch takes it; it used to be refused): PyTorch's result
    and gradients in float64, the mask's too, and the 3-D call's bits."""
    q = torch.randn(9, 16, device=DEVICE, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(11, 16, device=DEVICE, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.randn(9, 11, device=DEVICE, dtype=torch.float64, requires_grad=True)
    with poisoned():
        out = qflash.sdpa(q, k, v, attn_mask=mask)
    assert out.shape == (9, 16)
    assert_written(out)
    assert torch.equal(out, qflash.sdpa(q[None], k[None], v[None], attn_mask=mask)[0])
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert rel_l2_err(out, ref) < 1e-12
    for g, r in zip(torch.autograd.grad(out.sum(), (q, k, v, mask)), torch.autograd.grad(ref.sum(), (q, k, v, mask))):
        assert g.shape == r.shape and rel_l2_err(g, r) < 1e-12
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert rel_l2_err(qflash.sdpa(q, k, v, is_causal=True), causal) < 1e-12
    with pytest.raises(ValueError, match="key must be \\(seqlen_k, headdim\\) as query is"):
        qflash.sdpa(q, k[None], v)


@pytest.mark.parametrize("headdim_v", [24, 72])
def test_sdpa_value_head_dim_of_its_own(headdim_v):
    """PyTorch takes a value head dim apart from query's and key's (MLA: 192 / 128; it used to be
    refused): in float16 the flash-attn rule against float64 (causal, GQA); in float64 PyTorch's
    result and gradients (a mask's too), also with 5-D inputs."""
    q = torch.randn(2, 4, 37, 40, device=DEVICE).half()
    k, v = torch.randn(2, 2, 53, 40, device=DEVICE).half(), torch.randn(2, 2, 53, headdim_v, device=DEVICE).half()
    with poisoned():
        out = qflash.sdpa(q, k, v, is_causal=True, enable_gqa=True)
    assert out.shape == (2, 4, 37, headdim_v) and out.is_contiguous()
    assert_written(out)
    kw = dict(is_causal=True, enable_gqa=True)
    assert_flash_rule(out, sdpa_ref(*_f64(q, k, v), **kw), sdpa_ref(q, k, v, upcast=False, **kw))

    q, k = (torch.randn(2, 3, 4, 9, 16, device=DEVICE, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, 4, 9, headdim_v // 2, device=DEVICE, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(9, 9, device=DEVICE, dtype=torch.float64, requires_grad=True)
    out = qflash.sdpa(q, k, v, attn_mask=mask, scale=0.3)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    assert out.shape == ref.shape and rel_l2_err(out, ref) < 1e-12
    for g, r in zip(torch.autograd.grad(out.sum(), (q, k, v, mask)), torch.autograd.grad(ref.sum(), (q, k, v, mask))):
        assert g.shape == r.shape and rel_l2_err(g, r) < 1e-12
    with pytest.raises(ValueError, match="at most 256, got 16 \\(query, key\\) and 300 \\(value\\)"):
        qflash.sdpa(q[0, 0], k[0, 0], torch.randn(2, 4, 9, 300, device=DEVICE, dtype=torch.float64)[0])


@pytest.mark.parametrize("scale", [-0.4, 0.0])
def test_sdpa_takes_a_scale_of_any_sign(scale):
    """PyTorch takes any finite scale (qflash used to refuse <= 0; the kernels rescale by each row's
    largest raw product, so the op layer negates or zeroes a copy of query): float64 output and
    gradients against the reference, causal with GQA and with a float mask; float16 by the
    flash-attn rule. query itself is left as it was."""
    q = torch.randn(2, 4, 19, 24, device=DEVICE, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 27, 24, device=DEVICE, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.randn(19, 27, device=DEVICE, dtype=torch.float64, requires_grad=True)
    q_before = q.detach().clone()
    for kw in (dict(is_causal=True, enable_gqa=True), dict(attn_mask=mask, enable_gqa=True)):
        inputs = (q, k, v, mask) if "attn_mask" in kw else (q, k, v)
        out, ref = qflash.sdpa(q, k, v, scale=scale, **kw), sdpa_ref(q, k, v, scale=scale, **kw)
        assert rel_l2_err(out, ref) < 1e-12
        for g, r in zip(torch.autograd.grad(out.sum(), inputs), torch.autograd.grad(ref.sum(), inputs)):
            assert rel_l2_err(g, r) < 1e-12 or (scale == 0 and g.abs().max() == r.abs().max() == 0)
    assert torch.equal(q.detach(), q_before)
    q16, k16, v16 = (t.detach().half() for t in (q, k, v))
    with poisoned():
        out = qflash.sdpa(q16, k16, v16, scale=scale, is_causal=True, enable_gqa=True)
    assert_written(out)
    kw = dict(scale=scale, is_causal=True, enable_gqa=True)
    assert_flash_rule(out, sdpa_ref(*_f64(q16, k16, v16), **kw), sdpa_ref(q16, k16, v16, upcast=False, **kw))
    with pytest.raises(ValueError, match="scale must be a finite number, got inf"):
        qflash.sdpa(q16, k16, v16, scale=float("inf"), enable_gqa=True)


def test_sdpa_under_autocast_casts_as_pytorch():
    """Under torch.autocast PyTorch's SDPA takes its floating inputs in autocast's dtype (float16
    here), masks included, whatever mix they came in (float32 query and key beside a float16 value,
    as rotary embeddings leave them in a model with float32 weights); qflash.sdpa used to run such
    inputs in float32, or refuse the mix. Output dtype and values as PyTorch's, gradients back in
    the inputs' dtypes; float64 stays float64, as under autocast."""
    q, k = (torch.randn(2, 3, 21, 32, device=DEVICE, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, 21, 32, device=DEVICE).half().requires_grad_()
    mask = torch.randn(21, 21, device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.float16):
        out = qflash.sdpa(q, k, v, attn_mask=mask)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out64 = qflash.sdpa(*(t.detach().double() for t in (q, k, v)), attn_mask=mask.double())
    assert out.dtype == ref.dtype == torch.float16 and out64.dtype == torch.float64
    q16, k16, v16, m16 = (t.detach().half() for t in (q, k, v, mask))
    assert_flash_rule(out, sdpa_ref(*_f64(q16, k16, v16, m16)[:3], attn_mask=m16.double()),
                      sdpa_ref(q16, k16, v16, attn_mask=m16, upcast=False))
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert [g.dtype for g in grads] == [torch.float32, torch.float32, torch.float16]


def test_sdpa_matches_pytorch_function():
    q = torch.randn(1, 2, 33, 32, device=DEVICE)
    k, v = torch.randn(1, 2, 33, 32, device=DEVICE), torch.randn(1, 2, 33, 32, device=DEVICE)
    torch.testing.assert_close(qflash.sdpa(q, k, v, is_causal=True),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Keys split into shares (flash-decoding): where (batch, head, row block) programs are too few.
# ----------------------------------------------------------------------------------------------
def _split_keys(monkeypatch, num_splits):
    """Make the public functions split the keys into ``num_splits`` shares here (on the GPU the
    launcher chooses; in the interpreter it never splits on its own)."""
    default = attention_kernels.default_config
    monkeypatch.setattr(attention_kernels, "default_config",
                        lambda *a, **kw: dataclasses.replace(default(*a, **kw), num_splits=num_splits))


@pytest.mark.parametrize("num_splits", [2, 3, 40])
@pytest.mark.parametrize("sq,sk,kw", [
    (1, 239, {}), (1, 1023, {"causal": True}), (3, 113, {"causal": True}), (63, 63, {"causal": True}),
    (1, 1, {}), (7, 200, {"window_size": (50, 0)}), (2, 150, {"softcap": 5.0, "alibi_slopes": "yes"}),
])
def test_split_keys_match_the_reference(monkeypatch, num_splits, sq, sk, kw):
    """Decoding sizes (one or a few query rows, bottom-right causal), ragged key counts, more
    shares than key blocks (40: most shares empty), windows, soft-capping, ALiBi; output and lse
    by the flash-attn rule, every element written; the gradients through a split forward."""
    _split_keys(monkeypatch, num_splits)
    kw = dict(kw)
    if kw.get("alibi_slopes") == "yes":
        kw["alibi_slopes"] = torch.rand(4, device=DEVICE)
    q, k, v = _qkv(2, sq, sk, 4, 2, 40)
    out, _ = check_flash(q, k, v, **kw)
    for t in (q, k, v):
        t.requires_grad_()
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(qflash.flash_attn_func(q, k, v, **kw), (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_grads = torch.autograd.grad(attention_ref(q64, k64, v64, **kw)[0], (q64, k64, v64), dout.double())
    pt = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kw)[0]
    pt_grads = torch.autograd.grad(pt, (q, k, v), dout)
    for g, r, p, name in zip(grads, ref_grads, pt_grads, "qkv"):
        assert_flash_rule(g, r, p, factor=3, what=f"d{name}")


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("sq,kw", [(1, {}), (3, {"causal": True}), (8, {"window_size": (9, 0)}),
                                   (2, {"softcap": 4.0, "causal": True})])
def test_grouped_heads_share_a_row_block(monkeypatch, num_splits, sq, kw):
    """Decoding with grouped heads: the four query heads of a key/value head as the rows of one
    block (4 x 8 = 32 rows here), which reads the keys and values once for all four; by the
    flash-attn rule against the reference, query heads kept apart (they see different queries)."""
    _split_keys(monkeypatch, num_splits)
    q, k, v = _qkv(2, sq, 77, 8, 2, 24)
    assert attention_kernels.packs_gqa(q, k, attention_kernels.AttnOptions(1.0))
    check_flash(q, k, v, **kw)
    q[:, :, 1::4] += 1.0  # one head of each group changes: only its rows may move
    out, _ = check_flash(q, k, v, **kw)
    assert attention_kernels.packs_gqa(q, k, attention_kernels.AttnOptions(1.0, alibi_slopes=q)) is False


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window_size": (40, 0), "softcap": 4.0}])
def test_grouped_heads_share_a_row_block_varlen(monkeypatch, num_splits, kw):
    """Packed sequences decode with packed heads too (a serving step: a few new rows a sequence
    against its own cache), an empty sequence and a one-key cache among them; output and lse
    against the reference."""
    _split_keys(monkeypatch, num_splits)
    lens_q, lens_k = [1, 4, 0, 1, 3], [300, 1, 9, 129, 40]
    q, k, v, cu_q, cu_k = _varlen(lens_q, lens_k, h=8, hkv=2, d=24)
    opts = attention_kernels.AttnOptions(1.0, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4, max_seqlen_k=300)
    assert attention_kernels.forward_plan(q, k, opts).pack
    _check_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **kw)


def test_grouped_heads_packed_varlen_max_seqlen_under_the_truth_gives_nan_rows():
    """Where heads are packed, a sequence whose group of rows overflows the one row block comes
    out NaN in every head of every group, like the unpacked grid's rows past its end."""
    lens = [1, 9, 2]
    q, k, v, cu, _ = _varlen(lens, [20, 30, 5], h=8, hkv=2)
    cu_k = torch.tensor([0, 20, 50, 55], dtype=torch.int32, device=DEVICE)
    opts = attention_kernels.AttnOptions(1.0, cu_seqlens_q=cu, cu_seqlens_k=cu_k, max_seqlen_q=2, max_seqlen_k=30)
    assert attention_kernels.forward_plan(q, k, opts).pack
    with poisoned(FINITE_POISON):
        out, lse, _ = qflash.flash_attn_varlen_func(q, k, v, cu, cu_k, 2, 30, return_attn_probs=True)
        want, want_lse, _ = qflash.flash_attn_varlen_func(q, k, v, cu, cu_k, 9, 30, return_attn_probs=True)
    long = torch.zeros(out.shape[0], dtype=torch.bool)
    long[1:10] = True
    assert out[long].isnan().all() and lse[:, long].isnan().all()
    # The two launches' row blocks differ (16 and 64 rows), and on the GPU so may a row's sum order.
    torch.testing.assert_close(out[~long], want[~long], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(lse[:, ~long], want_lse[:, ~long], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("sq", [1, 3])
def test_grouped_heads_packed_with_a_mask_every_head_shares(monkeypatch, num_splits, sq):
    """transformers' padded batches decode with a boolean mask broadcast over the heads (B, 1, Sq,
    Sk): its plane is read at the packed rows' query positions. A float mask of one plane a head
    keeps the heads apart (unpacked); both by the rule."""
    _split_keys(monkeypatch, num_splits)
    query = torch.randn(2, 8, sq, 40, device=DEVICE).half()
    key, value = (torch.randn(2, 2, 150, 40, device=DEVICE).half() for _ in range(2))
    mask = torch.rand(2, 1, sq, 150, device=DEVICE) > 0.3
    mask[1, :, :, :100] = False  # left padding in the second sequence
    bias = mask.expand(2, 8, sq, 150)
    opts = attention_kernels.AttnOptions(1.0, bias=bias)
    assert attention_kernels.forward_plan(query.transpose(1, 2), key.transpose(1, 2), opts).pack
    _check_sdpa(query, key, value, attn_mask=mask, enable_gqa=True)
    _check_sdpa(query, key, value, attn_mask=mask[:, :, :1].expand(2, 1, sq, 150), enable_gqa=True)
    per_head = torch.randn(2, 8, sq, 150, device=DEVICE)
    assert not attention_kernels.packs_gqa(query.transpose(1, 2), key.transpose(1, 2),
                                           attention_kernels.AttnOptions(1.0, bias=per_head))
    _check_sdpa(query, key, value, attn_mask=per_head, enable_gqa=True)


# ----------------------------------------------------------------------------------------------
# flash_attn_with_kvcache: new rows against a KV cache, new keys appended in place.
# ----------------------------------------------------------------------------------------------
def _kvcache(batch=4, slots=128, new=0, sq=1, h=8, hkv=2, d=40, dtype=torch.float16):
    q = torch.randn(batch, sq, h, d, device=DEVICE).to(dtype)
    k_cache, v_cache = (torch.randn(batch, slots, hkv, d, device=DEVICE).to(dtype) for _ in range(2))
    k, v = ((torch.randn(batch, new, hkv, d, device=DEVICE).to(dtype) for _ in range(2)) if new else (None, None))
    return q, k_cache, v_cache, k, v


def _check_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, **kw):
    """The call against the float64 reference by the flash-attn rule, its lse, and the caches
    after it (the new rows in place, every other slot as it was; rotated keys within rounding)."""
    kw64 = dict(kw)
    for name in ("rotary_cos", "rotary_sin"):
        if kw.get(name) is not None:
            kw64[name] = kw[name].double()
    ref, ref_lse, k_want, v_want = attention_kvcache_ref(*_f64(q, k_cache, v_cache), *(_f64(k, v) if k is not None
                                                         else (None, None)), cache_seqlens, **kw64)
    pt, _, _, _ = attention_kvcache_ref(q, k_cache, v_cache, k, v, cache_seqlens, upcast=False, reorder_ops=True,
                                        **kw)
    q_before = q.clone()
    with poisoned():
        out, lse = qflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                                  return_softmax_lse=True, **kw)
    assert_written(out)
    assert torch.equal(q, q_before)
    assert_flash_rule(out, ref, pt)
    finite = torch.isfinite(ref_lse)
    eps = torch.finfo(q.dtype).eps
    tol = 1e-4 if kw.get("rotary_cos") is None else 2 * eps  # rotated q and keys rounded to q's dtype first
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=tol, atol=tol)
    if kw.get("rotary_cos") is None:
        assert torch.equal(k_cache.double(), k_want) and torch.equal(v_cache.double(), v_want)
    else:  # rotated in float32 and rounded to the cache's dtype: within one rounding of float64's
        torch.testing.assert_close(k_cache.double(), k_want, rtol=eps, atol=eps)
        assert torch.equal(v_cache.double(), v_want)
    return out


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("new,sq,kw", [
    (0, 1, {}), (1, 1, {"causal": True}), (3, 3, {"causal": True}), (3, 2, {"window_size": (20, 0)}),
    (2, 1, {"softcap": 5.0, "alibi_slopes": "yes", "causal": True}), (0, 5, {"causal": True}),
])
def test_kvcache_matches_the_reference(monkeypatch, num_splits, new, sq, kw):
    """Ragged caches (0, 1, 63 and 113 keys of 128 slots, with the new ones after them), grouped
    heads, a head dim of 40, causal aligned to each sequence's last key; split and not."""
    _split_keys(monkeypatch, num_splits)
    kw = dict(kw)
    if kw.get("alibi_slopes") == "yes":
        kw["alibi_slopes"] = torch.rand(4, 8, device=DEVICE)
    q, k_cache, v_cache, k, v = _kvcache(new=new, sq=sq)
    lens = torch.tensor([0, 1, 63, 113], dtype=torch.int32, device=DEVICE)
    _check_kvcache(q, k_cache, v_cache, k, v, lens, **kw)


def _rotary_tables(slots, rotary_dim, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(slots + 5, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [seqlen_ro, rotary_dim / 2]
    return angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rotary_dim", [16, 40])
@pytest.mark.parametrize("kw", [{"causal": True}, {}, {"window_size": (30, 0)}])
def test_kvcache_rotary(interleaved, rotary_dim, kw):
    """Rotary embeddings as flash-attn applies them: the new keys at their positions, q at its
    rows' positions (causal, windows) or all at the cache's length (neither), the first rotary_dim
    dims of a head of 40, pairs interleaved (GPT-J) or in halves (GPT-NeoX)."""
    q, k_cache, v_cache, k, v = _kvcache(new=3, sq=3)
    cos, sin = _rotary_tables(128, rotary_dim)
    lens = torch.tensor([0, 1, 63, 113], dtype=torch.int32, device=DEVICE)
    _check_kvcache(q, k_cache, v_cache, k, v, lens, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved,
                   **kw)


def test_kvcache_rotary_more_query_rows_than_new_keys():
    """Five query rows after two new keys, causal: q's rows rotated at cache_seqlens[b] + i, up to
    three positions past the cache's last slot (the table holds them)."""
    q, k_cache, v_cache, k, v = _kvcache(new=2, sq=5)
    cos, sin = _rotary_tables(128, 16)  # 133 rows: positions up to 126 + 4
    lens = torch.tensor([0, 1, 63, 126], dtype=torch.int32, device=DEVICE)
    _check_kvcache(q, k_cache, v_cache, k, v, lens, rotary_cos=cos, rotary_sin=sin, causal=True)


def test_kvcache_chunked_prefill():
    """A chunk of 70 new rows a sequence (more than one row block, heads not packed) into caches
    holding 0-113 keys, causal: each row sees the cache and the chunk up to itself."""
    q, k_cache, v_cache, k, v = _kvcache(batch=4, slots=200, new=70, sq=70)
    lens = torch.tensor([0, 1, 63, 113], dtype=torch.int32, device=DEVICE)
    _check_kvcache(q, k_cache, v_cache, k, v, lens, causal=True)


@pytest.mark.parametrize("new", [0, 2])
@pytest.mark.parametrize("cache_seqlens", [None, 70, "int64"])
def test_kvcache_seqlens_forms(cache_seqlens, new):
    """cache_seqlens as None (every slot a key: new keys go in the last slots), an int for every
    sequence, an int64 tensor; with new keys and without."""
    q, k_cache, v_cache, k, v = _kvcache(batch=2, slots=96, new=new, sq=2)
    if cache_seqlens == "int64":
        cache_seqlens = torch.tensor([5, 94 - new], dtype=torch.int64, device=DEVICE)
    _check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, causal=True)


def test_kvcache_matches_flash_attn_func_on_a_full_cache():
    """Every slot a key: the same numbers as flash_attn_func on the cache (both kernels' rounding)."""
    q, k_cache, v_cache, _, _ = _kvcache(batch=3, slots=77, sq=4, d=64)
    want = qflash.flash_attn_func(q, k_cache, v_cache, causal=True)
    got = qflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=77, causal=True)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_kvcache_overflow_gives_nan_and_stays_in_bounds():
    """A sequence whose new keys would pass its cache's end gets NaN outputs and its rows that
    fit go in; the other sequences are as a good call gives them; set_debug(True) raises."""
    q, k_cache, v_cache, k, v = _kvcache(batch=3, slots=64, new=3, sq=1)
    lens = torch.tensor([10, 62, 30], dtype=torch.int32, device=DEVICE)  # 62 + 3 > 64
    k_before = k_cache.clone()
    with poisoned(FINITE_POISON):
        out = qflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens)
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()
    assert torch.equal(k_cache[1, 62:], k[1, :2]) and torch.equal(k_cache[1, :62], k_before[1, :62])
    good = lens.clone()
    good[1] = 0
    ref, _, _, _ = attention_kvcache_ref(*_f64(q, k_before, v_cache), *_f64(k, v), good)
    for b in (0, 2):
        torch.testing.assert_close(out[b].double(), ref[b], rtol=2e-3, atol=2e-3)
    qflash.set_debug(True)
    try:
        with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, 61\]"):
            qflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens)
    finally:
        qflash.set_debug(False)


def test_kvcache_under_torch_compile_runs_eagerly():
    """torch.compile takes a function that calls it (the call itself runs eagerly, a graph break):
    the same output, and the caches written in place the same way."""
    q, k_cache, v_cache, k, v = _kvcache(batch=2, slots=20, new=1, h=4, d=32)
    lens = torch.tensor([3, 10], dtype=torch.int32, device=DEVICE)

    def step(q, k_cache, v_cache, k, v):
        return qflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True) * 2

    caches = (k_cache.clone(), v_cache.clone())
    want = step(q, *caches, k, v)
    got = torch.compile(step)(q, k_cache, v_cache, k, v)
    assert torch.equal(got, want) and torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])


@pytest.mark.parametrize("kw", [{"causal": True}, {"alibi_slopes": "yes"}, {"rotary": True, "causal": True},
                                {"window_size": (20, 0)}])
def test_kvcache_batch_idx_and_leftpad(kw):
    """Sequences on cache rows of their own choosing (3 of 5 rows, out of order) with left
    padding: the keys start at the pad (causal, ALiBi and windows count from there; rotary goes by
    cache slot, as flash-attn's), the new rows go into the chosen rows; split in 3."""
    kw = dict(kw)
    q, _, _, k, v = _kvcache(batch=3, new=2, sq=2)
    k_cache, v_cache = (torch.randn(5, 128, 2, 40, device=DEVICE).half() for _ in range(2))
    if kw.get("alibi_slopes") == "yes":
        kw["alibi_slopes"] = torch.rand(3, 8, device=DEVICE)
    if kw.pop("rotary", False):
        kw["rotary_cos"], kw["rotary_sin"] = _rotary_tables(128, 16)
    lens, pads = (torch.tensor(x, dtype=torch.int32, device=DEVICE) for x in ([10, 63, 100], [3, 0, 50]))
    idx = torch.tensor([4, 0, 2], dtype=torch.int64, device=DEVICE)
    _check_kvcache(q, k_cache, v_cache, k, v, lens, cache_batch_idx=idx, cache_leftpad=pads, **kw)


def test_kvcache_caches_in_any_layout():
    """Caches of any strides with a unit last one: slot-major (slots, rows, ...) seen as (rows,
    slots, ...), and the first 96 slots of wider rows; new keys, rotary, rows chosen."""
    q, _, _, k, v = _kvcache(batch=3, new=2, sq=2)
    k_cache = torch.randn(96, 4, 2, 40, device=DEVICE).half().transpose(0, 1)  # (4, 96, 2, 40), slot-major
    v_cache = torch.randn(4, 128, 2, 40, device=DEVICE).half()[:, :96]
    cos, sin = _rotary_tables(96, 16)
    lens = torch.tensor([10, 60, 94], dtype=torch.int32, device=DEVICE)
    idx = torch.tensor([3, 1, 0], dtype=torch.int32, device=DEVICE)
    _check_kvcache(q, k_cache, v_cache, k, v, lens, causal=True, cache_batch_idx=idx, rotary_cos=cos,
                   rotary_sin=sin, rotary_interleaved=False)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("page_size,kw", [
    (16, {"causal": True}), (5, {"causal": True, "rotary": True}), (32, {"window_size": (20, 0), "leftpad": True}),
    (7, {"softcap": 5.0, "alibi_slopes": "yes"}),
])
def test_kvcache_paged_matches_the_reference(monkeypatch, num_splits, page_size, kw):
    """A paged cache (flash-attn's block_table): pages of 5-32 slots in shuffled order, whole
    pages and a last part page, ragged lengths (0, 1, 63 and 113 keys before 2 new ones), new
    keys written into their pages, rotary, left padding, windows, softcap and ALiBi; split and not."""
    _split_keys(monkeypatch, num_splits)
    kw = dict(kw)
    q, k_rows, v_rows, k, v = _kvcache(new=2, sq=2, slots=120)
    k_cache, v_cache, table = paged_cache(k_rows, v_rows, page_size, spare_pages=2)
    if kw.pop("rotary", False):
        kw["rotary_cos"], kw["rotary_sin"] = _rotary_tables(table.shape[1] * page_size, 16)
    if kw.pop("leftpad", False):
        kw["cache_leftpad"] = torch.tensor([0, 1, 30, 100], dtype=torch.int32, device=DEVICE)
    if kw.get("alibi_slopes") == "yes":
        kw["alibi_slopes"] = torch.rand(4, 8, device=DEVICE)
    lens = torch.tensor([0, 1, 63, 113], dtype=torch.int32, device=DEVICE)
    _check_kvcache(q, k_cache, v_cache, k, v, lens, block_table=table, **kw)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_kvcache_paged_bad_pages_stay_apart(monkeypatch, num_splits):
    """A block table that names a page outside the cache for a sequence's keys: that sequence is
    NaN and its new key goes nowhere, the others come out right and their keys go into their
    pages; entries past a sequence's keys are not read; set_debug(True) raises. Split, only the
    share that reads the bad page sees it: the combine carries its NaN into the whole row."""
    _split_keys(monkeypatch, num_splits)
    q, k_rows, v_rows, k, v = _kvcache(batch=3, new=1, sq=1, slots=64)
    k_pages, v_pages, table = paged_cache(k_rows, v_rows, 16, spare_pages=2)
    # the caches inside larger buffers of finite values: a page read past the cache would not be NaN
    k_cache, v_cache = (torch.cat([p, p[:2]]).clone()[: len(p)] for p in (k_pages, v_pages))
    lens = torch.tensor([10, 40, 20], dtype=torch.int32, device=DEVICE)
    table[1, 2] = k_cache.shape[0]  # sequence 1's keys 32-40: a page past the cache
    table[0, 3] = -7  # past sequence 0's keys: never read
    k_before = k_cache.clone()
    with poisoned(FINITE_POISON):
        out = qflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table)
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()
    want = k_before.clone()
    want[table[0, 0], 10], want[table[2, 1], 4] = k[0, 0], k[2, 0]
    assert torch.equal(k_cache, want)
    good = table[[0, 2]].clone()
    good[0, 3] = good[0, 0]  # (any page: not read)
    ref, _, _, _ = attention_kvcache_ref(*_f64(q[[0, 2]], k_before, v_cache), *_f64(k[[0, 2]], v[[0, 2]]),
                                         lens[[0, 2]], block_table=good)
    torch.testing.assert_close(out[[0, 2]].double(), ref, rtol=2e-3, atol=2e-3)
    qflash.set_debug(True)
    try:
        with pytest.raises(ValueError, match=r"block_table\[1\] names pages outside"):
            qflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table)
    finally:
        qflash.set_debug(False)


def _check_varlen_paged(lens_q, lens_k, page_size, slots, h=4, hkv=2, d=32, dtype=torch.float16, **kw):
    """flash_attn_varlen_func on a paged cache (each sequence's keys at the start of a row of
    ``slots``, the rows cut into shuffled pages) by the rule against the float64 reference on the
    keys packed, and its lse."""
    q, k, v, cu_q, cu_k = _varlen(lens_q, lens_k, h=h, hkv=hkv, d=d, dtype=dtype)
    rows = []
    for t in (k, v):
        r = torch.randn(len(lens_k), slots, *t.shape[1:], device=DEVICE).to(t.dtype)
        for b, n in enumerate(lens_k):
            r[b, :n] = t[sum(lens_k[:b]): sum(lens_k[:b]) + n]
        rows.append(r)
    k_pages, v_pages, table = paged_cache(*rows, page_size, spare_pages=2)
    _check_varlen(q, k_pages, v_pages, cu_q, cu_k, max(lens_q), max(lens_k), block_table=table, packed_kv=(k, v),
                  **kw)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window_size": (5, 2), "softcap": 3.0}])
def test_varlen_paged_matches_packed(monkeypatch, num_splits, kw):
    """Packed queries (1, 4, 0 and 3 rows) against paged keys (30, 1, 9 and 57 in pages of 7
    slots): the reference's numbers on the keys packed; split and not."""
    _split_keys(monkeypatch, num_splits)
    _check_varlen_paged([1, 4, 0, 3], [30, 1, 9, 57], 7, 60, **kw)


@gpu
def test_gpu_varlen_paged():
    """A paged varlen decode step on the H200 (vLLM's call): one query row a sequence, 1 / 4097 /
    8000 keys in pages of 16, bf16, D = 128, grouped heads, causal; split and packed by the
    launcher."""
    _check_varlen_paged([1, 1, 1], [1, 4097, 8000], 16, 8192, h=16, hkv=4, d=128, dtype=torch.bfloat16, causal=True)


def test_varlen_paged_bad_counts_and_refusals():
    """A key count past a sequence's pages, or below zero, gives NaN in that sequence only; dropout
    and gradients are refused with a clear error."""
    q, k, v, cu_q, cu_k = _varlen([2, 3], [10, 20])
    rows = [torch.randn(2, 21, *t.shape[1:], device=DEVICE).to(t.dtype) for t in (k, v)]
    k_pages, v_pages, table = paged_cache(*rows, 7, spare_pages=2)  # 3 pages: 21 slots a sequence
    cu_bad = torch.tensor([0, 10, 32], dtype=torch.int32, device=DEVICE)  # sequence 1: 22 keys
    with poisoned(FINITE_POISON):
        out = qflash.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_bad, 3, 22, block_table=table)
    assert out[2:].isnan().all() and not out[:2].isnan().any()
    cu_back = torch.tensor([0, 10, 5], dtype=torch.int32, device=DEVICE)  # sequence 1: -5 keys (the kernel counts)
    with poisoned(FINITE_POISON):
        out = qflash.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_back, 3, 10, block_table=table)
    assert out[2:].isnan().all() and not out[:2].isnan().any()
    with pytest.raises(ValueError, match="dropout_p must be 0 with block_table"):
        qflash.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 3, 20, dropout_p=0.1, block_table=table)
    strided = torch.randn(*k_pages.shape[:-1], 2 * k_pages.shape[-1], device=DEVICE).to(k_pages.dtype)[..., ::2]
    with pytest.raises(ValueError, match="k must have a unit last stride with block_table"):
        qflash.flash_attn_varlen_func(q, strided, v_pages, cu_q, cu_k, 3, 20, block_table=table)
    # On meta tensors, shapes only: those of the real call's outputs
    out, lse, _ = qflash.flash_attn_varlen_func(*(t.to("meta") for t in (q, k_pages, v_pages, cu_q, cu_k)), 3, 20,
                                                block_table=table.to("meta"), return_attn_probs=True)
    real, real_lse, _ = qflash.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 3, 20, block_table=table,
                                                      return_attn_probs=True)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (real.shape, real.dtype, real_lse.shape, real_lse.dtype)
    with pytest.raises(ValueError, match="forward-only"):
        qflash.flash_attn_varlen_func(q.requires_grad_(), k_pages, v_pages, cu_q, cu_k, 3, 20, block_table=table)


def test_kvcache_shared_rows_among_many_sequences():
    """Sequences 0 and 139 of 140 name one cache row (the duplicates are looked for 128 sequences
    a step): the row takes the later one's new key, the other rows their own."""
    q, _, _, k, v = _kvcache(batch=140, new=1, sq=1, h=2, hkv=1, d=16)
    k_cache, v_cache = (torch.randn(140, 8, 1, 16, device=DEVICE).half() for _ in range(2))
    idx = torch.arange(140, dtype=torch.int32, device=DEVICE)
    idx[0] = 139
    lens = torch.full((140,), 3, dtype=torch.int32, device=DEVICE)
    lens[0] = 1  # where sequence 0's key would land in row 139, if it went in
    k_before = k_cache.clone()
    qflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, cache_batch_idx=idx)
    want = k_before.clone()
    want[1:, 3] = k[1:, 0]
    assert torch.equal(k_cache, want)


def test_kvcache_bad_rows_stay_apart(monkeypatch):
    """A row index outside the cache, a pad past the keys: those sequences are NaN, nothing of
    theirs lands in the cache, the others come out right; two sequences on one row: the row takes
    the later one's new keys, whatever the launch order. set_debug(True) raises for each."""
    _split_keys(monkeypatch, 3)
    q, _, _, k, v = _kvcache(batch=4, new=2, sq=1)
    k_cache, v_cache = (torch.randn(3, 64, 2, 40, device=DEVICE).half() for _ in range(2))
    lens = torch.tensor([10, 20, 30, 5], dtype=torch.int32, device=DEVICE)
    idx = torch.tensor([0, 7, 1, 2], dtype=torch.int32, device=DEVICE)  # sequence 1: no row 7
    pads = torch.tensor([0, 0, 31, 0], dtype=torch.int32, device=DEVICE)  # sequence 2: pad past its keys
    k_before, v_before = k_cache.clone(), v_cache.clone()
    with poisoned(FINITE_POISON):
        out = qflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, cache_batch_idx=idx,
                                             cache_leftpad=pads)
    assert out[1].isnan().all() and out[2].isnan().all() and not out[[0, 3]].isnan().any()
    want_k = k_before.clone()
    want_k[0, 10:12], want_k[1, 30:32], want_k[2, 5:7] = k[0], k[2], k[3]  # the pad is bad, the row is not
    assert torch.equal(k_cache, want_k)
    ref, _, _, _ = attention_kvcache_ref(*_f64(q[[0, 3]], k_before, v_before), *_f64(k[[0, 3]], v[[0, 3]]),
                                         lens[[0, 3]], cache_batch_idx=idx[[0, 3]])
    torch.testing.assert_close(out[[0, 3]].double(), ref, rtol=2e-3, atol=2e-3)
    k_cache.copy_(k_before)
    same = torch.tensor([1, 1, 0, 2], dtype=torch.int32, device=DEVICE)  # sequences 0 and 1 share row 1
    qflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, cache_batch_idx=same)
    assert torch.equal(k_cache[1, 20:22], k[1]) and torch.equal(k_cache[1, 10:12], k_before[1, 10:12])
    qflash.set_debug(True)
    try:
        with pytest.raises(ValueError, match=r"cache_batch_idx must lie in \[0, 3\)"):
            qflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, cache_batch_idx=idx)
        with pytest.raises(ValueError, match="cache_leftpad must lie in"):
            qflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                           cache_batch_idx=idx.abs() % 3, cache_leftpad=pads)
    finally:
        qflash.set_debug(False)


def test_kvcache_bad_inputs():
    q, k_cache, v_cache, k, v = _kvcache(batch=2, slots=32, new=2)
    q4 = torch.randn(2, 4, *q.shape[2:], device=DEVICE).to(q.dtype)
    cos, sin = _rotary_tables(32, 8)
    f = qflash.flash_attn_with_kvcache
    cases = [
        (lambda: f(q, k_cache, v_cache, rotary_cos=cos, rotary_sin=sin), ValueError, "need k and v"),
        (lambda: f(q, k_cache, v_cache, k, v, rotary_cos=cos), ValueError, "given together"),
        (lambda: f(q, k_cache, v_cache, k, v, rotary_cos=cos[:20], rotary_sin=sin[:20]), ValueError, "seqlen_ro"),
        # four query rows after two new keys at slot 30 sit at positions 30 to 33: past a table of 32 rows
        (lambda: f(q4, k_cache, v_cache, k, v, rotary_cos=cos[:32], rotary_sin=sin[:32], causal=True), ValueError,
         r"seqlen_ro >= 34 rows"),
        (lambda: f(q, k_cache, v_cache, k, v, rotary_cos=torch.ones(40, 21, device=DEVICE),
                   rotary_sin=torch.ones(40, 21, device=DEVICE)), ValueError, "rotary_dim"),
        (lambda: f(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin[:, :3]), ValueError, "same shape"),
        (lambda: f(q, k_cache, v_cache, cache_batch_idx=1), TypeError, "cache_batch_idx must be an int32 / int64"),
        (lambda: f(q, k_cache, v_cache, cache_leftpad=torch.zeros(3, dtype=torch.int32, device=DEVICE)),
         ValueError, "cache_leftpad must be an int32"),
        (lambda: f(q, k_cache, v_cache, block_table=q), ValueError, "block_table must be an int32 tensor"),
        (lambda: f(q, k_cache, v_cache, block_table=torch.zeros(2, 1, dtype=torch.int32, device=DEVICE),
                   cache_batch_idx=torch.zeros(2, dtype=torch.int32, device=DEVICE)), ValueError,
         "cannot be given together"),
        (lambda: f(q, k_cache, v_cache, k=k), ValueError, "must be given together"),
        (lambda: f(q, k_cache, v_cache, k[:, :, :1], v[:, :, :1]), ValueError, "k and v must have shape"),
        (lambda: f(q, k_cache, v_cache, cache_seqlens=torch.zeros(2, device=DEVICE)), ValueError, "int32 / int64"),
        (lambda: f(q, k_cache, v_cache, cache_seqlens=torch.zeros(3, dtype=torch.int32, device=DEVICE)),
         ValueError, r"shape \(2,\)"),
        (lambda: f(q, k_cache, v_cache, cache_seqlens=1.5), TypeError, "cache_seqlens must be an int"),
        (lambda: f(q, k_cache, v_cache, k, v, cache_seqlens=31), ValueError, r"must lie in \[0, 30\].*got 31"),
        (lambda: f(q, k_cache, v_cache, cache_seqlens=-1), ValueError, r"must lie in \[0, 32\].*got -1"),
        (lambda: f(q, torch.randn(2, 32, 2, 80, device=DEVICE).half()[..., ::2], v_cache), ValueError,
         "k_cache must have a unit last stride"),
        (lambda: f(q, k_cache[:1], v_cache[:1]), ValueError, "k_cache has batch 1"),
        (lambda: f(q, k_cache, v_cache.float()), TypeError, "v_cache has dtype"),
        (lambda: f(q, k_cache, v_cache, num_splits=-1), ValueError, "num_splits"),
        (lambda: f(q, k_cache[:, :1].contiguous(), v_cache[:, :1].contiguous(), k, v), ValueError, "cache holds 1"),
        (lambda: f(q, k_cache, v_cache, cache_seqlens=torch.zeros(2, dtype=torch.int32, device="meta")), ValueError,
         "cache_seqlens is on meta but q is on"),
        (lambda: f(q, k_cache, v_cache, block_table=torch.zeros(2, 1, dtype=torch.int32, device="meta")), ValueError,
         "block_table is on meta but q is on"),
        (lambda: f(q, k_cache, v_cache, k, v, rotary_cos=[1.0], rotary_sin=sin), ValueError,
         r"rotary_cos must be a floating tensor \(seqlen_ro, rotary_dim / 2\), got list"),
        (lambda: f(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin.to("meta")), ValueError,
         "rotary_sin is on meta but q is on"),
        # (meta tensors: a cache of 2^31 slots takes no memory)
        (lambda: f(q.to("meta"), *(torch.empty(2, 2**31, *k_cache.shape[2:], dtype=k_cache.dtype, device="meta"),) * 2),
         ValueError, "seqlen_cache and seqlen_q must be under 2\\^31, got 2147483648 and 1"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
    cache = attention_kernels.KVCache(torch.zeros(1, dtype=torch.int32, device=DEVICE))
    opts = attention_kernels.AttnOptions(1.0, kv_cache=cache)
    with pytest.raises(ValueError, match="forward-only"):
        attention_kernels.attention_backward(q, q, q, q, q, q, opts)


@gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_kvcache_decode(d):
    """A serving step on the H200: batch 3, caches of 30000 slots filled to 1, 4097 and 29998, one
    new key each, bf16, causal, with and without Llama's rotary embedding (halves), and on other
    rows with left padding; split and packed by the launcher."""
    lens = torch.tensor([1, 4097, 29998], dtype=torch.int32, device=DEVICE)
    q, k_cache, v_cache, k, v = _kvcache(batch=3, slots=30000, new=1, sq=1, h=16, hkv=4, d=d, dtype=torch.bfloat16)
    _check_kvcache(q, k_cache, v_cache, k, v, lens, causal=True)
    q, k_cache, v_cache, k, v = _kvcache(batch=3, slots=30000, new=1, sq=1, h=16, hkv=4, d=d, dtype=torch.bfloat16)
    cos, sin = _rotary_tables(30000, d)
    _check_kvcache(q, k_cache, v_cache, k, v, lens, causal=True, rotary_cos=cos, rotary_sin=sin,
                   rotary_interleaved=False)
    idx, pads = (torch.tensor(x, device=DEVICE) for x in ([2, 0, 1], [0, 4000, 100]))
    _check_kvcache(q, k_cache, v_cache, k, v, lens, causal=True, cache_batch_idx=idx, cache_leftpad=pads)


@gpu
@pytest.mark.parametrize("page_size", [16, 256])
def test_gpu_kvcache_paged(page_size):
    """A paged serving step on the H200 (vLLM's 16-slot pages and flash-attn's 256): batch 3,
    8192 slots a sequence in shuffled pages, filled to 1, 4097 and 8190, one new key each, bf16,
    D = 128, causal, Llama's rotary; split and packed by the launcher."""
    lens = torch.tensor([1, 4097, 8190], dtype=torch.int32, device=DEVICE)
    q, k_rows, v_rows, k, v = _kvcache(batch=3, slots=8192, new=1, sq=1, h=16, hkv=4, d=128, dtype=torch.bfloat16)
    k_cache, v_cache, table = paged_cache(k_rows, v_rows, page_size, spare_pages=2)
    cos, sin = _rotary_tables(8192, 128)
    _check_kvcache(q, k_cache, v_cache, k, v, lens, causal=True, block_table=table, rotary_cos=cos, rotary_sin=sin,
                   rotary_interleaved=False)


def test_split_keys_varlen_and_mask(monkeypatch):
    """Packed sequences (an empty one, one key, one query) and sdpa's float mask, split in 3."""
    _split_keys(monkeypatch, 3)
    lens_q, lens_k = [1, 4, 0, 1], [300, 1, 9, 129]
    q, k, v, cu_q, cu_k = _varlen(lens_q, lens_k)
    with poisoned():
        out = qflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    assert_written(out)
    ref, _ = attention_varlen_ref(*_f64(q, k, v), cu_q, cu_k, causal=True)
    pt, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, upcast=False, reorder_ops=True)
    assert_flash_rule(out, ref, pt)
    query, key = torch.randn(2, 4, 2, 32, device=DEVICE).half(), torch.randn(2, 4, 333, 32, device=DEVICE).half()
    mask = torch.randn(2, 1, 2, 333, device=DEVICE)
    _check_sdpa(query, key, key.flip(2), attn_mask=mask)


def test_split_keys_with_dropout_keep_the_same_mask(monkeypatch):
    """Dropout draws by (row, key), wherever a share starts: split and unsplit forwards agree."""
    q, k, v = _qkv(1, 2, 300, 2, 1, 32)
    torch.manual_seed(5)
    whole = qflash.flash_attn_func(q, k, v, dropout_p=0.3)
    _split_keys(monkeypatch, 4)
    torch.manual_seed(5)
    split = qflash.flash_attn_func(q, k, v, dropout_p=0.3)
    torch.testing.assert_close(split, whole, rtol=2e-3, atol=2e-3)


def test_forward_plan_packs_grouped_heads_and_splits_only_where_asked():
    """The plan the launcher runs by: a decode call of 8 query heads on 2 packs them (one 16-row
    block a key/value head); without a GPU the keys split only where a config asks."""
    q, k, _ = _qkv(3, 1, 500, 8, 2, 64)
    plan = attention_kernels.forward_plan(q, k, attention_kernels.AttnOptions(1.0))
    assert plan.pack and plan.grid_heads == 2 and plan.programs == 6 and plan.config.block_m == 16
    if not HAS_CUDA:
        assert plan.num_splits == 1
    cfg = dataclasses.replace(plan.config, num_splits=5, pack_gqa=False)
    plan = attention_kernels.forward_plan(q, k, attention_kernels.AttnOptions(1.0), cfg)
    assert not plan.pack and plan.programs == 24 and plan.num_splits == 5


def test_kv_splits_fill_the_sms_once():
    """The launcher's choice: no split where programs fill the SMs or keys are short, else enough
    shares to fill them once, each of whole key blocks and at least MIN_KEYS_PER_SPLIT keys, at
    most MAX_KV_SPLITS; decoding's row blocks two programs an SM, shares down to one block, or one
    an SM where two would leave shares of at most the tiles' short_share_keys keys."""
    ks = attention_kernels.kv_splits
    assert attention_kernels.MIN_KEYS_PER_SPLIT == 256
    assert ks(programs=132, keys=10**6, block_n=64, sms=132) == 1
    assert ks(programs=32, keys=448, block_n=64, sms=132) == 1  # 7 blocks: not two shares of 4
    assert ks(programs=32, keys=512, block_n=64, sms=132) == 2
    assert ks(programs=32, keys=4096, block_n=64, sms=132) == 5  # 160 programs: one round of 132 SMs and a part
    assert ks(programs=32, keys=768, block_n=128, sms=132) == 3  # the blocks bound it: 6 of 128 keys, 2 a share
    assert ks(programs=32, keys=100, block_n=512, sms=132) == 1  # a block longer than the least share
    assert ks(programs=8, keys=4096, block_n=512, sms=132) == 8
    assert ks(programs=1, keys=10**6, block_n=64, sms=132) == attention_kernels.MAX_KV_SPLITS
    # decoding: shares down to one block, two programs an SM and no more
    assert attention_kernels.DECODE_PROGRAMS_PER_SM == 2
    assert ks(programs=8, keys=1024, block_n=64, sms=132, decoding=True) == 16  # one block a share
    assert ks(programs=8, keys=65536, block_n=64, sms=132, decoding=True) == 33  # 264 programs
    assert ks(programs=32, keys=4096, block_n=64, sms=132, decoding=True) == 8  # 256, not 9 x 32 = 288
    assert ks(programs=128, keys=4096, block_n=64, sms=132, decoding=True) == 2
    assert ks(programs=132, keys=4096, block_n=64, sms=132, decoding=True) == 1
    assert ks(programs=1, keys=10**6, block_n=64, sms=132, decoding=True) == attention_kernels.MAX_KV_SPLITS
    # ... or one an SM where two would leave shares of at most short_share_keys keys
    short = dict(sms=132, decoding=True, short_share_keys=512)
    assert ks(programs=8, keys=4096, block_n=64, **short) == 16  # not 33 shares of 124 keys
    assert ks(programs=8, keys=16384, block_n=64, **short) == 16  # not 33 of 496
    assert ks(programs=8, keys=16896, block_n=64, **short) == 16  # 33 of 512 keys: at most 512
    assert ks(programs=8, keys=16960, block_n=64, **short) == 33  # 33 of more than 512
    assert ks(programs=8, keys=1024, block_n=64, **short) == 16  # one block a share either way
    assert ks(programs=128, keys=1024, block_n=64, **short) == 1  # no split where two shares hold 512
    assert ks(programs=128, keys=4096, block_n=64, **short) == 2
    assert ks(programs=133, keys=1024, block_n=64, **short) == 1
    # ... or one an SM where that leaves one share (no combine kernel) of at most one_share_keys keys
    one = dict(sms=132, decoding=True, one_share_keys=4096)
    assert ks(programs=128, keys=4096, block_n=64, **one) == 1  # not 2 of 2048
    assert ks(programs=128, keys=4160, block_n=64, **one) == 2
    assert ks(programs=66, keys=1024, block_n=64, **one) == 4  # one an SM would still leave 2 shares: two an SM
    assert ks(programs=67, keys=1024, block_n=64, **one) == 1  # not 3
    assert ks(programs=8, keys=1024, block_n=64, **one) == 16  # one an SM leaves 16 shares: the rule is not for it
    assert ks(programs=128, keys=4096, block_n=64, sms=132, decoding=True, short_share_keys=128) == 2
    cfg = attention_kernels.AttnFwdConfig(block_m=128, block_n=64, num_warps=4, num_stages=2)
    assert attention_kernels.decode_config(cfg, rows=1).block_m == 16
    assert attention_kernels.decode_config(cfg, rows=40).block_m == 64
    assert attention_kernels.decode_config(cfg, rows=65) is cfg


@gpu
def test_gpu_decode_plan_two_programs_an_sm():
    """On the H200: a decode step's plan gives every SM two programs (Llama-3-8B's 8 key heads at
    batch 1 with 64k keys: 2 x SMs // 8 shares), or one where two would leave shares of at most 512
    keys at D = 128 (4k keys: SMs // 8); a prefill call that splits keeps one round of the SMs."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    q, k, _ = _qkv(1, 1, 65536, 32, 8, 128, dtype=torch.bfloat16)
    plan = attention_kernels.forward_plan(q, k, attention_kernels.AttnOptions(1.0))
    assert plan.pack and plan.programs == 8 and plan.num_splits == 2 * sms // 8
    plan = attention_kernels.forward_plan(q, k[:, :4096], attention_kernels.AttnOptions(1.0))
    assert plan.pack and plan.programs == 8 and plan.num_splits == sms // 8
    q, k, _ = _qkv(2, 1023, 1023, 6, 2, 128, dtype=torch.bfloat16)
    plan = attention_kernels.forward_plan(q, k, attention_kernels.AttnOptions(1.0, window_right=0))
    assert plan.num_splits == -(-sms // plan.programs)
    # batch 16 with 4k keys: 128 programs, all the keys in one share (no combine kernel)
    q, k, _ = _qkv(16, 1, 4096, 32, 8, 128, dtype=torch.bfloat16)
    plan = attention_kernels.forward_plan(q, k, attention_kernels.AttnOptions(1.0))
    assert plan.programs == 128 and plan.num_splits == (1 if sms >= 128 else 2)


@gpu
def test_gpu_paged_decode_plan_short_shares():
    """On the H200: a paged decode step whose shares would hold one 128-key block takes 64-key
    blocks in two stages (batch 1 with 1k keys: 16 shares, 128 programs); long shares keep the
    paged tiles. A dense one at D = 64 takes two stages for shares of up to 512 keys."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for keys, block_n, stages in ((1024, 64, 2), (65536, 128, 3)):
        q, k, v = _qkv(1, 1, keys, 32, 8, 128, dtype=torch.bfloat16)
        k_pages, _, table = paged_cache(k, v, 16, spare_pages=2)
        lens = torch.full((1,), keys, device=q.device, dtype=torch.int32)
        opts = attention_kernels.AttnOptions(1.0, kv_cache=attention_kernels.KVCache(lens, block_table=table))
        plan = attention_kernels.forward_plan(q, k_pages, opts)
        assert (plan.config.block_n, plan.config.num_stages) == (block_n, stages)
        assert plan.num_splits == min(2 * sms // 8, keys // block_n)
    for keys, stages in ((4096, 2), (65536, 3)):
        q, k, _ = _qkv(1, 1, keys, 32, 8, 64, dtype=torch.bfloat16)
        plan = attention_kernels.forward_plan(q, k, attention_kernels.AttnOptions(1.0))
        shares = min(2 * sms // 8, keys // 128)
        assert (plan.config.block_n, plan.config.num_stages, plan.num_splits) == (128, stages, shares)


def test_decode_tiles(monkeypatch):
    """Decoding's tiles (rows up to DECODE_ROWS), as the launcher asks for them on an H200: deeper
    pipelines, 128-key blocks at D <= 64, row blocks of the rows' next power of two, pointer loads
    (no tensor descriptors; one program an SM for shares of up to 512 keys at D = 128, or for one
    share of up to 4k keys; two stages for shares of up to 512 keys at D = 64), and 128-key blocks
    for a paged cache (D = 256: at most 128 registers), 64-key ones where a share holds one block;
    D = 256, float32 and dropout keep their tiles with the rows cut."""
    from qflash.kernels import attention as kernels

    monkeypatch.setattr(kernels, "has_tma", lambda device: True)
    cuda = torch.device("cuda")

    def cfg(d, rows, dtype=torch.bfloat16, **kw):
        return kernels.default_config(d, dtype, cuda, seqlen_k=4096, rows=rows, **kw)

    assert cfg(64, 4) == kernels.AttnFwdConfig(16, 128, 4, 3, use_tma=False, one_share_keys=4096)
    assert cfg(64, 4, share_keys=512) == kernels.AttnFwdConfig(16, 128, 4, 2, use_tma=False, one_share_keys=4096)
    assert cfg(64, 4, share_keys=513) == cfg(64, 4)
    assert cfg(128, 4, share_keys=64) == cfg(128, 4)
    assert cfg(128, 32) == kernels.AttnFwdConfig(32, 64, 4, 3, use_tma=False, short_share_keys=512,
                                                 one_share_keys=4096)
    assert cfg(96, 64) == kernels.AttnFwdConfig(64, 64, 4, 3, use_tma=False, short_share_keys=512,
                                                one_share_keys=4096)
    assert cfg(128, 4, paged=True) == kernels.AttnFwdConfig(16, 128, 4, 3, use_tma=False)
    assert cfg(64, 4, paged=True) == kernels.AttnFwdConfig(16, 128, 4, 5, use_tma=False)
    assert cfg(256, 4, paged=True) == dataclasses.replace(cfg(256, 4), use_tma=False, maxnreg=128)
    # paged, for the length of the key shares: one block a share, two of 64 keys; up to four, 3 stages
    assert cfg(64, 4, paged=True, share_keys=128) == kernels.AttnFwdConfig(16, 64, 4, 2, use_tma=False)
    assert cfg(128, 4, paged=True, share_keys=100) == kernels.AttnFwdConfig(16, 64, 8, 2, use_tma=False)
    assert cfg(64, 4, paged=True, share_keys=512) == kernels.AttnFwdConfig(16, 128, 4, 3, use_tma=False)
    assert cfg(64, 4, paged=True, share_keys=640) == cfg(64, 4, paged=True)
    assert cfg(128, 4, paged=True, share_keys=512) == cfg(128, 4, paged=True)
    assert cfg(256, 4, paged=True, share_keys=64) == cfg(256, 4, paged=True)
    assert cfg(128, 65) == cfg(128, None) == kernels.default_config(128, torch.bfloat16, cuda, seqlen_k=4096)
    assert cfg(256, 1) == dataclasses.replace(cfg(256, None), block_m=16)
    assert cfg(64, 1, torch.float32) == dataclasses.replace(cfg(64, None, torch.float32), block_m=16)
    assert cfg(64, 1, dropout=True) == dataclasses.replace(cfg(64, None, dropout=True), block_m=16)


# ----------------------------------------------------------------------------------------------
# torch.compile: the custom op traces with its fake implementation.
# ----------------------------------------------------------------------------------------------
def test_torch_compile_fullgraph_traces():
    q, k, v = _qkv(1, 24, 40, 2, 1, 32)
    fn = torch.compile(lambda a, b, c: qflash.flash_attn_func(a, b, c, causal=True) * 2,
                       fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(fn(q, k, v), qflash.flash_attn_func(q, k, v, causal=True) * 2, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# Bad inputs: clear errors naming the argument.
# ----------------------------------------------------------------------------------------------
def _bad_cases():
    q, k, v = _qkv(1, 8, 8, 4, 2, 32)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
    f = qflash.flash_attn_func
    vf = qflash.flash_attn_varlen_func
    return [
        (lambda: f(q[0], k, v), ValueError, "q must have 4 dimensions"),
        (lambda: f(q, k[..., :16], v[..., :16]), ValueError, "head dimension"),
        (lambda: f(q, k, v[:, :4]), ValueError, "k and v must have the same shape"),
        (lambda: f(q, *_qkv(1, 8, 8, 4, 3, 32)[1:]), ValueError, "multiple of key/value heads"),
        (lambda: f(*_qkv(1, 8, 8, 2, 2, 288)), ValueError, "between 1 and 256"),
        (lambda: f(q, k.float(), v), TypeError, "k has dtype"),
        (lambda: f(q, k.to("meta"), v), ValueError, "k is on meta"),
        (lambda: f(*(t.to(torch.float8_e4m3fn) for t in (q, k, v))), TypeError, "float16, bfloat16, float32 or float64"),
        (lambda: f(q.int(), k, v), TypeError, "float16"),
        (lambda: f(q, k, v, window_size=(-2, 0)), ValueError, "window_size left"),
        (lambda: f(q, k, v, window_size=5), ValueError, "window_size must be a pair"),
        (lambda: f(q, k, v, dropout_p=1.0), ValueError, "dropout_p must be in"),
        (lambda: f(q, k, v, softcap=-1.0), ValueError, "softcap"),
        (lambda: f(q, k, v, softmax_scale=0.0), ValueError, "softmax_scale"),
        (lambda: f(q, k, v, alibi_slopes=torch.ones(3, device=DEVICE)), ValueError, "alibi_slopes must have shape"),
        (lambda: f(q, k[:, :, :, :].repeat(2, 1, 1, 1), v.repeat(2, 1, 1, 1)), ValueError, "batch"),
        (lambda: f("q", k, v), TypeError, "q must be a torch.Tensor"),
        (lambda: vf(q[0], k[0], v[0], cu.long(), cu, 8, 8), TypeError, "cu_seqlens_q must be int32"),
        (lambda: vf(q[0], k[0], v[0], cu, torch.tensor([0, 4, 8], dtype=torch.int32, device=DEVICE), 8, 8),
         ValueError, "cu_seqlens_k has 3 entries"),
        (lambda: vf(q[0], k[0], v[0], cu[:1], cu, 8, 8), ValueError, "batch \\+ 1 >= 2"),
        (lambda: qflash.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)), ValueError, "enable_gqa"),
        (lambda: qflash.sdpa(q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool, device=DEVICE)),
         ValueError, "does not broadcast"),
        (lambda: qflash.sdpa(q, q, q, attn_mask=torch.ones(8, 4, dtype=torch.float64, device=DEVICE)), TypeError,
         "attn_mask must be bool, torch.float32 or torch.float16 \\(query's dtype\\), got torch.float64"),
        (lambda: qflash.sdpa(q.float(), q.float(), q.float(), attn_mask=torch.ones(8, 4, dtype=torch.float64,
                                                                                    device=DEVICE)),
         TypeError, "attn_mask must be bool or torch.float32, got torch.float64$"),
        (lambda: qflash.sdpa(q, q, q, attn_mask=torch.ones(8, 4, dtype=torch.int64, device=DEVICE)), TypeError,
         "attn_mask must be bool"),
        (lambda: qflash.sdpa(q, q, q, is_causal=True, attn_mask=torch.ones(8, 4, dtype=torch.bool, device=DEVICE)),
         ValueError, "either attn_mask or is_causal"),
        (lambda: qflash.flash_attn_qkvpacked_func(q), ValueError, "qkv must have shape"),
        (lambda: f(q, k, v, window_size=(2.5, 1)), ValueError, "window_size must be a pair of ints"),
        (lambda: f(q, k, v, softmax_scale="a"), ValueError, "softmax_scale must be a positive finite number, got 'a'"),
        (lambda: f(q[:, :, :0], k[:, :, :0], v[:, :, :0]), ValueError, "at least one head"),
        (lambda: vf(q[0], k[0], v[0], cu, cu, None, 8), TypeError, "max_seqlen_q must be an int, got None"),
        (lambda: vf(q[0], k[0], v[0], cu, cu, 8.5, 8), TypeError, "max_seqlen_q must be an int"),
        (lambda: vf(q[0], k[0], v[0], cu, cu, 8, -3), ValueError, "max_seqlen_k must be >= 0"),
        (lambda: vf(q[0], k[0], v[0], cu, cu, 8, 8, block_table=torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)),
         ValueError, "k must have 4 dimensions \\(num_pages, page_size, heads_kv, headdim\\) with block_table"),
        (lambda: f(q, k, v, sinks=torch.zeros(2, device=DEVICE)), ValueError,
         "sinks must be a floating tensor of shape \\(4,\\) \\(a score a query head\\), got \\(2,\\)"),
        (lambda: f(q, k, v, sinks=torch.zeros(4, dtype=torch.int32, device=DEVICE)), ValueError,
         "sinks must be a floating"),
        (lambda: f(q, k, v, sinks=[0.0] * 4), ValueError, "sinks must be a floating tensor .* got list"),
        (lambda: f(q, k, v, sinks=torch.zeros(4, device="meta")), ValueError, "sinks is on meta"),
        (lambda: vf(q[0], k[0], v[0], cu, cu, 8, 8, sinks=torch.zeros(1, 4, device=DEVICE)), ValueError, "sinks must"),
        (lambda: qflash.sdpa(q, q, q, sinks=torch.zeros(4, device=DEVICE)), ValueError, "shape \\(8,\\)"),
        (lambda: qflash.flash_attn_with_kvcache(q, k, v, sinks=torch.zeros(3, device=DEVICE)), ValueError,
         "sinks must"),
        (lambda: f(q, k, v, alibi_slopes=[1.0] * 4), TypeError, "alibi_slopes must be a tensor .* got list"),
        (lambda: f(q, k, v, alibi_slopes=torch.ones(4, device="meta")), ValueError, "alibi_slopes is on meta"),
        (lambda: f(q, k, v, alibi_slopes=torch.ones(4, dtype=torch.int32, device=DEVICE)), TypeError,
         "alibi_slopes must be floating point, got torch.int32"),
        (lambda: qflash.flash_attn_kvpacked_func(q, k), ValueError,
         r"kv must have shape \(batch, seqlen_k, 2, heads_kv, headdim\), got \(1, 8, 2, 32\)"),
        (lambda: qflash.flash_attn_varlen_kvpacked_func(q[0], k[0], cu, cu, 8, 8), ValueError,
         r"kv must have shape \(total_k, 2, heads_kv, headdim\)"),
        (lambda: qflash.flash_attn_varlen_qkvpacked_func(q[0], cu, 8), ValueError,
         r"qkv must have shape \(total, 3, heads, headdim\), got \(8, 4, 32\)"),
        (lambda: vf(q[0], k[0], v[0], [0, 8], cu, 8, 8), TypeError, "cu_seqlens_q must be a torch.Tensor .* got list"),
        (lambda: vf(q[0], k[0], v[0], cu, cu.to("meta"), 8, 8), ValueError, "cu_seqlens_k is on meta"),
        (lambda: qflash.sdpa(q.transpose(1, 2), k.repeat(2, 1, 1, 1).transpose(1, 2),
                             v.repeat(2, 1, 1, 1).transpose(1, 2), enable_gqa=True),
         ValueError, "key has batch 2 but query has batch 1"),
        (lambda: qflash.sdpa(q, q, q, attn_mask=[[True]]), TypeError, "attn_mask must be a tensor, got list"),
        (lambda: qflash.sdpa(q, q, q, attn_mask=torch.ones(8, 4, dtype=torch.bool, device="meta")), ValueError,
         "attn_mask is on meta"),
        # A mask of 5 dimensions reaches into query's leading dims (2,), which it does not fit
        (lambda: qflash.sdpa(*(q[None].expand(2, -1, -1, -1, -1),) * 3,
                             attn_mask=torch.ones(3, 1, 1, 4, 4, dtype=torch.bool, device=DEVICE)),
         ValueError, r"attn_mask of shape \(3, 1, 1, 4, 4\) does not broadcast to \(2, 1, 8, 4, 4\)"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_inputs(case):
    fn, exc, match = _bad_cases()[case]
    with pytest.raises(exc, match=match):
        fn()


def test_debug_checks_cu_seqlens_contents():
    q, k, v = _qkv(1, 8, 8, 2, 2, 32)
    bad = torch.tensor([0, 5, 3], dtype=torch.int32, device=DEVICE)
    qflash.set_debug(True)
    try:
        with pytest.raises(ValueError, match="never decrease"):
            qflash.flash_attn_varlen_func(q[0], k[0], v[0], bad, bad, 8, 8)
        good = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
        with pytest.raises(ValueError, match="max_seqlen_q=2 but the longest sequence has 5"):
            qflash.flash_attn_varlen_func(q[0], k[0], v[0], good, good, 2, 8)
    finally:
        qflash.set_debug(False)


@pytest.mark.parametrize("case", ["past the end", "backwards"])
def test_bad_cu_seqlens_contents_stay_in_bounds_and_give_nan(case):
    """Without set_debug the contents of cu_seqlens go unchecked on the host (a check costs a
    sync). The kernels then keep every access inside the packed rows (a last entry past them once
    aborted the interpreter), write NaN into the rows of the sequences they see are wrong, and the
    other sequences' rows come out as a call with good contents gives them."""
    q, k, v, good, _ = _varlen([5, 9, 7], [5, 9, 7], h=2, hkv=2)  # 21 rows
    bad, nan_rows, same_rows = {
        "past the end": ([0, 5, 14, 40], slice(14, 21), slice(0, 14)),  # the last ends at 40
        "backwards": ([0, 9, 5, 21], slice(9, 21), slice(0, 5)),  # the third starts before the second
    }[case]
    bad = torch.tensor(bad, dtype=torch.int32, device=DEVICE)
    with poisoned(FINITE_POISON):
        out, lse, _ = qflash.flash_attn_varlen_func(q, k, v, bad, bad, 40, 40, causal=True, return_attn_probs=True)
        # the same max_seqlen, so the same launch: rows reduced in the same order, the same bits
        want, want_lse, _ = qflash.flash_attn_varlen_func(q, k, v, good, good, 40, 40, causal=True,
                                                          return_attn_probs=True)
    assert out[nan_rows].isnan().all() and lse[:, nan_rows].isnan().all()
    assert torch.equal(out[same_rows], want[same_rows]) and torch.equal(lse[:, same_rows], want_lse[:, same_rows])


def test_strided_cu_seqlens_and_a_generous_max_seqlen():
    """cu_seqlens with a stride (a view) is read as its values, not its storage; a max_seqlen far
    over the packed rows (2^40: a grid past int32 if it were taken as given) gives what the true
    longest length gives."""
    q, k, v, cu, _ = _varlen([5, 9, 7], [5, 9, 7], h=2, hkv=2)
    strided = torch.stack([cu, cu + 1], dim=1)[:, 0]  # same values, stride 2
    assert strided.stride(0) == 2
    want = qflash.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True)
    got = qflash.flash_attn_varlen_func(q, k, v, strided, strided, 2 ** 40, 2 ** 40, causal=True)
    assert torch.equal(got, want)


def test_max_seqlen_under_the_truth_gives_nan_rows():
    """max_seqlen_q sizes the launch grid; a sequence longer than the grid would have rows that no
    program computes, and comes out NaN (all of it) instead of whatever the memory held."""
    lens = [5, 300, 7]  # the second sequence: rows 5-304
    q, k, v, cu, _ = _varlen(lens, lens, h=2, hkv=2)
    with poisoned(FINITE_POISON):
        out, lse, _ = qflash.flash_attn_varlen_func(q, k, v, cu, cu, 1, 300, return_attn_probs=True)
        want, want_lse, _ = qflash.flash_attn_varlen_func(q, k, v, cu, cu, 300, 300, return_attn_probs=True)
    assert attention_kernels.default_config(32, q.dtype, q.device, seqlen_k=300).block_m < 300  # a grid too short
    long = torch.zeros(out.shape[0], dtype=torch.bool)
    long[5:305] = True
    assert out[long].isnan().all() and lse[:, long].isnan().all()
    assert torch.equal(out[~long], want[~long]) and torch.equal(lse[:, ~long], want_lse[:, ~long])


@pytest.mark.skipif(HAS_CUDA, reason="CPU-only check")
def test_cpu_tensor_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = _qkv(1, 8, 8, 2, 2, 32)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        qflash.flash_attn_func(q, k, v)


# ----------------------------------------------------------------------------------------------
# GPU (H200): the full sweep.
# ----------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [32, 64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (113, 203), (239, 1), (128, 217), (799, 3), (1023, 1023), (4224, 4224)])
def test_gpu_sweep(dtype, d, causal, sq, sk):
    q, k, v = _qkv(2, sq, sk, 6, 2, d, dtype=dtype)
    check_flash(q, k, v, causal=causal)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kw", [{"window_size": (256, 64)}, {"softcap": 30.0, "causal": True},
                                {"alibi_slopes": "yes", "causal": True}])
def test_gpu_options(dtype, kw):
    kw = dict(kw)
    if kw.get("alibi_slopes") == "yes":
        kw["alibi_slopes"] = torch.rand(4, device="cuda")
    q, k, v = _qkv(2, 1500, 2100, 4, 2, 128, dtype=dtype)
    check_flash(q, k, v, **kw)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d,causal,sq,sk", [(64, True, 1024, 1024), (128, False, 512, 768), (256, True, 256, 384),
                                            (64, True, 128, 4096)])
def test_gpu_sinks_gluon_forward(dtype, d, causal, sq, sk):
    """The Gluon forward (taken: checked) with sinks, gpt-oss's grouping (8 query heads a key/value
    head), causal bottom-right with Sk > Sq; output and lse by the rule."""
    q, k, v = _qkv(2, sq, sk, 16, 2, d, dtype=dtype)
    sinks = _sinks(16)
    opts = attention_kernels.AttnOptions(d ** -0.5, window_right=0 if causal else -1, sinks=sinks)
    assert attention_kernels._fast_path_fits(q, k, v, opts)
    check_flash(q, k, v, causal=causal, sinks=sinks)


@gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("b,sk", [(1, 4097), (16, 30000)])
def test_gpu_sinks_decode_splits_the_keys(d, b, sk):
    """Decoding with sinks on the launcher's own plan (keys split, grouped heads packed: checked),
    dense and from a paged cache."""
    q, k, v = _qkv(b, 1, sk, 16, 2, d, dtype=torch.bfloat16)
    sinks = _sinks(16)
    plan = attention_kernels.forward_plan(q, k, attention_kernels.AttnOptions(1.0, sinks=sinks))
    assert plan.num_splits > 1 and plan.pack
    check_flash(q, k, v, sinks=sinks)
    k_pages, v_pages, table = paged_cache(k, v, 16)
    lens = torch.full((b,), sk, dtype=torch.int32, device=DEVICE)
    with poisoned():
        out = qflash.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lens, block_table=table, sinks=sinks)
    ref, _ = attention_ref(*_f64(q, k, v), sinks=sinks.double())
    pt, _ = attention_ref(q, k, v, sinks=sinks, upcast=False, reorder_ops=True)
    assert_flash_rule(out, ref, pt)


@gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("b,sk", [(1, 4097), (3, 30000)])
def test_gpu_decode_splits_the_keys(d, b, sk):
    """Decoding on the H200: the launcher splits these calls' keys (checked, not assumed); one
    query row, and two with the causal mask aligned bottom-right, by the flash-attn rule; a boolean
    mask through sdpa, as transformers decodes."""
    q, k, v = _qkv(b, 2, sk, 8, 2, d, dtype=torch.bfloat16)
    plan = attention_kernels.forward_plan(q[:, :1], k, attention_kernels.AttnOptions(1.0))
    assert plan.num_splits > 1 and plan.pack
    check_flash(q[:, :1], k, v)
    check_flash(q, k, v, causal=True)
    mask = torch.rand(b, 1, 1, sk, device="cuda") > 0.1
    _check_sdpa(q[:, :1].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True)


@gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_long_causal(d):
    q, k, v = _qkv(1, 8192, 8192, 2, 1, d, dtype=torch.bfloat16)
    check_flash(q, k, v, causal=True)


@gpu
def test_gpu_varlen_and_sdpa_bf16():
    lens_q, lens_k = [1, 700, 3000, 129], [2000, 700, 3000, 1]
    q, k, v, cu_q, cu_k = _varlen(lens_q, lens_k, h=8, hkv=2, d=128, dtype=torch.bfloat16)
    out = qflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    ref, _ = attention_varlen_ref(*_f64(q, k, v), cu_q, cu_k, causal=True)
    pt, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, upcast=False, reorder_ops=True)
    assert_flash_rule(out, ref, pt)
    query = torch.randn(2, 8, 1000, 128, device="cuda").bfloat16()
    mask = torch.rand(2, 1, 1000, 1000, device="cuda") > 0.2
    _check_sdpa(query, query.flip(2), query.flip(1), attn_mask=mask)


@gpu
def test_gpu_over_2_31_elements():
    # 2^15 sequences of 128 tokens, 4 heads x 128: 2^31 elements per tensor; offsets pass int32.
    b, s, h, d = 2**15, 128, 4, 128
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    assert q.numel() >= 2**31
    out = qflash.flash_attn_func(q, k, v, causal=True)
    for idx in (0, b // 2, b - 1):  # the last sequences live past 2^31
        sl = slice(idx, idx + 1)
        ref, _ = attention_ref(*_f64(q[sl], k[sl], v[sl]), causal=True)
        pt, _ = attention_ref(q[sl], k[sl], v[sl], causal=True, upcast=False, reorder_ops=True)
        assert_flash_rule(out[sl], ref, pt)


@gpu
def test_gpu_torch_compile_and_cuda_graph():
    q, k, v = _qkv(2, 1024, 1024, 8, 8, 128, dtype=torch.bfloat16)
    expected = qflash.flash_attn_func(q, k, v, causal=True)
    fn = torch.compile(lambda a, b, c: qflash.flash_attn_func(a, b, c, causal=True), fullgraph=True)
    torch.testing.assert_close(fn(q, k, v), expected, rtol=0, atol=0)
    graph = torch.cuda.CUDAGraph()
    qflash.flash_attn_func(q, k, v, causal=True)  # warm up (compile) outside capture
    with torch.cuda.graph(graph):
        out = qflash.flash_attn_func(q, k, v, causal=True)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.testing.assert_close(out, qflash.flash_attn_func(q, k, v, causal=True), rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# Both load paths: pointers (any strides) and tensor descriptors (Hopper's copy engine).
# ----------------------------------------------------------------------------------------------
@pytest.fixture(params=[False, True], ids=["pointers", "descriptors"])
def load_path(request, monkeypatch):
    from qflash.kernels import attention as kernels

    base = kernels.default_config

    def config(*args, **kwargs):
        return dataclasses.replace(base(*args, **kwargs), use_tma=request.param)

    monkeypatch.setattr(kernels, "default_config", config)
    return request.param


@pytest.mark.parametrize("sq,sk,d,kw", [
    (113, 203, 80, {"causal": True}),
    (239, 1, 64, {}),
    (1, 97, 32, {}),
    (97, 300, 64, {"softcap": 3.0}),
    (70, 130, 48, {"window_size": (40, -1)}),
    (40, 300, 32, {"growing": True}),
    (50, 70, 32, {"window_size": (7, 3), "softcap": 2.0}),
])
def test_load_paths(load_path, sq, sk, d, kw):
    q, k, v = _qkv(2, sq, sk, 4, 2, d)
    kw = dict(kw)  # the parametrized dict is shared by every load path: pop from a copy
    if kw.pop("growing", False):
        # Scores that grow along the keys: the running max moves at many tiles, so every
        # rescale of the accumulator counts.
        k = (k.float() * torch.linspace(0.1, 4.0, sk, device=k.device)[None, :, None, None]).to(k.dtype)
    check_flash(q, k, v, **kw)


def test_load_paths_varlen_and_sdpa(load_path):
    lens_q, lens_k = [1, 63, 0, 40], [5, 63, 9, 11]
    q, k, v, cu_q, cu_k = _varlen(lens_q, lens_k)
    with poisoned():
        out = qflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 63, 63, causal=True)
    ref, _ = attention_varlen_ref(*_f64(q, k, v), cu_q, cu_k, causal=True)
    pt, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, upcast=False, reorder_ops=True)
    assert_flash_rule(out, ref, pt)
    query = torch.randn(2, 3, 29, 32, device=DEVICE).half()
    _check_sdpa(query, query.flip(2), query.flip(1), attn_mask=torch.rand(29, 29, device=DEVICE) > 0.3)


def test_forward_register_cap_reaches_the_launch(monkeypatch):
    """A forward config's ``maxnreg`` (the paged D = 256 decode tiles cap registers at 128) is a
    launch option of the kernel; none is passed without one."""
    from qflash.kernels import attention as kernels

    launches = []

    class Launcher:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setattr(kernels, "_fwd_launcher", Launcher())
    q, k, v = _qkv(1, 1, 64, 4, 2, 32)
    for cap in (128, None):
        cfg = kernels.AttnFwdConfig(16, 16, 4, 1, num_splits=1, maxnreg=cap)
        kernels.attention_forward(q, k, v, kernels.AttnOptions(1.0), config=cfg)
    assert launches[0]["maxnreg"] == 128 and "maxnreg" not in launches[1]


def test_default_config_buckets(monkeypatch):
    """The tuned table (searched on the H200) as the launcher asks for it: head-dim buckets,
    and for D = 256 a length bucket, where short sequences load through pointers."""
    from qflash.kernels import attention as kernels

    monkeypatch.setattr(kernels, "has_tma", lambda device: True)  # an H200, without one
    cuda = torch.device("cuda")
    cfg = lambda d, sk: kernels.default_config(d, torch.bfloat16, cuda, seqlen_k=sk)  # noqa: E731
    assert not cfg(64, 4096).use_tma and cfg(128, 512).use_tma and cfg(128, 4096).use_tma
    assert not cfg(256, 512).use_tma and not cfg(200, 1).use_tma
    assert cfg(256, 513).use_tma and cfg(256, 16384).use_tma and cfg(256, None).use_tma
    dropout = lambda d: kernels.default_config(d, torch.bfloat16, cuda, seqlen_k=4096, dropout=True)  # noqa: E731
    assert dropout(64).block_m == dropout(128).block_m == 64 and dropout(256) == cfg(256, 4096)


def _gpu_fwd_tiles():
    """The H200 search grid, gpu-marked: `pytest -m gpu` on the H200 checks every candidate."""
    from qflash.bench.attention import TILE_GRID

    return [pytest.param(d, t, marks=gpu) for bucket, grid in TILE_GRID.items() for t in grid
            for d in (bucket, bucket - 16)]


@pytest.mark.parametrize("d,tile", _gpu_fwd_tiles(), ids=str)
@pytest.mark.parametrize("kw", [{"causal": True}, {}, {"window_size": (300, 2)}], ids=["causal", "full", "window"])
def test_every_forward_tile(d, tile, kw, monkeypatch):
    """Each searched tile shape, in both dtypes the H200 benchmarks, on ragged lengths."""
    from qflash.kernels import attention as kernels

    cfg = kernels.AttnFwdConfig(*tile)
    monkeypatch.setattr(kernels, "default_config", lambda *args, **kwargs: cfg)
    for dtype in (torch.bfloat16, torch.float16):
        check_flash(*_qkv(2, 1023, 1500, 4, 2, d, dtype=dtype), **kw)
        check_flash(*_qkv(1, 1500, 777, 2, 1, d, dtype=dtype), **kw)


# ----------------------------------------------------------------------------------------------
# Replayed eager forwards (ops/attention.py's _EAGER_FORWARDS): from the second no-grad call of a
# kind on a GPU, the launches of the one before run again with the new tensors' pointers.
# ----------------------------------------------------------------------------------------------
_REPLAY_CASES = ("decode, split keys", "Gluon prefill", "ragged, window, softcap, ALiBi", "sinks", "varlen",
                 "varlen, one cu_seqlens", "sdpa with a mask", "KV cache, rotary", "paged KV cache, rotary",
                 "packed q, k, v")


def _replay_case(name: str):
    """(inputs(seed), call(*inputs)) of each kind of eager forward: decoding with keys split
    and grouped heads, a Gluon prefill, ragged lengths with window, softcap and ALiBi, sinks, varlen
    (self-attention: one cu_seqlens for q and k), sdpa with a mask, KV caches (new keys, rotary,
    paged) written in place, and packed q / k / v."""
    def gen(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return lambda *shape, dtype=torch.bfloat16: torch.randn(*shape, device="cuda", generator=g).to(dtype)

    def dense(b, sq, sk, h, hkv, d, dtype=torch.bfloat16):
        return lambda seed: tuple(gen(seed)(*shape, dtype=dtype) for shape in ((b, sq, h, d), (b, sk, hkv, d),
                                                                               (b, sk, hkv, d)))

    def kvcache(paged, seed):
        torch.manual_seed(seed)  # (paged_cache draws the slots no sequence reads from the global generator)
        r = gen(seed)
        q, k_cache, v_cache, k, v = r(3, 2, 8, 64), r(3, 300, 2, 64), r(3, 300, 2, 64), r(3, 2, 2, 64), r(3, 2, 2, 64)
        cos, sin = _rotary_tables(300, 32)
        lens = torch.tensor([0, 77, 290], dtype=torch.int32, device="cuda")
        if not paged:
            return q, k_cache, v_cache, k, v, lens, cos, sin, None
        k_pages, v_pages, table = paged_cache(k_cache, v_cache, 16, spare_pages=3, seed=seed)
        return q, k_pages, v_pages, k, v, lens, cos, sin, table

    def with_cache(q, k_cache, v_cache, k, v, lens, cos, sin, table):
        return qflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                              cache_seqlens=lens, block_table=table, causal=True,
                                              return_softmax_lse=True)

    lens_q, lens_k = [1, 63, 0, 40], [5, 1023, 9, 113]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0)], dtype=torch.int32, device="cuda")
                  for n in (lens_q, lens_k))
    alibi = torch.rand(2, 4, device="cuda")
    sinks = attention_sinks(8, device="cuda")
    mask = torch.rand(29, 47, device="cuda") > 0.3
    attn = lambda *t, **kw: qflash.flash_attn_func(*t, return_attn_probs=True, **kw)[:2]  # noqa: E731
    cases = [
        ("decode, split keys", dense(2, 1, 1023, 8, 2, 128), lambda q, k, v: attn(q, k, v, causal=True)),
        ("Gluon prefill", dense(1, 256, 256, 4, 2, 128, torch.float16), lambda q, k, v: attn(q, k, v, causal=True)),
        ("ragged, window, softcap, ALiBi", dense(2, 113, 239, 4, 2, 96, torch.float16),
         lambda q, k, v: attn(q, k, v, window_size=(32, 0), softcap=30.0, alibi_slopes=alibi)),
        ("sinks", dense(1, 1, 1023, 8, 2, 64), lambda q, k, v: attn(q, k, v, sinks=sinks)),
        ("varlen", lambda seed: (gen(seed)(104, 4, 32), gen(seed + 99)(1150, 2, 32), gen(seed + 98)(1150, 2, 32)),
         lambda q, k, v: qflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 63, 1023, causal=True,
                                                       return_attn_probs=True)[:2]),
        ("varlen, one cu_seqlens", lambda seed: tuple(gen(seed + i)(1150, h, 32) for i, h in enumerate((4, 2, 2))),
         lambda q, k, v: qflash.flash_attn_varlen_func(q, k, v, cu_k, cu_k, 1023, 1023, causal=True,
                                                       return_attn_probs=True)[:2]),
        ("sdpa with a mask", lambda seed: tuple(gen(seed)(2, 3, n, 32) for n in (29, 47, 47)),
         lambda q, k, v: (qflash.sdpa(q, k, v, attn_mask=mask),)),
        ("KV cache, rotary", lambda seed: kvcache(False, seed), with_cache),
        ("paged KV cache, rotary", lambda seed: kvcache(True, seed), with_cache),
        ("packed q, k, v", lambda seed: (gen(seed)(2, 70, 3, 4, 64, dtype=torch.float16),),
         lambda qkv: attn(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])),
    ]
    assert [case[0] for case in cases] == list(_REPLAY_CASES)
    return dict((case[0], case[1:]) for case in cases)[name]


@gpu
@pytest.mark.parametrize("name", _REPLAY_CASES)
def test_gpu_eager_forwards_replay_bit_for_bit(name, monkeypatch):
    """Five calls of a kind on fresh inputs without gradients (poisoned outputs), the last three
    replayed, against the same calls with replays off: the same bits in every output and every
    cache written in place. (The ragged case's tl tiles make their tensor descriptors in the kernel,
    in Triton's scratch memory.)"""
    from qflash.kernels import replay
    from qflash.ops.attention import _EAGER_FORWARDS

    inputs, call = _replay_case(name)
    results = {}
    for replays_on in (True, False):
        monkeypatch.setattr(replay, "ENABLED", replays_on)
        runs = [inputs(seed) for seed in range(5)]
        with torch.no_grad(), poisoned():
            outs = [call(*run) for run in runs]
        results[replays_on] = [(*outs[i], *runs[i]) for i in range(5)]  # outputs, then the (written) inputs
        if replays_on:
            assert len(_EAGER_FORWARDS.replays()) == 1
    for call_index, (on, off) in enumerate(zip(results[True], results[False])):
        for item, (a, b) in enumerate(zip(on, off)):  # the outputs, then the inputs
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.nan_to_num(), b.nan_to_num())
                                             and torch.equal(a.isnan(), b.isnan())), (name, call_index, item)
    for out in results[True]:
        assert_written(out[0])


@gpu
def test_gpu_eager_forwards_replay_only_memory_shared_alike(monkeypatch):
    """A replay of packed q, k, v (read at their distances from q) is not taken by q, k, v of
    the same shapes and strides from three packed tensors: their kind is another, with a replay
    of its own; the same bits as with replays off."""
    from qflash.kernels import replay
    from qflash.ops.attention import _EAGER_FORWARDS

    packs = [torch.randn(2, 70, 3, 4, 64, device="cuda", dtype=torch.float16) for _ in range(3)]
    apart = (packs[0][:, :, 0], packs[1][:, :, 1], packs[2][:, :, 2])
    monkeypatch.setattr(replay, "ENABLED", False)
    wants = [qflash.flash_attn_func(*qkv.unbind(2)) for qkv in (*packs, torch.stack(apart, 2))]
    monkeypatch.setattr(replay, "ENABLED", True)
    with torch.no_grad():
        for qkv, want in zip(packs, wants):  # run, recorded, replayed
            assert torch.equal(qflash.flash_attn_func(*qkv.unbind(2)), want)
        assert len(_EAGER_FORWARDS.replays()) == 1
        for _ in range(3):
            assert torch.equal(qflash.flash_attn_func(*apart), wants[-1])
        assert len(_EAGER_FORWARDS.replays()) == 2


@gpu
def test_gpu_eager_forwards_replay_a_decode_loop_recording_once_a_step(monkeypatch):
    """Decode steps of three layers with a cache that grows by one key a step (transformers'
    dynamic cache: a new kind each step): the first step runs, records and replays; every later
    step records in its first layer and replays in the others. The same bits as with replays off."""
    from qflash.kernels import replay
    from qflash.ops.attention import _EAGER_FORWARDS

    recorded = []
    record = replay.record
    monkeypatch.setattr(replay, "record", lambda fn, args: recorded.append(args[1].shape[1]) or record(fn, args))
    q = torch.randn(1, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
    keys, values = (torch.randn(1, 1030, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    outs = {}
    for replays_on in (True, False):
        monkeypatch.setattr(replay, "ENABLED", replays_on)
        with torch.no_grad():
            outs[replays_on] = [qflash.flash_attn_func(q, keys[:, :n], values[:, :n], causal=True)
                                for n in range(1024, 1029) for _ in range(3)]
    assert recorded == [1024, 1025, 1026, 1027, 1028] and len(_EAGER_FORWARDS.replays()) == 5
    assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))


@gpu
def test_gpu_eager_forwards_replay_per_stream_and_not_under_hooks():
    """A replay is its stream's (another stream records its own), and a launch hook (a profiler's)
    takes the normal path, which it then sees."""
    from triton import knobs

    from qflash.ops.attention import _EAGER_FORWARDS

    q, k, v = _qkv(2, 1, 300, 8, 2, 64, dtype=torch.bfloat16)
    want = qflash.flash_attn_func(q, k, v)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(qflash.flash_attn_func(q, k, v), want)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            outs = [qflash.flash_attn_func(q, k, v) for _ in range(3)]
        torch.cuda.synchronize()
        assert all(torch.equal(out, want) for out in outs) and len(_EAGER_FORWARDS.replays()) == 2
        seen = []
        hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
        knobs.runtime.launch_enter_hook.add(hook)
        try:
            assert torch.equal(qflash.flash_attn_func(q, k, v), want)
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        assert seen
