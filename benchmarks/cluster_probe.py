"""The FP8 per-tensor matmul in clusters beside the same kernel without, shape by shape.

    python3 benchmarks/cluster_probe.py 128x6144x4096 8192x8192x8192 [--out probe.json]

For each M x N x K: one call of ``matmul_gluon.launch`` a variant (pairs or fours of CTAs sharing
A's or B's tiles, with or without a programmatic dependent launch, other ring depths and tile
widths), timed warm from a CUDA graph (``triton.testing.do_bench_cudagraph``), and whether its
bits equal those of the launch without clusters. A variant the shape does not take prints the
error instead of a time."""

import argparse
import json

import torch
import triton

import qflash
from qflash.kernels import matmul_gluon

VARIANTS = [("plain", {}), ("pairs A", dict(cluster="A")), ("pairs A nopdl", dict(cluster="A", pdl=False)),
            ("pairs A st4", dict(cluster="A", stages=4)), ("pairs B", dict(cluster="B")),
            ("fours A", dict(cluster="A", cluster_size=4)), ("fours B", dict(cluster="B", cluster_size=4)),
            ("plain bn128 st5", dict(block_n=128, stages=5)),
            ("pairs A bn128 st5", dict(cluster="A", block_n=128, stages=5)),
            # a ninth slot, where the C blocks of bulk stores leave room for none (128 x 64 tiles)
            ("plain st9", dict(stages=9)), ("pairs A st9", dict(cluster="A", stages=9))]


def operands(m: int, n: int, k: int):
    """A (m x k) and B (n x k) in FP8 e4m3 with their per-tensor scales."""
    a_q, a_s = qflash.quantize(torch.randn(m, k, device="cuda"), torch.float8_e4m3fn, "tensor")
    b_q, b_s = qflash.quantize(torch.randn(n, k, device="cuda"), torch.float8_e4m3fn, "tensor")
    return a_q, b_q, a_s, b_s


def probe(shape: str) -> list:
    m, n, k = map(int, shape.split("x"))
    a_q, b_q, a_s, b_s = operands(m, n, k)

    def call(**options):
        return matmul_gluon.launch(a_q, b_q, a_s, b_s, None, torch.bfloat16, "tensor", **options)

    want = call()
    rows = []
    for name, options in VARIANTS:
        try:
            same = bool(torch.equal(call(**options), want))
            us = triton.testing.do_bench_cudagraph(lambda: call(**options), rep=200) * 1e3
        except Exception as e:  # a variant this shape does not take
            same, us = repr(e)[:120], None
        print(f"{shape:>16} {name:>20} {us if us is None else round(us, 1)!s:>8} us  same={same}", flush=True)
        rows.append(dict(shape=shape, variant=name, us=us, same=same))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+", help="M x N x K, such as 128x6144x4096")
    parser.add_argument("--out", help="where to write the rows as JSON")
    args = parser.parse_args()
    rows = [row for shape in args.shapes for row in probe(shape)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
