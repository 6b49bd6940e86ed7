"""Time tile shapes of the Gluon FP8 matmul side by side with cuBLAS (``torch._scaled_mm``, float32
accumulation) on one GPU, per tensor and per row, kernels replayed from CUDA graphs.

Every variant's output is checked in the same run: bit for bit against the 128-wide default (each
128 x 128 block of the product is the same sequence of wgmma partials and float32 adds, whatever the
tile width or the way C is written; float32 and bfloat16 outputs both), and within float32 rounding of a float32 reference on the dequantized inputs.
Prints one line per (shape, variant) and writes JSON."""

import argparse
import re

import torch

from qflash.bench.harness import environment, graph_ms, save_json
from qflash.kernels import matmul_gluon as g
from qflash import quantize

# (N, K) of the Llama-3 projections: q/k/v fused, o, gate/up fused, down.
LLAMA = {"8B qkv": (6144, 4096), "8B o": (4096, 4096), "8B gate_up": (28672, 4096), "8B down": (4096, 14336),
         "70B qkv": (10240, 8192), "70B o": (8192, 8192), "70B gate_up": (57344, 8192), "70B down": (8192, 28672)}
VARIANTS = "128x6,256x4,256x3,256x4t,256x3t,256x4tg16"  # block_n x stages, t: C by bulk copies, gN: GROUP_M


def variant(text):
    """'256x4tg16' -> dict(block_n=256, stages=4, tma_store=True, group_m=16)."""
    match = re.fullmatch(r"(\d+)x(\d+)(t?)(?:g(\d+))?", text)
    if match is None:
        raise SystemExit(f"a variant is block_n x stages [t] [gN], got {text!r}")
    block_n, stages, tma, group = match.groups()
    out = dict(block_n=int(block_n), stages=int(stages), tma_store=bool(tma))
    if group:
        out["group_m"] = int(group)
    return out


def shapes(ms):
    yield "8192^3", 8192, 8192, 8192
    for m in ms:
        for name, (n, k) in LLAMA.items():
            yield name, m, n, k


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="128,1024,8192", help="rows of A for the Llama shapes")
    p.add_argument("--variants", default=VARIANTS, help="block_n x stages [t] [gN], ...")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    variants = [(v, variant(v)) for v in args.variants.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for name, m, n, k in shapes(map(int, args.m.split(","))):
        a, b = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
        flop = 2 * m * n * k
        for scales in ("tensor", "row"):
            a_q, a_s = quantize(a, torch.float8_e4m3fn, scales)
            b_q, b_s = quantize(b, torch.float8_e4m3fn, scales)
            a_k, b_k = (a_s, b_s) if scales == "tensor" else (a_s.reshape(-1, 1), b_s.reshape(-1, 1))
            ref = (a_q.float() * a_k) @ (b_q.float() * b_k).T
            cublas = graph_ms(lambda: torch._scaled_mm(a_q, b_q.T, scale_a=a_k, scale_b=b_k.reshape(1, -1)
                                                       if scales == "row" else b_k, out_dtype=torch.bfloat16))
            base = base16 = None
            for label, opts in variants:
                out = g.launch(a_q, b_q, a_k, b_k, None, torch.float32, scales, **opts)
                out16 = g.launch(a_q, b_q, a_k, b_k, None, torch.bfloat16, scales, **opts)
                base = out if base is None else base
                base16 = out16 if base16 is None else base16
                err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
                ms = graph_ms(lambda: g.launch(a_q, b_q, a_k, b_k, None, torch.bfloat16, scales, **opts))
                rows.append(dict(shape=name, m=m, n=n, k=k, scales=scales, variant=label, **opts,
                                 ms=ms, tflops=flop / ms * 1e-9, cublas_ms=cublas, cublas_tflops=flop / cublas * 1e-9,
                                 vs_cublas=cublas / ms, same_as_128=bool(torch.equal(out, base) and torch.equal(out16, base16)),
                                 rel_err=err,
                                 within_fp32=err < 1e-5 * max(1.0, k ** 0.5)))
                r = rows[-1]
                print(f"{name:12s} M={m:5d} {scales:6s} {label:10s}: {r['tflops']:7.1f} TFLOP/s "
                      f"cuBLAS {r['cublas_tflops']:7.1f} ({r['vs_cublas']:.2f}x) same={r['same_as_128']} "
                      f"err={err:.1e}", flush=True)
            del out, out16, base, base16, ref
    if args.out:
        save_json(args.out, dict(env=environment(), rows=rows))


if __name__ == "__main__":
    main()
