"""Launch helpers of ``qflash.kernels.common``: the plain-Python grid arithmetic must agree
with Triton's own, and tensor-descriptor eligibility must follow the TMA rules."""

import torch
import triton

from qflash.kernels.common import cdiv, next_power_of_2, tma_compatible


def test_grid_arithmetic_matches_triton():
    for a in range(0, 300):
        for b in (1, 3, 16, 64, 127, 128):
            assert cdiv(a, b) == triton.cdiv(a, b)
        if a >= 1:  # (for 0 Triton gives 0, a useless block size; ours gives 1)
            assert next_power_of_2(a) == triton.next_power_of_2(a)
    assert next_power_of_2(0) == 1 and next_power_of_2(2**31 + 1) == 2**32


def test_tma_compatible():
    t = torch.zeros(64, 64, dtype=torch.float16)
    assert tma_compatible(t)
    assert not tma_compatible(t.T)  # last stride is not 1
    assert not tma_compatible(t[:, 1:])  # base not 16-byte aligned, row stride fine
    assert not tma_compatible(torch.zeros(64, 63, dtype=torch.float16))  # 126-byte rows
    assert not tma_compatible(torch.zeros(0, 64, dtype=torch.float16))
