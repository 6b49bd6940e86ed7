"""Stream-K against whole rounds under Nsight Compute (session 29's experiment): the Gluon matmul
at M = 8192 with block scales (128 x 128 tiles) and per tensor (128 x 256), each once with and
once without ``stream_k``, inside NVTX ranges that name them:

    ncu --profile-from-start off --clock-control none --nvtx --section WarpStateStats \\
        --section SchedulerStats -o sk python3 benchmarks/ncu_stream_k.py

(s29b ran it with both shapes below and counters, s29c with 8B o only and the stall sections.)"""

import torch

from qflash import quantize
from qflash.kernels import matmul_gluon as g


def main():
    calls = []
    for m, n, k in ((8192, 4096, 4096), (8192, 57344, 8192)):
        a, b = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
        ab_q, ab_s = quantize(a, torch.float8_e4m3fn, "block", (1, 128))
        bb_q, bb_s = quantize(b, torch.float8_e4m3fn, "block", (128, 128))
        a_q, a_s = quantize(a, torch.float8_e4m3fn, "tensor")
        b_q, b_s = quantize(b, torch.float8_e4m3fn, "tensor")
        for sk in (False, True):
            calls.append((f"block {n}x{k} sk={sk}", lambda sk=sk, x=(ab_q, bb_q, ab_s, bb_s): g.launch(
                *x, None, torch.bfloat16, "block", block_n=128, stages=5, tma_store=True, stream_k=sk)))
            calls.append((f"tensor {n}x{k} sk={sk}", lambda sk=sk, x=(a_q, b_q, a_s, b_s): g.launch(
                *x, None, torch.bfloat16, "tensor", block_n=256, stages=3, tma_store=True, stream_k=sk)))
    for _, fn in calls:
        fn(), fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for label, fn in calls:
        torch.cuda.nvtx.range_push(label)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
