"""Block scales by the copy engine (this tree) against the kernel before it (scales loaded by the
consumers, ``.old/matmul_gluon_head.py``: a copy of the last commit's module), and our per tensor,
side by side from CUDA graphs; outputs compared bit for bit. A/B script of one experiment.

    python3 benchmarks/block_scales_tma_ab.py 8192,1024 out.json [column-major A scales: 1]
"""
import importlib.util
import sys

import torch

sys.path.insert(0, "benchmarks")
from gluon_mm_variants import cublas, operands  # noqa: E402

from qflash.bench.harness import environment, graph_ms, save_json  # noqa: E402
from qflash.bench.matmul import llama_shapes  # noqa: E402
from qflash.kernels import matmul_gluon as new  # noqa: E402

spec = importlib.util.spec_from_file_location("old_mm", ".old/matmul_gluon_head.py")
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)


def main():
    ms = [int(x) for x in sys.argv[1].split(",")]
    columns = len(sys.argv) > 3 and sys.argv[3] == "1"  # A's scales made column-major (and aligned) once, outside
    rows = []
    for name, m, n, k in llama_shapes(ms, cube=8192 in ms):
        a, b = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
        ta, tb, tak, tbk, _, _ = operands(a, b, "tensor")
        ba, bb, bak, bbk, ref, _ = operands(a, b, "block")
        bak_new = new._scales_for_copies(bak) if columns else bak
        out = {}
        runs = [("tensor", lambda: new.launch(ta, tb, tak, tbk, None, torch.bfloat16, "tensor")),
                ("block_new", lambda: new.launch(ba, bb, bak_new, bbk, None, torch.bfloat16, "block")),
                ("block_new_g4", lambda: new.launch(ba, bb, bak_new, bbk, None, torch.bfloat16, "block", k_group=4)),
                ("block_old", lambda: old.launch(ba, bb, bak, bbk, None, torch.bfloat16, "block")),
                ("cublas", lambda: cublas(ta, tb, tak, tbk, "tensor"))]
        for label, fn in runs:
            out[label] = graph_ms(fn)
        same = all(torch.equal(new.launch(ba, bb, bak_new, bbk, None, dt, "block"),
                               old.launch(ba, bb, bak, bbk, None, dt, "block"))
                   for dt in (torch.float32, torch.bfloat16))
        got = new.launch(ba, bb, bak_new, bbk, None, torch.float32, "block").double()
        err = ((got - ref.double()).norm() / ref.double().norm()).item()
        r = dict(shape=name, m=m, n=n, k=k, a_scales_column_major=columns,
                 **{f"{key}_ms": v for key, v in out.items()}, block_same_bits_as_old=same, block_rel_err=err,
                 new_over_old=out["block_old"] / out["block_new"], g4_over_old=out["block_old"] / out["block_new_g4"],
                 new_vs_tensor=out["tensor"] / out["block_new"], g4_vs_tensor=out["tensor"] / out["block_new_g4"],
                 old_vs_tensor=out["tensor"] / out["block_old"], tensor_vs_cublas=out["cublas"] / out["tensor"])
        rows.append(r)
        print(f"{name:12s} M={m:5d} new/old {r['new_over_old']:.3f} g4/old {r['g4_over_old']:.3f} | block/tensor "
              f"new {r['new_vs_tensor']:.3f} g4 {r['g4_vs_tensor']:.3f} old {r['old_vs_tensor']:.3f} | tensor x "
              f"cuBLAS {r['tensor_vs_cublas']:.3f} same={same} err={err:.1e}", flush=True)
    save_json(sys.argv[2], dict(env=environment(), rows=rows))


if __name__ == "__main__":
    main()
