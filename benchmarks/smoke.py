"""A first look on a new GPU: one call per load path and dtype, error against fp64."""

import torch

import qflash
from qflash.kernels.attention import AttnFwdConfig, AttnOptions, attention_forward
from qflash.reference import attention_ref

for dtype in (torch.float16, torch.bfloat16):
    for use_tma in (False, True):
        for causal in (False, True):
            q, k, v = (torch.randn(2, 1000, 4, 80, device="cuda", dtype=dtype) for _ in range(3))
            cfg = AttnFwdConfig(128, 64, 8, 3, use_tma=use_tma)
            opts = AttnOptions(80**-0.5, window_right=0 if causal else -1)
            out, lse = attention_forward(q, k, v, opts, config=cfg)
            ref, _ = attention_ref(q.double(), k.double(), v.double(), causal=causal)
            pt, _ = attention_ref(q, k, v, causal=causal, upcast=False)
            print(f"{dtype} tma={use_tma} causal={causal}: err {float((out.double() - ref).abs().max()):.2e} "
                  f"torch err {float((pt.double() - ref).abs().max()):.2e}")
print(qflash.flash_attn_func(q, k, v).shape)
