"""Host (Python) time of one forward call, on a problem too small for the GPU to matter.

    python3 benchmarks/host_overhead.py --out host.json

At 512 tokens a forward kernel runs 0.1-0.2 ms; a launch path that costs as much on the CPU
shows up in eager timings. Prints microseconds a call for each path, then where the public
path's time goes (cProfile, top functions by own time).
"""

import argparse
import cProfile
import io
import pstats
import time

import torch
import torch.nn.functional as F

import qflash
from qflash.bench.harness import environment, save_json
from qflash.kernels import attention_gluon
from qflash.kernels.attention import AttnOptions, attention_forward, default_config


def per_call_us(fn, calls: int = 500) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    q, k, v = (torch.randn(1, 128, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    opts = AttnOptions(128**-0.5)
    cfg = default_config(128, q.dtype, q.device, causal=False, seqlen_k=128)
    paths = {
        "attention_gluon.launch": lambda: attention_gluon.launch(q, k, v, 128**-0.5, False, True),
        "attention_gluon.attention_forward_gluon": lambda: attention_gluon.attention_forward_gluon(q, k, v, 128**-0.5),
        "tl kernel (attention_forward, config)": lambda: attention_forward(q, k, v, opts, config=cfg),
        "qflash.flash_attn_func": lambda: qflash.flash_attn_func(q, k, v),
        "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(qt, kt, vt),
    }
    result = {"env": environment(), "rows": []}
    for name, fn in paths.items():
        us = per_call_us(fn)
        result["rows"].append({"path": name, "us_per_call": us})
        print(f"{name:45s} {us:8.1f} us/call", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        qflash.flash_attn_func(q, k, v)
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    result["profile_flash_attn_func_200_calls"] = text.getvalue()
    print(text.getvalue())
    save_json(args.out, result)


if __name__ == "__main__":
    main()
