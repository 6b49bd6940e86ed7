"""Probe (GPU, timing only): the L2 promotion of the TMA descriptors that the FP8 products load
through. Triton 3.6's launcher always encodes a host descriptor with 128-byte promotion; this
script wraps its ``fill_tma_descriptor`` and encodes the descriptor object Triton made again, by
``cuTensorMapEncodeTiled`` through ctypes, with 256 bytes or none (after checking, on the first
descriptors, that its encoding of Triton's own arguments gives Triton's bytes). FP8 products
through the public dispatch at M = 16 / 128 / 1024 on the Llama shapes, per tensor and with block
scales, each promotion timed twice in turn from CUDA graphs, cuBLAS in the same run; the output
bits are compared across promotions.

    python3 benchmarks/l2_promotion_probe.py --out l2.json"""
import argparse
import ctypes
import sys

import torch
import triton

from qflash.bench.harness import environment, graph_ms, save_json
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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="16,128,1024")
    p.add_argument("--promos", default="128,256,none")
    p.add_argument("--scales", default="tensor,block")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    promos = args.promos.split(",")
    rows = []
    for name, m, n, k in llama_shapes(map(int, args.m.split(","))):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        ops = fp8_operands(a, b, ("tensor", "block") if "block" in args.scales and m <= 128 else ("tensor",))
        cub = cublas_fp8(*ops["tensor"])
        for scales, operands in ops.items():
            row = dict(shape=name, m=m, n=n, k=k, scales=scales)
            fn = lambda: scaled_matmul(*operands, None, torch.bfloat16, scales)
            outs = {}
            for rep in range(2):
                for promo in (promos if rep == 0 else promos[::-1]):
                    STATE["promo"] = None if promo == "128" else promo
                    outs[promo] = fn()
                    row.setdefault(f"p{promo}_ms", []).append(graph_ms(fn))
                STATE["promo"] = None
                row.setdefault("cublas_ms", []).append(graph_ms(cub))
            row["same_bits"] = all(torch.equal(outs[promos[0]], o) for o in outs.values())
            best = {pr: min(row[f"p{pr}_ms"]) for pr in promos}
            row.update({f"p{pr}_vs_128": best["128"] / best[pr] for pr in promos})
            row["p128_vs_cublas"] = min(row["cublas_ms"]) / best["128"]
            rows.append(row)
            print(f"{name:10s} M={m:5d} {scales:6s} " + " ".join(
                f"{pr}: {best[pr] * 1e3:8.2f} us ({row[f'p{pr}_vs_128']:.3f})" for pr in promos)
                + f" | cuBLAS {min(row['cublas_ms']) * 1e3:8.2f} ({row['p128_vs_cublas']:.3f}) same {row['same_bits']}",
                flush=True)
    print("descriptors filled", STATE["calls"], "checked", STATE["checked"])
    if args.out:
        save_json(args.out, dict(env=environment(), rows=rows, checked=STATE["checked"]))


if __name__ == "__main__":
    main()
