"""Decoding attention (one query row a sequence against a long cache), side by side with SDPA.

A decode step reads the whole K/V cache for one query row, so its time is the cache's bytes over
the memory's speed, if enough programs read at once: one (batch, head) program each gives
batch x heads programs, 32 at batch 1 for 132 SMs. qflash then splits the keys into shares
(``kv_splits``, flash-decoding) and weighs them together in a second kernel; with grouped heads
the query heads of a key/value head share one row block (``PACK_GQA``), which reads the cache once
for all of them. Timed from CUDA graphs (and eagerly): the public ``flash_attn_func`` (as the
launcher chooses), ``flash_attn_with_kvcache`` on the cache as it is, without packing, without
packing or split, with session 45's tiles and shares (the prefill tiles with row blocks cut to
the rows), the tiles the forward took before decoding had any of this (128 query rows a block,
neither), and PyTorch's SDPA backends with ``enable_gqa``. At batch > 1 the same step also from a
padded batch (a boolean mask through ``qflash.sdpa``, beside SDPA with it) and from packed
sequences (``flash_attn_varlen_func``).
And a whole serving step (``step_providers``: rotary, the new key written in place, attention)
through ``flash_attn_with_kvcache`` beside the same step in PyTorch ops with SDPA, and the step
on a paged cache (``paged_providers``: pages of 16 and 256 slots through ``block_table``).
Also a few short prefill sizes that the launcher now splits (programs under the SM count).

    python3 benchmarks/attention_decode.py --out decode.json
"""

import argparse
import dataclasses
import math

import torch
import torch.nn.functional as F

import qflash
from qflash.bench.attention import _qflash_provider
from qflash.bench.harness import environment, graph_ms, save_json, time_ms
from qflash.kernels import attention as kernels
from qflash.testing import paged_cache


def round45_config(q, k, causal):
    """The tiles and key shares session 45's launcher gave a call (before decoding had tiles of its
    own): the prefill tiles with row blocks cut to the rows, shares of at least 8 key blocks."""
    d = q.shape[-1]
    opts = kernels.AttnOptions(1 / math.sqrt(d), window_right=0 if causal else -1)
    rows = q.shape[1] * (q.shape[2] // k.shape[2] if kernels.packs_gqa(q, k, opts) else 1)
    cfg = kernels.decode_config(kernels.default_config(d, q.dtype, q.device, causal=causal, seqlen_k=k.shape[1]),
                                rows)
    programs = kernels.forward_plan(q, k, opts, dataclasses.replace(cfg, num_splits=1)).programs
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    splits = 1 if programs >= sms else max(1, min(math.ceil(sms / programs), math.ceil(k.shape[1] / cfg.block_n) // 8,
                                                  kernels.MAX_KV_SPLITS))
    return dataclasses.replace(cfg, num_splits=splits)


def providers(q, k, v, causal):
    d = q.shape[-1]
    base = kernels.default_config(d, q.dtype, q.device, causal=causal, seqlen_k=k.shape[1])
    unpacked = kernels.default_config(d, q.dtype, q.device, causal=causal, seqlen_k=k.shape[1], rows=q.shape[1])
    configs = {  # the tl forward with these tiles
        "qflash no pack": dataclasses.replace(unpacked, pack_gqa=False),
        "qflash no pack, no split": dataclasses.replace(unpacked, pack_gqa=False, num_splits=1),
        "qflash round 45 (prefill tiles, shares of 8 blocks)": round45_config(q, k, causal),
        "qflash before (128-row blocks, neither)": dataclasses.replace(base, num_splits=1, pack_gqa=False),
    }
    out = {"qflash": lambda: qflash.flash_attn_func(q, k, v, causal=causal),
           # the same keys as a full cache: the packed-sequence view and its keys-in-use read
           "qflash with_kvcache": lambda: qflash.flash_attn_with_kvcache(q, k, v, causal=causal)}
    out.update({name: _qflash_provider(cfg)(q, k, v, causal) for name, cfg in configs.items()})
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
        def run(backend=getattr(SDPBackend, name)):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal and q.shape[1] > 1,
                                                      enable_gqa=kt.shape[1] != qt.shape[1]).transpose(1, 2)
        out[f"sdpa {name.lower()}"] = run
    return out


def masked_providers(q, k, v):
    """A decode step of a padded batch as transformers runs it: a boolean mask (B, 1, 1, Sk), here
    all True but the first key of each sequence, through ``qflash.sdpa`` (the heads packed, as the
    plane is every head's) and without packing, beside PyTorch's SDPA with the same mask."""
    b, sk = q.shape[0], k.shape[1]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    mask = torch.ones(b, 1, 1, sk, dtype=torch.bool, device=q.device)
    mask[..., 0] = False
    opts = kernels.AttnOptions(1 / math.sqrt(q.shape[-1]), bias=mask.expand(b, q.shape[2], 1, sk))
    cfg = kernels.default_config(q.shape[-1], q.dtype, q.device, seqlen_k=sk, rows=1)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def pt(backends):
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True).transpose(1, 2)

    return {
        "qflash sdpa mask": lambda: qflash.sdpa(qt, kt, vt, attn_mask=mask, enable_gqa=True).transpose(1, 2),
        "qflash mask no pack": lambda: kernels.attention_forward(q, k, v, opts,
                                                                 config=dataclasses.replace(cfg, pack_gqa=False))[0],
        "sdpa mask (PyTorch's choice)": lambda: pt([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                                    SDPBackend.MATH]),
        "sdpa mask cudnn_attention": lambda: pt([SDPBackend.CUDNN_ATTENTION]),
    }


def varlen_providers(q, k, v):
    """The same step with the sequences packed (``flash_attn_varlen_func``, one row each, as
    serving stacks call it), packed heads and not."""
    b, sk, d = q.shape[0], k.shape[1], q.shape[-1]
    qv, kv_, vv = q.reshape(b, *q.shape[2:]), k.reshape(b * sk, *k.shape[2:]), v.reshape(b * sk, *v.shape[2:])
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device)
    cu_k = cu_q * sk
    opts = kernels.AttnOptions(1 / math.sqrt(d), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=1, max_seqlen_k=sk)
    cfg = kernels.default_config(d, q.dtype, q.device, seqlen_k=sk, rows=1)
    unpack = dataclasses.replace(cfg, pack_gqa=False)
    return {
        "qflash varlen": lambda: qflash.flash_attn_varlen_func(qv, kv_, vv, cu_q, cu_k, 1, sk).unsqueeze(1),
        "qflash varlen no pack": lambda: kernels.attention_forward(qv, kv_, vv, opts, config=unpack)[0].unsqueeze(1),
    }


def _rope_halves(x, cos, sin, pos):
    """x (B, S, H, D) rotated in halves (Llama) at positions ``pos`` (S,), in float32."""
    c, s = cos[pos][None, :, None, :], sin[pos][None, :, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def step_providers(q, k, v):
    """A whole serving step: one new key / value a sequence into the cache's last slot, rotary on q
    and the new key (Llama's halves), then attention over the cache: ``flash_attn_with_kvcache``
    (one launch for the rotary and the writes, one for the attention, one to combine) beside the
    same step in PyTorch ops (a static cache, as transformers' StaticCache writes it, then SDPA)."""
    b, sk, hkv, d = k.shape
    gen = torch.Generator(device=q.device).manual_seed(1)
    k_new, v_new = (torch.randn(b, 1, hkv, d, device=q.device, dtype=q.dtype, generator=gen) for _ in range(2))
    angles = torch.arange(sk, device=q.device, dtype=torch.float32)[:, None] * (
        1e4 ** (-torch.arange(0, d, 2, device=q.device, dtype=torch.float32) / d))
    cos, sin = angles.cos(), angles.sin()
    lens = torch.full((b,), sk - 1, dtype=torch.int32, device=q.device)
    pos = torch.full((1,), sk - 1, dtype=torch.long, device=q.device)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def torch_step(backend):
        def run():
            k.index_copy_(1, pos, _rope_halves(k_new, cos, sin, pos))
            v.index_copy_(1, pos, v_new)
            qt, kt, vt = (x.transpose(1, 2) for x in (_rope_halves(q, cos, sin, pos), k, v))
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)
        return run

    return {
        "qflash with_kvcache step": lambda: qflash.flash_attn_with_kvcache(
            q, k, v, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens, causal=True,
            rotary_interleaved=False),
        "torch step + sdpa cudnn_attention": torch_step(SDPBackend.CUDNN_ATTENTION),
        "torch step + sdpa flash_attention": torch_step(SDPBackend.FLASH_ATTENTION),
    }


def paged_providers(q, k, v):
    """The same step on a paged cache: the cache cut into pages of 16 slots (vLLM's) and of 256
    (flash-attn's), shuffled, read through ``block_table`` by ``flash_attn_with_kvcache`` and by
    ``flash_attn_varlen_func`` (one query row a sequence), beside ``flash_attn_with_kvcache`` on the
    dense cache."""
    b, sk = k.shape[:2]
    lens = torch.full((b,), sk, dtype=torch.int32, device=q.device)
    out = {"qflash with_kvcache dense": lambda: qflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)}
    for page in (16, 256):
        k_pages, v_pages, table = paged_cache(k, v, page, seed=page)
        cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device)
        out[f"qflash with_kvcache paged {page}"] = (
            lambda kp=k_pages, vp=v_pages, t=table: qflash.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens,
                                                                                     block_table=t))
        out[f"qflash varlen paged {page}"] = (
            lambda kp=k_pages, vp=v_pages, t=table, cu_q=cu_q: qflash.flash_attn_varlen_func(
                q.reshape(b, *q.shape[2:]), kp, vp, cu_q, cu_q * sk, 1, sk, block_table=t).unsqueeze(1))
    return out


def measure(rows, fns, ref, info, cache_bytes, plan=None):
    """Time each provider from graphs and eagerly, with its largest difference from ``ref`` (None:
    the first provider's output)."""
    for name, fn in fns.items():
        if ref is None:
            ref = fn().float()
        splits, pack = (plan or {}).get(name, (None, None))
        row = dict(provider=name, **info, splits=splits, packed=pack)
        try:
            got = fn().float()
            row["max_diff_vs_qflash"] = (got - ref).abs().max().item()
            row.update(time_ms(fn))
            row["ms_graph"] = graph_ms(fn)
            if row["ms_graph"]:
                row["cache_TBps_graph"] = cache_bytes / (row["ms_graph"] * 1e-3) / 1e12
        except Exception as e:  # noqa: BLE001 - a backend that refuses the shape
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print({k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()}, flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--cache", default="1024,4096,16384,65536")
    p.add_argument("--heads", default="32,8", help="query heads, key/value heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kinds", default="dense,step,paged,mask,varlen,prefill",
                   help="which rows: dense, step, paged, mask, varlen (decode steps) and prefill (short prefills)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    kinds = set(args.kinds.split(","))
    heads, heads_kv = map(int, args.heads.split(","))
    d = args.head_dim
    rows = []
    cases = [(b, 1, s, heads, heads_kv, False) for b in map(int, args.batches.split(","))
             for s in map(int, args.cache.split(","))]
    if "prefill" in kinds:
        cases += [(2, 1023, 1023, 6, 2, True), (1, 2000, 2000, 4, 4, True), (4, 700, 700, 8, 2, False)]
    env = environment()
    for b, sq, sk, h, hkv, causal in cases:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        plan = kernels.forward_plan(q, k, kernels.AttnOptions(1 / math.sqrt(d), window_right=0 if causal else -1))
        splits, pack = plan.num_splits, plan.pack
        ref = qflash.flash_attn_func(q, k, v, causal=causal).float()
        info = dict(batch=b, seqlen_q=sq, seqlen_k=sk, heads=h, heads_kv=hkv, head_dim=d, causal=causal)
        cache_bytes = 2 * b * sk * hkv * d * 2
        if sq > 1 or "dense" in kinds:
            measure(rows, providers(q, k, v, causal), ref, dict(info, kind="dense"), cache_bytes,
                    plan={"qflash": (splits, pack)})
        if sq == 1 and "step" in kinds:
            measure(rows, step_providers(q, k.clone(), v.clone()), None, dict(info, kind="step"), cache_bytes)
        if sq == 1 and "paged" in kinds:
            measure(rows, paged_providers(q, k, v), ref, dict(info, kind="paged"), cache_bytes)
        if sq == 1 and b > 1:  # the same step from a padded batch (a mask) and from packed sequences
            if "mask" in kinds:
                measure(rows, masked_providers(q, k, v), None, dict(info, kind="mask"), cache_bytes)
            if "varlen" in kinds:
                measure(rows, varlen_providers(q, k, v), ref, dict(info, kind="varlen"), cache_bytes)
        if args.out:  # after every shape, so that a run cut short keeps what it measured
            save_json(args.out, {"env": env, "complete": False, "rows": rows})
    if args.out:
        save_json(args.out, {"env": env, "complete": True, "rows": rows})


if __name__ == "__main__":
    main()
