"""Backward at head dim 256 with ``deterministic=True`` on the H200: the Gluon dK / dV and dQ
kernels (which sum in a fixed order) against the tl kernels (``QFLASH_GLUON=0``, what such calls
ran before session 20), and the default call, side by side in one run; bf16, 16 heads, 16k tokens
a batch, with and without the causal mask. Times the backward alone (``torch.autograd.grad`` on
a kept graph), median of ``triton.testing.do_bench``.

    python3 benchmarks/bwd_deterministic_d256.py out.json
"""

import os
import sys

import torch
import triton

import qflash
from qflash.bench.harness import environment, save_json

HEADS, HEAD_DIM, TOKENS = 16, 256, 16384
# label -> (QFLASH_GLUON, deterministic)
RUNS = {"deterministic_gluon": ("1", True), "deterministic_tl": ("0", True), "default": ("1", False)}


def backward_ms(seqlen: int, causal: bool) -> dict:
    shape = (TOKENS // seqlen, seqlen, HEADS, HEAD_DIM)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    row = dict(seqlen=seqlen, batch=shape[0], heads=HEADS, head_dim=HEAD_DIM, causal=causal)
    try:
        for label, (gluon, deterministic) in RUNS.items():
            os.environ["QFLASH_GLUON"] = gluon  # read on every call, the backward's included
            out = qflash.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
            row[f"{label}_ms"] = triton.testing.do_bench(
                lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), return_mode="median")
    finally:
        os.environ["QFLASH_GLUON"] = "1"
    row["gluon_over_tl"] = row["deterministic_tl_ms"] / row["deterministic_gluon_ms"]
    return row


def main():
    rows = []
    for causal in (False, True):
        for seqlen in (1024, 4096):
            rows.append(backward_ms(seqlen, causal))
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
    if len(sys.argv) > 1:
        save_json(sys.argv[1], dict(env=environment(), rows=rows))


if __name__ == "__main__":
    main()
