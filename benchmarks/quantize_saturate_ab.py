"""A / B of the quantize kernels against an earlier version of kernels/quantize.py, loaded from a
file as a second module. Session 31: s31a, float8 without the clamp before the conversion where
the group's own absmax bounds the values; s31b, that and int8 by an add and a byte gather (taken
out); s31c, the clamp of a static scale as one NaN-keeping min. The same bits checked on every
case and on values that hit the clamp (Inf, NaN, a static scale that saturates), then times from
CUDA graphs, the two in turn, five times each.

    git show 4cdba52:src/qflash/kernels/quantize.py > benchmarks/quantize_old_tmp.py   (session 30's)
    OUT=out python3 benchmarks/quantize_saturate_ab.py --old benchmarks/quantize_old_tmp.py"""

import argparse
import importlib.util
import os

import torch

from qflash.bench.harness import copy_bandwidth, environment, graph_ms, save_json
from qflash.kernels import quantize as new
from qflash.reference.quantize import QMAX

E4, E5, I8 = torch.float8_e4m3fn, torch.float8_e5m2, torch.int8
CASES = [  # (M, N, dtype, granularity, block, static)
    (2048, 4096, E4, "tensor", None, False), (3072, 4096, E4, "tensor", None, False),
    (4096, 4096, E4, "tensor", None, False), (8192, 4096, E4, "tensor", None, False),
    (4096, 4096, E4, "tensor", None, True), (16384, 8192, E4, "tensor", None, True),
    (4096, 4096, E4, "row", None, False), (16384, 8192, E4, "row", None, False),
    (4096, 4096, E4, "block", (1, 128), False), (16384, 8192, E4, "block", (1, 128), False),
    (4096, 4096, E4, "block", (128, 128), False), (16384, 8192, E5, "row", None, False),
    (3072, 4096, E5, "tensor", None, False), (16384, 8192, I8, "row", None, False),
    (2048, 4096, I8, "tensor", None, False), (3072, 4096, I8, "tensor", None, False),
    (4096, 4096, I8, "tensor", None, False), (4096, 4096, I8, "tensor", None, True),
    (4096, 4096, I8, "row", None, False), (4096, 4096, I8, "block", (1, 128), False),
    (16384, 8192, I8, "block", (1, 128), False), (4096, 4096, I8, "block", (128, 128), False),
]


def same_bits(a, b):  # (NaN scales compared by their bits)
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1].view(torch.int32),
                                                                                        b[1].view(torch.int32))


def load(path):
    spec = importlib.util.spec_from_file_location("quantize_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def checks(old):
    """Bits of the two builds on values that hit the clamp: a static scale that saturates, Inf, NaN."""
    bad = 0
    for dtype in (E4, E5, I8):
        x = torch.randn(1000, 1000, device="cuda") * 1e3
        x[3, 5], x[7, 9], x[11, 13] = float("inf"), float("-inf"), float("nan")
        for static in (torch.full((1,), 1e-3, device="cuda"), torch.full((1,), 1.0, device="cuda")):
            bad += not same_bits(*(k.quantize(x, dtype, "tensor", static_scale=static) for k in (new, old)))
        for gran, block in (("row", None), ("block", (1, 128)), ("block", (128, 128)), ("tensor", None)):
            y = torch.randn(777, 1000, device="cuda", dtype=torch.bfloat16) * 100
            y[5, 6] = float("nan")
            bad += not same_bits(new.quantize(y, dtype, gran, block), old.quantize(y, dtype, gran, block))
    return bad


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--old", required=True, help="an earlier kernels/quantize.py")
    old = load(parser.parse_args().old)
    copy = copy_bandwidth()
    print(f"copy {copy:.2f} TB/s; clamp and NaN checks differing: {checks(old)} of 18", flush=True)
    rows = []
    for m, n, dtype, gran, block, static in CASES:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        kw = dict(static_scale=(x.abs().amax().float() / QMAX[dtype]).reshape(1)) if static else {}
        a, b = (lambda k=k: k.quantize(x, dtype, gran, block, **kw) for k in (new, old))
        same = same_bits(a(), b())
        times = {"new": [], "old": []}
        for _ in range(5):
            times["new"].append(graph_ms(a))
            times["old"].append(graph_ms(b))
        nbytes = x.numel() * (x.element_size() + 1)
        best = {k: min(v) for k, v in times.items()}
        row = dict(shape=f"{m}x{n}", dtype=str(dtype), granularity=gran, block=block, static=static, same_bits=same,
                   ms=times, x_copy={k: nbytes / (t * 1e-3) / 1e12 / copy for k, t in best.items()},
                   new_over_old=best["old"] / best["new"])
        rows.append(row)
        print(f"{m}x{n} {str(dtype)[6:]:14s} {gran:6s} {str(block):10s} static={static!s:5s} same={same} "
              f"old {best['old'] * 1e3:7.2f} new {best['new'] * 1e3:7.2f} us  x_copy {row['x_copy']['old']:.3f} -> "
              f"{row['x_copy']['new']:.3f}  speedup {row['new_over_old']:.3f}", flush=True)
    save_json(os.path.join(os.environ.get("OUT", "."), "quantize_saturate_ab.json"),
              dict(env=environment(), copy_TBps=copy, rows=rows))


if __name__ == "__main__":
    main()
