"""Attention forward benchmark: qflash next to PyTorch's SDPA backends and other peers.

Sizing follows the FlashAttention papers: batch x seqlen = 16k tokens and
heads x headdim = 2048, seqlen 512 ... 16k. Every provider is first checked
against a float32 reference on a slice of the benchmark inputs (the last query
rows of two heads, which see every key), and its error is reported next to its
speed. TFLOP/s use the 4 * B * H * Sq * Sk * D convention, halved for causal.

    python -m qflash.bench.attention --out results.json           # the sweep
    python -m qflash.bench.attention --tiles --head-dims 128       # qflash tile search
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import platform
import sys
from typing import Callable, Dict, List, Optional

import torch

DEFAULT_SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]
DEFAULT_HEAD_DIMS = [64, 128, 256]
DEFAULT_PROVIDERS = ["qflash", "sdpa_cudnn", "sdpa_flash"]
ALL_PROVIDERS = ["qflash", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "naive", "flex", "flash_attn", "sageattention"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def environment() -> Dict[str, object]:
    """What a result was measured on."""
    import triton

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sm_count=props.multi_processor_count,
                   capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                   cudnn=torch.backends.cudnn.version())
    return env


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool) -> float:
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops / 2 if causal else flops


# ----------------------------------------------------------------------------------------------
# Providers: each takes q, k, v in flash-attn layout (B, S, H, D) and returns a callable that
# computes attention and returns the output in that layout. Layout conversion for the peers
# happens once, outside the timed call.
# ----------------------------------------------------------------------------------------------
def _sdpa_provider(backend_name: str):
    def make(q, k, v, causal):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        F = torch.nn.functional

        def run():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)

        return run

    return make


def _qflash_provider(config=None):
    def make(q, k, v, causal):
        if config is None:
            import qflash

            return lambda: qflash.flash_attn_func(q, k, v, causal=causal)
        from qflash.kernels.attention import attention_forward

        scale = 1.0 / math.sqrt(q.shape[-1])
        return lambda: attention_forward(q, k, v, softmax_scale=scale, window_right=0 if causal else -1,
                                         config=config)[0]

    return make


def _naive(q, k, v, causal):
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1])

    def run():
        s = (qt @ kt.transpose(-1, -2)) * scale
        if causal:
            n = s.shape[-1]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        return (torch.softmax(s.float(), dim=-1).to(q.dtype) @ vt).transpose(1, 2)

    return run


def _flex(q, k, v, causal):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    block_mask = None
    if causal:
        n = q.shape[1]
        block_mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, n, n, device=q.device)
    compiled = torch.compile(flex_attention)
    return lambda: compiled(qt, kt, vt, block_mask=block_mask).transpose(1, 2)


def _flash_attn(q, k, v, causal):
    from flash_attn import flash_attn_func

    return lambda: flash_attn_func(q, k, v, causal=causal)


def _sage(q, k, v, causal):
    from sageattention import sageattn

    return lambda: sageattn(q, k, v, tensor_layout="NHD", is_causal=causal)


PROVIDERS: Dict[str, Callable] = {
    "qflash": _qflash_provider(),
    "sdpa_cudnn": _sdpa_provider("CUDNN_ATTENTION"),
    "sdpa_flash": _sdpa_provider("FLASH_ATTENTION"),
    "sdpa_efficient": _sdpa_provider("EFFICIENT_ATTENTION"),
    "naive": _naive,
    "flex": _flex,
    "flash_attn": _flash_attn,
    "sageattention": _sage,
}


def _slice_error(out: torch.Tensor, q, k, v, causal: bool) -> float:
    """Max abs error on the last 256 query rows of heads 0-1 of batch 0, against fp32."""
    from qflash.reference import attention_ref

    rows = min(256, q.shape[1])
    sl = (slice(0, 1), slice(q.shape[1] - rows, None), slice(0, 2))
    ref, _ = attention_ref(q[sl].float(), k[:1, :, :2].float(), v[:1, :, :2].float(), causal=causal)
    return float((out[sl].float() - ref).abs().max())


def bench_one(make, q, k, v, causal: bool, *, rep_ms: int = 100) -> Dict[str, object]:
    import triton

    try:
        fn = make(q, k, v, causal)
        out = fn()
        err = _slice_error(out, q, k, v, causal)
        del out
        ms, lo, hi = triton.testing.do_bench(fn, warmup=25, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        return {"ms": ms, "ms_p20": lo, "ms_p80": hi, "max_err": err, "error": None}
    except Exception as exc:  # a peer that is missing or refuses the shape is reported, not fatal
        torch.cuda.empty_cache()
        return {"ms": None, "max_err": None, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}


def fa_shapes(seqlens, head_dims, total_tokens=16384, hidden=2048):
    for d in head_dims:
        for s in seqlens:
            yield max(1, total_tokens // s), hidden // d, s, d


def run_sweep(providers: List[str], seqlens, head_dims, causals, dtype, *, progress=None) -> List[dict]:
    rows = []
    for (batch, heads, seqlen, d), causal in itertools.product(list(fa_shapes(seqlens, head_dims)), causals):
        g = torch.Generator(device="cuda").manual_seed(seqlen * 7 + d)
        q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", generator=g).to(dtype) for _ in range(3))
        flops = attention_flops(batch, heads, seqlen, seqlen, d, causal)
        for name in providers:
            if name == "naive" and batch * heads * seqlen * seqlen * 4 > 48 * 2**30:
                res = {"ms": None, "max_err": None, "error": "skipped: score matrix over 48 GB"}
            else:
                res = bench_one(PROVIDERS[name], q, k, v, causal)
            tflops = flops / (res["ms"] * 1e-3) / 1e12 if res["ms"] else None
            rows.append(dict(provider=name, batch=batch, heads=heads, seqlen=seqlen, head_dim=d, causal=causal,
                             dtype=str(dtype).replace("torch.", ""), tflops=tflops, **res))
            if progress:
                progress(rows[-1])
        del q, k, v
        torch.cuda.empty_cache()
    return rows


# (block_m, block_n, num_warps, num_stages, use_tma) searched on the H200, per head-dim bucket.
# The grid searched on the H200 in the second round (benchmarks/results/attention_tiles_*.json
# hold every round); the winners are qflash.kernels.attention.default_config.
TILE_GRID = {
    64: [(128, 64, 4, 3, False), (128, 64, 4, 3, True), (128, 128, 4, 3, True), (128, 64, 4, 4, False),
         (128, 128, 4, 3, False), (128, 128, 8, 3, False), (256, 64, 8, 3, True), (256, 64, 8, 3, False)],
    128: [(128, 64, 4, 2, True), (128, 64, 4, 2, False), (128, 64, 4, 3, False), (128, 128, 8, 3, True),
          (256, 64, 8, 2, True), (128, 32, 4, 2, True), (128, 64, 4, 1, True)],
    256: [(128, 64, 8, 2, True), (128, 32, 8, 2, True), (64, 32, 4, 2, True), (128, 64, 8, 2, False),
          (128, 32, 8, 3, True)],
}


def tile_configs(head_dim: int):
    from qflash.kernels.attention import AttnFwdConfig

    bucket = 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256
    for bm, bn, w, s, tma in TILE_GRID[bucket]:
        yield AttnFwdConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=s, use_tma=tma)


def run_tiles(seqlens, head_dims, causals, dtype, *, progress=None, rows=None) -> List[dict]:
    rows = [] if rows is None else rows
    for d in head_dims:
        inputs = {}
        for seqlen in seqlens:
            batch, heads = max(1, 16384 // seqlen), 2048 // d
            g = torch.Generator(device="cuda").manual_seed(d + seqlen)
            inputs[seqlen] = [torch.randn(batch, seqlen, heads, d, device="cuda", generator=g).to(dtype)
                              for _ in range(3)]
        for causal in causals:
            for cfg in tile_configs(d):
                for seqlen, (q, k, v) in inputs.items():  # one compile serves every length
                    batch, heads = q.shape[0], q.shape[2]
                    flops = attention_flops(batch, heads, seqlen, seqlen, d, causal)
                    res = bench_one(_qflash_provider(cfg), q, k, v, causal, rep_ms=60)
                    tflops = flops / (res["ms"] * 1e-3) / 1e12 if res["ms"] else None
                    rows.append(dict(provider="qflash", config=cfg.__dict__, batch=batch, heads=heads,
                                     seqlen=seqlen, head_dim=d, causal=causal, tflops=tflops, **res))
                    if progress:
                        progress(rows[-1])
    return rows


def memory_probe(seqlens=(4096, 16384, 65536), providers=("qflash", "sdpa_flash", "naive")) -> List[dict]:
    """Extra peak device memory of one forward at batch 1, 16 heads, D=128, bf16."""
    rows = []
    for n in seqlens:
        q, k, v = (torch.randn(1, n, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for name in providers:
            if name == "naive" and 16 * n * n * 2 * 3 > 100 * 2**30:
                rows.append(dict(provider=name, seqlen=n, extra_mb=None, predicted_naive_mb=16 * n * n * 10 / 2**20,
                                 error="skipped: would not fit"))
                continue
            fn = PROVIDERS[name](q, k, v, False)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            try:
                out = fn()
                torch.cuda.synchronize()
                extra = (torch.cuda.max_memory_allocated() - base) / 2**20
                del out
                rows.append(dict(provider=name, seqlen=n, extra_mb=extra, error=None))
            except torch.cuda.OutOfMemoryError as exc:
                rows.append(dict(provider=name, seqlen=n, extra_mb=None, error=f"OutOfMemoryError: {exc}"[:120]))
            torch.cuda.empty_cache()
        # What the output and lse alone need, for comparison: O(N).
        rows.append(dict(provider="output+lse (bytes that must exist)", seqlen=n,
                         extra_mb=(n * 16 * 128 * 2 + 16 * n * 4) / 2**20, error=None))
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def _table(rows: List[dict], title: str):
    from rich.table import Table

    keys = [k for k in ("provider", "config", "seqlen", "head_dim", "causal", "tflops", "ms", "max_err", "extra_mb",
                        "error") if any(k in r for r in rows)]
    table = Table(title=title)
    for k in keys:
        table.add_column(k)
    for r in rows:
        table.add_row(*[_fmt(r.get(k)) for k in keys])
    return table


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}" if abs(x) < 1e-2 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.3f}"
    if isinstance(x, dict):
        return ",".join(f"{v}" for v in x.values())
    return str(x)


def ratio_table(rows: List[dict], numerator="qflash", denominators=("sdpa_cudnn", "sdpa_flash")) -> List[dict]:
    """qflash's speed over each peer's, point by point."""
    index = {(r["provider"], r["seqlen"], r["head_dim"], r["causal"]): r for r in rows}
    out = []
    for (p, s, d, c), r in index.items():
        if p != numerator or not r.get("tflops"):
            continue
        row = dict(seqlen=s, head_dim=d, causal=c, qflash_tflops=r["tflops"])
        for den in denominators:
            o = index.get((den, s, d, c))
            row[f"x_{den}"] = r["tflops"] / o["tflops"] if o and o.get("tflops") else None
        out.append(row)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="qflash bench attention", description=__doc__.splitlines()[0])
    parser.add_argument("--providers", default=",".join(DEFAULT_PROVIDERS),
                        help=f"comma-separated, from {','.join(ALL_PROVIDERS)}")
    parser.add_argument("--seqlens", default=",".join(map(str, DEFAULT_SEQLENS)))
    parser.add_argument("--head-dims", default=",".join(map(str, DEFAULT_HEAD_DIMS)))
    parser.add_argument("--causal", choices=["both", "true", "false"], default="both")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--tiles", action="store_true", help="search qflash tile configs instead")
    parser.add_argument("--memory", action="store_true", help="also measure extra peak memory (B=1, H=16, D=128)")
    parser.add_argument("--quick", action="store_true", help="a short run: seqlens 1024,4096, head dim 128")
    parser.add_argument("--out", help="write results as JSON here")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        parser.error("the attention benchmark times CUDA kernels; no CUDA device is visible")
    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        parser.error(f"unknown provider(s) {unknown}; choose from {ALL_PROVIDERS}")
    seqlens = [int(s) for s in args.seqlens.split(",")]
    head_dims = [int(d) for d in args.head_dims.split(",")]
    if args.quick:
        seqlens, head_dims = [1024, 4096], [128]
    causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    dtype = DTYPES[args.dtype]

    from rich.console import Console

    console = Console()

    result = {"env": environment(), "dtype": args.dtype, "convention": "4*B*H*S^2*D, /2 causal"}

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    def progress(r):
        save()  # a run cut short still leaves what it measured
        what = r.get("config") or r["provider"]
        console.log(f"D={r['head_dim']} S={r['seqlen']} causal={r['causal']} {what}: "
                    f"{_fmt(r.get('tflops'))} TFLOP/s err={_fmt(r.get('max_err'))} {r.get('error') or ''}")

    if args.tiles:
        result["tiles"] = []
        run_tiles(seqlens, head_dims, causals, dtype, progress=progress, rows=result["tiles"])
        best = {}
        for r in result["tiles"]:
            key = (r["head_dim"], r["causal"], r["seqlen"])
            if r.get("tflops") and (key not in best or r["tflops"] > best[key]["tflops"]):
                best[key] = r
        console.print(_table(list(best.values()), "best tile config per (head_dim, causal)"))
    else:
        result["rows"] = run_sweep(providers, seqlens, head_dims, causals, dtype, progress=progress)
        result["ratios"] = ratio_table(result["rows"])
        failed = [r for r in result["rows"] if r.get("error")]
        if failed:
            console.print(_table(failed, "providers that did not run"))
        from rich.table import Table

        t = Table(title="qflash speed over peers (same run)")
        for c in ("seqlen", "head_dim", "causal", "qflash_tflops", "x_sdpa_cudnn", "x_sdpa_flash"):
            t.add_column(c)
        for r in result["ratios"]:
            t.add_row(*[_fmt(r.get(c)) for c in ("seqlen", "head_dim", "causal", "qflash_tflops", "x_sdpa_cudnn",
                                                   "x_sdpa_flash")])
        console.print(t)
    if args.memory:
        result["memory"] = memory_probe()
        console.print(_table(result["memory"], "extra peak memory, MB (B=1, H=16, D=128, bf16)"))
    save()
    if args.out:
        console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
