"""Probe (GPU, timing only): the L2 promotion of the TMA descriptors that the FP8 products load
through. Triton 3.6's launcher always encodes a host descriptor with 128-byte promotion; this
script wraps its ``fill_tma_descriptor`` and encodes the descriptor object Triton made again, by
``cuTensorMapEncodeTiled`` through ctypes, with 256 bytes or none (after checking, on the first
descriptors, that its encoding of Triton's own arguments gives Triton's bytes). FP8 products
through the public dispatch at M = 16 / 128 / 1024 on the Llama shapes, per tensor and with block
scales, cuBLAS and each promotion timed in turn ``--rounds`` times from CUDA graphs, each round
starting one further along, a ratio the median of the rounds' own (before session 56: the best of
two timings); the output bits are compared across promotions. ``--weights cold`` rotates every
product through copies of B and its scales, four times the L2 together, as a model's layers find
their weights in DRAM (s38's runs timed one B, which stays in L2 up to 8B qkv).

    python3 benchmarks/l2_promotion_probe.py --out l2.json
    python3 benchmarks/l2_promotion_probe.py --m 16,128 --scales tensor --weights cold --rounds 3 --out l2c.json"""
import argparse
import ctypes
import statistics
import sys
from functools import partial

import torch
import triton

from qflash.bench.harness import (environment, graph_ms, in_turn, median_speedup, rotating, save_json,
                                  weight_copies)
from qflash.bench.matmul import cublas_fp8, fp8_operands, llama_shapes
from qflash.kernels.matmul import scaled_matmul

CU = ctypes.CDLL("libcuda.so.1")
ENC = CU.cuTensorMapEncodeTiled
ENC.restype = ctypes.c_int
ENC.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
PROMO = {"none": 0, "64": 1, "128": 2, "256": 3}
STATE = {"promo": None, "checked": 0, "calls": 0}
utils = triton.runtime.driver.active.utils
ORIG = utils.fill_tma_descriptor


def encode(target, addr, swizzle, elem_size, elem_type, block, shape, strides, padding, promo):
    rank = len(block)
    box = (ctypes.c_uint32 * 5)(*reversed(block))
    dims = (ctypes.c_uint64 * 5)(*reversed(shape))
    st = (ctypes.c_uint64 * 5)(*[elem_size * s for s in reversed(strides[:-1])])
    es = (ctypes.c_uint32 * 5)(1, 1, 1, 1, 1)
    res = ENC(target, elem_type, rank, addr, dims, st, box, es, 0, swizzle, promo, 1 if padding == 1 else 0)
    if res != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled: {res}")


def patched(addr, swizzle, elem_size, elem_type, block, shape, strides, padding):
    desc = ORIG(addr, swizzle, elem_size, elem_type, block, shape, strides, padding)
    STATE["calls"] += 1
    target = id(desc) + 128
    if STATE["checked"] < 20:  # our encoding of Triton's own arguments must give Triton's bytes
        before = ctypes.string_at(target, 128)
        buf = ctypes.create_string_buffer(256)
        aligned = (ctypes.addressof(buf) + 127) // 128 * 128
        encode(aligned, addr, swizzle, elem_size, elem_type, block, shape, strides, padding, PROMO["128"])
        if ctypes.string_at(aligned, 128) != before:
            sys.exit(f"re-encoding differs from Triton's descriptor: block {block} shape {shape}")
        STATE["checked"] += 1
    if STATE["promo"] is not None:
        encode(target, addr, swizzle, elem_size, elem_type, block, shape, strides, padding, PROMO[STATE["promo"]])
    return desc


utils.fill_tma_descriptor = patched


def promoted(promo, fn):
    """``fn`` launched with its descriptors encoded with ``promo`` (a CUDA graph keeps the encoding
    its capture made)."""
    def call():
        STATE["promo"] = None if promo == "128" else promo
        try:
            return fn()
        finally:
            STATE["promo"] = None
    return call


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="16,128,1024")
    p.add_argument("--only", default=None, help="these shapes only, by name (8B o,70B qkv,...)")
    p.add_argument("--promos", default="128,256,none")
    p.add_argument("--scales", default="tensor,block")
    p.add_argument("--weights", default="warm", help="warm: one B repeated; cold: B rotated through copies")
    p.add_argument("--rounds", type=int, default=2, help="timings of cuBLAS and every promotion in turn")
    p.add_argument("--rep-ms", type=int, default=100, help="ms of replays a timing")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    promos = args.promos.split(",")
    only = None if args.only is None else set(args.only.split(","))
    rows = []
    for name, m, n, k in llama_shapes(map(int, args.m.split(","))):
        if only is not None and name not in only:
            continue
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        kinds = tuple(s for s in args.scales.split(",") if s != "block" or m <= 128)
        ops = fp8_operands(a, b, tuple(dict.fromkeys(("tensor",) + kinds)))
        for scales in kinds:
            a_q, b_q, a_s, b_s = ops[scales]
            peer = "tensor" if scales == "block" else scales  # cuBLAS takes no block scales
            p_a_q, p_b_q, p_a_s, p_b_s = ops[peer]
            cold = args.weights == "cold"
            sets = ([(bq, bs, bq, bs) for bq, bs in weight_copies(cold, b_q, b_s)] if peer == scales else
                    weight_copies(cold, b_q, b_s, p_b_q, p_b_s, nbytes=b_q.numel()))
            cub = rotating([cublas_fp8(p_a_q, pb, p_a_s, pbs) for _, _, pb, pbs in sets])
            mm = rotating([partial(scaled_matmul, a_q, bq, a_s, bs, None, torch.bfloat16, scales)
                           for bq, bs, _, _ in sets])
            outs = {pr: promoted(pr, lambda: scaled_matmul(a_q, b_q, a_s, b_s, None, torch.bfloat16, scales))()
                    for pr in promos}
            fns = [cub] + [promoted(pr, mm) for pr in promos]
            times = [[] for _ in fns]
            for i in in_turn(len(fns), args.rounds):
                times[i].append(graph_ms(fns[i], rep_ms=args.rep_ms))
            row = dict(shape=name, m=m, n=n, k=k, scales=scales, cublas_scales=peer, weights=args.weights,
                       copies=len(sets), cublas_ms=times[0], **{f"p{pr}_ms": t for pr, t in zip(promos, times[1:])})
            row["same_bits"] = all(torch.equal(outs[promos[0]], o) for o in outs.values())
            row.update({f"p{pr}_vs_128": median_speedup(row[f"p{pr}_ms"], row["p128_ms"]) for pr in promos})
            row.update({f"p{pr}_vs_cublas": median_speedup(row[f"p{pr}_ms"], times[0]) for pr in promos})
            rows.append(row)
            med = {pr: statistics.median(row[f"p{pr}_ms"]) for pr in promos}
            print(f"{name:10s} M={m:5d} {scales:6s} {args.weights} x{len(sets)} " + " ".join(
                f"{pr}: {med[pr] * 1e3:8.2f} us ({row[f'p{pr}_vs_128']:.3f}, {row[f'p{pr}_vs_cublas']:.3f}x cuBLAS)"
                for pr in promos) + f" | cuBLAS {statistics.median(times[0]) * 1e3:8.2f} same {row['same_bits']}",
                flush=True)
        if args.out:  # after every shape: a run cut short keeps what it measured
            save_json(args.out, dict(env=environment(), rows=rows, checked=STATE["checked"], complete=False))
    print("descriptors filled", STATE["calls"], "checked", STATE["checked"])
    if args.out:
        save_json(args.out, dict(env=environment(), rows=rows, checked=STATE["checked"], complete=True))


if __name__ == "__main__":
    main()
