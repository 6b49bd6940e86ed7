import math, json, sys, torch, triton
from torch.profiler import profile, ProfilerActivity
import qflash
from qflash.bench.attention import attention_flops, sized_inputs
from qflash.kernels import attention_gluon as g
from qflash.kernels.attention import AttnOptions, attention_backward, default_bwd_configs
out_path = sys.argv[1]
rows = []
torch.manual_seed(0)
# correctness against the tl dQ kernel, on forward outputs
for (b, sq, sk, h, hkv, causal, br) in [(2, 1152, 1152, 4, 2, False, True), (2, 1152, 1152, 4, 4, True, True),
                                         (2, 384, 1152, 4, 2, True, True), (1, 1152, 384, 4, 1, True, True),
                                         (1, 1152, 384, 2, 2, True, False), (1, 128, 256, 2, 2, False, True)]:
    d = 256
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
    do = torch.randn_like(q)
    scale = 1 / math.sqrt(d)
    opts = AttnOptions(scale, window_right=0 if causal else -1, bottom_right=br)
    from qflash.kernels.attention import attention_forward
    out, lse = attention_forward(q, k, v, opts)[:2]
    delta = (do.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
    dq_tl = attention_backward(do, q, k, v, out, lse, opts, configs=default_bwd_configs(d, q.dtype, q.device))[0]
    dq_g = g.launch_dq(do, q, k, v, lse, delta, scale, causal, br)
    dq_64 = None
    err = ((dq_g.float() - dq_tl.float()).abs().max() / dq_tl.float().abs().max()).item()
    again = g.launch_dq(do, q, k, v, lse, delta, scale, causal, br)
    r = dict(check=(b, sq, sk, h, hkv, causal, br), rel_err_vs_tl=err, bitwise_repeat=bool(torch.equal(dq_g, again)),
             finite=bool(torch.isfinite(dq_g).all()))
    rows.append(r); print(r, flush=True)
for n in (1024, 4096, 16384):
    for causal in (False, True):
        d = 256
        q, k, v, o, do = sized_inputs(n, d, count=5)
        b, h = q.shape[0], q.shape[2]
        lse = torch.randn(b, h, n, device="cuda") + 10
        delta = torch.randn(b, h, n, device="cuda")
        opts = AttnOptions(1 / math.sqrt(d), window_right=0 if causal else -1)
        cfg = default_bwd_configs(d, q.dtype, q.device)
        fn = lambda: attention_backward(do, q, k, v, o, lse, opts, configs=cfg)
        for _ in range(3): fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5): fn()
            torch.cuda.synchronize()
        tl_dq = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages() if "dq_kernel" in e.key) / 5 / 1000
        g_dq = triton.testing.do_bench(lambda: g.launch_dq(do, q, k, v, lse, delta, 1 / math.sqrt(d), causal, True), rep=60)
        g_dkdv = triton.testing.do_bench(lambda: g.launch_backward(do, q, k, v, lse, delta, 1 / math.sqrt(d), causal, True), rep=60)
        flops = 2.5 * attention_flops(b, h, n, n, d, causal)
        r = dict(head_dim=d, seqlen=n, causal=causal, tl_dq_ms=tl_dq, gluon_dq_ms=g_dq, gluon_dkdv_ms=g_dkdv,
                 dq_speedup=tl_dq / g_dq, split_tflops=flops / (g_dkdv + tl_dq) * 1e-9,
                 all_gluon_tflops=flops / (g_dkdv + g_dq) * 1e-9)
        rows.append(r); print({kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in r.items()}, flush=True)
json.dump(dict(rows=rows), open(out_path, "w"), indent=1)
