"""Quantization: accuracy of each scheme (quantization error apart from kernel error) and
the fused quantize kernel's bandwidth.

    qflash bench quantize --accuracy --out acc.json     # any device (CPU: the interpreter)
    qflash bench quantize --out bw.json                 # GB/s against the copy ceiling (GPU)
    qflash bench quantize --tiles --out tiles.json      # program sizes of the one-load paths (GPU)

Accuracy: for A (M, K) activations, Gaussian or with a few outlier channels 20-100x
larger, and B (N, K) Gaussian weights, each scheme quantizes both operands and
multiplies them with qflash's kernel. ``quant_*`` compares the exact product of the
dequantized operands with the float64 product of the originals (the price of the
format and the scales); ``kernel_rel_err`` compares the kernel's output with that exact
product of the dequantized operands (the price of the kernel).
"""

from __future__ import annotations

from functools import partial
from typing import List, Optional

import torch

from qflash.bench.harness import (
    bench_parser,
    environment,
    finish,
    graph_ms,
    measure_ceilings,
    positive_ints,
    require_runnable,
    rich_table,
    run_as_script,
    time_ms,
)
from qflash.reference.quantize import QMAX

# name: (dtype, A granularity, A block, B granularity, B block, matmul)
SCHEMES = {
    "int8 per-tensor": (torch.int8, "tensor", None, "tensor", None, "int8"),
    "int8 per-row x per-column": (torch.int8, "row", None, "row", None, "int8"),
    "fp8 per-tensor": (torch.float8_e4m3fn, "tensor", None, "tensor", None, "fp8"),
    "fp8 per-row x per-column": (torch.float8_e4m3fn, "row", None, "row", None, "fp8"),
    "fp8 block 1x128 / 128x128": (torch.float8_e4m3fn, "block", (1, 128), "block", (128, 128), "fp8"),
}


def deepgemm_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's calc_diff: 1 - cosine-like similarity, 0 for identical tensors."""
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / ((x * x).sum() + (y * y).sum()))


def accuracy_rows(m: int, n: int, k: int, device: str, seed: int = 0) -> List[dict]:
    import qflash
    from qflash.reference.matmul import dequantize_operand
    from qflash.testing import rel_l2_err, sqnr_db, with_outlier_channels

    g = torch.Generator(device="cpu").manual_seed(seed)
    a_gauss = torch.randn(m, k, generator=g)
    inputs = {
        "gaussian": a_gauss,
        "outlier channels (4 x 50)": with_outlier_channels(a_gauss, num=4, scale=50.0, seed=seed),
    }
    b = torch.randn(n, k, generator=g).to(device)
    rows = []
    for data, a in inputs.items():
        a = a.to(device)
        exact = a.double() @ b.double().T
        for name, (qdtype, ga, ba, gb, bb, kind) in SCHEMES.items():
            a_q, a_s = qflash.quantize(a, qdtype, ga, ba)
            b_q, b_s = qflash.quantize(b, qdtype, gb, bb)
            deq = dequantize_operand(a_q, a_s, block_rows=1) @ dequantize_operand(b_q, b_s, block_rows=128).T
            mm = qflash.int8_matmul if kind == "int8" else qflash.fp8_matmul
            out = mm(a_q, b_q, a_s, b_s, out_dtype=torch.float32)
            rows.append(dict(data=data, scheme=name, quant_sqnr_db=sqnr_db(deq, exact),
                             quant_rel_err=rel_l2_err(deq, exact), quant_deepgemm_diff=deepgemm_diff(deq, exact),
                             kernel_rel_err=rel_l2_err(out, deq)))
    return rows


def _bandwidth_row(fn, x: torch.Tensor, *, graph: bool, **labels) -> dict:
    """Time one quantize call: bytes read + written over the time, eager and (``graph``) from a CUDA graph."""
    nbytes = x.numel() * (x.element_size() + 1)
    ms = time_ms(fn)["ms"]
    row = dict(labels, ms=ms, gbps=nbytes / (ms * 1e-3) / 1e9)
    if graph:
        row["ms_graph"] = graph_ms(fn)
        if row["ms_graph"]:
            row["gbps_graph"] = nbytes / (row["ms_graph"] * 1e-3) / 1e9
    return row


def bandwidth_rows(shapes, dtype=torch.bfloat16) -> List[dict]:
    """Quantize throughput per scheme (CUDA), eager and replayed from a CUDA graph."""
    import qflash

    rows = []
    for m, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        for name, (qdtype, ga, ba, _, _, _) in SCHEMES.items():
            rows.append(_bandwidth_row(lambda: qflash.quantize(x, qdtype, ga, ba), x, graph=True,
                                       shape=f"{m}x{k}", scheme=name))
            if ga == "tensor":  # the same with a static scale: one read instead of two
                s = x.abs().amax().float() / QMAX[qdtype]
                rows.append(_bandwidth_row(lambda: qflash.quantize(x, qdtype, ga, scale=s), x, graph=True,
                                           shape=f"{m}x{k}", scheme=f"{name}, static scale"))
    return rows


# Program sizes tried by --tiles: elements per program x warps.
QUANTIZE_TILE_GRID = [(elems, warps) for elems in (4096, 8192, 16384) for warps in (4, 8, 16)]
TILE_SCHEMES = ["int8 per-row x per-column", "fp8 per-row x per-column", "fp8 block 1x128 / 128x128"]


def tile_rows(shapes, dtype=torch.bfloat16) -> List[dict]:
    """Bandwidth of each program size on the one-load paths (activation quantization), eager and
    from a CUDA graph (eager calls on the smaller shapes wait for the host)."""
    from qflash.kernels.quantize import quantize as launch

    rows = []
    for m, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        for name in TILE_SCHEMES:
            qdtype, ga, ba = SCHEMES[name][:3]
            for elems, warps in QUANTIZE_TILE_GRID:
                fn = partial(launch, x, qdtype, ga, ba, tile_elems=elems, num_warps=warps)
                rows.append(_bandwidth_row(fn, x, graph=True, shape=f"{m}x{k}", scheme=name, tile_elems=elems,
                                           num_warps=warps))
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    parser = bench_parser("quantize", __doc__, quick="small shapes")
    parser.add_argument("--accuracy", action="store_true", help="quantization vs kernel error table (any device)")
    parser.add_argument("--tiles", action="store_true", help="time program sizes of the one-load paths (GPU)")
    parser.add_argument("--shape", default="256,1024,512", type=positive_ints(3), help="M,N,K of the accuracy product")
    args = parser.parse_args(argv)
    m, n, k = args.shape
    cuda = require_runnable(parser)
    if not args.accuracy and not cuda:
        parser.error("bandwidth is measured on a CUDA GPU; on a CPU use --accuracy")
    from rich.console import Console

    console = Console()
    result = {"env": environment()}
    if args.accuracy:
        if args.quick:
            m, n, k = 32, 64, 256
        result["accuracy"] = accuracy_rows(m, n, k, "cuda" if cuda else "cpu")
        result["accuracy_shape"] = [m, n, k]
        console.print(rich_table(result["accuracy"], ["data", "scheme", "quant_sqnr_db", "quant_rel_err",
                                                      "quant_deepgemm_diff", "kernel_rel_err"],
                                 f"quantized matmul accuracy, (M, N, K) = {(m, n, k)}"))
    else:
        shapes = [(1024, 4096)] if args.quick else [(4096, 4096), (8192, 8192), (16384, 8192)]
        result["ceilings"] = measure_ceilings()
        key = "tiles" if args.tiles else "bandwidth"
        result[key] = tile_rows(shapes[::2]) if args.tiles else bandwidth_rows(shapes)
        for r in result[key]:
            r["x_copy"] = r["gbps"] / (result["ceilings"]["copy_TBps"] * 1e3)
            if r.get("gbps_graph"):
                r["x_copy_graph"] = r["gbps_graph"] / (result["ceilings"]["copy_TBps"] * 1e3)
        cols = ["shape", "scheme"] + (["tile_elems", "num_warps"] if args.tiles else [])
        cols += ["ms", "gbps", "x_copy", "ms_graph", "x_copy_graph"]
        console.print(rich_table(result[key], cols, "fused quantize, bf16 in, 1-byte out"))
    return finish(console, args.out, result)


if __name__ == "__main__":
    run_as_script(main)
