"""Programmatic dependent launch on the H200: do consecutive kernels overlap, ours and cuBLAS's,
and what it gives where a matmul follows another kernel.

    python3 benchmarks/pdl_probe.py --out pdl.json

1. Overlap: ten back-to-back FP8 per-tensor products captured in one CUDA graph and replayed
   under the torch profiler; for each pair of neighbours the gap from the end of one kernel to the
   start of the next (negative: the next began before the last ended). Ours as dispatched and with
   programmatic dependent launch off everywhere, and ``torch._scaled_mm``.
2. Chains, replayed from graphs, as a quantized layer runs them: the activations quantized per
   row, then the per-row product (ours, as dispatched or with the launch off in the quantize and
   the product; or cuBLAS on the same quantized operands); and the (1, 128) block quantize, then
   the block-scaled product (ours only: cuBLAS takes no block scales).
Every product's output is checked against cuBLAS's in the same run (within float32 rounding)."""

import argparse

import torch

from qflash import quantize
from qflash.bench.harness import environment, graph_ms, save_json
from qflash.bench.matmul import cublas_fp8, fp8_operands, llama_shapes
from qflash.kernels.common import early_launch
from qflash.kernels.matmul import scaled_matmul


def ours(a_q, b_q, a_k, b_k, scales="tensor"):
    return scaled_matmul(a_q, b_q, a_k, b_k, None, torch.bfloat16, scales)


def cublas(a_q, b_q, a_k, b_k, scales="tensor"):  # (per tensor or per row by the scales' sizes)
    return cublas_fp8(a_q, b_q, a_k, b_k)()


def gaps_us(fn, calls=10):
    """Gaps between the kernels of ``calls`` back-to-back calls of ``fn`` replayed from a graph."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and "memset" not in e.name.lower() and "memcpy" not in e.name.lower()),
                     key=lambda e: e.time_range.start)
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    return dict(kernels=len(spans), names=sorted({e.name[:60] for e in kernels}),
                gaps=[round(b[0] - a[1], 2) for a, b in zip(spans, spans[1:])],
                durations=[round(e - s, 2) for s, e in spans])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="16,128")
    p.add_argument("--overlap-shapes", default="8B qkv,70B qkv")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for name, m, n, k in llama_shapes(map(int, args.m.split(","))):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        ops = fp8_operands(a, b)
        a_q, b_q, a_k, b_k = ops["tensor"]
        _, b_r, _, b_rk = ops["row"]  # B's, for the chains, which quantize the activations themselves
        _, b_b, _, b_bk = ops["block"]
        ref = cublas(a_q, b_q, a_k, b_k).float()
        row = dict(shape=name, m=m, n=n, k=k)
        for label, fn, on in (("pdl", ours, True), ("no_pdl", ours, False), ("cublas", cublas, True)):
            with early_launch(on):
                out = fn(a_q, b_q, a_k, b_k).float()
                row[f"{label}_rel_err_vs_cublas"] = ((out - ref).norm() / ref.norm()).item()
                row[f"{label}_ms"] = graph_ms(lambda: fn(a_q, b_q, a_k, b_k))
                if name in args.overlap_shapes.split(","):
                    row[f"{label}_overlap"] = gaps_us(lambda: fn(a_q, b_q, a_k, b_k))

                def chain():  # the layer's pair, per row
                    x_q, x_k = quantize(a, torch.float8_e4m3fn, "row")
                    return fn(x_q, b_r, x_k.reshape(-1, 1), b_rk.reshape(-1, 1), "row")
                row[f"{label}_chain_ms"] = graph_ms(chain)
                if fn is ours:
                    def block_chain():  # and with block scales
                        x_q, x_k = quantize(a, torch.float8_e4m3fn, "block", (1, 128))
                        return ours(x_q, b_b, x_k, b_bk, "block")
                    row[f"{label}_block_chain_ms"] = graph_ms(block_chain)
        for label in ("pdl", "no_pdl"):
            row[f"{label}_vs_cublas"] = row["cublas_ms"] / row[f"{label}_ms"]
            row[f"{label}_chain_vs_cublas"] = row["cublas_chain_ms"] / row[f"{label}_chain_ms"]
        row["block_chain_pdl_over_no_pdl"] = row["no_pdl_block_chain_ms"] / row["pdl_block_chain_ms"]
        rows.append(row)
        print(f"{name:12s} M={m:5d} pdl {row['pdl_ms'] * 1e3:7.2f} us ({row['pdl_vs_cublas']:.3f}x) "
              f"no_pdl {row['no_pdl_ms'] * 1e3:7.2f} ({row['no_pdl_vs_cublas']:.3f}x) cuBLAS "
              f"{row['cublas_ms'] * 1e3:7.2f} | row chain pdl {row['pdl_chain_ms'] * 1e3:7.2f} no_pdl "
              f"{row['no_pdl_chain_ms'] * 1e3:7.2f} cuBLAS {row['cublas_chain_ms'] * 1e3:7.2f} | block chain "
              f"pdl {row['pdl_block_chain_ms'] * 1e3:7.2f} no_pdl {row['no_pdl_block_chain_ms'] * 1e3:7.2f} | "
              f"err {row['pdl_rel_err_vs_cublas']:.1e}", flush=True)
        for label in ("pdl", "no_pdl", "cublas"):
            if f"{label}_overlap" in row:
                o = row[f"{label}_overlap"]
                print(f"    {label:7s} kernels {o['kernels']} gaps {o['gaps']} durations {o['durations']}",
                      flush=True)
    if args.out:
        save_json(args.out, dict(env=environment(), rows=rows))


if __name__ == "__main__":
    main()
