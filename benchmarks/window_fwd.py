"""Sliding-window forward (the tl kernel's path): the stretch order side by side, and FlexAttention.

The tl forward visits a program's key blocks in three stretches: the masked left window edge, the
unmasked interior, the masked diagonal. With a left edge it now runs the interior first
(``EDGES_LAST``): with the masked left edge first, ptxas serialized the D = 64 build's wgmma
(benchmarks/NOTES.md, fourteenth round). This times both orders (the old one by overriding the
launch's flag) and FlexAttention with the same window, causal, bf16. TFLOP/s count visible pairs.
"""

import argparse
import itertools
import math

from qflash.bench.attention import sized_inputs
from qflash.bench.harness import compiled_flex_attention, environment, save_json, time_ms
from qflash.kernels import attention as kernels


def window_pairs(n: int, left: int) -> int:
    """Visible (query, key) pairs of a causal window of ``left`` keys before the diagonal."""
    return sum(min(i, left) + 1 for i in range(n))


def qflash_forward(q, k, v, left, edges_last):
    opts = kernels.AttnOptions(1 / math.sqrt(q.shape[-1]), window_left=left, window_right=0)
    launcher = kernels._fwd_launcher

    class Override:  # the same launch with EDGES_LAST forced
        def __getitem__(self, grid):
            return lambda *a, **kw: launcher[grid](*a, **dict(kw, EDGES_LAST=edges_last))

    def run():
        kernels._fwd_launcher = Override()
        try:
            return kernels.attention_forward(q, k, v, opts)[0]
        finally:
            kernels._fwd_launcher = launcher

    return run


def flex_forward(q, k, v, left):
    from torch.nn.attention.flex_attention import create_block_mask

    n = q.shape[1]
    mask = create_block_mask(lambda b, h, i, j: (j <= i) & (i - j <= left), None, None, n, n, device=q.device)
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    compiled = compiled_flex_attention()
    return lambda: compiled(qt, kt, vt, block_mask=mask).transpose(1, 2)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--seqlens", default="4096,16384")
    p.add_argument("--windows", default="256,1024")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for d, n, left in itertools.product(*(map(int, a.split(",")) for a in (args.head_dims, args.seqlens,
                                                                            args.windows))):
        q, k, v = sized_inputs(n, d)
        b, h = q.shape[0], q.shape[2]
        variants = {"qflash": qflash_forward(q, k, v, left, True),
                    "qflash_masked_edge_first": qflash_forward(q, k, v, left, False),
                    "flex": flex_forward(q, k, v, left)}
        ref = variants["qflash"]().float()
        flops = 4.0 * b * h * d * window_pairs(n, left)
        for name, fn in variants.items():
            err = float((fn().float() - ref).abs().max())
            t = time_ms(fn, rep_ms=100)
            rows.append(dict(provider=name, head_dim=d, seqlen=n, batch=b, heads=h, window_left=left,
                             ms=t["ms"], tflops=flops / t["ms"] / 1e9, max_diff_vs_qflash=err))
            print(f"D={d} n={n} left={left} {name:26s} {t['ms']:.3f} ms {rows[-1]['tflops']:.0f} TFLOP/s "
                  f"diff {err:.1e}", flush=True)
    if args.out:
        save_json(args.out, dict(environment=environment(), rows=rows))


if __name__ == "__main__":
    main()
