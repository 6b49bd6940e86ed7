"""Where the tl backward's time goes under a causal mask, and two ways to shorten its last wave.

For each shape: the delta, dQ and dK/dV kernels timed apart (torch.profiler), then whole backwards
(`attention_backward`, delta pass included) side by side with SDPA's cuDNN and flash-attn 2
backends: the default configs, dQ's blocks launched last to first (`reverse`), the dK/dV kernel on
a second stream beside dQ (`overlap`), and both. TFLOP/s count 2.5 x the forward's FLOPs.
"""

import argparse
import dataclasses
import itertools
import math

import torch
import triton

from qflash.bench.attention import BACKWARD_FLOPS, PROVIDERS, attention_flops, backward_of
from qflash.bench.harness import environment, save_json
from qflash.kernels.attention import AttnOptions, attention_backward, attention_forward, default_bwd_configs


def kernel_times(fn, reps: int = 10):
    """Mean device time a call of each kernel that ``fn`` launches, in ms."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        name = event.key
        for short in ("preprocess", "dq", "dkdv"):
            if name.startswith(f"_attn_bwd_{short}"):
                times[short] = event.device_time_total / 1e3 / reps
    return times


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlens", default="1024,4096,16384")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--rounds", type=int, default=2, help="times each variant this often, interleaved; keeps the best")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for d, n, causal in itertools.product(map(int, args.head_dims.split(",")), map(int, args.seqlens.split(",")),
                                          (False, True)):
        b, h = 16384 // n, 2048 // d
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(b, n, h, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(4))
        opts = AttnOptions(1 / math.sqrt(d), window_right=0 if causal else -1)
        o, lse = attention_forward(q, k, v, opts)
        flops = BACKWARD_FLOPS * attention_flops(b, h, n, n, d, causal)
        dq_cfg, dkdv_cfg = default_bwd_configs(d, q.dtype, q.device)
        reversed_dq = (dataclasses.replace(dq_cfg, reverse=True), dkdv_cfg)
        variants = {
            "default": lambda: attention_backward(do, q, k, v, o, lse, opts, configs=(dq_cfg, dkdv_cfg)),
            "reverse dq": lambda: attention_backward(do, q, k, v, o, lse, opts, configs=reversed_dq),
            "overlap": lambda: attention_backward(do, q, k, v, o, lse, opts, configs=(dq_cfg, dkdv_cfg), overlap=True),
            "reverse dq + overlap": lambda: attention_backward(do, q, k, v, o, lse, opts, configs=reversed_dq,
                                                               overlap=True),
        }
        ref = variants["default"]()
        for name, fn in variants.items():  # every variant computes the same gradients, bit for bit
            got = fn()
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(got[:3], ref[:3])), name
        for peer in ("sdpa_cudnn", "sdpa_flash"):
            variants[peer] = backward_of(PROVIDERS[peer])(q, k, v, causal)
        best = {}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                ms = triton.testing.do_bench(fn, rep=60)
                best[name] = min(best.get(name, ms), ms)
        kernels = {name: kernel_times(variants[name]) for name in ("default", "reverse dq")}
        row = dict(head_dim=d, seqlen=n, causal=causal, batch=b, heads=h,
                   tflops={name: flops / ms * 1e-9 for name, ms in best.items()}, ms=best, kernels_ms=kernels)
        rows.append(row)
        print(d, n, "causal" if causal else "full ",
              " ".join(f"{name}={t:.0f}" for name, t in row["tflops"].items()),
              "| kernels ms:", {k2: round(t, 3) for k2, t in kernels["default"].items()},
              "dq reversed", round(kernels["reverse dq"].get("dq", float("nan")), 3), flush=True)
        del variants, ref
        torch.cuda.empty_cache()
    if args.out:
        save_json(args.out, dict(env=environment(), convention="TFLOP/s = 2.5 x forward FLOPs / time", rows=rows))


if __name__ == "__main__":
    main()
