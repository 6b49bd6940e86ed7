"""Attention forward benchmark: qflash next to PyTorch's SDPA backends and other peers.

Sizing follows the FlashAttention papers: batch x seqlen = 16k tokens and
heads x headdim = 2048, seqlen 512 ... 16k. Every provider is first checked
against a float32 reference on a slice of the benchmark inputs (the last query
rows of two heads, which see every key); its error is a column next to its
speed, never hidden. TFLOP/s use the 4 * B * H * Sq * Sk * D convention, halved
for causal (``tflops``), and the exact count of visible (query, key) pairs
(``tflops_exact``).

    qflash bench attention --out results.json       # the sweep, with PNG plots beside the JSON
    qflash bench attention --quick                  # a short run (also on a CPU, in the interpreter)
    qflash bench attention --tiles --head-dims 128  # qflash tile search (GPU)
"""

from __future__ import annotations

import itertools
import math
import os
from typing import Callable, Dict, List, Optional, Sequence

import torch

from qflash.bench.harness import (
    bench_parser,
    compiled_flex_attention,
    environment,
    finish,
    fmt,
    graph_ms,
    measure_ceilings,
    names_from,
    plot_lines,
    plot_roofline,
    positive_ints,
    require_runnable,
    rich_table,
    run_as_script,
    save_json,
    time_ms,
)

DEFAULT_SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]
DEFAULT_HEAD_DIMS = [64, 128, 256]
QUICK_SEQLENS = {True: [1024, 4096], False: [32, 64]}  # --quick, on a GPU or not
QUICK_HEAD_DIMS = {True: [128], False: [32]}
DEFAULT_PROVIDERS = ["qflash", "sdpa_cudnn", "sdpa_flash"]
CPU_PROVIDERS = ["qflash", "sdpa_math", "naive"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = 2e-2  # slice check against fp32: bf16 outputs are good to ~1e-2


def attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal, exact=False) -> float:
    """4 * B * H * Sq * Sk * D, halved for causal; ``exact`` counts only visible pairs."""
    pairs = seqlen_q * seqlen_k
    if causal:
        if exact:  # bottom-right causal: row i sees min(Sk, i + Sk - Sq + 1) keys
            pairs = sum(max(0, min(seqlen_k, i + seqlen_k - seqlen_q + 1)) for i in range(seqlen_q))
        else:
            pairs /= 2
    return 4.0 * batch * heads * pairs * head_dim


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


TL_DEFAULT = "tl default"  # a _qflash_provider config: the tl kernel with its default tiles for the shape


def _qflash_provider(config=None):
    """The public function (config None: the Gluon kernel where it fits, else the tl one), or the
    tl kernel with ``config``'s tiles (TL_DEFAULT: its default ones, also where Gluon would run)."""

    def make(q, k, v, causal):
        if config is None:
            import qflash

            return lambda: qflash.flash_attn_func(q, k, v, causal=causal)
        from qflash.kernels.attention import AttnOptions, attention_forward, default_config

        opts = AttnOptions(1.0 / math.sqrt(q.shape[-1]), window_right=0 if causal else -1)
        cfg = (default_config(q.shape[-1], q.dtype, q.device, causal=causal, seqlen_k=k.shape[1])
               if config == TL_DEFAULT else config)
        return lambda: attention_forward(q, k, v, opts, config=cfg)[0]

    return make


def _qflash_deterministic(q, k, v, causal):
    """The public function with ``deterministic=True``: the same forward, and the backward on
    kernels that give the same bits each run: the tl kernels at D = 64 / 128 (there the Gluon
    backward sums dQ in any order), the Gluon dK / dV and dQ kernels at D = 256 (session 20 on;
    before, the tl kernels there too)."""
    import qflash

    return lambda: qflash.flash_attn_func(q, k, v, causal=causal, deterministic=True)


def _qflash_gluon(q, k, v, causal):
    """The warp-specialized Gluon kernel alone (Hopper), also where qflash would take the tl one."""
    from qflash.kernels.attention_gluon import attention_forward_gluon

    scale = 1.0 / math.sqrt(q.shape[-1])
    return lambda: attention_forward_gluon(q, k, v, scale, causal=causal)[0]


def _naive(q, k, v, causal):
    """Three steps, the N x N scores in device memory: what FlashAttention avoids."""
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
    from torch.nn.attention.flex_attention import create_block_mask

    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    block_mask = None
    if causal:
        n = q.shape[1]
        block_mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, n, n, device=q.device)
    compiled = compiled_flex_attention()
    return lambda: compiled(qt, kt, vt, block_mask=block_mask).transpose(1, 2)


def _flash_attn(q, k, v, causal):
    from flash_attn import flash_attn_func

    return lambda: flash_attn_func(q, k, v, causal=causal)


def _sage(q, k, v, causal):
    from sageattention import sageattn

    return lambda: sageattn(q, k, v, tensor_layout="NHD", is_causal=causal)


PROVIDERS: Dict[str, Callable] = {
    "qflash": _qflash_provider(),
    "qflash_gluon": _qflash_gluon,
    "qflash_tl": _qflash_provider(TL_DEFAULT),
    "qflash_deterministic": _qflash_deterministic,
    "sdpa_cudnn": _sdpa_provider("CUDNN_ATTENTION"),
    "sdpa_flash": _sdpa_provider("FLASH_ATTENTION"),
    "sdpa_efficient": _sdpa_provider("EFFICIENT_ATTENTION"),
    "sdpa_math": _sdpa_provider("MATH"),
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


def backward_of(make):
    """A provider that times the backward pass (dq, dk, dv) of ``make``'s forward."""

    def make_backward(q, k, v, causal):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        out = make(q, k, v, causal)()
        g = torch.Generator(device=q.device).manual_seed(1)
        dout = torch.randn(out.shape, device=q.device, generator=g).to(out.dtype)

        def run():
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        run.dout = dout
        return run

    return make_backward


def _slice_grad_error(grads, q, k, v, dout, causal: bool) -> float:
    """Max abs error of dq, dk, dv for batch 0, heads 0-1, against fp32 reference gradients."""
    from qflash.reference import attention_ref

    leaves = [x[:1, :, :2].detach().float().requires_grad_() for x in (q, k, v)]
    ref_out, _ = attention_ref(*leaves, causal=causal)
    ref = torch.autograd.grad(ref_out, leaves, dout[:1, :, :2].float())
    return max(float((g[:1, :, :2].float() - r).abs().max()) for g, r in zip(grads, ref))


def bench_one(make, q, k, v, causal: bool, *, rep_ms: int = 100, backward: bool = False,
              graph: bool = False) -> Dict[str, object]:
    """Check a provider on the benchmark inputs, then time it. Failures become an error column."""
    try:
        fn = make(q, k, v, causal)
        res = fn()
        if backward:
            err = _slice_grad_error(res, q, k, v, fn.dout, causal)
        else:
            err = _slice_error(res, q, k, v, causal)
        del res
        tol = TOLERANCE * (4 if backward else 1)  # gradients are larger and rounder in bf16
        timing = time_ms(fn, rep_ms=rep_ms, device=q.device.type)
        if graph:  # the kernels alone: replayed from a CUDA graph, no Python between launches
            timing["graph_ms"] = graph_ms(fn)
        return {**timing, "max_err": err, "check": "ok" if err <= tol else "MISMATCH", "error": None}
    except ModuleNotFoundError as exc:
        return {"ms": None, "max_err": None, "check": None, "error": f"not installed: {exc.name}"}
    except Exception as exc:  # a peer that refuses the shape or device is reported, not fatal
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"ms": None, "max_err": None, "check": None,
                "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"}


def fa_shapes(seqlens, head_dims, total_tokens=16384, hidden=2048):
    """(batch, heads, seqlen, head_dim) with batch x seqlen = total_tokens and heads x head_dim = hidden."""
    for d in head_dims:
        for s in seqlens:
            yield max(1, total_tokens // s), max(1, hidden // d), s, d


BACKWARD_FLOPS = 2.5  # the backward does 5 matmuls to the forward's 2


def _row(name, batch, heads, seqlen, d, causal, dtype, res, backward=False):
    work = BACKWARD_FLOPS if backward else 1.0
    flops = work * attention_flops(batch, heads, seqlen, seqlen, d, causal)
    flops_exact = work * attention_flops(batch, heads, seqlen, seqlen, d, causal, exact=True)
    nbytes = 4 * batch * seqlen * heads * d * torch.tensor([], dtype=dtype).element_size()  # q, k, v, out
    ms = res.get("ms")
    return dict(provider=name, batch=batch, heads=heads, seqlen=seqlen, head_dim=d, causal=causal,
                dtype=str(dtype).replace("torch.", ""),
                tflops=flops / (ms * 1e-3) / 1e12 if ms else None,
                tflops_graph=flops / (res["graph_ms"] * 1e-3) / 1e12 if res.get("graph_ms") else None,
                tflops_exact=flops_exact / (ms * 1e-3) / 1e12 if ms else None,
                gbps=nbytes / (ms * 1e-3) / 1e9 if ms else None,
                intensity=flops / nbytes, **res)


def run_sweep(providers, shapes, causals, dtype, device, *, rows: List[dict], progress=None,
              backward: bool = False, graph: bool = False) -> List[dict]:
    for (batch, heads, seqlen, d), causal in itertools.product(list(shapes), causals):
        g = torch.Generator(device=device).manual_seed(seqlen * 7 + d)
        q, k, v = (torch.randn(batch, seqlen, heads, d, device=device, generator=g).to(dtype) for _ in range(3))
        for name in providers:
            if name == "naive" and batch * heads * seqlen * seqlen * 6 > 48 * 2**30:
                res = {"ms": None, "max_err": None, "check": None, "error": "skipped: N x N scores over 48 GB"}
            else:
                make = backward_of(PROVIDERS[name]) if backward else PROVIDERS[name]
                res = bench_one(make, q, k, v, causal, backward=backward, graph=graph and name != "flex")
            rows.append(_row(name, batch, heads, seqlen, d, causal, dtype, res, backward))
            if progress:
                progress(rows[-1])
        del q, k, v
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


# (block_m, block_n, num_warps, num_stages, use_tma) searched on the H200, per head-dim bucket:
# the winners of the earlier rounds (benchmarks/results/attention_tiles_*.json) and their
# runner-ups; the winners are qflash.kernels.attention.default_config.
TILE_GRID = {
    64: [(128, 64, 4, 3, False), (128, 64, 4, 3, True), (128, 128, 4, 3, True), (128, 128, 8, 3, False)],
    128: [(128, 64, 4, 2, True), (128, 64, 4, 3, False), (128, 128, 8, 3, True), (128, 64, 4, 1, True)],
    256: [(128, 64, 8, 2, True), (128, 64, 8, 2, False), (128, 32, 8, 3, True), (64, 32, 4, 2, True)],
}


def sized_inputs(seqlen: int, head_dim: int, dtype=torch.bfloat16, count: int = 3, seed: int = 0) -> list:
    """``count`` random (batch, seqlen, heads, head_dim) tensors at the benchmarks' sizing: batch x
    seqlen = 16k tokens, heads x head_dim = 2048 (q, k, v, and dO where a script needs it)."""
    batch, heads = max(1, 16384 // seqlen), 2048 // head_dim
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(batch, seqlen, heads, head_dim, device="cuda", generator=g).to(dtype) for _ in range(count)]


def _tile_inputs(seqlens, d: int, dtype) -> Dict[int, list]:
    """q, k, v per length, made once so that one compile of a config serves every length."""
    return {seqlen: sized_inputs(seqlen, d, dtype, seed=d + seqlen) for seqlen in seqlens}


def tile_configs(head_dim: int):
    from qflash.kernels.attention import AttnFwdConfig

    bucket = 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256
    for bm, bn, w, s, tma in TILE_GRID[bucket]:
        yield AttnFwdConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=s, use_tma=tma)


def run_tiles(seqlens, head_dims, causals, dtype, *, rows: List[dict], progress=None) -> List[dict]:
    for d in head_dims:
        inputs = _tile_inputs(seqlens, d, dtype)
        for causal in causals:
            for cfg in tile_configs(d):
                for seqlen, (q, k, v) in inputs.items():  # one compile serves every length
                    res = bench_one(_qflash_provider(cfg), q, k, v, causal, rep_ms=60)
                    row = _row("qflash", q.shape[0], q.shape[2], seqlen, d, causal, dtype, res)
                    rows.append(dict(row, config=cfg.__dict__))
                    if progress:
                        progress(rows[-1])
    return rows


# Backward tiles, (block_m, block_n, num_warps, num_stages[, use_tma, maxnreg, edges_last]) as
# AttnBwdConfig takes them: the dQ kernel keeps block_m query rows and streams K/V, the dK/dV
# kernel keeps block_n keys and streams Q/dO; use_tma loads the streamed tiles through tensor
# descriptors; edges_last visits dK/dV's masked diagonal after its interior. The earlier rounds'
# grids (attention_bwd_tiles_*.json) chose the defaults. Left out for good: dK/dV tiles of 32
# query rows with 3 stages (dK errors of 0.04-0.3 on the H200, gpu_tests_h200_2026-11-29_s3a.log),
# at D = 256 32-row tiles (they compile to mma.sync: Hopper's wgmma needs 64 rows a warpgroup),
# a dK/dV kernel computing S^T = K Q^T (slower at every point, ..._tiles_transposed_..._s14a), and
# a dK/dV kernel that also adds dS @ K into a float32 dQ with atomics (five products a tile pair
# instead of seven, no dQ kernel): never faster; at D = 128 the whole backward took 1.9-2.2 x as
# long through the copy engine's reduce-add, 2.2-3.0 x through pointer atomics
# (attention_bwd_fused_dq_..._s15a, ..._pointer_..._s15b).
BWD_TILE_GRID = {
    64: {"dq": [(64, 64, 4, 3, True), (64, 32, 4, 4, True), (128, 32, 8, 3, True)],
         "dkdv": [(64, 64, 4, 3, True, None, True), (64, 64, 4, 3, True), (64, 128, 8, 2, True)]},
    128: {"dq": [(64, 64, 4, 2, True), (64, 32, 4, 3, True), (128, 32, 8, 3, True)],
          "dkdv": [(64, 64, 4, 2, True, None, True), (64, 64, 4, 2, True), (128, 64, 8, 1, True)]},
    256: {"dq": [(128, 32, 8, 2, True), (64, 64, 8, 2, True), (128, 16, 8, 3, True)],
          "dkdv": [(128, 64, 8, 1, True, None, True), (64, 64, 8, 2, True, None, True), (128, 64, 8, 1)]},
}


def _qflash_bwd_provider(configs):
    """Times the qflash backward launcher alone, with explicit (dQ, dK/dV) tile configs."""
    def make(q, k, v, causal):
        from qflash.kernels.attention import AttnOptions, attention_backward, attention_forward

        opts = AttnOptions(1.0 / math.sqrt(q.shape[-1]), window_right=0 if causal else -1)
        out, lse = attention_forward(q, k, v, opts)
        g = torch.Generator(device=q.device).manual_seed(1)
        dout = torch.randn(out.shape, device=q.device, generator=g).to(out.dtype)

        def run():
            return attention_backward(dout, q, k, v, out, lse, opts, configs=configs)

        run.dout = dout
        return run

    return make


def run_bwd_tiles(seqlens, head_dims, causals, dtype, *, rows: List[dict], progress=None,
                  vary: Sequence[str] = ("dq", "dkdv")) -> List[dict]:
    """Each dQ candidate next to the default dK/dV config, and each dK/dV candidate next to the
    default dQ config: the time differences belong to the kernel that changed."""
    from qflash.kernels.attention import AttnBwdConfig, default_bwd_configs

    for d in head_dims:
        inputs = _tile_inputs(seqlens, d, dtype)
        dq_default, dkdv_default = default_bwd_configs(d, dtype, torch.device("cuda"))
        grid = BWD_TILE_GRID[64 if d <= 64 else 128 if d <= 128 else 256]
        pairs = [("dq", (AttnBwdConfig(*t), dkdv_default)) for t in grid["dq"]] + \
                [("dkdv", (dq_default, AttnBwdConfig(*t))) for t in grid["dkdv"]]
        pairs = [(kind, configs) for kind, configs in pairs if kind in vary]
        for causal in causals:
            for vary, configs in pairs:
                for seqlen, (q, k, v) in inputs.items():
                    res = bench_one(_qflash_bwd_provider(configs), q, k, v, causal, rep_ms=60, backward=True)
                    row = _row("qflash", q.shape[0], q.shape[2], seqlen, d, causal, dtype, res, backward=True)
                    rows.append(dict(row, vary=vary, dq_config=configs[0].__dict__,
                                     dkdv_config=configs[1].__dict__))
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
                rows.append(dict(provider=name, seqlen=n, extra_mb=None, error="skipped: would not fit"))
                continue
            fn = PROVIDERS[name](q, k, v, False)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            try:
                out = fn()
                torch.cuda.synchronize()
                rows.append(dict(provider=name, seqlen=n, extra_mb=(torch.cuda.max_memory_allocated() - base) / 2**20,
                                 error=None))
                del out
            except torch.cuda.OutOfMemoryError as exc:
                rows.append(dict(provider=name, seqlen=n, extra_mb=None, error=f"OutOfMemoryError: {exc}"[:120]))
            torch.cuda.empty_cache()
        # The bytes that must exist whatever the algorithm: output and lse, O(N).
        rows.append(dict(provider="output+lse", seqlen=n, extra_mb=(n * 16 * 128 * 2 + 16 * n * 4) / 2**20, error=None))
        del q, k, v
        torch.cuda.empty_cache()
    return rows


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
            if r.get("tflops_graph"):  # the same ratio with both sides replayed from CUDA graphs
                row[f"x_{den}_graph"] = (r["tflops_graph"] / o["tflops_graph"]
                                         if o and o.get("tflops_graph") else None)
        out.append(row)
    return out


def _plots(result: dict, stem: str) -> List[str]:
    rows = [r for r in result["rows"] if r.get("tflops")]
    if not rows:
        return []
    panels = sorted({(f"D={r['head_dim']}", "causal" if r["causal"] else "non-causal") for r in rows},
                    key=lambda p: (int(p[0][2:]), p[1] == "causal"))
    paths = [plot_lines(rows, panels=panels, panel_key=lambda r: (f"D={r['head_dim']}",
                                                                   "causal" if r["causal"] else "non-causal"),
                        x="seqlen", y="tflops", series="provider", path=f"{stem}.png", xlabel="sequence length",
                        ylabel="TFLOP/s", title=f"attention {result['pass']}, {result['dtype']}, "
                                                        f"{result['env'].get('gpu') or 'CPU (interpreter)'}")]
    if result.get("ceilings"):
        paths.append(plot_roofline(rows, result["ceilings"], path=f"{stem}_roofline.png",
                                   title=f"attention {result['pass']} vs measured ceilings, {result['env'].get('gpu')}"))
    return paths


def main(argv: Optional[List[str]] = None) -> int:
    parser = bench_parser("attention", __doc__, quick="a short run (tiny shapes on a CPU)", out="write results as JSON here (plots go beside it, same stem)")
    parser.add_argument("--providers", help=f"comma-separated, from {','.join(PROVIDERS)} "
                                            f"(default: {','.join(DEFAULT_PROVIDERS)}; on a CPU {','.join(CPU_PROVIDERS)})")
    listed = lambda values: ",".join(map(str, values))  # noqa: E731
    for option, default, quick in (("--seqlens", DEFAULT_SEQLENS, QUICK_SEQLENS),
                                   ("--head-dims", DEFAULT_HEAD_DIMS, QUICK_HEAD_DIMS)):
        parser.add_argument(option, type=positive_ints(), help=f"comma-separated (default: {listed(default)}; "
                            f"--quick: {listed(quick[True])}, on a CPU {listed(quick[False])})")
    parser.add_argument("--causal", choices=["both", "true", "false"], default="both")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--backward", action="store_true", help="time the backward pass (FLOPs: 2.5 x forward)")
    parser.add_argument("--tiles", action="store_true", help="search qflash tile configs instead (GPU)")
    parser.add_argument("--vary", default="dq,dkdv", type=names_from(("dq", "dkdv")),
                        help="with --tiles --backward: which kernel's candidates to time (dq, dkdv)")
    parser.add_argument("--graph", action="store_true",
                        help="forward: also time each call replayed from a CUDA graph (no Python launch cost)")
    parser.add_argument("--memory", action="store_true", help="also measure extra peak memory (GPU)")
    parser.add_argument("--ceilings", action="store_true", help="also measure copy and matmul ceilings (GPU)")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    providers = [p.strip() for p in (args.providers or ",".join(DEFAULT_PROVIDERS if cuda else CPU_PROVIDERS)).split(",")
                 if p.strip()]
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        parser.error(f"unknown provider(s) {unknown}; choose from {','.join(PROVIDERS)}")
    # --quick picks short lists, for what the command line leaves unsaid
    seqlens = args.seqlens or (QUICK_SEQLENS[cuda] if args.quick else DEFAULT_SEQLENS)
    head_dims = args.head_dims or (QUICK_HEAD_DIMS[cuda] if args.quick else DEFAULT_HEAD_DIMS)
    if (args.tiles or args.memory or args.ceilings) and not cuda:
        parser.error("--tiles, --memory and --ceilings measure a CUDA GPU; none is visible")
    require_runnable(parser)
    causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    dtype = DTYPES[args.dtype]
    if cuda:
        shapes = list(fa_shapes(seqlens, head_dims))
    else:  # the interpreter: tiny shapes, only to exercise the benchmark itself
        dtype = torch.float16
        shapes = list(fa_shapes(seqlens, head_dims, total_tokens=128, hidden=64))

    from rich.console import Console
    from rich.progress import Progress

    console = Console()
    result = {"env": environment(), "dtype": str(dtype).replace("torch.", ""),
              "pass": "backward" if args.backward else "forward",
              "convention": "tflops: 4*B*H*S^2*D, /2 causal; tflops_exact: visible pairs only; "
                            "gbps: bytes of q, k, v, out over time"}
    stem = os.path.splitext(args.out)[0] if args.out else None

    with Progress(console=console, transient=True, disable=not console.is_terminal) as bar:
        if args.tiles:
            result["tiles"] = []
            total = len(head_dims) * len(causals) * len(seqlens) * 10
            task = bar.add_task("tile search", total=total)
            progress = lambda r: (bar.advance(task), stem and save_json(args.out, result))  # noqa: E731
            if args.backward:
                run_bwd_tiles(seqlens, head_dims, causals, dtype, rows=result["tiles"], progress=progress,
                              vary=args.vary)
            else:
                run_tiles(seqlens, head_dims, causals, dtype, rows=result["tiles"], progress=progress)
        else:
            result["rows"] = []
            task = bar.add_task(f"attention {result['pass']}", total=len(shapes) * len(causals) * len(providers))
            run_sweep(providers, shapes, causals, dtype, device, rows=result["rows"], backward=args.backward,
                      graph=args.graph and cuda and not args.backward,
                      progress=lambda r: (bar.advance(task), stem and save_json(args.out, result)))
    if args.ceilings:
        result["ceilings"] = measure_ceilings()
    if args.memory:
        result["memory"] = memory_probe()

    if args.tiles:
        best = {}
        for r in result["tiles"]:
            key = (r["head_dim"], r["causal"], r["seqlen"], r.get("vary"))
            if r.get("tflops") and (key not in best or r["tflops"] > best[key]["tflops"]):
                best[key] = r
        console.print(rich_table(list(best.values()), ["config", "vary", "dq_config", "dkdv_config", "seqlen",
                                                       "head_dim", "causal", "tflops"],
                                 "best tile config per (head_dim, causal, seqlen)"))
    else:
        rows = result["rows"]
        result["ratios"] = ratio_table(rows)
        cols = ["provider", "seqlen", "head_dim", "causal", "tflops", "tflops_exact", "gbps", "ms", "max_err", "check",
                "error"]
        title = f"attention {result['pass']}, {result['dtype']}, {result['env'].get('gpu') or 'CPU (interpreter)'}"
        console.print(rich_table(rows if not cuda or args.quick else [r for r in rows if r.get("error") or
                                 r.get("check") != "ok"], cols, title if not cuda or args.quick
                                 else "providers that did not run or did not match"))
        if result["ratios"] and cuda:
            graphs = ["x_sdpa_cudnn_graph", "x_sdpa_flash_graph"] if any(r.get("tflops_graph") for r in rows) else []
            console.print(rich_table(result["ratios"], ["seqlen", "head_dim", "causal", "qflash_tflops",
                                                        "x_sdpa_cudnn", "x_sdpa_flash", *graphs],
                                     "qflash over peers, same run"))
    if result.get("ceilings"):
        console.print("ceilings: " + ", ".join(f"{k} {fmt(v)}" for k, v in result["ceilings"].items()))
    if result.get("memory"):
        console.print(rich_table(result["memory"], ["provider", "seqlen", "extra_mb", "error"],
                                 "extra peak memory, MB (B=1, H=16, D=128, bf16)"))
    return finish(console, args.out, result, lambda: _plots(result, stem) if "rows" in result else [])


if __name__ == "__main__":
    run_as_script(main)
