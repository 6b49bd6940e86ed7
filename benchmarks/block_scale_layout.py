"""FP8 block scales at M = 8192: A's 1 x 128 scales stored row-major (M, K/128), as ``quantize``
makes them, against the same values stored column-major (each K step's scales contiguous over
the rows, as DeepGEMM asks for), each timed twice from CUDA graphs beside our per-tensor product.

    OUT=out python3 benchmarks/block_scale_layout.py    (writes $OUT/block_a_scales_layout_m8192.json)"""

import os

import torch

from qflash import quantize
from qflash.bench.harness import environment, graph_ms, save_json
from qflash.bench.matmul import llama_shapes
from qflash.kernels import matmul_gluon as g

F8 = torch.float8_e4m3fn


def main():
    rows = []
    for name, m, n, k in llama_shapes([8192], cube=True):
        a, b = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
        a_q, a_t = quantize(a, F8, "tensor")
        b_q, b_t = quantize(b, F8, "tensor")
        tensor_ms = graph_ms(lambda: g.launch(a_q, b_q, a_t, b_t, None, torch.bfloat16, "tensor"))
        a_q, a_k = quantize(a, F8, "block", (1, 128))
        b_q, b_k = quantize(b, F8, "block", (128, 128))
        a_kt = a_k.t().contiguous().t()  # the same values, column-major

        def block(a_scale, out_dtype=torch.bfloat16):
            return g.launch(a_q, b_q, a_scale, b_k, None, out_dtype, "block")

        same = torch.equal(block(a_k, torch.float32), block(a_kt, torch.float32))
        row_ms, col_ms = graph_ms(lambda: block(a_k)), graph_ms(lambda: block(a_kt))
        row2_ms, col2_ms = graph_ms(lambda: block(a_k)), graph_ms(lambda: block(a_kt))
        r = dict(shape=name, m=m, n=n, k=k, tensor_ms=tensor_ms, block_row_major_ms=[row_ms, row2_ms],
                 block_col_major_ms=[col_ms, col2_ms], same_bits=same,
                 block_over_tensor_row_major=tensor_ms / min(row_ms, row2_ms),
                 block_over_tensor_col_major=tensor_ms / min(col_ms, col2_ms))
        rows.append(r)
        print(f"{name:11s} same={same} block/tensor row-major {r['block_over_tensor_row_major']:.3f} "
              f"col-major {r['block_over_tensor_col_major']:.3f}  ms {row_ms:.3f}/{row2_ms:.3f} vs "
              f"{col_ms:.3f}/{col2_ms:.3f}", flush=True)
    save_json(os.path.join(os.environ.get("OUT", "."), "block_a_scales_layout_m8192.json"),
              dict(env=environment(), rows=rows))


if __name__ == "__main__":
    main()
