"""Pure-PyTorch symmetric quantization: what the quantize kernel must produce.

A group of values (the whole tensor, a row, a column or a 2-D block) shares one
scale ``absmax(group) / QMAX`` with QMAX = 127 (int8), 448 (float8_e4m3fn) or
57344 (float8_e5m2). ``x_q = saturate(round(x * (QMAX / absmax)))`` (a multiply per
element by the group's inverse scale, as fast kernels do) and ``x ~ x_q * scale``.

- int8 rounds to nearest, ties to even (as torch.round and the hardware conversion), within
  [-127, 127] (symmetric: -128 unused).
- float8 rounds to nearest even (the hardware conversion) after saturating to +-QMAX,
  so values past the format's range never become inf or NaN.
- An all-zero group gets scale 1 (its values quantize to 0, exactly).
- Scales are never below SCALE_MIN = 2^-126, float32's smallest normal: a group of values so
  small (0 < absmax < QMAX * 2^-126, about 1.5e-36 for int8) that absmax / QMAX would be a
  subnormal gets SCALE_MIN and the inverse 2^126 (QMAX / absmax would overflow to inf from
  about QMAX * 2^-128 down, making every value +-QMAX and zeros NaN). Its values quantize to
  x * 2^126, under QMAX: fewer significant bits, as subnormals have, an error under 2^-126.
- A group holding NaN or +-inf gets scale NaN, so dequantizing it gives NaN: a
  non-finite input stays visible instead of being silently clipped.

Scales are float32, shaped to broadcast against the input after expansion:
tensor () ; row (M, 1) ; column (1, N) ; block (ceil(M/bm), ceil(N/bn)).

Static per-tensor scale (``scale`` given, e.g. from calibration): no absmax is taken;
``x_q = saturate(round(x * (1 / scale)))`` with the same rounding and saturation, and the
given scale is returned. NaN inputs give 0 (int8) or NaN (float8), +-inf saturates. A scale
that is not positive, finite and normal (0, negative, inf, NaN, under SCALE_MIN: its inverse
could overflow) makes every value 0 (int8) or NaN (float8), as a non-finite group does.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
SCALE_MIN = 2.0**-126  # float32's smallest normal: the least scale, whose inverse 2^126 is finite
GRANULARITIES = ("tensor", "row", "column", "block")

__all__ = ["QMAX", "SCALE_MIN", "GRANULARITIES", "quantize_ref", "dequantize_ref", "expand_scale", "scale_shape"]


def scale_shape(m: int, n: int, granularity: str, block_size: Optional[Sequence[int]] = None) -> Tuple[int, ...]:
    """The scale's shape for an (m, n) input: tensor () ; row (m, 1) ; column (1, n) ; block
    (ceil(m/bm), ceil(n/bn))."""
    shape = {"tensor": (), "row": (m, 1), "column": (1, n)}.get(granularity)
    return shape if shape is not None else (math.ceil(m / block_size[0]), math.ceil(n / block_size[1]))


def expand_scale(scale: torch.Tensor, shape: Sequence[int], granularity: str,
                 block_size: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The per-element scale of a 2-D tensor of ``shape``."""
    m, n = shape
    if granularity == "block":
        bm, bn = block_size
        return scale.repeat_interleave(bm, 0)[:m].repeat_interleave(bn, 1)[:, :n]
    return scale.expand(m, n) if scale.dim() else scale.reshape(1, 1).expand(m, n)


def _group_absmax(x: torch.Tensor, granularity: str, block_size) -> torch.Tensor:
    a = x.abs()
    m, n = x.shape
    if x.numel() == 0:  # no values: every group takes an all-zero group's absmax (so scale 1)
        return a.new_zeros(scale_shape(m, n, granularity, block_size))
    if granularity == "tensor":
        return a.amax()
    if granularity == "row":
        return a.amax(dim=1, keepdim=True)
    if granularity == "column":
        return a.amax(dim=0, keepdim=True)
    bm, bn = block_size
    pad = torch.zeros(math.ceil(m / bm) * bm, math.ceil(n / bn) * bn, dtype=a.dtype, device=a.device)
    pad[:m, :n] = a
    return pad.view(pad.shape[0] // bm, bm, pad.shape[1] // bn, bn).amax(dim=(1, 3))


def quantize_ref(x: torch.Tensor, dtype: torch.dtype, granularity: str = "row",
                 block_size: Optional[Sequence[int]] = None,
                 scale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantization of a 2-D tensor; returns (x_q, scale) as described above."""
    x = x.detach().to(torch.float32)
    qmax = QMAX[dtype]
    if scale is not None:  # static, per tensor: one IEEE reciprocal, then the same rounding
        scale = scale.detach().to(device=x.device, dtype=torch.float32).reshape(())
        valid = (scale >= SCALE_MIN) & torch.isfinite(scale)
        inv = torch.where(valid, torch.ones_like(scale) / scale, torch.full_like(scale, math.nan))
        return _round_saturate(x * inv, dtype, qmax), scale.clone()
    amax = _group_absmax(x, granularity, block_size)
    # Tensor / tensor divisions: IEEE on every device (PyTorch's CUDA division by a Python
    # number multiplies by its reciprocal instead, which can differ in the last bit).
    qmax_t = torch.full_like(amax, qmax)
    scale = amax / qmax_t
    normal = scale >= SCALE_MIN  # (not for an all-zero group: scale 1)
    ones = torch.ones_like(amax)
    inv = torch.where(normal, qmax_t / torch.where(normal, amax, ones),
                      torch.where(amax > 0, torch.full_like(amax, 1 / SCALE_MIN), ones))
    scale = torch.where(normal, scale, torch.where(amax > 0, torch.full_like(amax, SCALE_MIN), ones))
    bad = _group_absmax(torch.where(torch.isfinite(x), torch.zeros_like(x), torch.ones_like(x)), granularity,
                        block_size) > 0
    scale = torch.where(bad, torch.full_like(scale, math.nan), scale)
    inv = torch.where(bad, torch.full_like(inv, math.nan), inv)
    return _round_saturate(x * expand_scale(inv, x.shape, granularity, block_size), dtype, qmax), \
        scale.to(torch.float32)


def _round_saturate(y: torch.Tensor, dtype: torch.dtype, qmax: float) -> torch.Tensor:
    y = y.clamp(-qmax, qmax)  # NaN stays NaN
    if dtype == torch.int8:
        y = torch.where(torch.isnan(y), torch.zeros_like(y), y)
        return torch.round(y).to(torch.int8)  # ties to even
    return y.to(dtype)


def dequantize_ref(x_q: torch.Tensor, scale: torch.Tensor, granularity: str = "row",
                   block_size: Optional[Sequence[int]] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (x_q.to(torch.float32) * expand_scale(scale.float(), x_q.shape, granularity, block_size)).to(dtype)
