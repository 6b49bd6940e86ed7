"""Packed-sequence attention (``flash_attn_varlen_func``) timed for two source trees in turn.

    python benchmarks/varlen_ab.py --trees base=/path/a/src,new=/path/b/src --out varlen_ab.json

Each tree runs in its own process (``PYTHONPATH`` set to it), the trees take turns ``--rounds``
times, and every process times the same cases: bfloat16, 16 sequences of 256-4096 tokens (a fixed
draw), D = 64 / 128, GQA 32 / 8 heads and 16 / 16, causal or not, the forward alone and the forward
with the backward, from CUDA graphs. The JSON holds each tree's best time a case and new / base.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CASES = [(d, heads, heads_kv, causal) for d in (64, 128) for heads, heads_kv in ((16, 16), (32, 8))
         for causal in (False, True)]


def _time_cases() -> dict:
    """In the child process: {case name: (forward ms, forward + backward ms)}."""
    import torch
    import triton.testing

    import qflash

    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(256, 4097, (16,), generator=gen)
    cu = torch.zeros(17, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    cu, total, longest = cu.cuda(), int(lens.sum()), int(lens.max())
    times = {}
    for d, heads, heads_kv, causal in CASES:
        q = torch.randn(total, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(total, heads_kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(total, heads_kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn(total, heads, d, device="cuda", dtype=torch.bfloat16)

        def fwd():
            return qflash.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal)

        def fwd_bwd():
            torch.autograd.grad(fwd(), (q, k, v), dout)

        name = f"D{d} H{heads}/{heads_kv} {'causal' if causal else 'full'}"
        try:
            times[name] = [triton.testing.do_bench_cudagraph(fn, rep=100) for fn in (fwd, fwd_bwd)]
        except RuntimeError:  # a capture that fails: eager timings, marked as such
            times[name + " (eager)"] = [triton.testing.do_bench(fn, rep=100) for fn in (fwd, fwd_bwd)]
    return times


def main() -> None:
    if os.environ.get("VARLEN_AB_CHILD"):
        print(json.dumps(_time_cases()))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", required=True, help="name=src_path,name=src_path (the first is the base)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    trees = dict(item.split("=", 1) for item in args.trees.split(","))
    best = {name: {} for name in trees}
    for _ in range(args.rounds):
        for name, src in trees.items():
            env = dict(os.environ, VARLEN_AB_CHILD="1", PYTHONPATH=src)
            run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, check=True)
            for case, ms in json.loads(run.stdout.strip().splitlines()[-1]).items():
                best[name][case] = [min(a, b) for a, b in zip(best[name].get(case, ms), ms)]
    from qflash.bench.harness import environment

    base, *others = trees
    ratios = {other: {case: [b / o for b, o in zip(best[base][case], best[other][case])] for case in best[base]}
              for other in others}
    result = dict(environment=environment(), trees=trees, rounds=args.rounds, columns=["forward", "forward+backward"],
                  best_ms=best, base_over_other=ratios)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for other, table in ratios.items():
        for case, (f_ratio, fb_ratio) in table.items():
            print(f"{case:24s} {base} / {other}: forward {f_ratio:.3f}, forward+backward {fb_ratio:.3f}")


if __name__ == "__main__":
    main()
