"""Public quantization ops: ``quantize`` and ``dequantize``.

Symmetric, with one float32 scale per group; the groups:

    "tensor"   one scale                      scale shape ()
    "row"      one per row     (activations)  (M, 1)
    "column"   one per column                 (1, N)
    "block"    one per (bm x bn) block        (ceil(M / bm), ceil(N / bn)),
               e.g. (1, 128) for activations and (128, 128) for weights (DeepSeek-V3)

Rounding: int8 rounds to nearest, ties to even (as torch.round), and saturates at +-127;
float8 rounds to nearest even and saturates at +-448 (e4m3fn) / +-57344 (e5m2) instead of overflowing.
An all-zero group gets scale 1. A group holding NaN or inf gets scale NaN (its int8
values are 0, its float8 values NaN), so the problem survives dequantization.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from qflash.ops.common import require_runnable, require_tensor
from qflash.reference.quantize import GRANULARITIES, QMAX, expand_scale

__all__ = ["quantize", "dequantize"]

_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_block(block_size) -> Tuple[int, int]:
    try:
        bm, bn = (int(b) for b in block_size)
    except (TypeError, ValueError):
        raise ValueError(f"block_size must be a pair of ints (rows, cols), got {block_size!r}") from None
    for b in (bm, bn):
        if b < 1 or b > 256 or b & (b - 1):
            raise ValueError(f"block_size entries must be powers of two from 1 to 256, got {block_size!r}")
    return bm, bn


def quantize(x: torch.Tensor, dtype: torch.dtype = torch.int8, granularity: str = "row",
             block_size: Optional[Sequence[int]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D float tensor in one fused pass per group (absmax, scale, round, cast).

    Args:
        x: (M, N) float16 / bfloat16 / float32, any strides.
        dtype: torch.int8, torch.float8_e4m3fn or torch.float8_e5m2.
        granularity: "tensor", "row", "column" or "block" (see the module docstring).
        block_size: (bm, bn) powers of two, only with granularity "block".

    Returns:
        (x_q, scale): x_q (M, N) in ``dtype``; scale float32 shaped as listed above,
        so that ``x ~ x_q * scale`` (broadcast; blocks via ``dequantize``).
    """
    require_tensor("x", x, 2, "(M, N)")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if dtype not in QMAX:
        raise TypeError(f"dtype must be torch.int8, torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if (granularity == "block") != (block_size is not None):
        raise ValueError("block_size is required with granularity='block' and only then")
    require_runnable("x", x)
    from qflash.kernels.quantize import quantize as launch

    return launch(x, dtype, granularity, _check_block(block_size) if block_size is not None else None)


def dequantize(x_q: torch.Tensor, scale: torch.Tensor, granularity: str = "row",
               block_size: Optional[Sequence[int]] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x_q * scale`` with the scale expanded to its groups; returns ``dtype``."""
    require_tensor("x_q", x_q, 2, "(M, N)")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    bs = _check_block(block_size) if granularity == "block" else None
    m, n = x_q.shape
    expected = {"tensor": [(), (1,), (1, 1)], "row": [(m, 1)], "column": [(1, n)],
                "block": [(-(-m // bs[0]), -(-n // bs[1]))] if bs else []}[granularity]
    if tuple(scale.shape) not in expected:
        raise ValueError(f"scale of shape {tuple(scale.shape)} does not fit granularity {granularity!r} "
                         f"for x_q of shape {(m, n)}: expected {expected[0] if expected else '?'}")
    s = scale.reshape(()) if granularity == "tensor" else scale
    return (x_q.to(torch.float32) * expand_scale(s.float(), (m, n), granularity, bs)).to(dtype)
