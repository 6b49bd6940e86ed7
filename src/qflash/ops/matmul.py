"""Public scaled matmuls: ``int8_matmul`` and ``fp8_matmul``.

``C = (a_q * a_scale) @ (b_q * b_scale).T + bias`` with A (M, K) activations and B
(N, K) in ``nn.Linear`` weight layout, output in ``out_dtype``. No alignment is
required (edges are masked); K a multiple of 128 and M, N multiples of 128 give
full tiles.

Scales (float32):
    per tensor   a_scale and b_scale with one element each
    per row      a_scale (M,) or (M, 1), b_scale (N,) or (N, 1) (one may be per tensor)
    block (fp8)  a_scale (M, ceil(K/128)) for 1 x 128 groups and
                 b_scale (ceil(N/128), ceil(K/128)) for 128 x 128 groups, any strides;
                 on Hopper the kernel reads a_scale fastest column-major with each column
                 16-byte aligned, as ``quantize(..., "block", (1, 128))`` returns it (other
                 layouts cost a copy of a_scale each call)

Bias: (N,) in any floating dtype, added in float32 before the cast to ``out_dtype``; one with a
stride other than 1 is copied.

Early launch (Hopper, opt in): with ``qflash.kernels.common.PDL = True`` products of up to 128
rows (the Gluon FP8 kernel where its grid fills the SMs, and the ``tl`` kernel's), and
``quantize``'s one-pass kernel, are programmatic dependent launches: each may start while the
kernel ahead of it still runs and waits for it before touching memory. That gains where the kernel
ahead is one of these (products back to back, a quantize then its product) and can lose after
other kernels (benchmarks/NOTES.md, the thirty-fifth and thirty-sixth rounds).
"""

from __future__ import annotations

from typing import Optional

import torch

from qflash.ops.common import on_device_of, require_runnable, require_tensor, through_custom_op

__all__ = ["int8_matmul", "fp8_matmul", "INT8_MAX_K"]

# The longest K whose int32 sums cannot overflow: |a b| <= 128 * 128 a product, (2^31 - 1) // 2^14.
INT8_MAX_K = (2**31 - 1) // (128 * 128)
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _shape(scale) -> Optional[tuple]:
    return tuple(scale.shape) if isinstance(scale, torch.Tensor) else None


def _check_operands(a_q, b_q, dtypes, bias, out_dtype) -> Optional[torch.Tensor]:
    """Check the operands; return the bias as the kernels read it."""
    require_tensor("a_q", a_q, 2, "(M, K)")
    require_tensor("b_q", b_q, 2, "(N, K), nn.Linear's weight layout")
    for name, t in (("a_q", a_q), ("b_q", b_q)):
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if a_q.dtype != b_q.dtype:
        raise TypeError(f"a_q is {a_q.dtype} but b_q is {b_q.dtype}: they must match")
    if a_q.shape[1] != b_q.shape[1]:
        raise ValueError(f"a_q (M, K) = {tuple(a_q.shape)} and b_q (N, K) = {tuple(b_q.shape)} disagree on K")
    if b_q.device != a_q.device:
        raise ValueError(f"b_q is on {b_q.device} but a_q is on {a_q.device}")
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (b_q.shape[0],):
            raise ValueError(f"bias must be a tensor of shape ({b_q.shape[0]},), got {getattr(bias, 'shape', bias)}")
        if not bias.is_floating_point():
            raise TypeError(f"bias must be a floating-point tensor, got {bias.dtype}")
        if bias.device != a_q.device:
            raise ValueError(f"bias is on {bias.device}, expected {a_q.device}")
    require_runnable("a_q", a_q)
    # The kernels read the bias as one contiguous row (any floating dtype, added in float32)
    return None if bias is None else bias.contiguous()


def _check_float_on(name: str, scale, device) -> None:
    """A scale of any kind: a floating-point tensor on the operands' device."""
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point():
        got = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(f"{name} must be a floating-point tensor, got {got}")
    if scale.device != device:
        raise ValueError(f"{name} is on {scale.device}, expected {device}")


def _scale(name: str, scale, rows: int, device) -> torch.Tensor:
    """A per-tensor (one element) or per-row ((rows,) or (rows, 1)) scale as float32. The kernels
    read any of these layouts through its strides (``matmul_epilogue.scale_strides``), so a float32
    scale goes on as it is: no copy, no reshape on every call."""
    _check_float_on(name, scale, device)
    if scale.numel() != 1 and tuple(scale.shape) not in ((rows,), (rows, 1)):
        raise ValueError(f"{name} must have one element (per tensor) or shape ({rows},) / ({rows}, 1) "
                         f"(per row), got {tuple(scale.shape)}")
    return scale if scale.dtype == torch.float32 else scale.float()


# ----------------------------------------------------------------------------------------------
# Launch paths, as for attention (ops/attention.py): eager calls go straight to the launcher;
# under torch.compile the graph records the custom op qflash::scaled_matmul, whose fake
# implementation gives the output's shape (the op's dispatch costs tens of microseconds, as much as
# a short product, so eager calls skip it).
# ----------------------------------------------------------------------------------------------
def _scaled_matmul_impl(a_q: torch.Tensor, b_q: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                        bias: Optional[torch.Tensor], out_dtype: torch.dtype, scales: str) -> torch.Tensor:
    from qflash.kernels.matmul import scaled_matmul

    with on_device_of(a_q):
        return scaled_matmul(a_q, b_q, a_scale, b_scale, bias, out_dtype, scales)


_scaled_matmul_op = torch.library.custom_op("qflash::scaled_matmul", mutates_args=())(_scaled_matmul_impl)


@_scaled_matmul_op.register_fake
def _(a_q, b_q, a_scale, b_scale, bias, out_dtype, scales):
    return a_q.new_empty((a_q.shape[0], b_q.shape[0]), dtype=out_dtype)  # C (M, N), contiguous


def launch_scaled_matmul(a_q: torch.Tensor, b_q: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                         bias: Optional[torch.Tensor], out_dtype: torch.dtype, scales: str) -> torch.Tensor:
    """The product of validated operands (also ``QuantizedLinear``'s): the custom op under
    torch.compile and on meta tensors (its fake implementation: shapes only), else the launcher.
    ``scales``: "tensor", "row" or "block"."""
    if through_custom_op(a_q):
        return torch.ops.qflash.scaled_matmul(a_q, b_q, a_scale, b_scale, bias, out_dtype, scales)
    return _scaled_matmul_impl(a_q, b_q, a_scale, b_scale, bias, out_dtype, scales)


def _tensor_or_row(a_q, b_q, a_scale, b_scale, bias, out_dtype) -> torch.Tensor:
    """The product with per-tensor scales (both one element) or per-row ones (either per row)."""
    a_s = _scale("a_scale", a_scale, a_q.shape[0], a_q.device)
    b_s = _scale("b_scale", b_scale, b_q.shape[0], a_q.device)
    return launch_scaled_matmul(a_q, b_q, a_s, b_s, bias, out_dtype,
                                "tensor" if a_s.numel() == b_s.numel() == 1 else "row")


def int8_matmul(a_q: torch.Tensor, b_q: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """s8 x s8 with exact int32 accumulation; scales and bias applied once, in the epilogue.

    Per-tensor or per-row scales (see the module docstring). Returns (M, N) ``out_dtype``.
    K is at most ``INT8_MAX_K`` = 131071, where the int32 sums cannot overflow whatever the values.
    """
    bias = _check_operands(a_q, b_q, (torch.int8,), bias, out_dtype)
    if a_q.shape[1] > INT8_MAX_K:
        raise ValueError(f"int8_matmul: K = {a_q.shape[1]} is over {INT8_MAX_K}, beyond which the exact int32 sums "
                         f"could overflow; take fp8_matmul (float32 sums) for such K")
    return _tensor_or_row(a_q, b_q, a_scale, b_scale, bias, out_dtype)


def fp8_matmul(a_q: torch.Tensor, b_q: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
               bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP8 (e4m3fn or e5m2) product, promoted to float32 every 128-wide K block.

    Per-tensor, per-row or block scales (1 x 128 for A, 128 x 128 for B); see the
    module docstring. Returns (M, N) ``out_dtype``.
    """
    bias = _check_operands(a_q, b_q, _FP8, bias, out_dtype)
    m, k = a_q.shape
    n = b_q.shape[0]
    from qflash.kernels.matmul import QBLOCK

    k_blocks = _cdiv(k, QBLOCK)
    block_a, block_b = (m, k_blocks), (_cdiv(n, QBLOCK), k_blocks)
    # Where one block spans K, (M, 1) and (N, 1) scales are per row (the same product), and B's
    # (ceil(N / 128), 1) are blocks where that is not N
    b_block = _shape(b_scale) == block_b and b_scale.numel() > 1 and (k_blocks > 1 or block_b[0] != n)
    if b_block or (_shape(a_scale) == block_a and k_blocks > 1):
        if not b_block:
            raise ValueError(f"with block-scaled a_scale (M, ceil(K/128)) = {block_a}, b_scale must be "
                             f"(ceil(N/128), ceil(K/128)) = {block_b}, got {_shape(b_scale)}")
        if _shape(a_scale) != block_a:
            raise ValueError(f"with block-scaled b_scale {block_b}, a_scale must be (M, ceil(K/128)) = {block_a}, "
                             f"got {_shape(a_scale)}")
        _check_float_on("a_scale", a_scale, a_q.device)
        _check_float_on("b_scale", b_scale, a_q.device)
        return launch_scaled_matmul(a_q, b_q, a_scale.float(), b_scale.float(), bias, out_dtype, "block")
    return _tensor_or_row(a_q, b_q, a_scale, b_scale, bias, out_dtype)
