"""Block-scaled FP8 products of decode size (M <= 32) on one GPU: ``fp8_matmul``'s dispatch, the
``tl`` kernel's transposed product and the Gluon kernel's transposed product (K in the runs its
plan picks, and in 1, 2 and 4 runs), beside our per-tensor product and cuBLAS per tensor on the
same shapes, every kernel replayed from CUDA graphs.

    python3 benchmarks/decode_block_scales.py --m 1,16,32 --out decode_block.json

Each variant's output is checked against the ``tl`` kernel's (relative L2 error: the Gluon kernel
adds the K steps' partials in another order). Prints one line per shape and writes JSON. (Session
36's JSON, ``matmul_fp8_decode_block_dispatch_*_s36e.json``, came from an earlier form of this
script that timed the ``tl`` kernel against its tiles before that session.)"""

import argparse

import torch

from qflash.bench.harness import environment, graph_ms, save_json
from qflash.bench.matmul import cublas_fp8, fp8_operands, llama_shapes
from qflash.kernels import matmul_gluon
from qflash.kernels.matmul import default_config, scaled_matmul
from qflash.testing import rel_l2_err


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="1,16,32")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for name, m, n, k in llama_shapes(map(int, args.m.split(","))):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        ops = fp8_operands(a, b, ("tensor", "block"))
        x_q, w_q, x_k, w_k = ops["block"]
        row = dict(shape=name, m=m, n=n, k=k)
        row["cublas_tensor_ms"] = graph_ms(cublas_fp8(*ops["tensor"]))
        row["ours_tensor_ms"] = graph_ms(lambda: scaled_matmul(*ops["tensor"], None, torch.bfloat16, "tensor"))
        tl_config = default_config(m, n, k, "block", False, a.device)
        variants = {
            "block": lambda: scaled_matmul(x_q, w_q, x_k, w_k, None, torch.bfloat16, "block"),
            "tl": lambda: scaled_matmul(x_q, w_q, x_k, w_k, None, torch.bfloat16, "block", config=tl_config),
            "gluon": lambda: matmul_gluon.launch(x_q, w_q, x_k, w_k, None, torch.bfloat16, "block",
                                                 swap_ab=True),
        }
        for runs in (1, 2, 4):
            variants[f"gluon_k{runs}"] = (lambda runs=runs: matmul_gluon.launch(
                x_q, w_q, x_k, w_k, None, torch.bfloat16, "block", swap_ab=True, split_k=runs))
        want = variants["tl"]().float()
        for label, fn in variants.items():
            row[f"{label}_err_vs_tl"] = rel_l2_err(fn().float(), want)
            row[f"{label}_ms"] = graph_ms(fn)
            row[f"{label}_vs_ours_tensor"] = row["ours_tensor_ms"] / row[f"{label}_ms"]
        rows.append(row)
        print(f"M={m:3d} {name:11s} per tensor: cuBLAS {row['cublas_tensor_ms'] * 1e3:7.2f} us, ours "
              f"{row['ours_tensor_ms'] * 1e3:7.2f} | block x ours per tensor: "
              + ", ".join(f"{label} {row[f'{label}_vs_ours_tensor']:.3f}" for label in variants)
              + f" | max err vs tl {max(row[f'{label}_err_vs_tl'] for label in variants):.1e}", flush=True)
    if args.out:
        save_json(args.out, dict(env=environment(), rows=rows))


if __name__ == "__main__":
    main()
