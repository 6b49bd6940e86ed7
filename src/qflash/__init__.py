"""qflash: exact FlashAttention and quantized attention/matmul kernels in Triton.

Importing ``qflash`` does no work: the kernels (and triton) load on first use of
an op, so ``import qflash.reference`` stays free of triton.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "flash_attn_func": "qflash.ops.attention",
    "flash_attn_kvpacked_func": "qflash.ops.attention",
    "flash_attn_qkvpacked_func": "qflash.ops.attention",
    "flash_attn_varlen_func": "qflash.ops.attention",
    "flash_attn_varlen_kvpacked_func": "qflash.ops.attention",
    "flash_attn_varlen_qkvpacked_func": "qflash.ops.attention",
    "sdpa": "qflash.ops.attention",
    "set_debug": "qflash.ops.attention",
    "quantize": "qflash.ops.quantize",
    "dequantize": "qflash.ops.quantize",
    "int8_matmul": "qflash.ops.matmul",
    "fp8_matmul": "qflash.ops.matmul",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'qflash' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
