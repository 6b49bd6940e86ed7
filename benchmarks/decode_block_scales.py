"""Block-scaled FP8 products of decode size (M <= 32, the ``tl`` kernel's transposed product) on one
GPU: ``fp8_matmul``'s dispatch against the tiles it took before session 36 (pointer loads, 6 ring
slots for 64-wide tiles, 4 for 128-wide ones), beside our per-tensor product and cuBLAS per tensor
on the same shapes, every kernel replayed from CUDA graphs.

    python3 benchmarks/decode_block_scales.py --m 1,16,32 --out decode_block.json

Each variant's output is checked bit for bit against the dispatch's (the same K order: only the
loads and the ring differ). Prints one line per shape and writes JSON."""

import argparse
from dataclasses import replace

import torch

from qflash import quantize
from qflash.bench.harness import environment, graph_ms, save_json
from qflash.bench.matmul import LLAMA
from qflash.kernels.matmul import default_config, scaled_matmul


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="1,16,32")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for m in map(int, args.m.split(",")):
        for name, (n, k) in LLAMA.items():
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            t_a, t_ak = quantize(a, torch.float8_e4m3fn, "tensor")
            t_b, t_bk = quantize(b, torch.float8_e4m3fn, "tensor")
            x_q, x_k = quantize(a, torch.float8_e4m3fn, "block", (1, 128))
            w_q, w_k = quantize(b, torch.float8_e4m3fn, "block", (128, 128))
            row = dict(shape=name, m=m, n=n, k=k)
            row["cublas_tensor_ms"] = graph_ms(lambda: torch._scaled_mm(t_a, t_b.T, scale_a=t_ak, scale_b=t_bk,
                                                                        out_dtype=torch.bfloat16))
            row["ours_tensor_ms"] = graph_ms(lambda: scaled_matmul(t_a, t_b, t_ak, t_bk, None, torch.bfloat16,
                                                                   "tensor"))
            config = default_config(m, n, k, "block", False, a.device)
            before = replace(config, use_tma=False, num_stages=6 if config.block_n == 64 else 4)
            want = scaled_matmul(x_q, w_q, x_k, w_k, None, torch.bfloat16, "block")
            row["config"], row["config_before"] = str(config), str(before)
            for label, cfg in (("block", None), ("block_before", before)):
                out = scaled_matmul(x_q, w_q, x_k, w_k, None, torch.bfloat16, "block", config=cfg)
                row[f"{label}_same_bits"] = torch.equal(out, want)
                row[f"{label}_ms"] = graph_ms(lambda: scaled_matmul(x_q, w_q, x_k, w_k, None, torch.bfloat16,
                                                                    "block", config=cfg))
                row[f"{label}_vs_ours_tensor"] = row["ours_tensor_ms"] / row[f"{label}_ms"]
            rows.append(row)
            print(f"M={m:3d} {name:11s} per tensor: cuBLAS {row['cublas_tensor_ms'] * 1e3:7.2f} us, ours "
                  f"{row['ours_tensor_ms'] * 1e3:7.2f} | block {row['block_ms'] * 1e3:7.2f} "
                  f"({row['block_vs_ours_tensor']:.3f} x ours per tensor), before "
                  f"{row['block_before_ms'] * 1e3:7.2f} ({row['block_before_vs_ours_tensor']:.3f}) "
                  f"same bits {row['block_before_same_bits']}", flush=True)
    if args.out:
        save_json(args.out, dict(env=environment(), rows=rows))


if __name__ == "__main__":
    main()
