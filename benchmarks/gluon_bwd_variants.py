"""Time variants of the Gluon backward kernel side by side (one process, one GPU): the ring depth,
how a tile's dQ reaches memory (float32 atomic adds from registers, or the copy engine's reduce-add
from shared memory), beside earlier copies of the kernel's module (``--baseline``). More schemes
were timed with it and removed (benchmarks/NOTES.md: eighth round; seventeenth, the staggered
query blocks, with the earlier copies in commit f3f08bd); the sixteenth round's ablations ran from
a temporary copy (commit 9faf4a4, benchmarks/_gluon_ablate.py).
Prints TFLOP/s (2.5 x the forward's FLOPs; the kernel alone, without the delta pass) and writes JSON."""

import argparse
import importlib.util
import itertools
import math

import torch
import triton

from qflash.bench.attention import attention_flops, sized_inputs
from qflash.bench.harness import environment, save_json
from qflash.kernels import attention_gluon as g
from qflash.kernels.attention import AttnOptions, attention_backward, default_bwd_configs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlens", default="1024,4096,16384")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--stages", default="2,3")
    p.add_argument("--baseline", default=None,
                   help="copies of earlier attention_gluon.py files to time beside (comma-separated)")
    p.add_argument("--dq-tma", default="0,1")
    p.add_argument("--variants", default=None,
                   help='schedules to time instead of --stages x --dq-tma: "NAME=int,NAME=int;..." (kernel constexprs)')
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    baselines = {}
    for path in filter(None, (args.baseline or "").split(",")):
        spec = importlib.util.spec_from_file_location(f"gluon_baseline_{len(baselines)}", path)
        baselines[path] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baselines[path])
    g.bwd_preferred = lambda head_dim, causal, seqlen_k: True  # the launcher's whole Gluon path, wherever it fits
    dq_tma_flags = [bool(int(x)) for x in args.dq_tma.split(",")]
    for d, n, causal in itertools.product(map(int, args.head_dims.split(",")), map(int, args.seqlens.split(",")),
                                          (False, True)):
        q, k, v, o, do = sized_inputs(n, d, count=5)
        b, h = q.shape[0], q.shape[2]
        lse = torch.randn(b, h, n, device="cuda") + 10
        delta = torch.randn(b, h, n, device="cuda")
        flops = 2.5 * attention_flops(b, h, n, n, d, causal)
        if args.variants:
            schedules = [{k: int(x) for k, x in (kv.split("=") for kv in one.split(","))}
                         for one in args.variants.split(";")]
        else:
            schedules = [dict(STAGES=stages, DQ_TMA=dq_tma)
                         for stages, dq_tma in itertools.product(map(int, args.stages.split(",")), dq_tma_flags)
                         if not (stages == 3 and dq_tma and d == 128)]  # that one does not fit shared memory
        for schedule in schedules:
            fn = lambda: g.launch_backward(do, q, k, v, lse, delta, 1 / math.sqrt(d), causal, True, **schedule)
            ms = triton.testing.do_bench(fn, rep=60)
            rows.append(dict(head_dim=d, seqlen=n, causal=causal, **{k.lower(): x for k, x in schedule.items()},
                             ms=ms, tflops=flops / ms * 1e-9))
            print(rows[-1], flush=True)
        for path, baseline in baselines.items():  # each with its own default variant
            ms = triton.testing.do_bench(lambda: baseline.launch_backward(do, q, k, v, lse, delta, 1 / math.sqrt(d),
                                                                          causal, True), rep=60)
            rows.append(dict(head_dim=d, seqlen=n, causal=causal, path=f"baseline {path}", ms=ms,
                             tflops=flops / ms * 1e-9))
            print(rows[-1], flush=True)
        # Whole backwards (delta pass included) through the launcher: the tl kernels, and this
        # kernel with its default variant.
        opts = AttnOptions(1 / math.sqrt(d), window_right=0 if causal else -1)
        tl_configs = default_bwd_configs(d, q.dtype, q.device)
        for name, configs in (("tl backward", tl_configs), ("gluon backward", None)):
            ms = triton.testing.do_bench(lambda: attention_backward(do, q, k, v, o, lse, opts, configs=configs), rep=60)
            rows.append(dict(head_dim=d, seqlen=n, causal=causal, path=name, ms=ms, tflops=flops / ms * 1e-9))
            print(rows[-1], flush=True)
    if args.out:
        save_json(args.out, dict(env=environment(), rows=rows))


if __name__ == "__main__":
    main()
