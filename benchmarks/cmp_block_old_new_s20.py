import json, sys, torch
sys.path.insert(0, "benchmarks")
from gluon_mm_variants import shapes, operands
from qflash.bench.harness import graph_ms, environment, save_json
from qflash.kernels import matmul_gluon as new, matmul_gluon_old as old
rows = []
for name, m, n, k in shapes([1024, 8192]):
    a, b = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
    a_q, b_q, a_k, b_k, ref, peer = operands(a, b, "block")
    t_q, tb_q, t_a, t_b, _, _ = operands(a, b, "tensor")
    same = torch.equal(new.launch(a_q, b_q, a_k, b_k, None, torch.float32, "block"), old.launch(a_q, b_q, a_k, b_k, None, torch.float32, "block"))
    r = dict(shape=name, m=m, n=n, k=k, same_bits=same)
    for rep in range(2):
        for label, mod, args in (("old", old, (a_q, b_q, a_k, b_k, "block")), ("new", new, (a_q, b_q, a_k, b_k, "block")), ("tensor", new, (t_q, tb_q, t_a, t_b, "tensor"))):
            x = args
            r.setdefault(label, []).append(graph_ms(lambda: mod.launch(x[0], x[1], x[2], x[3], None, torch.bfloat16, x[4])))
    rows.append(r)
    print(name, m, same, {l: [round(v * 1e3, 1) for v in r[l]] for l in ("old", "new", "tensor")},
          "new/old %.3f" % (min(r["old"]) / min(r["new"])), "new/tensor %.3f" % (min(r["tensor"]) / min(r["new"])), flush=True)
save_json(sys.argv[1], dict(env=environment(), rows=rows))
