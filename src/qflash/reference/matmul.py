"""Pure-PyTorch scaled INT8 / FP8 matrix products: what the matmul kernels must produce.

``int8_matmul_ref`` is exact up to its float32 epilogue, applied in the kernel's order
(int32 product, times A's scale, times B's scale, plus bias, then the cast), so the
kernel must match it bit for bit. ``fp8_matmul_ref`` multiplies the dequantized inputs
in float64: the kernel must match it to float32 rounding in Triton's interpreter, and on Hopper
as closely as cuBLAS does (its tensor cores keep about 14 bits of an FP8 sum inside each
128-wide K block).
"""

from __future__ import annotations

from typing import Optional

import torch

from qflash.reference.quantize import expand_scale

QBLOCK = 128

__all__ = ["int8_matmul_ref", "fp8_matmul_ref", "dequantize_operand"]


def int8_matmul_ref(a_q, b_q, a_scale, b_scale, bias: Optional[torch.Tensor] = None, out_dtype=torch.bfloat16):
    # Exact in float64 on any device (CUDA has no int64 matmul): every partial sum is an
    # integer below K * 127^2, far under 2^53.
    acc = a_q.to(torch.float64) @ b_q.to(torch.float64).T
    assert float(acc.abs().max()) < 2**31 if acc.numel() else True, "int32 accumulation would overflow"
    out = acc.to(torch.float32)
    if a_scale.numel() == 1 and b_scale.numel() == 1:
        out = out * (a_scale.reshape(()).float() * b_scale.reshape(()).float())
    else:
        out = out * a_scale.float().reshape(-1, 1).expand(out.shape[0], 1) * b_scale.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def dequantize_operand(x_q: torch.Tensor, scale: torch.Tensor, *, block_rows: int) -> torch.Tensor:
    """float64 values of an operand: scale of numel 1, one per row, or (rows/block_rows, K/128) blocks."""
    m, k = x_q.shape
    s = scale.double()
    if s.numel() == 1:
        full = s.reshape(1, 1).expand(m, k)
    elif s.numel() == m:
        full = s.reshape(m, 1).expand(m, k)
    else:
        full = expand_scale(s, (m, k), "block", (block_rows, QBLOCK))
    return x_q.double() * full


def fp8_matmul_ref(a_q, b_q, a_scale, b_scale, bias: Optional[torch.Tensor] = None, out_dtype=torch.bfloat16):
    a = dequantize_operand(a_q, a_scale, block_rows=1)
    b = dequantize_operand(b_q, b_scale, block_rows=QBLOCK)
    out = a @ b.T
    if bias is not None:
        out = out + bias.double()
    return out.to(out_dtype)
