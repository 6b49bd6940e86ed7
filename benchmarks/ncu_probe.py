"""Hardware counters of the FP8 matmul and quantize kernels beside cuBLAS, with Nsight Compute.

Each kernel of interest runs once, eagerly, after a warm-up, between cudaProfilerStart and
cudaProfilerStop, inside an NVTX range that names it, so that ncu profiles just those:

    ncu --profile-from-start off --clock-control none --nvtx --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \\
        --section WarpStateStats --section ComputeWorkloadAnalysis --section SchedulerStats \\
        -o probe python3 benchmarks/ncu_probe.py
    ncu --import probe.ncu-rep --page details --print-nvtx-rename kernel > details.txt

(``bash benchmarks/run_gpu.sh ncu`` does both, with ``NCU_ARGS`` passed on; ``--only LABEL``: only
the job of that label, as ``run_gpu.sh ncustalls`` profiles one kernel an ncu process; ``--block``: only the
block-scaled kernel at ``BLOCK_CASES``, for warp-stall samples by instruction; ``--cluster``: per
tensor at ``CLUSTER_CASES``, ours without clusters, ours in clusters that share the activations'
tile (pairs at M = 128, fours at M = 16) and cuBLAS, for the L2 bytes each moves.) ncu replays
each kernel many times and flushes the caches before each replay, so a kernel's L2 hits from the
one before it do not show; time with CUDA graphs (gluon_mm_variants.py), not here. cuBLAS's
kernel names carry its tile and cluster shape (nvjet_sm90_qqtst_160x64_128x7_1x2_...: 64 rows x
160 columns, 128-deep K steps, 7 slots, two CTAs a cluster)."""

import sys

import torch

from qflash import fp8_matmul, quantize
from qflash.bench.matmul import LLAMA
CASES = [(128, "8B qkv"), (128, "70B qkv"), (128, "8B o"), (8192, "70B qkv"), (16, "8B o")]
# --block: block scales at M = 8192 where K is long (70B down) and where it is not (70B o), nothing else
BLOCK_CASES = [(8192, "70B down"), (8192, "70B o")]
# --cluster: (M, shape, CTAs a cluster)
CLUSTER_CASES = [(128, "8B qkv", 2), (128, "70B qkv", 2), (16, "8B o", 4), (16, "70B o", 4), (8192, "70B o", 2),
                 (16, "70B down", 4)]


def cluster_jobs():
    """(label, call) for the Gluon kernel without and with clusters, and cuBLAS, at CLUSTER_CASES."""
    from qflash.kernels import matmul_gluon

    out = []
    for m, name, ctas in CLUSTER_CASES:
        n, k = LLAMA[name]
        a_q, a_s = quantize(torch.randn(m, k, device="cuda"), torch.float8_e4m3fn, "tensor")
        b_q, b_s = quantize(torch.randn(n, k, device="cuda"), torch.float8_e4m3fn, "tensor")
        swap = dict(swap_ab=True, ctas_per_sm=1) if m <= matmul_gluon.SUB_M else {}
        for label, extra in (("plain", {}), (f"clusters of {ctas} sharing A", dict(cluster="A", cluster_size=ctas))):
            out.append((f"ours M={m} {name} tensor {label}",
                        lambda a_q=a_q, b_q=b_q, a_s=a_s, b_s=b_s, opts={**swap, **extra}: matmul_gluon.launch(
                            a_q, b_q, a_s, b_s, None, torch.bfloat16, "tensor", **opts)))
        out.append((f"cublas M={m} {name} tensor",
                    lambda a_q=a_q, b_q=b_q, a_s=a_s, b_s=b_s: torch._scaled_mm(a_q, b_q.T, scale_a=a_s, scale_b=b_s,
                                                                                out_dtype=torch.bfloat16)))
    return out


def block_jobs():
    """(label, call) for the block-scaled kernel alone at BLOCK_CASES."""
    out = []
    for m, name in BLOCK_CASES:
        n, k = LLAMA[name]
        a_q, a_s = quantize(torch.randn(m, k, device="cuda"), torch.float8_e4m3fn, "block", (1, 128))
        b_q, b_s = quantize(torch.randn(n, k, device="cuda"), torch.float8_e4m3fn, "block", (128, 128))
        out.append((f"ours M={m} {name} block",
                    lambda a_q=a_q, b_q=b_q, a_s=a_s, b_s=b_s: fp8_matmul(a_q, b_q, a_s, b_s)))
    return out


def jobs():
    """(label, call) for each kernel to profile."""
    out = []
    for m, name in CASES:
        n, k = LLAMA[name]
        a, b = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
        a_q, a_s = quantize(a, torch.float8_e4m3fn, "tensor")
        b_q, b_s = quantize(b, torch.float8_e4m3fn, "tensor")
        out.append((f"ours M={m} {name} tensor",
                    lambda a_q=a_q, b_q=b_q, a_s=a_s, b_s=b_s: fp8_matmul(a_q, b_q, a_s, b_s)))
        out.append((f"cublas M={m} {name} tensor",
                     lambda a_q=a_q, b_q=b_q, a_s=a_s, b_s=b_s: torch._scaled_mm(a_q, b_q.T, scale_a=a_s, scale_b=b_s,
                                                                                 out_dtype=torch.bfloat16)))
        if m == 8192:
            ab_q, ab_s = quantize(a, torch.float8_e4m3fn, "block", (1, 128))
            bb_q, bb_s = quantize(b, torch.float8_e4m3fn, "block", (128, 128))
            out.append((f"ours M={m} {name} block",
                        lambda a_q=ab_q, b_q=bb_q, a_s=ab_s, b_s=bb_s: fp8_matmul(a_q, b_q, a_s, b_s)))
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    static = torch.full((), 0.01, device="cuda")
    out.append(("quantize dynamic tensor 4096^2 fp8", lambda: quantize(x, torch.float8_e4m3fn, "tensor")))
    out.append(("quantize static tensor 4096^2 fp8",
                lambda: quantize(x, torch.float8_e4m3fn, "tensor", scale=static)))
    out.append(("quantize row 4096^2 fp8", lambda: quantize(x, torch.float8_e4m3fn, "row")))
    return out


def main():
    args = sys.argv[1:]
    calls = block_jobs() if "--block" in args else cluster_jobs() if "--cluster" in args else jobs()
    if "--only" in args:
        label = args[args.index("--only") + 1]
        calls = [(name, fn) for name, fn in calls if name == label]
        if not calls:
            sys.exit(f"ncu_probe.py: no job is labelled {label!r}")
    for _, fn in calls:  # compile and warm up
        fn(), fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for label, fn in calls:
        torch.cuda.nvtx.range_push(label)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.cudart().cudaProfilerStop()
    for i, (label, _) in enumerate(calls):
        print(i, label, file=sys.stderr)


if __name__ == "__main__":
    main()
