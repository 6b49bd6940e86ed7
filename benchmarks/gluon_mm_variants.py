"""Time tile shapes of the Gluon FP8 matmul side by side with cuBLAS (``torch._scaled_mm``, float32
accumulation) on one GPU, per tensor and per row (and block: against cuBLAS per tensor), kernels
replayed from CUDA graphs.

    python3 benchmarks/gluon_mm_variants.py --m 128,1024 --variants 128x5t,128x5ts4,auto --out v.json
    python3 benchmarks/gluon_mm_variants.py --scales tensor,block --variants 256x3t,128x5t --out b.json
    python3 benchmarks/gluon_mm_variants.py --m 16 --nk "4096,1024;4096,4096" --variants public,w10s1 --out k.json

Every variant's output is checked in the same run:
- within float32 rounding of a float32 reference on the dequantized inputs;
- bit for bit against the first variant, float32 and bfloat16 outputs both: each 128 x 128 block
  of the product is the same sequence of wgmma partials and float32 adds, whatever the tile
  width or the way C is written. Split K sums in another order, so its variants (and 'auto')
  are only checked against the reference.
Prints one line per (shape, variant) and writes JSON after every shape (``complete`` once all ran);
a variant a shape cannot take (a ring that does not fit) is recorded with its error and skipped.

``--weights cold`` times every product (cuBLAS's too) rotating through copies of B and its scales,
four times the L2 together, as a model's layers find their weights in DRAM; ``warm`` (the
default) repeats one B, which stays in L2 where it fits (a decode product's weights up to 8B qkv).
``--rounds R`` times cuBLAS and the variants in turn R times, each round starting one further along
(the order rotates), each ratio the median of its rounds'.

``--int8`` times INT8 products instead (tensor or row scales, ``qflash.quantize``'s), against
``torch._int_mm`` with B in ``nn.Linear``'s (N, K) layout (int32 out, no scales: the README's INT8
column), or where it refuses the shape (M <= 16) against the first variant; every variant's output
must be the bits of the exact reference (``int8_matmul_ref``), split K included.

    python3 benchmarks/gluon_mm_variants.py --int8 --m 16,128 --scales row --variants tl,128x6,auto,w"""

import argparse
import re
import statistics
from functools import partial

import torch

from qflash.bench.harness import (environment, graph_ms, in_turn, median_speedup, positive_ints, rotating,
                                  save_json, weight_copies)
from qflash.bench.matmul import cublas_fp8, fp8_operands, llama_shapes
from qflash.kernels import matmul_gluon as g
from qflash.kernels.common import early_launch, sm_count
from qflash.kernels.matmul import default_config, scaled_matmul
from qflash.reference.matmul import fp8_matmul_ref, int8_matmul_ref

# block_n x stages, t: C by bulk copies, n: 64-row tiles whose columns two consumers split, e: tensor or
# row scales read at each item's start instead of in its epilogue, sN: K
# split in N runs (sa: in sms // tiles runs where the tiles fill under half the SMs, as tile_config
# did for 128-wide tiles before session 22), gN: GROUP_M, cN: N consumers (64-row parts of a tile),
# xC: C CTAs an SM, bB: B blocks of C a consumer, kG: K steps in groups of G, CA / CB (last; CA4 /
# CB4: of four): in clusters of two CTAs (one an SM, or as xC says) whose tiles share A's (the
# activations') or B's (the weights') tiles by multicast copies (``launch(cluster="A" / "B",
# cluster_size=4)``); auto[G][T][CA|CB]: tile_config's (T: A's block scales column-major);
# w[N][sM][cP][xC][kG][e][CA]: the transposed product (swap_ab) with swap_config's tile, N ring
# slots, K in M runs, P consumers (64-row parts of B a tile; by default one), C CTAs an SM (by
# default swap_ctas_per_sm's, in clusters one), K steps in groups of G, e as above;
# public: ``fp8_matmul``'s dispatch (the tl kernel where ``matmul_gluon.preferred`` says no); publicP:
# the same with the Gluon kernel's programmatic dependent launch on (``common.PDL``; session
# 35's runs, before it became opt-in, named "public" the launch on and "publicN" off);
# tl: the tl kernel with its default tiles, wherever the dispatch would go
VARIANTS = "128x6,256x4,256x3,256x4t,256x3t,256x4tg16"


def _cluster(shares, size):
    """The options of a trailing CA / CB, CA4 / CB4."""
    return {"cluster": shares, **({"cluster_size": int(size)} if size else {})} if shares else {}


def variant(text):
    """'256x4tg16' -> dict(block_n=256, stages=4, tma_store=True, split_k=1, group_m=16); 'auto' ->
    tile_config's choice; 'public' -> None."""
    if text == "public":
        return None
    if text == "publicP":  # the dispatch with the Gluon kernel's programmatic dependent launch on
        return {"pdl": True}
    if text == "tl":
        return {"tl": True}
    auto = re.fullmatch(r"auto(\d)?(T?)(?:C([AB])([24])?)?", text)
    if auto:
        group, cols, cluster, size = auto.groups()
        return dict(**({"k_group": int(group)} if group else {}), **({"a_scale_cols": True} if cols else {}),
                    **_cluster(cluster, size))
    swap = re.fullmatch(r"w(\d+)?(?:s(\d+))?(?:c(\d))?(?:x(\d))?(?:k(\d))?(e?)(?:C([AB])([24])?)?", text)
    if swap:
        stages, split, consumers, ctas, k_group, early, cluster, size = swap.groups()
        return dict(swap_ab=True, **({"stages": int(stages)} if stages else {}),
                    **_cluster(cluster, size),
                    **({"k_group": int(k_group)} if k_group else {}),
                    **({"early_scales": True} if early else {}),
                    **({"split_k": int(split)} if split else {}),
                    **({"consumers": int(consumers)} if consumers else {}),
                    **({"ctas_per_sm": int(ctas)} if ctas else {}))
    match = re.fullmatch(r"(\d+)x(\d+)(t?)(n?)(e?)(?:s(\d+|a))?(?:g(\d+))?(?:c(\d))?(?:x(\d))?(?:b(\d))?(?:k(\d))?"
                         r"(?:C([AB])([24])?)?", text)
    if match is None:
        raise SystemExit(f"a variant is auto[G][T][CA|CB], w[N][sM][cP][xC][kG][e][CA], or block_n x stages [t] [n] "
                         f"[e] [sN] [gN] [cN] [xC] [bB] [kG] [CA|CB][4], got {text!r}")
    block_n, stages, tma, split_n, early, split, group, consumers, ctas, bufs, k_group, cluster, size = match.groups()
    out = dict(block_n=int(block_n), stages=int(stages), tma_store=bool(tma),
               split_k=split if split == "a" else int(split or 1))
    if split_n:
        out["split_n"] = True
    if early:
        out["early_scales"] = True
    if bufs:
        out["c_bufs"] = int(bufs)
    if k_group:
        out["k_group"] = int(k_group)
    if group:
        out["group_m"] = int(group)
    if consumers:
        out["consumers"] = int(consumers)
    if ctas:
        out["ctas_per_sm"] = int(ctas)
    out.update(_cluster(cluster, size))
    return out


def resolve(opts, m, n):
    """The variant's options for an M x N product: 'sa' made a number of runs."""
    if opts is None or opts.get("tl") or opts.get("pdl") or opts.get("split_k") != "a":
        return opts
    tiles = g.cdiv(m, 2 * g.SUB_M) * g.cdiv(n, opts["block_n"])
    sms = sm_count(torch.device("cuda"))
    return dict(opts, split_k=max(1, sms // tiles) if 2 * tiles < sms else 1)


def run(opts, a_q, b_q, a_k, b_k, out_dtype, scales):
    if opts is None:
        return scaled_matmul(a_q, b_q, a_k, b_k, None, out_dtype, scales)
    if opts.get("pdl"):
        with early_launch():
            return scaled_matmul(a_q, b_q, a_k, b_k, None, out_dtype, scales)
    if opts.get("tl"):
        config = default_config(a_q.shape[0], b_q.shape[0], a_q.shape[1], scales, a_q.dtype == torch.int8,
                                a_q.device)
        return scaled_matmul(a_q, b_q, a_k, b_k, None, out_dtype, scales, config=config)
    return g.launch(a_q, b_q, a_k, b_k, None, out_dtype, scales, **opts)


def int8_operands(a, b, scales):
    """(a_q, b_q, a_k, b_k, ref, None) for an INT8 product: the scales as the kernels take them ((M, 1)
    and (N, 1) per row) and the exact reference's float32 bits."""
    import qflash

    (a_q, a_s), (b_q, b_s) = (qflash.quantize(x, torch.int8, scales) for x in (a, b))
    a_k, b_k = (s.reshape(-1, 1) if scales == "row" else s for s in (a_s, b_s))
    return a_q, b_q, a_k, b_k, int8_matmul_ref(a_q, b_q, a_s, b_s, None, torch.float32), None


def int_mm(a_q, sets):
    """cuBLAS's INT8 product on each set's B in turn (``rotating``), or None where it refuses the shape."""
    try:
        torch._int_mm(a_q, sets[0][0].T)
    except RuntimeError:
        return None
    return rotating([partial(torch._int_mm, a_q, b_i.T) for b_i, _ in sets])


def kernel_names(fn):
    """The CUDA kernels one call of ``fn`` runs, by name (cuBLAS's name its tile and schedule)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def operands(a, b, scales):
    """(a_q, b_q, a_k, b_k, ref, cuBLAS's operands): block scales are 1 x 128 / 128 x 128, and cuBLAS
    (which takes no block scales) runs the same product per tensor."""
    a_q, b_q, a_k, b_k = fp8_operands(a, b, (scales,))[scales]
    if scales == "block":
        ref = fp8_matmul_ref(a_q, b_q, a_k, b_k, None, torch.float32)
        return a_q, b_q, a_k, b_k, ref, (*fp8_operands(a, b, ("tensor",))["tensor"], "tensor")
    ref = (a_q.float() * a_k) @ (b_q.float() * b_k).T  # row scales are (M, 1) and (N, 1)
    return a_q, b_q, a_k, b_k, ref, (a_q, b_q, a_k, b_k, scales)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="128,1024,8192", help="rows of A for the Llama shapes")
    p.add_argument("--no-cube", action="store_true", help="leave out 8192^3")
    p.add_argument("--only", default=None, help="these shapes only, by name (8192^3,70B down,...)")
    p.add_argument("--nk", default=None, help="N,K[;N,K...] at each --m instead of the Llama shapes (named NxK)")
    p.add_argument("--variants", default=VARIANTS, help="block_n x stages [t] [sN] [gN], ...")
    p.add_argument("--scales", default="tensor,row", help="tensor, row and / or block")
    p.add_argument("--weights", default="warm", help="warm and / or cold: B repeated or rotated through copies")
    p.add_argument("--rounds", type=int, default=1, help="timings of cuBLAS and every variant in turn")
    p.add_argument("--rep-ms", type=int, default=100, help="ms of replays a timing")
    p.add_argument("--cublas-kernels", action="store_true", help="record the kernels cuBLAS runs (profiler)")
    p.add_argument("--int8", action="store_true", help="INT8 products, against torch._int_mm")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    variants = [(v, variant(v)) for v in args.variants.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    only = None if args.only is None else set(args.only.split(","))
    ms = [int(m) for m in args.m.split(",")]
    if args.nk:
        nks = [positive_ints(2)(nk) for nk in args.nk.split(";")]
        shapes = [(f"{n}x{k}", m, n, k) for m in ms for n, k in nks]
    else:
        shapes = llama_shapes(ms, cube=not args.no_cube)
    for name, m, n, k in shapes:
        if only is not None and name not in only:
            continue
        a, b = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
        flop = 2 * m * n * k
        for scales in args.scales.split(","):
            a_q, b_q, a_k, b_k, ref, peer = (int8_operands if args.int8 else operands)(a, b, scales)
            for weights in args.weights.split(","):
                sets = weight_copies(weights == "cold", b_q, b_k)
                if args.int8:
                    cublas = int_mm(a_q, sets)  # (None: the variants against the first of them)
                else:  # (per tensor or per row by the scales' sizes; block scales: its own per-tensor B)
                    peer_sets = sets if peer[1] is b_q else weight_copies(weights == "cold", peer[1], peer[3])
                    cublas = rotating([cublas_fp8(peer[0], pb, peer[2], pbk) for pb, pbk in peer_sets])
                cublas_kernels = kernel_names(cublas) if args.cublas_kernels and cublas else None
                if cublas_kernels:
                    print(f"{name:12s} M={m:5d} {scales:6s} cuBLAS runs {cublas_kernels}", flush=True)
                tag = f"{scales:6s}" + ("" if weights == "warm" else f" {weights} x{len(sets)}")
                timed = []  # (label, options, relative error, same bits as the first, calls)
                base = base16 = None
                for label, opts in variants:
                    opts = resolve(opts, m, n)
                    a_k_used = a_k
                    if opts and opts.get("a_scale_cols"):  # A's block scales column-major: the same values
                        opts = {key: v for key, v in opts.items() if key != "a_scale_cols"}
                        a_k_used = a_k.t().contiguous().t()
                    try:
                        out = run(opts, a_q, b_q, a_k_used, b_k, torch.float32, scales)
                    except ValueError as e:  # a variant this shape cannot take (a ring that does not fit)
                        print(f"{name:12s} M={m:5d} {tag} {label:10s}: not taken: {e}", flush=True)
                        rows.append(dict(shape=name, m=m, n=n, k=k, scales=scales, weights=weights, variant=label,
                                         error=str(e)))
                        continue
                    out16 = run(opts, a_q, b_q, a_k_used, b_k, torch.bfloat16, scales)
                    base = out if base is None else base
                    base16 = out16 if base16 is None else base16
                    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
                    if args.int8:  # exact: the reference's bits, whatever the tiles and the split of K
                        same = torch.equal(out, ref) and torch.equal(out16, ref.to(torch.bfloat16))
                    else:
                        same = torch.equal(out, base) and torch.equal(out16, base16)
                    calls = rotating([partial(run, opts, a_q, b_i, a_k_used, b_k_i, torch.bfloat16, scales)
                                      for b_i, b_k_i in sets])
                    timed.append((label, opts or {}, err, same, calls))
                # rounds of cuBLAS and every variant in turn; a ratio is the median of each round's own
                fns = ([cublas] if cublas else []) + [t[-1] for t in timed]
                times = [[] for _ in fns]
                for i in in_turn(len(fns), args.rounds):
                    times[i].append(graph_ms(fns[i], rep_ms=args.rep_ms))
                if cublas is None:  # the first variant stands in for cuBLAS (its "cuBLAS" ratios are to it)
                    times.insert(0, times[0])
                cublas_ms = statistics.median(times[0])
                if not args.int8:
                    peer_name = "torch._scaled_mm"
                else:  # _int_mm, or where it refuses the shape the first variant
                    peer_name = "torch._int_mm" if cublas else timed[0][0] if timed else None
                for (label, opts, err, same, _), ms_list in zip(timed, times[1:]):
                    ms = statistics.median(ms_list)
                    ratio = median_speedup(ms_list, times[0])
                    rows.append(dict(shape=name, m=m, n=n, k=k, scales=scales, weights=weights, copies=len(sets),
                                     variant=label, **opts, ms=ms, tflops=flop / ms * 1e-9, cublas_ms=cublas_ms,
                                     cublas_tflops=flop / cublas_ms * 1e-9, vs_cublas=ratio, rel_err=err,
                                     within_fp32=err < 1e-5 * max(1.0, k ** 0.5),
                                     same_as_128=(same if args.int8 or (opts.get("split_k", 1) == 1
                                                                       and "block_n" in opts
                                                                       and not opts.get("swap_ab")) else None),
                                     peer=peer_name,
                                     cublas_kernels=cublas_kernels,
                                     **({"rounds_ms": ms_list, "rounds_cublas_ms": times[0]} if args.rounds > 1
                                        else {})))
                    r = rows[-1]
                    spread = ("" if args.rounds == 1 else
                              f" rounds {min(c / t for c, t in zip(times[0], ms_list)):.2f}-"
                              f"{max(c / t for c, t in zip(times[0], ms_list)):.2f}")
                    print(f"{name:12s} M={m:5d} {tag} {label:10s}: {r['tflops']:7.1f} TFLOP/s "
                          f"cuBLAS {r['cublas_tflops']:7.1f} ({r['vs_cublas']:.2f}x{spread}) same={r['same_as_128']} "
                          f"err={err:.1e}", flush=True)
                out = out16 = base = base16 = sets = peer_sets = cublas = timed = None
            ref = None
        if args.out:  # after every shape: a run cut short keeps what it measured
            save_json(args.out, dict(env=environment(), rows=rows, complete=False, **_clusters_held()))
    if args.out:
        save_json(args.out, dict(env=environment(), rows=rows, complete=True, **_clusters_held()))


def _clusters_held() -> dict:
    """How many clusters of each size the GPU held at once, where variants ran in clusters."""
    held = {f"{ctas} CTAs, {per_sm} an SM": n
            for (_, ctas, per_sm), n in sorted(g._cluster_launcher.resident.items())}
    return {"clusters_held_at_once": held} if held else {}


if __name__ == "__main__":
    main()
