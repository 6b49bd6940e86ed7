"""FP8 matmul error against the float64 product of the dequantized inputs, ours beside
``torch._scaled_mm``'s with and without fast accumulation (per tensor, float32 out), on the GPU
(s31g). Inside a 128-wide K block Hopper's tensor cores keep about 14 bits of an FP8 sum.

    python3 benchmarks/fp8_matmul_error_vs_cublas.py"""
import torch

import qflash
from qflash.bench.matmul import cublas_fp8
from qflash.reference.matmul import fp8_matmul_ref

torch.manual_seed(0)
for m, n, k in [(70, 96, 304), (96, 1024, 2048), (8, 4096, 4096), (128, 4096, 4096), (1024, 4096, 8192)]:
    a, b = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
    a_q, a_s = qflash.quantize(a, torch.float8_e4m3fn, "tensor")
    b_q, b_s = qflash.quantize(b, torch.float8_e4m3fn, "tensor")
    ref = fp8_matmul_ref(a_q, b_q, a_s, b_s, None, torch.float64)
    ours = qflash.fp8_matmul(a_q, b_q, a_s, b_s, out_dtype=torch.float32).double()
    errs = {"ours": ours}
    for fast in (False, True):
        errs[f"cublas fast={fast}"] = cublas_fp8(a_q, b_q, a_s, b_s, torch.float32, fast_accum=fast)().double()
    print(f"{m}x{n}x{k}", "  ".join(f"{name}: max {float((c - ref).abs().max()):.2e} rel_l2 "
                                      f"{float((c - ref).norm() / ref.norm()):.2e}" for name, c in errs.items()),
          flush=True)
