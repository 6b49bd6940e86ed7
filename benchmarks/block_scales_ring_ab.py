"""Throwaway: block scales through the ring (this tree) against session 32's kernel (global loads), and our
per tensor, side by side from graphs; outputs compared bit for bit."""
import importlib.util, json, sys, time
import torch
sys.path.insert(0, 'benchmarks')
from qflash.bench.harness import environment, graph_ms, save_json
from qflash.kernels import matmul_gluon as new
from qflash import quantize
# .old/matmul_gluon_s32.py: git show 57bf655:src/qflash/kernels/matmul_gluon.py
spec = importlib.util.spec_from_file_location("old_mm", ".old/matmul_gluon_s32.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
from gluon_mm_variants import LLAMA, cublas, operands
ms = [int(x) for x in sys.argv[1].split(",")]
rows = []
shapes = ([("8192^3", 8192, 8192, 8192)] if 8192 in ms else []) + [(n_, m, n, k) for m in ms for n_, (n, k) in LLAMA.items()]
for name, m, n, k in shapes:
    a, b = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
    ta, tb, tak, tbk, _, _ = operands(a, b, "tensor")
    ba, bb, bak, bbk, ref, _ = operands(a, b, "block")
    out = {}
    for label, fn in [("tensor", lambda: new.launch(ta, tb, tak, tbk, None, torch.bfloat16, "tensor")),
                      ("block_new", lambda: new.launch(ba, bb, bak, bbk, None, torch.bfloat16, "block")),
                      ("block_old", lambda: old.launch(ba, bb, bak, bbk, None, torch.bfloat16, "block")),
                      ("cublas", lambda: cublas(ta, tb, tak, tbk, "tensor"))]:
        out[label] = graph_ms(fn)
    same = all(torch.equal(new.launch(ba, bb, bak, bbk, None, dt, "block"), old.launch(ba, bb, bak, bbk, None, dt, "block"))
               for dt in (torch.float32, torch.bfloat16))
    err = ((new.launch(ba, bb, bak, bbk, None, torch.float32, "block").double() - ref.double()).norm() / ref.double().norm()).item()
    r = dict(shape=name, m=m, n=n, k=k, **{f"{key}_ms": v for key, v in out.items()}, block_same_bits_as_old=same, block_rel_err=err,
             new_over_old=out["block_old"] / out["block_new"], new_vs_tensor=out["tensor"] / out["block_new"],
             old_vs_tensor=out["tensor"] / out["block_old"], tensor_vs_cublas=out["cublas"] / out["tensor"])
    rows.append(r)
    print(f"{name:12s} M={m:5d} new/old {r['new_over_old']:.3f} block/tensor new {r['new_vs_tensor']:.3f} old {r['old_vs_tensor']:.3f} "
          f"tensor x cuBLAS {r['tensor_vs_cublas']:.3f} same={same} err={err:.1e}", flush=True)
save_json(sys.argv[2], dict(env=environment(), rows=rows))
