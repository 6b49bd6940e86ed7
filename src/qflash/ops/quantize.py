"""Public quantization ops: ``quantize`` and ``dequantize``.

Symmetric, with one float32 scale per group; the groups:

    "tensor"   one scale                      scale shape ()
    "row"      one per row     (activations)  (M, 1)
    "column"   one per column                 (1, N)
    "block"    one per (bm x bn) block        (ceil(M / bm), ceil(N / bn)),
               e.g. (1, 128) for activations and (128, 128) for weights (DeepSeek-V3);
               with (1, bn) blocks the scales come column-major, strides (1, M rounded up to
               4): the layout in which ``fp8_matmul``'s copy engine reads them (DeepGEMM's)

Rounding: int8 rounds to nearest, ties to even (as torch.round), and saturates at +-127;
float8 rounds to nearest even and saturates at +-448 (e4m3fn) / +-57344 (e5m2) instead of overflowing.
An all-zero group gets scale 1, and so does a group of no values (x with no rows or no columns).
No scale is below 2^-126 (float32's smallest normal): a group of values under QMAX * 2^-126
(about 1.5e-36 for int8) gets that scale, so that its inverse stays finite, and quantizes with
fewer significant bits, as subnormals do.
A group holding NaN or inf gets scale NaN (its int8 values are 0, its float8 values NaN), so the
problem survives dequantization.

Static per-tensor scales: ``quantize(x, dtype, "tensor", scale=s)`` takes a scale fixed
beforehand (calibration, a delayed-scaling history) and skips the absmax pass, so the input is
read once. Values beyond ``QMAX * s`` saturate; NaN values become 0 (int8) or NaN (float8).
A dynamic per-tensor scale needs the absmax of the whole tensor first. A contiguous input of
8192 values an SM up to twice what the SMs hold in registers (2.2-34.6 MB of 16-bit values on an
H200) takes one cooperative launch that reads the part it holds once; other inputs take two
launches that read it twice. A GPU that refuses the cooperative launch (it cannot keep all the
programs resident, as under MPS) gets a RuntimeWarning and two launches from then on.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

from qflash.ops.common import debug_enabled, on_device_of, require_runnable, require_tensor, through_custom_op
from qflash.reference.quantize import GRANULARITIES, QMAX, SCALE_MIN, expand_scale, scale_shape

__all__ = ["quantize", "dequantize"]

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what quantize (and QuantizedLinear) take


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
             block_size: Optional[Sequence[int]] = None, *,
             scale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D float tensor in one fused pass per group (absmax, scale, round, cast).

    Args:
        x: (M, N) float16 / bfloat16 / float32, any strides.
        dtype: torch.int8, torch.float8_e4m3fn or torch.float8_e5m2.
        granularity: "tensor", "row", "column" or "block" (see the module docstring).
        block_size: (bm, bn) powers of two, only with granularity "block".
        scale: a static per-tensor scale (one-element float tensor on x's device), only with
            granularity "tensor": no absmax is taken, ``x_q = saturate(round(x / scale))``.
            It must be positive, finite and at least 2^-126 (a normal float32, whose inverse
            is finite); ``qflash.set_debug(True)`` checks the value (a host sync), otherwise a
            bad one (0, negative, inf, NaN, under 2^-126) makes every value NaN (float8) or 0
            (int8).

    Returns:
        (x_q, scale): x_q (M, N) in ``dtype``; scale float32 shaped as listed above,
        so that ``x ~ x_q * scale`` (broadcast; blocks via ``dequantize``).
    """
    require_tensor("x", x, 2, "(M, N)")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if dtype not in QMAX:
        raise TypeError(f"dtype must be torch.int8, torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if (granularity == "block") != (block_size is not None):
        raise ValueError("block_size is required with granularity='block' and only then")
    if scale is not None:
        scale = _check_static_scale(scale, granularity, x.device)
    require_runnable("x", x)
    return launch_quantize(x, dtype, granularity, _check_block(block_size) if block_size is not None else None, scale)


# ----------------------------------------------------------------------------------------------
# Launch paths, as for attention (ops/attention.py): eager calls go straight to the launcher;
# under torch.compile the graph records the custom op qflash::quantize, whose fake implementation
# gives the outputs' shapes and strides (the op's dispatch costs tens of microseconds, as much as a
# short kernel, so eager calls skip it).
# ----------------------------------------------------------------------------------------------
def _quantize_impl(x: torch.Tensor, dtype: torch.dtype, granularity: str, block_size: Optional[List[int]],
                   scale: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    from qflash.kernels.quantize import quantize as launch

    with on_device_of(x):
        return launch(x, dtype, granularity, None if block_size is None else tuple(block_size), static_scale=scale)


_quantize_op = torch.library.custom_op("qflash::quantize", mutates_args=())(_quantize_impl)


@_quantize_op.register_fake
def _(x, dtype, granularity, block_size, scale):
    from qflash.kernels.quantize import new_outputs

    x_q, x_scale = new_outputs(*x.shape, dtype, granularity, block_size, x.device)
    return x_q, x_scale.reshape(()) if granularity == "tensor" else x_scale


def launch_quantize(x: torch.Tensor, dtype: torch.dtype, granularity: str, block_size: Optional[Tuple[int, int]],
                    scale: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The quantize of validated arguments (also ``QuantizedLinear``'s): the custom op under
    torch.compile and on meta tensors (its fake implementation: shapes only), else the launcher."""
    if through_custom_op(x):
        return torch.ops.qflash.quantize(x, dtype, granularity, None if block_size is None else list(block_size),
                                         scale)
    return _quantize_impl(x, dtype, granularity, block_size, scale)


def _check_static_scale(scale, granularity: str, device) -> torch.Tensor:
    if granularity != "tensor":
        raise ValueError(f"a static scale is per tensor: pass granularity='tensor', got {granularity!r}")
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point() or scale.numel() != 1:
        raise TypeError(f"scale must be a one-element floating-point tensor, got "
                        f"{tuple(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__}"
                        f"{' ' + str(scale.dtype) if isinstance(scale, torch.Tensor) else ''}")
    if scale.device != device:
        raise ValueError(f"scale is on {scale.device}, expected x's device {device}")
    if debug_enabled() and not torch.compiler.is_compiling() and not scale.is_meta:  # a host sync: on request
        value = float(scale.to(torch.float32))  # (as the kernel reads it)
        if not (math.isfinite(value) and value >= SCALE_MIN):
            raise ValueError(f"scale must be positive and finite, and a normal float32 (at least 2**-126), got "
                             f"{float(scale)}")
    return scale.reshape(1).to(torch.float32)


def dequantize(x_q: torch.Tensor, scale: torch.Tensor, granularity: str = "row",
               block_size: Optional[Sequence[int]] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x_q * scale`` with the scale expanded to its groups (in float32); returns ``dtype``, a
    floating-point one."""
    require_tensor("x_q", x_q, 2, "(M, N)")
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"scale must be a torch.Tensor (as quantize returns it), got {type(scale).__name__}")
    if scale.device != x_q.device:
        raise ValueError(f"scale is on {scale.device} but x_q is on {x_q.device}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point dtype (the dequantized values), got {dtype}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if (granularity == "block") != (block_size is not None):
        raise ValueError("block_size is required with granularity='block' and only then")
    bs = _check_block(block_size) if granularity == "block" else None
    m, n = x_q.shape
    expected = [(), (1,), (1, 1)] if granularity == "tensor" else [scale_shape(m, n, granularity, bs)]
    if tuple(scale.shape) not in expected:
        raise ValueError(f"scale of shape {tuple(scale.shape)} does not fit granularity {granularity!r} "
                         f"for x_q of shape {(m, n)}: expected {expected[0]}")
    s = scale.reshape(()) if granularity == "tensor" else scale
    return (x_q.to(torch.float32) * expand_scale(s.float(), (m, n), granularity, bs)).to(dtype)
