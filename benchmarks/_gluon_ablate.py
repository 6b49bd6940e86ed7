import itertools, math, sys
import torch, triton
from qflash.bench.attention import attention_flops
from qflash.bench.harness import environment, save_json
from qflash.kernels import attention_gluon as g
from qflash.kernels.attention import AttnOptions, attention_backward, default_bwd_configs
rows = []
for d, n, causal in itertools.product((128, 64), (1024, 4096, 16384), (False, True)):
    b, h = 16384 // n, 2048 // d
    q, k, v, o, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(5))
    lse = torch.randn(b, h, n, device="cuda") + 10
    delta = torch.randn(b, h, n, device="cuda")
    flops = 2.5 * attention_flops(b, h, n, n, d, causal)
    variants = {"late0": dict(LATE_DQ=False), "late1": dict(LATE_DQ=True), "tma": dict(LATE_DQ=True, DQ_TMA=True),
                "tma_3stages": dict(LATE_DQ=True, DQ_TMA=True, STAGES=3) if d == 64 else None}
    ref = g.launch_backward(do, q, k, v, lse, delta, 1 / math.sqrt(d), causal, True, LATE_DQ=True)
    for name, var in variants.items():
        if var is None:
            continue
        fn = lambda: g.launch_backward(do, q, k, v, lse, delta, 1 / math.sqrt(d), causal, True, **var)
        got = fn()
        err = max(float((x.float() - y.float()).abs().max() / y.float().abs().max()) for x, y in zip(got, ref))
        ms = triton.testing.do_bench(fn, rep=60)
        rows.append(dict(head_dim=d, seqlen=n, causal=causal, variant=name, ms=ms, tflops=flops / ms * 1e-9, err=err))
        print(rows[-1], flush=True)
    opts = AttnOptions(1 / math.sqrt(d), window_right=0 if causal else -1)
    cfgs = default_bwd_configs(d, q.dtype, q.device)
    ms = triton.testing.do_bench(lambda: attention_backward(do, q, k, v, o, lse, opts, configs=cfgs), rep=60)
    rows.append(dict(head_dim=d, seqlen=n, causal=causal, variant="tl backward", ms=ms, tflops=flops / ms * 1e-9))
    print(rows[-1], flush=True)
save_json(sys.argv[1], dict(env=environment(), rows=rows))
