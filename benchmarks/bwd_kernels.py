"""Where the tl backward's time goes: the delta, dQ and dK/dV kernels timed apart
(torch.profiler), and whole backwards (`attention_backward`, delta pass included) with variants
of the dK/dV config side by side with SDPA's cuDNN and flash-attn 2 backends. TFLOP/s count
2.5 x the forward's FLOPs.

Session 14's first run of this script (`attention_bwd_order_h200_2026-11-30_s14b.json`, commit
4d4802f) timed two launch-order variants since removed: dQ's blocks launched last to first, and
the dK/dV kernel on a second stream beside dQ.
"""

import argparse
import dataclasses
import itertools
import math

import torch
import triton

from qflash.bench.attention import BACKWARD_FLOPS, PROVIDERS, attention_flops, backward_of, sized_inputs
from qflash.bench.harness import environment, kernel_events, save_json
from qflash.kernels.attention import AttnOptions, attention_backward, attention_forward, default_bwd_configs


def kernel_times(fn, reps: int = 10):
    """Mean device time a call of each kernel that ``fn`` launches, in ms."""
    times = {"other": 0.0}  # other: zero-fills, the fused dQ's scale and cast
    for event in kernel_events(fn, reps):
        name, ms = event.key, event.device_time_total / 1e3 / reps
        short = next((s for s in ("preprocess", "dq", "dkdv") if name.startswith(f"_attn_bwd_{s}")), None)
        if short:
            times[short] = ms
        elif event.device_type == torch.autograd.DeviceType.CUDA:  # kernels and memsets, not the ops above them
            times["other"] += ms
    return times


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlens", default="1024,4096,16384")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--rounds", type=int, default=2, help="times each variant this often, interleaved; keeps the best")
    p.add_argument("--dkdv", default="", help="configs beside the default: 'name=field:value,...;...', dK/dV's "
                                              "fields, dQ's with a 'dq.' prefix (e.g. 'regs168=maxnreg:168;"
                                              "late=heavy_first:0,dq.heavy_first:0')")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for d, n, causal in itertools.product(map(int, args.head_dims.split(",")), map(int, args.seqlens.split(",")),
                                          (False, True)):
        q, k, v, do = sized_inputs(n, d, count=4)
        b, h = q.shape[0], q.shape[2]
        opts = AttnOptions(1 / math.sqrt(d), window_right=0 if causal else -1)
        o, lse = attention_forward(q, k, v, opts)
        flops = BACKWARD_FLOPS * attention_flops(b, h, n, n, d, causal)
        dq_cfg, dkdv_cfg = default_bwd_configs(d, q.dtype, q.device)
        candidates = {"default": (dq_cfg, dkdv_cfg)}
        for spec in filter(None, args.dkdv.split(";")):  # name=field:value,dq.field:value
            name, fields = spec.split("=")
            changes = {f: int(x) for f, x in (kv.split(":") for kv in fields.split(","))}  # 1 for True
            dq_changes = {f[3:]: x for f, x in changes.items() if f.startswith("dq.")}
            kv_changes = {f: x for f, x in changes.items() if not f.startswith("dq.")}
            candidates[name] = (dataclasses.replace(dq_cfg, **dq_changes), dataclasses.replace(dkdv_cfg, **kv_changes))
        variants = {name: (lambda c=c: attention_backward(do, q, k, v, o, lse, opts, configs=c))
                    for name, c in candidates.items()}
        ref = variants["default"]()
        for name, fn in variants.items():  # the same gradients, up to the order of the sums
            got = fn()
            err = max(float((x.float() - y.float()).abs().max() / y.float().abs().max())
                      for x, y in zip(got[:3], ref[:3]))
            assert err < 1e-2, (name, err)
        for peer in ("sdpa_cudnn", "sdpa_flash"):
            variants[peer] = backward_of(PROVIDERS[peer])(q, k, v, causal)
        best = {}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                ms = triton.testing.do_bench(fn, rep=60)
                best[name] = min(best.get(name, ms), ms)
        kernels = {name: kernel_times(variants[name]) for name in candidates}
        row = dict(head_dim=d, seqlen=n, causal=causal, batch=b, heads=h,
                   tflops={name: flops / ms * 1e-9 for name, ms in best.items()}, ms=best, kernels_ms=kernels)
        rows.append(row)
        print(d, n, "causal" if causal else "full ",
              " ".join(f"{name}={t:.0f}" for name, t in row["tflops"].items()),
              "| kernels ms:", {name: {k2: round(t, 3) for k2, t in ks.items()} for name, ks in kernels.items()},
              flush=True)
        del variants, ref
        torch.cuda.empty_cache()
    if args.out:
        save_json(args.out, dict(env=environment(), convention="TFLOP/s = 2.5 x forward FLOPs / time", rows=rows))


if __name__ == "__main__":
    main()
