"""Attention with dropout on the GPU: qflash's forward and forward + backward at p = 0.1 beside
p = 0, beside SDPA's flash-attn 2 backend at the same p, and (``--before FILE``) beside another
copy of ``kernels/attention.py`` loaded from FILE, e.g. the previous commit's, timed in the same
process. Causal, bf16, batch x seqlen = 16k tokens, heads x headdim = 2048.

Before timing, each qflash variant's output is checked against the reference with the keep mask
that the same kernels draw (``dropout_keep_mask``) on the first batch entry.
"""

import argparse
import importlib.util
import math
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from qflash.bench.attention import sized_inputs
from qflash.bench.harness import environment, save_json
from qflash.kernels import attention as kernels
from qflash.reference import attention_ref


def load(path: str):
    spec = importlib.util.spec_from_file_location("attention_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def qflash_calls(module, q, k, v, p, seed=1234, fwd_cfg=None, bwd_cfgs=None):
    opts = module.AttnOptions(1 / math.sqrt(q.shape[-1]), window_right=0, dropout_p=p, dropout_seed=seed)
    out, lse = module.attention_forward(q, k, v, opts, config=fwd_cfg)
    dout = torch.randn_like(out)
    fwd = lambda: module.attention_forward(q, k, v, opts, config=fwd_cfg)  # noqa: E731
    both = lambda: module.attention_backward(dout, q, k, v, *fwd(), opts, configs=bwd_cfgs)  # noqa: E731
    return fwd, both, out


def tiles(text: str, head_dim: int):
    """"D:m,n,warps,stages[,tma];..." -> the (block_m, block_n, warps, stages, use_tma) tuples given
    for this head dim (tma 1 or 0, default 1)."""
    found = []
    for item in filter(None, text.split(";")):
        d, fields = item.split(":")
        if int(d) == head_dim:
            t = [int(x) for x in fields.split(",")]
            found.append((*t[:4], bool(t[4]) if len(t) > 4 else True))
    return found


def sdpa_calls(q, k, v, p):
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(qt)

    def fwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, dropout_p=p, is_causal=True)

    def both():
        torch.autograd.grad(fwd(), (qt, kt, vt), dout)

    return fwd, both


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--before", default=None, help="another kernels/attention.py to time beside this one")
    ap.add_argument("--fwd-tiles", default="", help='forward tiles to time too, "D:m,n,warps,stages;..."')
    ap.add_argument("--dkdv-tiles", default="", help="dK/dV tiles to time too (forward at its default), same form")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    before = load(args.before) if args.before else None
    rows = []
    for d in map(int, args.head_dims.split(",")):
        n = args.seqlen
        q, k, v = sized_inputs(n, d)
        b, h = q.shape[0], q.shape[2]
        variants = {}
        runs = [("qflash", kernels, args.p, None, None), ("qflash p=0", kernels, 0.0, None, None),
                ("qflash before", before, args.p, None, None)]
        dq_default, dkdv_default = kernels.default_bwd_configs(d, q.dtype, q.device)
        for t in tiles(args.fwd_tiles, d):
            runs.append((f"qflash fwd {t}", kernels, args.p, kernels.AttnFwdConfig(*t), None))
        for t in tiles(args.dkdv_tiles, d):
            dkdv = kernels.AttnBwdConfig(*t, edges_last=True)
            runs.append((f"qflash dkdv {t}", kernels, args.p, None, (dq_default, dkdv)))
        for name, module, p, fwd_cfg, bwd_cfgs in runs:
            if module is None:
                continue
            fwd, both, out = qflash_calls(module, q, k, v, p, fwd_cfg=fwd_cfg, bwd_cfgs=bwd_cfgs)
            if p > 0:  # the output of the mask these kernels draw, on the first batch entry
                mask = module.dropout_keep_mask(b, h, n, n, dropout_p=p, dropout_seed=1234, device="cuda")[:1]
                ref, _ = attention_ref(q[:1].float(), k[:1].float(), v[:1].float(), causal=True, dropout_p=p,
                                       dropout_mask=mask)
                err = float((out[:1].float() - ref).abs().max())
                assert err < 2e-2, (name, d, err)
            variants[name] = (fwd, both)
        variants[f"sdpa_flash p={args.p}"] = sdpa_calls(q, k, v, args.p)
        variants["sdpa_flash p=0"] = sdpa_calls(q, k, v, 0.0)
        flops = 4.0 * b * h * n * n * d / 2
        for name, (fwd, both) in variants.items():
            f_ms = triton.testing.do_bench(fwd, rep=100)  # (the dK/dV rows repeat the default forward)
            b_ms = triton.testing.do_bench(both, rep=100)
            rows.append(dict(provider=name, head_dim=d, seqlen=n, batch=b, heads=h, causal=True,
                             forward_ms=f_ms, forward_tflops=flops / f_ms * 1e-9,
                             fwd_bwd_ms=b_ms, fwd_bwd_tflops=3.5 * flops / b_ms * 1e-9))
            print(f"D={d} {name:22s} forward {f_ms:.3f} ms ({flops / f_ms * 1e-9:.0f} TFLOP/s), "
                  f"forward + backward {b_ms:.3f} ms ({3.5 * flops / b_ms * 1e-9:.0f})", flush=True)
    if args.out:
        save_json(args.out, dict(env=environment(), convention="causal FLOPs 2*B*H*S^2*D; forward + backward "
                                 "counted as 3.5 x the forward", rows=rows))


if __name__ == "__main__":
    main()
