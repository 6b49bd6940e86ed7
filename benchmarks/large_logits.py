"""The accuracy rule at large logits: forward and gradients of ``flash_attn_func`` against float64,
beside PyTorch's attention in the same precision, as the logits grow.

q and k are one Gaussian draw (1 x 40 x 2 x 64 and 1 x 70 x 2 x 64) scaled so that the largest
|score| (q k^T / sqrt(D)) is 10, 30, ... 1e9; v and dO stay Gaussian. For each size: the max
error of out, dq, dk, dv against ``attention_ref`` in float64, PyTorch's (``attention_ref`` in the
input dtype, ``upcast=False, reorder_ops=True``, as the tests take it) and whether the flash rule
(2 x, 3 x for gradients, plus the rounding floor) holds.

    TRITON_INTERPRET=1 python3 benchmarks/large_logits.py --dtype float32 --out large_logits.json
    python3 benchmarks/large_logits.py --device cuda --out large_logits.json   (on the GPU)
"""

import argparse
import subprocess
import sys

import torch

import qflash
from qflash.bench.harness import environment, save_json
from qflash.reference.attention import attention_ref
from qflash.testing import GRADIENT_FACTOR, FORWARD_FACTOR, flash_rule

SIZES = [10, 30, 60, 100, 300, 1e3, 1e4, 1e5, 1e7, 1e9]


def measure(dtype: torch.dtype, device: str) -> list:
    gen = torch.Generator().manual_seed(0)
    q0, k0 = torch.randn(1, 40, 2, 64, generator=gen), torch.randn(1, 70, 2, 64, generator=gen)
    v, dout = torch.randn(1, 70, 2, 64, generator=gen), torch.randn(1, 40, 2, 64, generator=gen)
    v, dout = v.to(device, dtype), dout.to(device, dtype)
    largest = (torch.einsum("bqhd,bkhd->bhqk", q0, k0) / 8).abs().max().item()
    rows = []
    for size in SIZES:
        c = (size / largest) ** 0.5
        q, k = (q0 * c).to(device, dtype), (k0 * c).to(device, dtype)
        ours = _grads(lambda q, k, v: qflash.flash_attn_func(q, k, v), q, k, v, dout)
        ref = _grads(lambda q, k, v: attention_ref(q, k, v)[0], q.double(), k.double(), v.double(), dout.double())
        torch_ = _grads(lambda q, k, v: attention_ref(q, k, v, upcast=False, reorder_ops=True)[0], q, k, v, dout)
        row = {"max_abs_score": size}
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            res = flash_rule(ours[i], ref[i], torch_[i], factor=FORWARD_FACTOR if i == 0 else GRADIENT_FACTOR)
            row[name] = {"qflash_err": res.kernel_err, "torch_err": res.torch_err, "rule_ok": res.ok}
        rows.append(row)
        print(f"{size:8.0e}  " + "  ".join(f"{n} {row[n]['qflash_err']:.2g}/{row[n]['torch_err']:.2g}"
                                          f"{'' if row[n]['rule_ok'] else ' X'}" for n in ("out", "dq", "dk", "dv")))
    return rows


def _grads(fn, q, k, v, dout):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, dout))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="float32,float16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    result = {"env": environment(), "commit": commit, "command": " ".join(sys.argv), "results": {}}
    for name in args.dtypes.split(","):
        print(f"{name}: max |score|  kernel error / PyTorch's error (X: the rule fails)")
        result["results"][name] = measure(getattr(torch, name), args.device)
    save_json(args.out, result)


if __name__ == "__main__":
    main()
