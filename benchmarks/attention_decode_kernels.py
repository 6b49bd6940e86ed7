"""Kernel by kernel, a decode step's device time: the forward's key shares apart from the kernel
that weighs them together, beside SDPA's cuDNN and flash backends (each also two kernels), from
torch.profiler over 50 eager calls. One query row, 32 / 8 heads, bf16, batch 1 and 4, caches of
1k-64k.

    python3 benchmarks/attention_decode_kernels.py --head-dims 64,128 --out kernels.json
"""

import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import qflash
from qflash.bench.harness import environment, kernel_events, save_json
from qflash.kernels import attention as kernels


def kernel_times(fn, calls=50):
    """Kernel name (cut to 60 characters) -> (launches a call, mean device microseconds)."""
    return {e.key[:60]: dict(count=e.count // calls, us=round(e.device_time_total / e.count, 2))
            for e in kernel_events(fn, calls, warmup=5) if e.device_type.name == "CUDA" and e.count}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for d in map(int, args.head_dims.split(",")):
        for b in (1, 4):
            for sk in (1024, 4096, 16384, 65536):
                gen = torch.Generator(device="cuda").manual_seed(0)
                q = torch.randn(b, 1, 32, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                k = torch.randn(b, sk, 8, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                v = torch.randn_like(k)
                plan = kernels.forward_plan(q, k, kernels.AttnOptions(1 / math.sqrt(d)))
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                fns = {"qflash": lambda: qflash.flash_attn_func(q, k, v)}
                for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                    def run(backend=backend):
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
                    fns[name] = run
                for name, fn in fns.items():
                    row = dict(d=d, batch=b, seqlen_k=sk, provider=name, splits=plan.num_splits,
                               block_n=plan.config.block_n)
                    try:
                        row["kernels"] = kernel_times(fn)
                    except Exception as e:  # noqa: BLE001 - a backend that refuses the shape
                        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    rows.append(row)
                    print(row, flush=True)
    if args.out:
        save_json(args.out, {"env": environment(), "rows": rows})


if __name__ == "__main__":
    main()
