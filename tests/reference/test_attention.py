"""The references themselves: checked against PyTorch and direct formulas in float64."""

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from qflash.reference import (
    alibi_bias,
    attention_ref,
    attention_varlen_ref,
    online_softmax_attention,
    sdpa_ref,
    visible_mask,
)

F64 = torch.float64


def _qkv(b, sq, sk, h, hkv, d, dtype=F64):
    return (torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hkv, d, dtype=dtype),
            torch.randn(b, sk, hkv, d, dtype=dtype))


def _sdpa_bhsd(q, k, v, **kw):
    """F.sdpa on flash-attn layout tensors."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw).transpose(1, 2)


@pytest.mark.parametrize("sq,sk", [(1, 1), (63, 63), (113, 203), (64, 17)])
def test_matches_sdpa_noncausal(sq, sk):
    q, k, v = _qkv(2, sq, sk, 3, 3, 40)
    out, lse = attention_ref(q, k, v)
    torch.testing.assert_close(out, _sdpa_bhsd(q, k, v), rtol=1e-12, atol=1e-12)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(40)
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sq,sk", [(63, 63), (40, 100), (100, 40)])
def test_causal_is_bottom_right(sq, sk):
    q, k, v = _qkv(1, sq, sk, 2, 2, 16)
    out, _ = attention_ref(q, k, v, causal=True)
    # F.sdpa is top-left: give it the bottom-right mask explicitly.
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    mask = j <= i + sk - sq
    expected = _sdpa_bhsd(q, k, v, attn_mask=mask)
    has_key = mask.any(dim=1)
    torch.testing.assert_close(out[:, has_key], expected[:, has_key], rtol=1e-12, atol=1e-12)
    assert torch.equal(out[:, ~has_key], torch.zeros_like(out[:, ~has_key]))
    if sq == sk:  # square: both alignments coincide
        torch.testing.assert_close(out, _sdpa_bhsd(q, k, v, is_causal=True), rtol=1e-12, atol=1e-12)


def test_rows_without_keys_are_zero_and_lse_inf():
    q, k, v = _qkv(1, 10, 3, 2, 2, 8)
    out, lse = attention_ref(q, k, v, causal=True)  # rows 0..6 see nothing
    assert torch.equal(out[:, :7], torch.zeros_like(out[:, :7]))
    assert torch.isinf(lse[:, :, :7]).all() and (lse[:, :, :7] > 0).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, 7:]).all()


def test_no_keys_at_all_gives_zero_and_lse_inf_or_the_sink():
    """seqlen_k = 0 (an empty sequence of a varlen batch): as a row whose keys are all masked."""
    q, k, v = _qkv(1, 4, 0, 2, 2, 8)
    out, lse = attention_ref(q, k, v)
    assert out.shape == q.shape and torch.equal(out, torch.zeros_like(out))
    assert torch.isposinf(lse).all()
    sinks = torch.randn(2, dtype=F64)
    out, lse = attention_ref(q, k, v, sinks=sinks)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, sinks.view(1, 2, 1).expand(1, 2, 4))


def test_gqa_equals_repeated_heads():
    q, k, v = _qkv(2, 17, 23, 6, 2, 16)
    out, lse = attention_ref(q, k, v, causal=True)
    k6, v6 = k.repeat_interleave(3, dim=2), v.repeat_interleave(3, dim=2)
    out6, lse6 = attention_ref(q, k6, v6, causal=True)
    torch.testing.assert_close(out, out6, rtol=0, atol=0)
    # query head h uses kv head h // 3: check one head by hand
    o2, _ = attention_ref(q[:, :, 4:5], k[:, :, 1:2], v[:, :, 1:2], causal=True)
    torch.testing.assert_close(out[:, :, 4:5], o2, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window", [(3, 2), (0, 0), (5, -1), (-1, 4)])
def test_window_direct_formula(window):
    sq, sk, d = 20, 27, 8
    q, k, v = _qkv(1, sq, sk, 1, 1, d)
    out, _ = attention_ref(q, k, v, window_size=window)
    left, right = window
    expected = torch.zeros_like(out)
    for i in range(sq):
        js = [j for j in range(sk)
              if (left < 0 or j >= i + sk - sq - left) and (right < 0 or j <= i + sk - sq + right)]
        if js:
            s = torch.stack([q[0, i, 0] @ k[0, j, 0] for j in js]) / math.sqrt(d)
            expected[0, i, 0] = torch.softmax(s, 0) @ v[0, js, 0]
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_softcap_direct_formula():
    q, k, v = _qkv(1, 9, 11, 2, 2, 8)
    q = q * 4  # large scores, so the cap matters
    cap = 2.5
    out, _ = attention_ref(q, k, v, softcap=cap, softmax_scale=0.3)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * 0.3
    s = cap * torch.tanh(s / cap)
    expected = torch.einsum("bhij,bjhd->bihd", torch.softmax(s, -1), v)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi_direct_formula(per_batch):
    b, sq, sk, h, d = 2, 7, 12, 3, 8
    q, k, v = _qkv(b, sq, sk, h, h, d)
    slopes = torch.rand(b, h, dtype=F64) if per_batch else torch.rand(h, dtype=F64)
    out, _ = attention_ref(q, k, v, alibi_slopes=slopes, causal=True)
    s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(d)
    for bb in range(b):
        for hh in range(h):
            sl = slopes[bb, hh] if per_batch else slopes[hh]
            for i in range(sq):
                for j in range(sk):
                    s[bb, hh, i, j] += -sl * abs(i + sk - sq - j) if j <= i + sk - sq else -math.inf
    expected = torch.einsum("bhij,bjhd->bihd", torch.softmax(s, -1), v)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert alibi_bias(slopes, sq, sk).shape[-2:] == (sq, sk)


def test_varlen_equals_per_sequence():
    cu_q = torch.tensor([0, 5, 6, 19], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 11, 24], dtype=torch.int32)
    q, k, v = torch.randn(19, 4, 8, dtype=F64), torch.randn(24, 2, 8, dtype=F64), torch.randn(24, 2, 8, dtype=F64)
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True)
    assert out.shape == q.shape and lse.shape == (4, 19)
    for b in range(3):
        o, l = attention_ref(q[None, cu_q[b]:cu_q[b + 1]], k[None, cu_k[b]:cu_k[b + 1]],
                             v[None, cu_k[b]:cu_k[b + 1]], causal=True)
        torch.testing.assert_close(out[cu_q[b]:cu_q[b + 1]], o[0], rtol=0, atol=0)
        torch.testing.assert_close(lse[:, cu_q[b]:cu_q[b + 1]], l[0], rtol=0, atol=0)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "float"])
def test_sdpa_ref_matches_pytorch(mask_kind):
    q = torch.randn(2, 4, 13, 16, dtype=F64)
    k, v = torch.randn(2, 4, 21, 16, dtype=F64), torch.randn(2, 4, 21, 16, dtype=F64)
    kw = {}
    if mask_kind == "causal":
        kw["is_causal"] = True
    elif mask_kind == "bool":
        kw["attn_mask"] = torch.rand(2, 1, 13, 21) > 0.3
        kw["attn_mask"][..., 0] = True  # no fully masked row: PyTorch would give NaN there
    elif mask_kind == "float":
        kw["attn_mask"] = torch.randn(13, 21, dtype=F64)
    torch.testing.assert_close(sdpa_ref(q, k, v, **kw), F.scaled_dot_product_attention(q, k, v, **kw),
                               rtol=1e-12, atol=1e-12)


def test_sdpa_ref_gqa():
    q = torch.randn(1, 6, 5, 8, dtype=F64)
    k, v = torch.randn(1, 2, 9, 8, dtype=F64), torch.randn(1, 2, 9, 8, dtype=F64)
    torch.testing.assert_close(sdpa_ref(q, k, v, enable_gqa=True),
                               F.scaled_dot_product_attention(q, k, v, enable_gqa=True), rtol=1e-12, atol=1e-12)


def test_sdpa_ref_any_leading_dims_with_gqa():
    """PyTorch's (batch, ..., heads, seqlen, headdim), as the public sdpa takes it: 5-D, GQA, a mask
    broadcast over a leading dim (the GQA repeat used to assume 4-D)."""
    q = torch.randn(2, 3, 4, 9, 16, dtype=torch.float64)
    k, v = torch.randn(2, 3, 2, 11, 16, dtype=torch.float64), torch.randn(2, 3, 2, 11, 16, dtype=torch.float64)
    mask = torch.randn(3, 1, 9, 11, dtype=torch.float64)
    torch.testing.assert_close(sdpa_ref(q, k, v, attn_mask=mask, enable_gqa=True),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
                               rtol=1e-12, atol=1e-12)


def test_sdpa_ref_two_dims():
    """(seqlen, headdim) alone, as PyTorch takes it: one head, causal or with a mask."""
    q, k, v = torch.randn(9, 16, dtype=F64), torch.randn(11, 16, dtype=F64), torch.randn(11, 16, dtype=F64)
    mask = torch.randn(9, 11, dtype=F64)
    for kw in (dict(attn_mask=mask), dict(is_causal=True)):
        torch.testing.assert_close(sdpa_ref(q, k, v, **kw), F.scaled_dot_product_attention(q, k, v, **kw),
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("trial", range(6))
def test_online_softmax_any_block_order(trial):
    g = torch.Generator().manual_seed(trial)
    sq, sk = int(torch.randint(1, 60, (1,), generator=g)), int(torch.randint(1, 90, (1,), generator=g))
    block_n = int(torch.randint(1, 33, (1,), generator=g))
    causal = bool(trial % 2)
    q, k, v = _qkv(2, sq, sk, 3, 3, 16)
    q = q * 3  # spread the scores so the running max really moves
    nblocks = math.ceil(sk / block_n)
    order = torch.randperm(nblocks, generator=g).tolist()
    out, lse = online_softmax_attention(q, k, v, block_n=block_n, order=order, causal=causal)
    ref_out, ref_lse = attention_ref(q, k, v, causal=causal)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_online_softmax_reports_each_block():
    q, k, v = _qkv(1, 4, 10, 1, 1, 8)
    seen = []
    online_softmax_attention(q, k, v, block_n=4, on_block=lambda st: seen.append((st["block"], st["keys"])))
    assert seen == [(0, (0, 4)), (1, (4, 8)), (2, (8, 10))]
    with pytest.raises(ValueError, match="permutation"):
        online_softmax_attention(q, k, v, block_n=4, order=[0, 0, 1])


def test_visible_mask_none_without_masking():
    assert visible_mask(4, 5) is None
    assert visible_mask(2, 4, causal=True, bottom_right=False).tolist() == [[True, False, False, False],
                                                                              [True, True, False, False]]


def test_reference_does_not_import_triton():
    code = "import sys, qflash.reference, qflash.testing; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
