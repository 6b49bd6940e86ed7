import math, json, sys, torch, triton
from torch.profiler import profile, ProfilerActivity
from qflash.bench.attention import attention_flops, sized_inputs
from qflash.kernels import attention_gluon as g
from qflash.kernels.attention import AttnOptions, attention_backward, default_bwd_configs
rows = []
for n in (1024, 4096, 16384):
    for causal in (False, True):
        d = 256
        q, k, v, o, do = sized_inputs(n, d, count=5)
        b, h = q.shape[0], q.shape[2]
        lse = torch.randn(b, h, n, device="cuda") + 10
        delta = torch.randn(b, h, n, device="cuda")
        flops = 2.5 * attention_flops(b, h, n, n, d, causal)
        opts = AttnOptions(1 / math.sqrt(d), window_right=0 if causal else -1)
        cfg = default_bwd_configs(d, q.dtype, q.device)
        fn = lambda: attention_backward(do, q, k, v, o, lse, opts, configs=cfg)
        for _ in range(3): fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5): fn()
            torch.cuda.synchronize()
        per = {}
        for e in prof.key_averages():
            if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0):
                per[e.key] = getattr(e, "self_device_time_total", 0) / 5 / 1000  # ms
        dq = sum(t for kname, t in per.items() if "dq_kernel" in kname)
        dkdv = sum(t for kname, t in per.items() if "dkdv" in kname)
        ms_nodq = triton.testing.do_bench(lambda: g.launch_backward(do, q, k, v, lse, delta, 1 / math.sqrt(d), causal, True, WITH_DQ=False), rep=60)
        ms_full = triton.testing.do_bench(lambda: g.launch_backward(do, q, k, v, lse, delta, 1 / math.sqrt(d), causal, True), rep=60)
        r = dict(head_dim=d, seqlen=n, causal=causal, tl_dq_ms=dq, tl_dkdv_ms=dkdv, gluon_no_dq_ms=ms_nodq, gluon_ms=ms_full,
                 hybrid_ms=ms_nodq + dq, kernels={kk: vv for kk, vv in per.items() if vv > 0.001})
        r["hybrid_over_gluon"] = ms_full / r["hybrid_ms"]
        rows.append(r)
        print({kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in r.items() if kk != "kernels"}, flush=True)
json.dump(dict(rows=rows), open(sys.argv[1], "w"), indent=1)
