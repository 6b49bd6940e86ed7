"""Tiles for decoding: the tl forward's key block, pipeline depth and key shares at decode sizes
(one query row a sequence against a long cache), each timed from CUDA graphs against the
launcher's own plan and session 45's in the same run.

A decode step is bound by how fast its programs pull the cache: with a program an SM, each SM
must keep enough bytes in flight to cover the memory's latency, which the key block and the
number of pipeline stages set (a stage of 64 keys at D = 128 is 32 KB of K and V).

    python3 benchmarks/attention_decode_tiles.py --head-dims 64,128,256 --out tiles.json

``--flip-tma``: each run also with tensor descriptors on / off.

``--shares``: the plan's tiles with other key share counts instead: shares of at least 64, 128 or
256 keys, enough of them to fill the SMs once (rounded up) or twice, or as many as give no SM a
second program; "shares >= 256 keys, 1 a SM"
is session 46's rule (``--rules``: that one only).

``--share-tiles``: for each share count (the plan's, one, as many as fill the SMs once or twice),
the tiles the rule gives shares of that length, and a few other key blocks, depths and warp counts.
"""

import argparse
import dataclasses
import math

import torch

from qflash.bench.harness import environment, graph_ms, save_json
from qflash.testing import paged_cache
from qflash.kernels import attention as kernels
from attention_decode import round45_config


def variants(plan, deep=False):
    """Name -> tiles: the plan's own, and other key blocks and pipeline depths (``deep``: up to 7)."""
    cfg = plan.config
    out = {"plan": cfg}
    for block_n in (64, 128):
        for stages in (2, 3, 4, 5, 6, 7) if deep else (2, 3, 4):
            if (block_n, stages) != (128, 4):
                out[f"n{block_n} s{stages}"] = dataclasses.replace(cfg, block_n=block_n, num_stages=stages)
    out[f"w{2 * cfg.num_warps}"] = dataclasses.replace(cfg, num_warps=2 * cfg.num_warps)
    out["tma" if not cfg.use_tma else "no tma"] = dataclasses.replace(cfg, use_tma=not cfg.use_tma)
    return out


def share_counts(plan, keys, sms, only_s46=False):
    """Name -> key shares a row block: kv_splits's rule with other least share sizes and with
    enough shares for one or two programs an SM."""
    blocks = math.ceil(keys / plan.config.block_n)
    out = {}
    for min_keys in ((256,) if only_s46 else (64, 128, 256)):
        for fill in ((1,) if only_s46 else (1, 2)):
            if plan.programs >= sms * fill:
                count = 1
            else:
                count = min(math.ceil(fill * sms / plan.programs), blocks // max(1, min_keys // plan.config.block_n),
                            kernels.MAX_KV_SPLITS * fill)
            out[f"shares >= {min_keys} keys, {fill} a SM"] = max(1, count)
    if not only_s46:  # no SM with a second program: as many shares as fit one wave
        out["shares of a block or more, at most 1 a SM"] = max(1, min(sms // plan.programs, blocks,
                                                                      kernels.MAX_KV_SPLITS))
    return out


def share_tiles(plan, q, k, keys, paged, sms):
    """Name -> tiles with their share count: ``share_counts``'s counts (and one share), each with
    ``default_config``'s tiles for shares of that length and the other tiles of SHARE_TILES."""
    counts = {1, plan.num_splits, *share_counts(plan, keys, sms).values()}
    rows = q.shape[1] * (q.shape[2] // k.shape[2] if plan.pack else 1)  # what a row block holds
    out = {}
    for count in sorted(counts):
        share = math.ceil(keys / count)
        base = kernels.default_config(q.shape[-1], q.dtype, q.device, seqlen_k=keys, rows=rows, paged=paged,
                                      share_keys=share)
        out[f"{count} shares, rule tiles"] = dataclasses.replace(base, num_splits=count)
        for block_n, stages, warps in SHARE_TILES:
            if share >= block_n and (q.shape[-1] > 64 or warps == 4):
                out[f"{count} shares, n{block_n} s{stages} w{warps}"] = dataclasses.replace(
                    base, num_splits=count, block_n=block_n, num_stages=stages, num_warps=warps)
    return out


# (key block, stages, warps) beside the rule's tiles for ``--share-tiles`` (8 warps at D > 64 only)
SHARE_TILES = ((64, 2, 8), (64, 3, 4), (128, 3, 4), (128, 5, 4), (128, 5, 8))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--cache", default="1024,4096,16384,65536")
    p.add_argument("--heads", default="32,8", help="query heads, key/value heads")
    p.add_argument("--head-dims", default="64,128,256")
    p.add_argument("--shares", action="store_true", help="share counts instead of tiles")
    p.add_argument("--rules", action="store_true", help="with --shares: the plan beside session 46's rule only")
    p.add_argument("--share-tiles", action="store_true", help="share counts, each with the rule's tiles for that "
                   "share length and others")
    p.add_argument("--splits", default=None, help="share counts (e.g. 1,2,4) for every tile variant instead of "
                   "the plan's count and twice it")
    p.add_argument("--flip-tma", action="store_true", help="every run also with tensor descriptors flipped")
    p.add_argument("--pages", type=int, default=0, help="time the forward on the cache cut into pages of this "
                   "many slots (block_table), up to 7 pipeline stages")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    heads, heads_kv = map(int, args.heads.split(","))
    rows, env = [], environment()
    for d in map(int, args.head_dims.split(",")):
        for b in map(int, args.batches.split(",")):
            for s in map(int, args.cache.split(",")):
                gen = torch.Generator(device="cuda").manual_seed(0)
                q = torch.randn(b, 1, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                k = torch.randn(b, s, heads_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                v = torch.randn(b, s, heads_kv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                opts = kernels.AttnOptions(1 / math.sqrt(d))
                plan = kernels.forward_plan(q, k, opts)
                ref = kernels.attention_forward(q, k, v, opts)[0].float()
                cache_bytes = 2 * b * s * heads_kv * d * 2
                if args.pages:  # the same keys through a block table
                    k, v, table = paged_cache(k, v, args.pages, seed=args.pages)
                    lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
                    opts = kernels.AttnOptions(1 / math.sqrt(d), kv_cache=kernels.KVCache(lens, block_table=table))
                    plan = kernels.forward_plan(q, k, opts)
                if args.shares:
                    sms = torch.cuda.get_device_properties(0).multi_processor_count
                    runs = [("plan", plan.config, 1)] + [
                        (name, dataclasses.replace(plan.config, num_splits=count), 1)
                        for name, count in share_counts(plan, s, sms, args.rules).items()]
                elif args.share_tiles:
                    sms = torch.cuda.get_device_properties(0).multi_processor_count
                    runs = [("plan", plan.config, 1)] + [
                        (name, cfg, 1) for name, cfg in share_tiles(plan, q, k, s, bool(args.pages), sms).items()]
                elif args.splits:
                    runs = [(f"{name} {count} shares", dataclasses.replace(cfg, num_splits=int(count)), 1)
                            for name, cfg in variants(plan, bool(args.pages)).items()
                            for count in args.splits.split(",")]
                else:
                    runs = [(name, cfg, factor) for name, cfg in variants(plan, bool(args.pages)).items()
                            for factor in ((1,) if args.pages else (1, 2))]
                    if not args.pages:
                        runs.append(("round 45", round45_config(q, k, False), 1))
                if args.flip_tma:
                    runs += [(f"{name} {'no tma' if cfg.use_tma else 'tma'}",
                              dataclasses.replace(cfg, use_tma=not cfg.use_tma), factor) for name, cfg, factor in runs]
                for name, cfg, split_factor in runs:
                    # the plan's share count for these tiles (auto), or twice it (two programs an SM where they fit)
                    auto = cfg.num_splits or kernels.forward_plan(q, k, opts, cfg).num_splits
                    run_cfg = dataclasses.replace(cfg, num_splits=min(auto * split_factor, 128))
                    row = dict(variant=name + (" x2 shares" if split_factor > 1 else ""), batch=b, seqlen_k=s,
                               heads=heads, heads_kv=heads_kv, head_dim=d, block_m=cfg.block_m,
                               block_n=cfg.block_n, num_stages=cfg.num_stages, num_warps=cfg.num_warps,
                               use_tma=cfg.use_tma, num_splits=run_cfg.num_splits, page_size=args.pages or None)
                    try:
                        fn = lambda c=run_cfg: kernels.attention_forward(q, k, v, opts, config=c)[0]  # noqa: E731
                        row["max_diff"] = (fn().float() - ref).abs().max().item()
                        row["ms_graph"] = graph_ms(fn)
                        row["cache_TBps"] = cache_bytes / (row["ms_graph"] * 1e-3) / 1e12
                    except Exception as e:  # noqa: BLE001 - tiles that do not fit shared memory
                        row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                    rows.append(row)
                    print({k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()},
                          flush=True)
                if args.out:  # after every shape, so that a run cut short keeps what it measured
                    save_json(args.out, {"env": env, "complete": False, "rows": rows})
    if args.out:
        save_json(args.out, {"env": env, "complete": True, "rows": rows})


if __name__ == "__main__":
    main()
