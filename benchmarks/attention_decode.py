"""Decoding attention (one query row a sequence against a long cache), side by side with SDPA.

A decode step reads the whole K/V cache for one query row, so its time is the cache's bytes over
the memory's speed, if enough programs read at once: one (batch, head) program each gives
batch x heads programs, 32 at batch 1 for 132 SMs. qflash then splits the keys into shares
(``kv_splits``, flash-decoding) and weighs them together in a second kernel; with grouped heads
the query heads of a key/value head share one row block (``PACK_GQA``), which reads the cache once
for all of them. Timed from CUDA graphs (and eagerly): the public ``flash_attn_func`` (as the
launcher chooses), without packing, without packing or split, with session 45's tiles and shares
(the prefill tiles with row blocks cut to the rows), the tiles the forward took before decoding
had any of this (128 query rows a block, neither), and PyTorch's SDPA
backends with ``enable_gqa``. Also a few short prefill sizes that the launcher now splits
(programs under the SM count).

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
    out = {"qflash": lambda: qflash.flash_attn_func(q, k, v, causal=causal)}
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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--cache", default="1024,4096,16384,65536")
    p.add_argument("--heads", default="32,8", help="query heads, key/value heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    heads, heads_kv = map(int, args.heads.split(","))
    d = args.head_dim
    rows = []
    cases = [(b, 1, s, heads, heads_kv, False) for b in map(int, args.batches.split(","))
             for s in map(int, args.cache.split(","))]
    cases += [(2, 1023, 1023, 6, 2, True), (1, 2000, 2000, 4, 4, True), (4, 700, 700, 8, 2, False)]  # short prefill
    for b, sq, sk, h, hkv, causal in cases:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        plan = kernels.forward_plan(q, k, kernels.AttnOptions(1 / math.sqrt(d), window_right=0 if causal else -1))
        splits, pack = plan.num_splits, plan.pack
        ref = qflash.flash_attn_func(q, k, v, causal=causal).float()
        cache_bytes = 2 * b * sk * hkv * d * 2
        for name, fn in providers(q, k, v, causal).items():
            row = dict(provider=name, batch=b, seqlen_q=sq, seqlen_k=sk, heads=h, heads_kv=hkv, head_dim=d,
                       causal=causal, splits=splits if name == "qflash" else None,
                       packed=pack if name == "qflash" else None)
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
    if args.out:
        save_json(args.out, {"env": environment(), "rows": rows})


if __name__ == "__main__":
    main()
